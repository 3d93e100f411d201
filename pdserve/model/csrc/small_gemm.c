/* out = x @ w^T (+ bias) for the few rows of a decode step: x [m, k], w [n, k] (nn.Linear's
 * layout, used in place: no packed copy), out [m, n], all float32.
 *
 * At decode batch sizes the weights are read once per step and come from DRAM (the KV cache
 * streamed through the caches since the last step). The BLAS GEMV/GEMM paths read them at a
 * fraction of the machine's stream bandwidth; this kernel streams each thread's weight rows with
 * software prefetch a few row blocks ahead, and keeps x in L1: tiles of ROWS x rows by COLS
 * weight rows, one vector accumulator per output along k, each reduced once at the end.
 *
 * Every output is the same sum in the same order whatever m and whichever tile computes it, so a
 * row's result does not depend on the batch around it. Built with AVX-512F (16 lanes, 4 x 4
 * tiles) or AVX2 + FMA (8 lanes, 4 x 3 tiles: AVX2 has 16 vector registers); elsewhere
 * small_gemm_available() says 0 and callers use torch.
 *
 * A tile's accumulators stay in registers only when the compiler knows its shape: full tiles are
 * inlined with constant rows and cols (one case per row count), and only the last, partial
 * column block takes the generic loop. With runtime bounds they lived on the stack, and 16 rows
 * ran at little more than half the FMA rate (docs/perf-log.md, S30).
 */
#include <stdint.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

#if defined(__AVX512F__)
#define LANES 16
#define COLS 4
typedef __m512 vec;
typedef __mmask16 tail_mask;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline tail_mask mask_of(int64_t left) { return (__mmask16)((1u << left) - 1u); }
static inline vec vload_tail(const float *p, tail_mask m) { return _mm512_maskz_loadu_ps(m, p); }
static inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
#else
#define LANES 8
#define COLS 3
typedef __m256 vec;
typedef __m256i tail_mask;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline tail_mask mask_of(int64_t left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vec vload_tail(const float *p, tail_mask m) { return _mm256_maskload_ps(p, m); }
static inline float vsum(vec a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

#define ROWS 4
#define PREFETCH_BLOCKS 4 /* blocks of COLS weight rows ahead */

int small_gemm_available(void) { return 1; }

/* `rows` (1..ROWS) of x against `cols` (1..COLS) rows of w; prefetch `ahead_rows` rows further
 * down w. The lanes past k (the last, masked chunk) add zeros. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_stride, int64_t rows,
                                                       const float *w, int64_t cols, int64_t k, int64_t ahead_rows,
                                                       float *out, int64_t out_stride, const float *bias) {
    vec acc[ROWS][COLS];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < COLS; c++) acc[r][c] = vzero();
    int64_t i = 0;
    for (; i + LANES <= k; i += LANES) {
        vec wv[COLS];
        for (int c = 0; c < cols; c++) {
            if (ahead_rows) _mm_prefetch((const char *)(w + (ahead_rows + c) * k + i), _MM_HINT_T0);
            wv[c] = vload(w + c * k + i);
        }
        for (int r = 0; r < rows; r++) {
            const vec xv = vload(x + r * x_stride + i);
            for (int c = 0; c < cols; c++) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
        }
    }
    if (i < k) {
        const tail_mask mask = mask_of(k - i);
        vec wv[COLS];
        for (int c = 0; c < cols; c++) wv[c] = vload_tail(w + c * k + i, mask);
        for (int r = 0; r < rows; r++) {
            const vec xv = vload_tail(x + r * x_stride + i, mask);
            for (int c = 0; c < cols; c++) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            out[r * out_stride + c] = vsum(acc[r][c]) + (bias ? bias[c] : 0.0f);
}

void small_gemm_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *out,
                    int64_t out_stride, int64_t m, int64_t n, int64_t k, int threads) {
    const int64_t blocks = (n + COLS - 1) / COLS; /* the last may hold fewer than COLS rows */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const float *wb = w + b * COLS * k;
        const int64_t cols = n - b * COLS < COLS ? n - b * COLS : COLS;
        /* Prefetch within this thread's share of w: static scheduling gives each a contiguous run. */
        const int64_t ahead = b + PREFETCH_BLOCKS < blocks - 1 ? PREFETCH_BLOCKS * COLS : 0;
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
            const int64_t rows = m - r0 < ROWS ? m - r0 : ROWS;
#define TILE(R, C) tile(x + r0 * x_stride, x_stride, R, wb, C, k, r0 == 0 ? ahead : 0, \
                               out + r0 * out_stride + b * COLS, out_stride, bias ? bias + b * COLS : 0)
            if (cols != COLS) {
                TILE(rows, cols);
                continue;
            }
            switch (rows) {
            case 1: TILE(1, COLS); break;
            case 2: TILE(2, COLS); break;
            case 3: TILE(3, COLS); break;
            case 4: TILE(4, COLS); break;
            default: TILE(rows, COLS); break; /* (none while ROWS is 4) */
            }
#undef TILE
        }
    }
}

#else
int small_gemm_available(void) { return 0; }

void small_gemm_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *out,
                    int64_t out_stride, int64_t m, int64_t n, int64_t k, int threads) {
    (void)x, (void)x_stride, (void)w, (void)bias, (void)out, (void)out_stride, (void)m, (void)n, (void)k,
        (void)threads;
}
#endif

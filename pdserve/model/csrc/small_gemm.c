/* out = x @ w^T (+ bias) for the few rows of a decode step: x [m, k], w [n, k] (nn.Linear's
 * layout, used in place: no packed copy), out [m, n], all float32.
 *
 * At decode batch sizes the weights are read once per step and come from DRAM (the KV cache
 * streamed through the caches since the last step). The BLAS GEMV/GEMM paths read them at a
 * fraction of the machine's stream bandwidth. This kernel gives each thread a contiguous share of
 * the weight rows and walks it in chunks that fit in L2: every row tile of x (ROWS rows, in L1)
 * against every block of COLS weight rows of the chunk, one vector accumulator per output along
 * k, each reduced once at the end. Meanwhile (from pf_min_rows() rows on) it prefetches the next
 * chunk, spread over all of this chunk's tiles, so that at several row tiles the weights stream
 * from memory while the later tiles compute from cache (prefetching only during the first tile
 * left memory idle for the rest: 16 rows took the time of 4 plus three compute passes;
 * docs/perf-log.md, S31).
 *
 * Every output is the same sum in the same order whatever m and whichever tile computes it, so a
 * row's result does not depend on the batch around it. Built with AVX-512F (16 lanes, 4 x 4
 * tiles, and 8 x 3 from WIDE_FROM rows on) or AVX2 + FMA (8 lanes, 4 x 3 tiles: AVX2 has 16
 * vector registers); elsewhere small_gemm_available() says 0 and callers use torch.
 *
 * A tile's accumulators stay in registers only when the compiler knows its shape: full tiles are
 * inlined with constant rows and cols (one case per row count), and only the last, partial
 * column block takes the generic loop. With runtime bounds they lived on the stack, and 16 rows
 * ran at little more than half the FMA rate (docs/perf-log.md, S30). For the same reason each
 * tile shape has its own tile function (its accumulator array exactly its size: one array sized
 * for both made the 4-wide one-row tile 5-10% slower) and its own parallel region (a region's
 * body is outlined into a function of its own, where the shape would be a runtime value).
 */
#include <stdint.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include <omp.h>

#if defined(__AVX512F__)
#define LANES 16
#define COLS 4
/* The wide tile: 24 of the 32 vector registers accumulate, and each weight vector loaded from L2
 * serves 8 rows instead of 4. It pays where the weights stream from memory and a step is bound by
 * the FMAs: from 13 rows on, the 100M shape's decode linears (4-125 MiB each) took 14-17% less time
 * (13-32 rows, Zen 5); at 5-12 rows it was within 5% either way, no steadier than builds of the same
 * tile laid out differently. Weights that stay in the caches between steps (the tiny model's, at
 * most 1.4 MiB) ran 2-8% slower in it (docs/perf-log.md, S37). */
#define WIDE_ROWS 8
#define WIDE_COLS 3
#define WIDE_FROM 13
#define WIDE_MIN_BYTES (2 << 20)
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
/* Weights are streamed a chunk of this many bytes ahead, into L2 (so that a chunk and the next fit
 * there together, and the next does not evict the tile's operands from L1). */
#define CHUNK_BYTES (192 * 1024)
#define PF_HINT _MM_HINT_T1
/* From how many rows on the prefetches pay. On Zen 4, with fewer than 3 rows the tiles are light
 * enough that the core's own prefetchers keep memory busy, and the prefetches only cost: at 1 and 2
 * rows they made the 100M shape's decode linears 12-14% and 7-9% slower; at 3 and 4 they save
 * 6-8% (docs/perf-log.md, S32). On an Intel Xeon (Emerald Rapids), whose cores each draw less
 * from memory, they pay at every count: 1 row 2-4% and 2 rows 7-9% faster with them (S33). */
static int64_t pf_min_rows(void) { return __builtin_cpu_is("amd") ? 3 : 1; }
/* Each loaded vector is used by several FMAs; this keeps the compiler from folding the load into
 * every one of them as a memory operand (GCC does, for w or x, whichever is left to it): 20 loads
 * for 16 FMAs instead of 8, which bounds the tile by the load ports on CPUs with one 512-bit load
 * a cycle (Zen 4: 16 rows took 22% longer; docs/perf-log.md, S31). A weight vector only one row
 * uses is left to fold: pinned, the one-row tile streamed 4% slower (S32). */
#define IN_REGISTER(v) __asm__("" : "+v"(v))

int small_gemm_available(void) { return 1; }

/* tile_narrow and tile_wide: `rows` (1..MAX_ROWS) of x against `cols` (1..MAX_COLS) rows of w;
 * prefetch the `pf_lines` cache lines from `pf` on, spread evenly over the k steps. The lanes past
 * k (the last, masked chunk) add zeros. */
#define DEFINE_TILE(NAME, MAX_ROWS, MAX_COLS)                                                              \
    static inline __attribute__((always_inline)) void NAME(                                               \
        const float *x, int64_t x_stride, int64_t rows, const float *w, int64_t cols, int64_t k,          \
        const char *pf, int64_t pf_lines, float *out, int64_t out_stride, const float *bias) {            \
        const int64_t steps = k / LANES > 0 ? k / LANES : 1;                                             \
        int64_t pf_done = 0, pf_credit = 0; /* pf_lines / steps lines a step, without a division */      \
        vec acc[MAX_ROWS][MAX_COLS];                                                                      \
        for (int r = 0; r < rows; r++)                                                                    \
            for (int c = 0; c < cols; c++) acc[r][c] = vzero();                                           \
        int64_t i = 0;                                                                                    \
        for (; i + LANES <= k; i += LANES) {                                                              \
            vec wv[MAX_COLS];                                                                             \
            for (pf_credit += pf_lines; pf_credit >= steps; pf_credit -= steps)                          \
                _mm_prefetch(pf + 64 * pf_done++, PF_HINT);                                               \
            for (int c = 0; c < cols; c++) {                                                              \
                wv[c] = vload(w + c * k + i);                                                             \
                if (rows > 1) IN_REGISTER(wv[c]); /* (used once, it is best folded into its FMA) */      \
            }                                                                                             \
            for (int r = 0; r < rows; r++) {                                                              \
                vec xv = vload(x + r * x_stride + i);                                                     \
                IN_REGISTER(xv);                                                                          \
                for (int c = 0; c < cols; c++) acc[r][c] = vfma(xv, wv[c], acc[r][c]);                    \
            }                                                                                             \
        }                                                                                                 \
        for (; pf_done < pf_lines; pf_done++) _mm_prefetch(pf + pf_done * 64, PF_HINT);                  \
        if (i < k) {                                                                                      \
            const tail_mask mask = mask_of(k - i);                                                        \
            vec wv[MAX_COLS];                                                                             \
            for (int c = 0; c < cols; c++) wv[c] = vload_tail(w + c * k + i, mask);                       \
            for (int r = 0; r < rows; r++) {                                                              \
                const vec xv = vload_tail(x + r * x_stride + i, mask);                                    \
                for (int c = 0; c < cols; c++) acc[r][c] = vfma(xv, wv[c], acc[r][c]);                    \
            }                                                                                             \
        }                                                                                                 \
        for (int r = 0; r < rows; r++)                                                                    \
            for (int c = 0; c < cols; c++)                                                                \
                out[r * out_stride + c] = vsum(acc[r][c]) + (bias ? bias[c] : 0.0f);                      \
    }

DEFINE_TILE(tile_narrow, ROWS, COLS)
#ifdef WIDE_ROWS
DEFINE_TILE(tile_wide, WIDE_ROWS, WIDE_COLS)
#endif

/* A tile with its shape as constants where it is a full one (one case per row count); only the last,
 * partial column block takes the generic loop. tile_rows and tile_cols (constants where inlined)
 * name the tile function: tile_wide for WIDE_ROWS, tile_narrow for ROWS. */
static inline __attribute__((always_inline)) void row_tile(const float *x, int64_t x_stride, int64_t rows,
                                                           const float *w, int64_t cols, int64_t k, const char *pf,
                                                           int64_t pf_lines, float *out, int64_t out_stride,
                                                           const float *bias, const int64_t tile_rows,
                                                           const int64_t tile_cols) {
#ifdef WIDE_ROWS
#define TILE(R, C) \
    (tile_rows == WIDE_ROWS ? tile_wide : tile_narrow)(x, x_stride, R, w, C, k, pf, pf_lines, out, out_stride, bias)
#else
#define TILE(R, C) tile_narrow(x, x_stride, R, w, C, k, pf, pf_lines, out, out_stride, bias)
#endif
    if (cols != tile_cols) {
        TILE(rows, cols);
        return;
    }
    switch (rows) {
    case 1: TILE(1, tile_cols); break;
    case 2: TILE(2, tile_cols); break;
    case 3: TILE(3, tile_cols); break;
    case 4: TILE(4, tile_cols); break;
#ifdef WIDE_ROWS /* (only wide tiles have more rows) */
    case 5: TILE(5, tile_cols); break;
    case 6: TILE(6, tile_cols); break;
    case 7: TILE(7, tile_cols); break;
    case 8: TILE(8, tile_cols); break;
#endif
    default: TILE(rows, tile_cols); break; /* (none) */
    }
#undef TILE
}

/* This thread's share of the weight rows (contiguous), in tiles of tile_rows x tile_cols. */
static inline __attribute__((always_inline)) void share(const float *x, int64_t x_stride, const float *w,
                                                        const float *bias, float *out, int64_t out_stride,
                                                        int64_t m, int64_t n, int64_t k, const int64_t tile_rows,
                                                        const int64_t tile_cols) {
    const int64_t blocks = (n + tile_cols - 1) / tile_cols; /* the last may hold fewer than tile_cols rows */
    const int64_t block_bytes = tile_cols * k * (int64_t)sizeof(float);
    const int64_t row_tiles = (m + tile_rows - 1) / tile_rows;
    const int64_t min_rows = pf_min_rows();
    /* Blocks per chunk: a chunk and the next one, being prefetched, fit in L2 together. */
    int64_t chunk = CHUNK_BYTES / block_bytes;
    if (chunk < 1) chunk = 1;
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t lo = blocks * t / nt, hi = blocks * (t + 1) / nt; /* this thread's contiguous share */
    for (int64_t c0 = lo; c0 < hi; c0 += chunk) {
        const int64_t c1 = c0 + chunk < hi ? c0 + chunk : hi;
        /* What to prefetch meanwhile: the next chunk of this thread's share (contiguous in w),
         * spread evenly over every tile of this chunk, so that the weights stream from memory
         * while the row tiles compute from cache, not only during the first. */
        const int64_t next1 = c1 + chunk < hi ? c1 + chunk : hi;
        const char *pf = (const char *)(w + c1 * tile_cols * k);
        const int64_t next_rows = (next1 * tile_cols < n ? next1 * tile_cols : n) - c1 * tile_cols;
        const int64_t lines =
            m >= min_rows && next_rows > 0 ? (next_rows * k * (int64_t)sizeof(float) + 63) / 64 : 0;
        const int64_t tiles = (c1 - c0) * row_tiles;
        int64_t done = 0, tile_i = 0;
        for (int64_t r0 = 0; r0 < m; r0 += tile_rows) {
            const int64_t rows = m - r0 < tile_rows ? m - r0 : tile_rows;
            for (int64_t b = c0; b < c1; b++) {
                const int64_t cols = n - b * tile_cols < tile_cols ? n - b * tile_cols : tile_cols;
                const int64_t upto = lines * ++tile_i / tiles;
                row_tile(x + r0 * x_stride, x_stride, rows, w + b * tile_cols * k, cols, k, pf + done * 64,
                         upto - done, out + r0 * out_stride + b * tile_cols, out_stride,
                         bias ? bias + b * tile_cols : 0, tile_rows, tile_cols);
                done = upto;
            }
        }
    }
}

/* One parallel region per tile shape: a region's body is compiled as a function of its own, and
 * only there is the shape a constant. */
static void gemm_narrow(const float *x, int64_t x_stride, const float *w, const float *bias, float *out,
                        int64_t out_stride, int64_t m, int64_t n, int64_t k, int threads) {
#pragma omp parallel num_threads(threads)
    share(x, x_stride, w, bias, out, out_stride, m, n, k, ROWS, COLS);
}

#ifdef WIDE_ROWS
static void gemm_wide(const float *x, int64_t x_stride, const float *w, const float *bias, float *out,
                      int64_t out_stride, int64_t m, int64_t n, int64_t k, int threads) {
#pragma omp parallel num_threads(threads)
    share(x, x_stride, w, bias, out, out_stride, m, n, k, WIDE_ROWS, WIDE_COLS);
}
#endif

void small_gemm_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *out,
                    int64_t out_stride, int64_t m, int64_t n, int64_t k, int threads) {
#ifdef WIDE_ROWS
    if (m >= WIDE_FROM && n * k * (int64_t)sizeof(float) >= WIDE_MIN_BYTES) {
        gemm_wide(x, x_stride, w, bias, out, out_stride, m, n, k, threads);
        return;
    }
#endif
    gemm_narrow(x, x_stride, w, bias, out, out_stride, m, n, k, threads);
}

#else
int small_gemm_available(void) { return 0; }

void small_gemm_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *out,
                    int64_t out_stride, int64_t m, int64_t n, int64_t k, int threads) {
    (void)x, (void)x_stride, (void)w, (void)bias, (void)out, (void)out_stride, (void)m, (void)n, (void)k,
        (void)threads;
}
#endif

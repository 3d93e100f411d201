/* out = x @ w^T (+ bias) for the few rows of a decode step: x [m, k], w [n, k] (nn.Linear's
 * layout, used in place: no packed copy), out [m, n], all float32.
 *
 * At decode batch sizes the weights are read once per step and come from DRAM (the KV cache
 * streamed through the caches since the last step). The BLAS GEMV/GEMM paths read them at a
 * third of the machine's stream bandwidth here; this kernel streams each thread's weight rows
 * with software prefetch a few row blocks ahead, and keeps x in L1: tiles of 4 x rows by 4
 * weight rows, 16 AVX-512 accumulators along k, each reduced once at the end.
 *
 * Every output is the same sum in the same order whatever m and whichever tile computes it, so a
 * row's result does not depend on the batch around it. Built only with AVX-512F; elsewhere
 * small_gemm_available() says 0 and callers use torch.
 */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>

int small_gemm_available(void) { return 1; }

#define PREFETCH_BLOCKS 4 /* row blocks of w ahead */

static inline void tile(const float *x, int64_t x_stride, int64_t rows, const float *w, int64_t k,
                        int64_t ahead_rows, float *out, int64_t out_stride, const float *bias) {
    /* rows (1..4) of x against 4 rows of w; prefetch `ahead_rows` rows further down w. */
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        __m512 wv[4];
        for (int c = 0; c < 4; c++) {
            if (ahead_rows) _mm_prefetch((const char *)(w + (ahead_rows + c) * k + i), _MM_HINT_T0);
            wv[c] = _mm512_loadu_ps(w + c * k + i);
        }
        for (int r = 0; r < rows; r++) {
            const __m512 xv = _mm512_loadu_ps(x + r * x_stride + i);
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    if (i < k) { /* the last partial chunk, masked: the lanes past k add zeros */
        const __mmask16 mask = (__mmask16)((1u << (k - i)) - 1u);
        __m512 wv[4];
        for (int c = 0; c < 4; c++) wv[c] = _mm512_maskz_loadu_ps(mask, w + c * k + i);
        for (int r = 0; r < rows; r++) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, x + r * x_stride + i);
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++)
            out[r * out_stride + c] = _mm512_reduce_add_ps(acc[r][c]) + (bias ? bias[c] : 0.0f);
}

/* One weight row against up to 4 x rows (the n % 4 rows left over): the same sums. */
static inline void row(const float *x, int64_t x_stride, int64_t rows, const float *w, int64_t k,
                       float *out, int64_t out_stride, const float *bias) {
    __m512 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        const __m512 wv = _mm512_loadu_ps(w + i);
        for (int r = 0; r < rows; r++) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * x_stride + i), wv, acc[r]);
    }
    if (i < k) {
        const __mmask16 mask = (__mmask16)((1u << (k - i)) - 1u);
        const __m512 wv = _mm512_maskz_loadu_ps(mask, w + i);
        for (int r = 0; r < rows; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + r * x_stride + i), wv, acc[r]);
    }
    for (int r = 0; r < rows; r++) out[r * out_stride] = _mm512_reduce_add_ps(acc[r]) + (bias ? bias[0] : 0.0f);
}

void small_gemm_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *out,
                    int64_t out_stride, int64_t m, int64_t n, int64_t k, int threads) {
    const int64_t blocks = n / 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const float *wb = w + b * 4 * k;
        /* Prefetch within this thread's share of w: static scheduling gives each a contiguous run. */
        const int64_t ahead = b + PREFETCH_BLOCKS < blocks ? PREFETCH_BLOCKS * 4 : 0;
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
            const int64_t rows = m - r0 < 4 ? m - r0 : 4;
            tile(x + r0 * x_stride, x_stride, rows, wb, k, r0 == 0 ? ahead : 0, out + r0 * out_stride + b * 4,
                 out_stride, bias ? bias + b * 4 : 0);
        }
    }
    for (int64_t c = blocks * 4; c < n; c++)
        for (int64_t r0 = 0; r0 < m; r0 += 4)
            row(x + r0 * x_stride, x_stride, m - r0 < 4 ? m - r0 : 4, w + c * k, k, out + r0 * out_stride + c,
                out_stride, bias ? bias + c : 0);
}

#else
int small_gemm_available(void) { return 0; }

void small_gemm_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *out,
                    int64_t out_stride, int64_t m, int64_t n, int64_t k, int threads) {
    (void)x, (void)x_stride, (void)w, (void)bias, (void)out, (void)out_stride, (void)m, (void)n, (void)k,
        (void)threads;
}
#endif

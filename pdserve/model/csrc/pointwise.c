/* Row-wise float32 ops of the decoder layer, each one pass over its rows instead of the four to
 * eight small torch ops (and their temporaries) they replace at decode batch sizes.
 * Rows are contiguous, `*_stride` floats apart; all sums in float32, as torch computes them. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* residual (when not NULL) += delta; then out = residual * rsqrt(mean(residual^2) + eps) * w.
 * With residual NULL, x is normalised alone: out = x * rsqrt(mean(x^2) + eps) * w. */
void rms_norm_f32(float *x, int64_t x_stride, const float *delta, int64_t delta_stride,
                  float *out, int64_t out_stride, const float *w, int64_t rows, int64_t dim,
                  float eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * x_stride, *o = out + r * out_stride;
        if (delta != NULL) {
            const float *dr = delta + r * delta_stride;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) xr[i] += dr[i];
        }
        float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
        for (int64_t i = 0; i < dim; i++) sq += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(sq / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = xr[i] * inv * w[i];
    }
}

/* Rotary embedding in place on each token's q and k heads (the first `heads` head_dim-wide
 * slices of its qkv row), half-split pairs as HF Llama: for i < d/2,
 *   x[i] = x[i] cos[i] - x[i + d/2] sin[i],  x[i + d/2] = x[i + d/2] cos[i + d/2] + x[i] sin[i + d/2].
 * cos and sin: [tokens, head_dim] rows. */
void rope_f32(float *qkv, int64_t row_stride, const float *cos, const float *sin, int64_t tokens,
              int64_t heads, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t r = 0; r < tokens; r++) {
        const float *c = cos + r * head_dim, *s = sin + r * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *x = qkv + r * row_stride + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float lo = x[i], hi = x[i + half];
                x[i] = lo * c[i] - hi * s[i];
                x[i + half] = hi * c[i + half] + lo * s[i + half];
            }
        }
    }
}

/* exp's argument kept within [-80, 80]: e^80 is finite in float32 and e^-80 a normal number. Past
 * about +-87 glibc's vector expf finishes each such lane in a scalar slow path (a batch-16 step's
 * logits took five times as long: docs/perf-log.md, S34), and with -ffast-math a division by e^88 =
 * inf becomes a reciprocal and a Newton step that gives NaN. The results are the same in float32:
 * silu(g) for g past 80 is g or -0, and a term of e^-80 beside at least 1 is nothing. */
static inline float exp_clamped(float x) { return expf(fminf(fmaxf(x, -80.0f), 80.0f)); }

/* Below this many outputs silu_mul runs on the calling thread alone (a decode step's rows); at
 * prompt sizes one thread took 1.2-1.5x torch's two-threaded silu and mul (docs/perf-log.md, S38). */
#define SILU_PARALLEL_MIN (1 << 16)

/* out = silu(gate) * up, where each input row is [gate | up], `dim` floats each. Rows are split
 * over `threads`; each output is the same expression whichever thread computes it. */
void silu_mul_f32(const float *gate_up, int64_t in_stride, float *out, int64_t out_stride, int64_t rows,
                  int64_t dim, int threads) {
#pragma omp parallel for num_threads(threads) if (rows > 1 && rows * dim >= SILU_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * in_stride, *u = g + dim;
        float *o = out + r * out_stride;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = g[i] / (1.0f + exp_clamped(-g[i])) * u[i];
    }
}

/* For each row of logits [rows, vocab] (rows `stride` floats apart): the first index of its
 * maximum, the maximum (top) and log Z = max + log(sum(exp(x - max))), so that any token's
 * logprob is x[t] - log Z, the greedy token's top - log Z.
 * Two passes over a row that stays in L2, instead of torch's max (values and indices) and a whole
 * log_softmax over [rows, vocab] (docs/perf-log.md, S34). A row holding NaN
 * or inf gets log Z = NaN (the caller refuses it), found from the exponent bits: -ffast-math lets
 * the compiler assume no float is ever NaN or inf, so no float compare can be trusted to. */
void argmax_logz_f32(const float *logits, int64_t stride, int64_t rows, int64_t vocab, int64_t *token,
                     double *top, double *logz, int threads) {
#pragma omp parallel for num_threads(threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * stride;
        float m = x[0];
        uint32_t special = 0; /* exponent bits all ones: NaN or inf */
#pragma omp simd reduction(max : m) reduction(| : special)
        for (int64_t i = 0; i < vocab; i++) {
            uint32_t bits;
            memcpy(&bits, x + i, sizeof bits);
            special |= (bits & 0x7f800000u) == 0x7f800000u;
            m = x[i] > m ? x[i] : m;
        }
        int64_t t = 0;
        while (t < vocab - 1 && x[t] != m) t++;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < vocab; i++) s += exp_clamped(x[i] - m);
        token[r] = t;
        top[r] = (double)m;
        if (special) {
            const uint64_t nan_bits = 0x7ff8000000000000ull;
            memcpy(logz + r, &nan_bits, sizeof nan_bits);
        } else {
            logz[r] = (double)m + log((double)s);
        }
    }
}

/* Decode attention read straight from the paged, block-major KV cache, and the KV write.
 *
 * One query token per sequence. Each (sequence, KV head) reads its K rows and V rows once, page
 * by page, in place: no gather copy, no padding. The query heads that share a KV head (GQA) take
 * each page while it is in L1. Exact softmax in two passes over a score buffer (scores; then max,
 * exp and sum; then the weighted V sum), float32 accumulation for every cache dtype. With AVX2 +
 * FMA, eight K rows are dotted at once (eight independent accumulators, one transposing sum) and
 * the V sum keeps 64 output lanes in registers; elsewhere plain loops compute the same. A float32
 * cache of 16-slot pages and head_dim 64 or 128 takes an AVX-512 path where the CPU has it: a
 * page's 16 K rows dotted at once (one transposing sum of 16 vectors), and each V row loaded once
 * for all the query heads of its group (`fast_item_f32`).
 *
 * Cache: [num_blocks, num_layers, 2, kv_heads, block_size, head_dim], contiguous.
 * q, out: float32 rows of [heads, head_dim] (each row contiguous, rows `*_row_stride` apart);
 * sequence s reads q row rows[s] and writes out row rows[s]. tables: [n, max_pages] page ids.
 * The result for one sequence depends on its own inputs only, never on the batch around it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float load1_f32(const float *p) { return *p; }
static inline float load1_bf16(const uint16_t *p) { return bf16_to_f32(*p); }

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1

static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }

static inline __m256 load8_bf16(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* Lane r of the result is the sum of the eight lanes of a[r]. */
static inline __m256 sum8x8(const __m256 a[8]) {
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                         _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

static inline float sum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

/* dots: out[t] = scale * <q, k row t> for `rows` consecutive rows of length d.
 * axpy: acc[i] += sum over t of w[t] * v[t][i]. */
#ifdef HAVE_AVX2
#define SIMD_PRIMITIVES(SUF, T)                                                                     \
    static inline int dots_simd_##SUF(const float *q, const T *k, int64_t rows, int64_t d,         \
                                      float scale, float *out) {                                    \
        if (d % 8) return 0;                                                                        \
        int64_t t = 0;                                                                              \
        for (; t + 8 <= rows; t += 8) {                                                             \
            __m256 a[8];                                                                            \
            for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();                                 \
            for (int64_t i = 0; i < d; i += 8) {                                                    \
                const __m256 qv = _mm256_loadu_ps(q + i);                                           \
                for (int r = 0; r < 8; r++)                                                         \
                    a[r] = _mm256_fmadd_ps(load8_##SUF(k + (t + r) * d + i), qv, a[r]);             \
            }                                                                                       \
            _mm256_storeu_ps(out + t, _mm256_mul_ps(sum8x8(a), _mm256_set1_ps(scale)));             \
        }                                                                                           \
        for (; t < rows; t++) {                                                                     \
            __m256 a = _mm256_setzero_ps();                                                         \
            for (int64_t i = 0; i < d; i += 8)                                                      \
                a = _mm256_fmadd_ps(load8_##SUF(k + t * d + i), _mm256_loadu_ps(q + i), a);         \
            out[t] = sum8(a) * scale;                                                               \
        }                                                                                           \
        return 1;                                                                                   \
    }                                                                                               \
    static inline int axpy_simd_##SUF(const float *w, const T *v, int64_t rows, int64_t d,         \
                                      float *acc) {                                                 \
        if (d % 8) return 0;                                                                        \
        int64_t c = 0;                                                                              \
        for (; c + 64 <= d; c += 64) {                                                              \
            __m256 a[8];                                                                            \
            for (int r = 0; r < 8; r++) a[r] = _mm256_loadu_ps(acc + c + 8 * r);                   \
            for (int64_t t = 0; t < rows; t++) {                                                    \
                const __m256 wv = _mm256_set1_ps(w[t]);                                             \
                for (int r = 0; r < 8; r++)                                                         \
                    a[r] = _mm256_fmadd_ps(wv, load8_##SUF(v + t * d + c + 8 * r), a[r]);           \
            }                                                                                       \
            for (int r = 0; r < 8; r++) _mm256_storeu_ps(acc + c + 8 * r, a[r]);                   \
        }                                                                                           \
        for (; c < d; c += 8) {                                                                     \
            __m256 a = _mm256_loadu_ps(acc + c);                                                    \
            for (int64_t t = 0; t < rows; t++)                                                      \
                a = _mm256_fmadd_ps(_mm256_set1_ps(w[t]), load8_##SUF(v + t * d + c), a);          \
            _mm256_storeu_ps(acc + c, a);                                                           \
        }                                                                                           \
        return 1;                                                                                   \
    }
#else
#define SIMD_PRIMITIVES(SUF, T)                                                                     \
    static inline int dots_simd_##SUF(const float *q, const T *k, int64_t rows, int64_t d,         \
                                      float scale, float *out) {                                    \
        (void)q, (void)k, (void)rows, (void)d, (void)scale, (void)out;                              \
        return 0;                                                                                   \
    }                                                                                               \
    static inline int axpy_simd_##SUF(const float *w, const T *v, int64_t rows, int64_t d,         \
                                      float *acc) {                                                 \
        (void)w, (void)v, (void)rows, (void)d, (void)acc;                                           \
        return 0;                                                                                   \
    }
#endif

#define PRIMITIVES(SUF, T)                                                                          \
    SIMD_PRIMITIVES(SUF, T)                                                                         \
    static inline void dots_##SUF(const float *q, const T *k, int64_t rows, int64_t d, float scale, \
                                  float *out) {                                                     \
        if (dots_simd_##SUF(q, k, rows, d, scale, out)) return;                                     \
        for (int64_t t = 0; t < rows; t++) {                                                        \
            float dot = 0.0f;                                                                       \
            for (int64_t i = 0; i < d; i++) dot += q[i] * load1_##SUF(k + t * d + i);               \
            out[t] = dot * scale;                                                                   \
        }                                                                                           \
    }                                                                                               \
    static inline void axpy_##SUF(const float *w, const T *v, int64_t rows, int64_t d,             \
                                  float *acc) {                                                     \
        if (axpy_simd_##SUF(w, v, rows, d, acc)) return;                                            \
        for (int64_t t = 0; t < rows; t++)                                                          \
            for (int64_t i = 0; i < d; i++) acc[i] += w[t] * load1_##SUF(v + t * d + i);           \
    }

PRIMITIVES(f32, float)
PRIMITIVES(bf16, uint16_t)

/* Ask for the next page while this one is computed: pages lie scattered, and the hardware
 * prefetcher starts cold at each one. Into L2 (prefetcht1), not L1, and in shares between the
 * query heads' dots rather than in one burst: on Zen 4 the burst of L1 prefetches stalled on its
 * few miss buffers (8 layers of batch-16 attention: 9.4-12 ms before, 6.1-6.5 ms now;
 * docs/perf-log.md, S31). */
static inline void prefetch_span(const char *p, int64_t lo, int64_t hi) {
    for (int64_t off = lo; off < hi; off += 64) __builtin_prefetch(p + off, 0, 2);
}

/* softmax in place over n scores. */
static void softmax(float *s, int64_t n) {
    float peak = s[0], total = 0.0f;
    for (int64_t t = 1; t < n; t++) peak = s[t] > peak ? s[t] : peak;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < n; t++) {
        s[t] = expf(s[t] - peak);
        total += s[t];
    }
    const float inv = 1.0f / total;
    for (int64_t t = 0; t < n; t++) s[t] *= inv;
}

#if defined(__AVX512F__)
/* The float32 AVX-512 path: one (sequence, KV head) over 16-slot pages of D vectors a row (head_dim
 * 16 * D). Against the AVX2 primitives above on the 100M shape's attention (16 heads on 4 KV heads
 * of 64), same run, 8 layers, cold: 12-17% less time at batch 1 and 16, contexts 512 and 2,048;
 * 20-30% less from cache (docs/perf-log.md, S33). */

/* Lane t of the result is the sum of the 16 lanes of a[t]. */
static inline __m512 sum16x16(const __m512 a[16]) {
    __m512 t[8], u[4], v[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88), _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
}

/* out[t] = scale * <q, k row t> for the page's `slots` rows (the rows past them are read, not stored). */
static inline __attribute__((always_inline)) void page_dots(const float *q, const float *k, int64_t slots, int D,
                                                            float scale, float *out) {
    __m512 qv[8], acc[16];
    for (int c = 0; c < D; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
    for (int t = 0; t < 16; t++) {
        acc[t] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k + t * 16 * D));
        for (int c = 1; c < D; c++) acc[t] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + t * 16 * D + 16 * c), acc[t]);
    }
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << slots) - 1u), _mm512_mul_ps(sum16x16(acc), _mm512_set1_ps(scale)));
}

/* acc[j * D + c] += sum over t of w[j][t] * (vector c of V row t), for H query heads: each V row
 * is loaded once for all of them. */
static inline __attribute__((always_inline)) void page_axpy(const float *const *w, const float *v, int64_t slots,
                                                            int D, int H, __m512 *acc) {
    for (int64_t t = 0; t < slots; t++) {
        __m512 vv[8];
        for (int c = 0; c < D; c++) vv[c] = _mm512_loadu_ps(v + t * 16 * D + 16 * c);
        for (int j = 0; j < H; j++) {
            const __m512 wj = _mm512_set1_ps(w[j][t]);
            for (int c = 0; c < D; c++) acc[j * D + c] = _mm512_fmadd_ps(wj, vv[c], acc[j * D + c]);
        }
    }
}

/* The work item of DEFINE_PAGED_DECODE below with D a constant (inlined once per head_dim): the
 * same passes and prefetches; the V sum takes up to 16 / D query heads at a time (16 accumulators). */
static inline __attribute__((always_inline)) void item_f32_d(const float *base, const int64_t *table, int64_t pages,
                                                             int64_t ctx, int64_t page_stride, int64_t kv_stride,
                                                             int64_t lines, const float *qs, float *os, int64_t group,
                                                             float scale, float *scores, const int D) {
    const int HV = 16 / D, head_dim = 16 * D;
    for (int64_t p = 0; p < pages; p++) {
        const float *k = base + table[p] * page_stride;
        const int64_t slots = p == pages - 1 ? ctx - p * 16 : 16;
        for (int64_t j = 0; j < group; j++) {
            if (p + 1 < pages) {
                const int64_t lo = lines * j / group * 64, hi = lines * (j + 1) / group * 64;
                prefetch_span((const char *)(base + table[p + 1] * page_stride), lo, hi);
                prefetch_span((const char *)(k + kv_stride), lo, hi);
            }
            page_dots(qs + j * head_dim, k, slots, D, scale, scores + j * ctx + p * 16);
        }
    }
    for (int64_t j = 0; j < group; j++) softmax(scores + j * ctx, ctx);
    for (int64_t j0 = 0; j0 < group; j0 += HV) {
        const int H = group - j0 < HV ? (int)(group - j0) : HV;
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t p = 0; p < pages; p++) {
            const float *v = base + table[p] * page_stride + kv_stride;
            if (p + 1 < pages && j0 == 0)
                prefetch_span((const char *)(base + table[p + 1] * page_stride + kv_stride), 0, lines * 64);
            const int64_t slots = p == pages - 1 ? ctx - p * 16 : 16;
            const float *w[16];
            for (int j = 0; j < H; j++) w[j] = scores + (j0 + j) * ctx + p * 16;
            if (H == HV)
                page_axpy(w, v, slots, D, HV, acc);
            else
                page_axpy(w, v, slots, D, H, acc);
        }
        for (int j = 0; j < H; j++)
            for (int c = 0; c < D; c++) _mm512_storeu_ps(os + (j0 + j) * head_dim + 16 * c, acc[j * D + c]);
    }
}

/* One work item on the AVX-512 path; 0 (nothing done) where it does not take the shape. */
static int fast_item_f32(const float *base, const int64_t *table, int64_t pages, int64_t ctx, int64_t page_stride,
                         int64_t kv_stride, int64_t lines, const float *qs, float *os, int64_t group,
                         int64_t block_size, int64_t head_dim, float scale, float *scores) {
    if (block_size != 16 || (head_dim != 64 && head_dim != 128)) return 0;
    if (head_dim == 64)
        item_f32_d(base, table, pages, ctx, page_stride, kv_stride, lines, qs, os, group, scale, scores, 4);
    else
        item_f32_d(base, table, pages, ctx, page_stride, kv_stride, lines, qs, os, group, scale, scores, 8);
    return 1;
}
#define FAST_ITEM_f32 fast_item_f32
#else
#define FAST_ITEM_f32(...) 0
#endif
#define FAST_ITEM_bf16(...) 0

#define DEFINE_PAGED_DECODE(SUF, T)                                                                 \
    int paged_decode_##SUF(const T *cache, const float *q, int64_t q_row_stride, float *out,        \
                           int64_t out_row_stride, const int64_t *rows, const int64_t *tables,     \
                           const int64_t *context_lens, int64_t n, int64_t max_pages,               \
                           int64_t layer, int64_t num_layers, int64_t heads, int64_t kv_heads,      \
                           int64_t block_size, int64_t head_dim, float scale, int threads) {        \
        const int64_t group = heads / kv_heads;                                                     \
        const int64_t head_stride = block_size * head_dim;                                          \
        const int64_t kv_stride = kv_heads * head_stride;       /* K -> V of one layer */           \
        const int64_t page_stride = num_layers * 2 * kv_stride; /* one page's slab */               \
        const int64_t lines = (head_stride * (int64_t)sizeof(T) + 63) / 64; /* one page of one head */ \
        int failed = 0;                                                                             \
        _Pragma("omp parallel for num_threads(threads) schedule(dynamic, 1)")                       \
        for (int64_t work = 0; work < n * kv_heads; work++) {                                       \
            const int64_t s = work / kv_heads, h = work % kv_heads;                                 \
            const int64_t ctx = context_lens[s];                                                    \
            const int64_t pages = (ctx + block_size - 1) / block_size;                              \
            const T *base = cache + layer * 2 * kv_stride + h * head_stride;                        \
            const int64_t *table = tables + s * max_pages;                                          \
            const float *qs = q + rows[s] * q_row_stride + h * group * head_dim;                    \
            float *os = out + rows[s] * out_row_stride + h * group * head_dim;                      \
            float *scores = malloc(sizeof(float) * (size_t)(group * ctx));                          \
            if (scores == NULL) {                                                                   \
                failed = 1;                                                                         \
                continue;                                                                           \
            }                                                                                       \
            if (FAST_ITEM_##SUF(base, table, pages, ctx, page_stride, kv_stride, lines, qs, os, group,   \
                                block_size, head_dim, scale, scores)) {                             \
                free(scores);                                                                       \
                continue;                                                                           \
            }                                                                                       \
            for (int64_t p = 0; p < pages; p++) {                                                   \
                const T *k = base + table[p] * page_stride;                                         \
                const int64_t slots = p == pages - 1 ? ctx - p * block_size : block_size;           \
                for (int64_t j = 0; j < group; j++) {                                               \
                    if (p + 1 < pages) { /* the next page's K and this page's V (the V pass then    \
                                            finds it in L2), a share before each query head */      \
                        const int64_t lo = lines * j / group * 64, hi = lines * (j + 1) / group * 64;   \
                        prefetch_span((const char *)(base + table[p + 1] * page_stride), lo, hi);    \
                        prefetch_span((const char *)(base + table[p] * page_stride + kv_stride), lo, hi); \
                    }                                                                               \
                    dots_##SUF(qs + j * head_dim, k, slots, head_dim, scale,                        \
                               scores + j * ctx + p * block_size);                                  \
                }                                                                                   \
            }                                                                                       \
            for (int64_t j = 0; j < group; j++) softmax(scores + j * ctx, ctx);                     \
            for (int64_t j = 0; j < group * head_dim; j++) os[j] = 0.0f;                            \
            for (int64_t p = 0; p < pages; p++) {                                                   \
                const T *v = base + table[p] * page_stride + kv_stride;                             \
                if (p + 1 < pages)                                                                  \
                    prefetch_span((const char *)(base + table[p + 1] * page_stride + kv_stride), 0, lines * 64); \
                const int64_t slots = p == pages - 1 ? ctx - p * block_size : block_size;           \
                for (int64_t j = 0; j < group; j++)                                                 \
                    axpy_##SUF(scores + j * ctx + p * block_size, v, slots, head_dim,               \
                               os + j * head_dim);                                                  \
            }                                                                                       \
            free(scores);                                                                           \
        }                                                                                           \
        return failed ? -1 : 0;                                                                     \
    }

DEFINE_PAGED_DECODE(f32, float)
DEFINE_PAGED_DECODE(bf16, uint16_t)

/* The new tokens' K and V (rows of [kv_heads, head_dim], `*_row_stride` apart) into their page
 * slots of one layer: token r goes to page blocks[r], slot offsets[r]. */
#define DEFINE_WRITE_KV(SUF, T)                                                                     \
    void write_kv_##SUF(T *cache, const T *k, int64_t k_row_stride, const T *v,                     \
                        int64_t v_row_stride, const int64_t *blocks, const int64_t *offsets,        \
                        int64_t tokens, int64_t layer, int64_t num_layers, int64_t kv_heads,        \
                        int64_t block_size, int64_t head_dim) {                                     \
        const int64_t head_stride = block_size * head_dim;                                          \
        const int64_t kv_stride = kv_heads * head_stride;                                           \
        const int64_t page_stride = num_layers * 2 * kv_stride;                                     \
        const size_t row_bytes = sizeof(T) * (size_t)head_dim;                                      \
        for (int64_t r = 0; r < tokens; r++) {                                                      \
            T *slot = cache + blocks[r] * page_stride + layer * 2 * kv_stride +                     \
                      offsets[r] * head_dim;                                                        \
            for (int64_t h = 0; h < kv_heads; h++) {                                                \
                memcpy(slot + h * head_stride, k + r * k_row_stride + h * head_dim, row_bytes);     \
                memcpy(slot + kv_stride + h * head_stride, v + r * v_row_stride + h * head_dim,     \
                       row_bytes);                                                                  \
            }                                                                                       \
        }                                                                                           \
    }

DEFINE_WRITE_KV(f32, float)
DEFINE_WRITE_KV(bf16, uint16_t)

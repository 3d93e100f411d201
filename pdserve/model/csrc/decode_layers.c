/* Every decoder layer of a float32 decode step in one call: the same kernels, in the same order
 * and on the same buffers' contents, as the model's per-op path through CpuKernelOps, so the
 * result is the same bit for bit; only the Python between them (module calls, argument checks,
 * views, output tensors) is gone: at batch 1 that Python was a tenth of a step of the 100M shape,
 * the gap to llama.cpp (docs/perf-log.md, S33 and S34). Per layer:
 *   normed = rms_norm(residual (+= out of the layer before), attn_norm)
 *   qkv = normed @ wqkv^T (+ bqkv); rope on q and k; k, v into their page slots
 *   attn = paged decode attention of q; out = attn @ wo^T
 *   normed = rms_norm(residual += out, mlp_norm)
 *   out = (silu(gate) * up of normed @ w_gate_up^T) @ w_down^T
 *
 * weights: [num_layers] rows of seven pointers, as `layer_weights` (bqkv NULL without a bias).
 * residual [m, hidden]: the embedded tokens on entry, the residual stream before the last
 * layer's MLP output on return; out [m, hidden]: that output. scratch: m * (hidden + qkv + q +
 * 3 * intermediate) floats. cos, sin: [m, head_dim]. The KV cache and the page arguments as
 * paged_decode and write_kv take them, with every one of the m rows decoding (rows[s] = s).
 * Returns paged_decode's status (0, or -1: out of memory for attention scores).
 */
#include <stddef.h>
#include <stdint.h>

void rms_norm_f32(float *x, int64_t x_stride, const float *delta, int64_t delta_stride, float *out,
                  int64_t out_stride, const float *w, int64_t rows, int64_t dim, float eps);
void rope_f32(float *qkv, int64_t row_stride, const float *cos, const float *sin, int64_t tokens,
              int64_t heads, int64_t head_dim);
void silu_mul_f32(const float *gate_up, int64_t in_stride, float *out, int64_t out_stride, int64_t rows,
                  int64_t dim, int threads);
void small_gemm_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *out,
                    int64_t out_stride, int64_t m, int64_t n, int64_t k, int threads);
void write_kv_f32(float *cache, const float *k, int64_t k_row_stride, const float *v, int64_t v_row_stride,
                  const int64_t *blocks, const int64_t *offsets, int64_t tokens, int64_t layer,
                  int64_t num_layers, int64_t kv_heads, int64_t block_size, int64_t head_dim);
int paged_decode_f32(const float *cache, const float *q, int64_t q_row_stride, float *out,
                     int64_t out_row_stride, const int64_t *rows, const int64_t *tables,
                     const int64_t *context_lens, int64_t n, int64_t max_pages, int64_t layer,
                     int64_t num_layers, int64_t heads, int64_t kv_heads, int64_t block_size,
                     int64_t head_dim, float scale, int threads);

typedef struct {
    const float *attn_norm, *wqkv, *bqkv, *wo, *mlp_norm, *w_gate_up, *w_down;
} layer_weights;

int decode_layers_f32(const layer_weights *weights, int64_t num_layers, float *residual, float *out,
                      float *scratch, const float *cos, const float *sin, float *cache,
                      const int64_t *slot_blocks, const int64_t *slot_offsets, const int64_t *rows,
                      const int64_t *tables, const int64_t *context_lens, int64_t max_pages, int64_t m,
                      int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                      int64_t intermediate, int64_t block_size, float eps, float scale, int threads) {
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
    const int64_t qkv_n = q_size + 2 * kv_size, gate_up_n = 2 * intermediate;
    float *normed = scratch, *qkv = normed + m * hidden, *attn = qkv + m * qkv_n;
    float *gate_up = attn + m * q_size, *act = gate_up + m * gate_up_n;
    for (int64_t l = 0; l < num_layers; l++) {
        const layer_weights *w = weights + l;
        rms_norm_f32(residual, hidden, l == 0 ? NULL : out, hidden, normed, hidden, w->attn_norm, m, hidden, eps);
        small_gemm_f32(normed, hidden, w->wqkv, w->bqkv, qkv, qkv_n, m, qkv_n, hidden, threads);
        rope_f32(qkv, qkv_n, cos, sin, m, heads + kv_heads, head_dim);
        write_kv_f32(cache, qkv + q_size, qkv_n, qkv + q_size + kv_size, qkv_n, slot_blocks, slot_offsets, m, l,
                     num_layers, kv_heads, block_size, head_dim);
        const int rc = paged_decode_f32(cache, qkv, qkv_n, attn, q_size, rows, tables, context_lens, m, max_pages, l,
                                        num_layers, heads, kv_heads, block_size, head_dim, scale, threads);
        if (rc != 0) return rc;
        small_gemm_f32(attn, q_size, w->wo, NULL, out, hidden, m, hidden, q_size, threads);
        rms_norm_f32(residual, hidden, out, hidden, normed, hidden, w->mlp_norm, m, hidden, eps);
        small_gemm_f32(normed, hidden, w->w_gate_up, NULL, gate_up, gate_up_n, m, gate_up_n, hidden, threads);
        silu_mul_f32(gate_up, gate_up_n, act, intermediate, m, intermediate, threads);
        small_gemm_f32(act, intermediate, w->w_down, NULL, out, hidden, m, hidden, intermediate, threads);
    }
    return 0;
}

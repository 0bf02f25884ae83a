/* An attention layer's step between its projections and its attention, fused, on the CPU:
 * rotary embedding of q and k (half-rotation layout, partial rotary: the first R of D dims),
 * and K and V written into their pages of the paged cache in the cache's dtype (fp32, bf16 or
 * fp16, rounded to nearest even as torch's .to() does).
 *
 * The references are engine/model/layers.py's Rotary.apply and the cache writes of
 * engine/model/attention.py (index_put of k.to(cache dtype) at each token's page and offset):
 * ~25 small torch ops a layer a step. kernels/cpu/rope_cache.py binds this.
 *
 * Layouts (innermost stride 1):
 *   q [T, H, D], k and v [T, Hkv, D]   fp32, strided (views inside a fused q|k|v output)
 *   cos, sin [T, R]                   fp32, contiguous
 *   k_cache, v_cache                  page p, offset o, head h at p * page_stride + o * offset_stride
 *                                     + h * head_stride elements (the same strides for both)
 *   pages, offsets [T]                where each token's K/V goes: page < num_pages, offset < page_size
 *   q_out [T, H, D]                   contiguous
 * Returns 0; -1 for an unknown dtype or an odd or too wide rotary part; -2 for a page or offset
 * outside the cache (checked before anything is written: the torch reference raises there).
 */
#include <stdint.h>
#include <string.h>

enum { KV_FP32 = 0, KV_BF16 = 1, KV_FP16 = 2 };

static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);  /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* One head's row: rotated (first r dims) or copied (the rest). */
static inline void rope_row(const float *x, const float *cos, const float *sin, int64_t r, int64_t dim, float *dst) {
    const int64_t half = r / 2;
    for (int64_t j = 0; j < half; j++) dst[j] = x[j] * cos[j] + (-x[j + half]) * sin[j];
    for (int64_t j = half; j < r; j++) dst[j] = x[j] * cos[j] + x[j - half] * sin[j];
    for (int64_t j = r; j < dim; j++) dst[j] = x[j];
}

static inline void store(int dtype, void *base, int64_t at, const float *row, int64_t dim) {
    if (dtype == KV_FP32) {
        memcpy((float *)base + at, row, (size_t)dim * sizeof(float));
    } else if (dtype == KV_BF16) {
        uint16_t *dst = (uint16_t *)base + at;
        for (int64_t j = 0; j < dim; j++) dst[j] = to_bf16(row[j]);
    } else {
        _Float16 *dst = (_Float16 *)base + at;
        for (int64_t j = 0; j < dim; j++) dst[j] = (_Float16)row[j];
    }
}

int rope_write_kv(const float *q, int64_t q_token_stride, int64_t q_head_stride, int64_t heads,
                  const float *k, int64_t k_token_stride, int64_t k_head_stride,
                  const float *v, int64_t v_token_stride, int64_t v_head_stride, int64_t kv_heads,
                  int64_t tokens, int64_t dim, const float *cos, const float *sin, int64_t rotary_dim,
                  int dtype, void *k_cache, void *v_cache, int64_t page_stride, int64_t offset_stride,
                  int64_t head_stride, const int64_t *pages, const int64_t *offsets, int64_t num_pages,
                  int64_t page_size, float *q_out) {
    if (dtype < KV_FP32 || dtype > KV_FP16 || rotary_dim % 2 != 0 || rotary_dim > dim || dim > 1024) return -1;
    for (int64_t t = 0; t < tokens; t++)
        if (pages[t] < 0 || pages[t] >= num_pages || offsets[t] < 0 || offsets[t] >= page_size) return -2;
    #pragma omp parallel for schedule(static) if (tokens * (heads + 2 * kv_heads) * dim >= (1 << 16))
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * rotary_dim, *s = sin + t * rotary_dim;
        for (int64_t h = 0; h < heads; h++)
            rope_row(q + t * q_token_stride + h * q_head_stride, c, s, rotary_dim, dim, q_out + (t * heads + h) * dim);
        const int64_t slot = pages[t] * page_stride + offsets[t] * offset_stride;
        float row[1024];
        for (int64_t h = 0; h < kv_heads; h++) {
            rope_row(k + t * k_token_stride + h * k_head_stride, c, s, rotary_dim, dim, row);
            store(dtype, k_cache, slot + h * head_stride, row, dim);
            store(dtype, v_cache, slot + h * head_stride, v + t * v_token_stride + h * v_head_stride, dim);
        }
    }
    return 0;
}

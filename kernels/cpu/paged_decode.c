/* Paged decode attention on the CPU: one new token for each of B sequences, over K/V read
 * where they lie in the page pool (no gather, no padding, no mask).
 *
 * Layouts (strides in elements; the head dim is contiguous):
 *   q    [B, H, D] fp32, contiguous          out [B, H, D] fp32, contiguous
 *   k, v [num_pages, P, Hkv, D] fp32/bf16/fp16 (strided views of the engine's pool)
 *   pages, offsets [B, L] int64 (position -> page, offset in it); lengths [B] int64
 * Query head h reads KV head h / (H / Hkv) (grouped-query attention): the G query heads of
 * one KV head are done together, so each K/V row is read once per step, converted to fp32 once,
 * and used for all G. Softmax is online (running max and sum, in fp32) over blocks of
 * positions. OpenMP splits the (sequence, KV head) pairs over the threads: libgomp is the
 * runtime torch already loaded, so both share one pool and torch.set_num_threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };
#define BLOCK 32
#define MAX_GROUP 64
#define MAX_DIM 256

#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
#endif

/* One K or V row as fp32: the row itself when it already is, else converted into buf. */
static inline const float *row_f32(int dtype, const void *base, int64_t idx, int dim, float *buf) {
    if (dtype == KV_F32) return (const float *)base + idx;
    int d = 0;
#if defined(__AVX512F__)
    if (dtype == KV_BF16) {  /* bf16 is the top half of an fp32: widen and shift */
        const uint16_t *src = (const uint16_t *)base + idx;
        for (; d + LANES <= dim; d += LANES) {
            __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + d)));
            _mm512_storeu_ps(buf + d, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
        }
    } else {
        const uint16_t *src = (const uint16_t *)base + idx;
        for (; d + LANES <= dim; d += LANES)
            _mm512_storeu_ps(buf + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + d))));
    }
#endif
    if (dtype == KV_BF16) {
        const uint16_t *src = (const uint16_t *)base + idx;
        for (; d < dim; d++) {
            uint32_t bits = (uint32_t)src[d] << 16;
            memcpy(&buf[d], &bits, 4);
        }
    } else {
        const _Float16 *src = (const _Float16 *)base + idx;
        for (; d < dim; d++) buf[d] = (float)src[d];
    }
    return buf;
}

/* out[g] = q[g] . k for the group's G query rows (q pre-scaled). */
static inline void scores(const float *q, const float *k, int group, int dim, float *out, int stride) {
#if defined(__AVX512F__)
    if (dim % LANES == 0) {
        for (int g = 0; g < group; g++) {
            const float *qg = q + g * dim;
            __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
            int d = 0;
            for (; d + 2 * LANES <= dim; d += 2 * LANES) {
                acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d), _mm512_loadu_ps(k + d), acc0);
                acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d + LANES), _mm512_loadu_ps(k + d + LANES), acc1);
            }
            if (d < dim) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d), _mm512_loadu_ps(k + d), acc0);
            out[g * stride] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
        }
        return;
    }
#endif
    for (int g = 0; g < group; g++) {
        float dot = 0.0f;
        #pragma omp simd reduction(+:dot)
        for (int d = 0; d < dim; d++) dot += q[g * dim + d] * k[d];
        out[g * stride] = dot;
    }
}

/* acc[g] += p[g] * v for the group's G rows. */
static inline void accumulate(float *acc, const float *p, int pstride, const float *v, int group, int dim) {
#if defined(__AVX512F__)
    if (dim % LANES == 0) {
        for (int g = 0; g < group; g++) {
            __m512 pg = _mm512_set1_ps(p[g * pstride]);
            float *ag = acc + g * dim;
            for (int d = 0; d < dim; d += LANES)
                _mm512_storeu_ps(ag + d, _mm512_fmadd_ps(pg, _mm512_loadu_ps(v + d), _mm512_loadu_ps(ag + d)));
        }
        return;
    }
#endif
    for (int g = 0; g < group; g++) {
        float pg = p[g * pstride];
        #pragma omp simd
        for (int d = 0; d < dim; d++) acc[g * dim + d] += pg * v[d];
    }
}

/* Rows a page apart (and pages anywhere in the pool) defeat the hardware prefetcher: each K/V row is
 * asked for AHEAD positions before it is read, so the loads overlap the arithmetic. */
#define AHEAD 8
static inline void prefetch_row(const void *base, int64_t idx, int elem, int row_bytes) {
    const char *p = (const char *)base + idx * elem;
    for (int off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

static void one_head(int dtype, const float *q, const void *k, const void *v,
                     int64_t k_sp, int64_t k_so, int64_t v_sp, int64_t v_so, int64_t k_head, int64_t v_head,
                     const int64_t *pages, const int64_t *offsets, int64_t p_sl, int64_t o_sl,
                     int64_t start, int64_t end, int group, int dim, float scale, float *out) {
    float qs[MAX_GROUP * MAX_DIM], acc[MAX_GROUP * MAX_DIM];  /* [G, D] each */
    float s[MAX_GROUP][BLOCK], m[MAX_GROUP], l[MAX_GROUP];
    float buf[MAX_DIM];
    int elem = dtype == KV_F32 ? 4 : 2, row_bytes = dim * elem;
    for (int i = 0; i < group * dim; i++) { qs[i] = q[i] * scale; acc[i] = 0.0f; }
    for (int g = 0; g < group; g++) { m[g] = -INFINITY; l[g] = 0.0f; }
    for (int64_t t0 = start; t0 < end; t0 += BLOCK) {
        int n = (int)(end - t0 < BLOCK ? end - t0 : BLOCK);
        for (int j = 0; j < n; j++) {  /* scores of this block: s[g][j] = q_g . k_t */
            int64_t t = t0 + j;
            if (t + AHEAD < end)
                prefetch_row(k, pages[(t + AHEAD) * p_sl] * k_sp + offsets[(t + AHEAD) * o_sl] * k_so + k_head,
                             elem, row_bytes);
            const float *kr = row_f32(dtype, k, pages[t * p_sl] * k_sp + offsets[t * o_sl] * k_so + k_head, dim, buf);
            scores(qs, kr, group, dim, &s[0][j], BLOCK);
        }
        for (int g = 0; g < group; g++) {  /* rescale what came before to the new running max */
            float mx = m[g];
            for (int j = 0; j < n; j++) mx = s[g][j] > mx ? s[g][j] : mx;
            float alpha = expf(m[g] - mx), sum = 0.0f;
            for (int j = 0; j < n; j++) { s[g][j] = expf(s[g][j] - mx); sum += s[g][j]; }
            l[g] = l[g] * alpha + sum;
            m[g] = mx;
            if (alpha != 1.0f)
                for (int d = 0; d < dim; d++) acc[g * dim + d] *= alpha;
        }
        for (int j = 0; j < n; j++) {
            int64_t t = t0 + j;
            if (t + AHEAD < end)
                prefetch_row(v, pages[(t + AHEAD) * p_sl] * v_sp + offsets[(t + AHEAD) * o_sl] * v_so + v_head,
                             elem, row_bytes);
            const float *vr = row_f32(dtype, v, pages[t * p_sl] * v_sp + offsets[t * o_sl] * v_so + v_head, dim, buf);
            accumulate(acc, &s[0][j], BLOCK, vr, group, dim);
        }
    }
    for (int g = 0; g < group; g++) {
        float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;  /* an empty context (never sent) gives zeros */
        for (int d = 0; d < dim; d++) out[g * dim + d] = acc[g * dim + d] * inv;
    }
}

/* Returns 0, or -1 when a size is past the fixed buffers (the caller checks first; this is a guard).
 * The dot products are OpenMP simd reductions: vectorised without -ffast-math anywhere else. */
int paged_decode_attention(int dtype, const float *q, const void *k, const void *v,
                           int64_t k_sp, int64_t k_so, int64_t k_sh, int64_t v_sp, int64_t v_so, int64_t v_sh,
                           const int64_t *pages, int64_t p_sb, int64_t p_sl,
                           const int64_t *offsets, int64_t o_sb, int64_t o_sl,
                           const int64_t *lengths, float *out, int64_t batch, int heads, int kv_heads, int dim,
                           float scale, int64_t window) {
    if (kv_heads <= 0 || heads % kv_heads || heads / kv_heads > MAX_GROUP || dim > MAX_DIM) return -1;
    int group = heads / kv_heads;
    #pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < batch; b++) {
        for (int h = 0; h < kv_heads; h++) {
            int64_t end = lengths[b];
            int64_t start = window > 0 && end > window ? end - window : 0;
            int64_t row = (b * heads + (int64_t)h * group) * dim;
            one_head(dtype, q + row, k, v, k_sp, k_so, v_sp, v_so, h * k_sh, h * v_sh,
                     pages + b * p_sb, offsets + b * o_sb, p_sl, o_sl, start, end, group, dim, scale, out + row);
        }
    }
    return 0;
}

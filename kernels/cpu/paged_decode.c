/* Paged decode attention on the CPU: one new token for each of B sequences, over K/V read
 * where they lie in the page pool (no gather, no padding, no mask).
 *
 * Layouts (strides in elements; the head dim is contiguous):
 *   q    [B, H, D] fp32, contiguous          out [B, H, D] fp32, contiguous
 *   k, v [num_pages, P, Hkv, D] fp32/bf16/fp16 (strided views of the engine's pool)
 *   pages, offsets [B, L] int64 (position -> page, offset in it); lengths [B] int64
 *   or, with page_size > 0, pages [B, W] int64 each sequence's page table (position t is at
 *   offset t % page_size of page pages[t / page_size]; offsets is not read): the form the
 *   engine's decode batch has, so its step builds no [B, L] tensors
 * Query head h reads KV head h / (H / Hkv) (grouped-query attention): the G query heads of
 * one KV head are done together, so each K/V row comes from memory once per step and serves
 * all G (converted to fp32 as it is loaded, for four query heads at a time). Softmax is online
 * (running max and sum, in fp32) over blocks of BLOCK positions: the block's scores, then its
 * exponentials, then its V rows. With AVX-512 (and a head dim that is a multiple of 16) the
 * inner loops are intrinsics; otherwise plain C loops. OpenMP splits the (sequence, KV head)
 * pairs over the threads: libgomp is the runtime torch already loaded, so both share one pool
 * and torch.set_num_threads.
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

/* out[g] = q[g] . k for the group's G query rows (q pre-scaled): the plain loops, for a head dim
 * that is no multiple of 16 (else scores_row). */
static inline void scores(const float *q, const float *k, int group, int dim, float *out, int stride) {
    for (int g = 0; g < group; g++) {
        float dot = 0.0f;
        #pragma omp simd reduction(+:dot)
        for (int d = 0; d < dim; d++) dot += q[g * dim + d] * k[d];
        out[g * stride] = dot;
    }
}

#if defined(__AVX512F__)
/* e^x for x <= 0 (a score minus the running max), 16 at once: x = n ln2 + r with |r| <= ln2/2
 * (ln2 split in two for exactness), Cephes' degree-6 polynomial for e^r (about 1 ulp), and 2^n
 * applied by scalef (which underflows to 0 where e^x does). glibc's expf, one at a time, cost
 * about a fifth of the kernel's time. */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));  /* e^-104 is 0 in fp32 already */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif

/* The largest of s[0..n) and mx. */
static inline float block_max(const float *s, int n, float mx) {
    int j = 0;
#if defined(__AVX512F__)
    if (n >= LANES) {
        __m512 m = _mm512_set1_ps(mx);
        for (; j + LANES <= n; j += LANES) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
        mx = _mm512_reduce_max_ps(m);
    }
#endif
    for (; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    return mx;
}

/* s[j] = e^(s[j] - mx) for j < n; returns their sum. */
static inline float block_exp(float *s, int n, float mx) {
    int j = 0;
    float sum = 0.0f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps(), vmx = _mm512_set1_ps(mx);
    for (; j < n; j += LANES) {
        __mmask16 live = n - j >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), vmx));
        _mm512_mask_storeu_ps(s + j, live, e);
        acc = _mm512_mask_add_ps(acc, live, acc, e);
    }
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; j < n; j++) { s[j] = expf(s[j] - mx); sum += s[j]; }
    return sum;
}

/* acc[g] += p[g] * v for the group's G rows: the plain loops (else accumulate_block). */
static inline void accumulate(float *acc, const float *p, int pstride, const float *v, int group, int dim) {
    for (int g = 0; g < group; g++) {
        float pg = p[g * pstride];
        #pragma omp simd
        for (int d = 0; d < dim; d++) acc[g * dim + d] += pg * v[d];
    }
}

#if defined(__AVX512F__)
/* 16 elements of a K/V row as fp32. */
static inline __m512 load16(int dtype, const char *row, int d) {
    if (dtype == KV_F32) return _mm512_loadu_ps((const float *)row + d);
    __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d));
    if (dtype == KV_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    return _mm512_cvtph_ps(half);
}

/* acc[g] += sum_j p[g][j] v_j over a block's n V rows for gn (<= 4) query rows, 16 columns at a time
 * with the gn accumulators in registers: no store per row (a 512-bit store per 16 columns of every
 * row and query row was the bottleneck), each V row read from L1 once per pass, converted inline. */
static inline void accumulate_block4(int dtype, float *acc, const float (*p)[BLOCK], const char *const *rows,
                                     int n, int gn, int dim) {
    for (int d = 0; d < dim; d += LANES) {
        __m512 a0 = _mm512_loadu_ps(acc + d);
        __m512 a1 = gn > 1 ? _mm512_loadu_ps(acc + dim + d) : _mm512_setzero_ps();
        __m512 a2 = gn > 2 ? _mm512_loadu_ps(acc + 2 * dim + d) : _mm512_setzero_ps();
        __m512 a3 = gn > 3 ? _mm512_loadu_ps(acc + 3 * dim + d) : _mm512_setzero_ps();
        for (int j = 0; j < n; j++) {
            __m512 x = load16(dtype, rows[j], d);
            a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[0][j]), x, a0);
            if (gn > 1) a1 = _mm512_fmadd_ps(_mm512_set1_ps(p[1][j]), x, a1);
            if (gn > 2) a2 = _mm512_fmadd_ps(_mm512_set1_ps(p[2][j]), x, a2);
            if (gn > 3) a3 = _mm512_fmadd_ps(_mm512_set1_ps(p[3][j]), x, a3);
        }
        _mm512_storeu_ps(acc + d, a0);
        if (gn > 1) _mm512_storeu_ps(acc + dim + d, a1);
        if (gn > 2) _mm512_storeu_ps(acc + 2 * dim + d, a2);
        if (gn > 3) _mm512_storeu_ps(acc + 3 * dim + d, a3);
    }
}

/* The switches hand accumulate_block4 constants, so each (dtype, gn) pair compiles branch-free. */
static inline void accumulate_block_dt(int dtype, float *acc, const float (*p)[BLOCK], const char *const *rows,
                                       int n, int group, int dim) {
    for (int g0 = 0; g0 < group; g0 += 4) {
        int gn = group - g0 < 4 ? group - g0 : 4;
        float *a = acc + g0 * dim;
        switch (gn) {
            case 4: accumulate_block4(dtype, a, p + g0, rows, n, 4, dim); break;
            case 3: accumulate_block4(dtype, a, p + g0, rows, n, 3, dim); break;
            case 2: accumulate_block4(dtype, a, p + g0, rows, n, 2, dim); break;
            default: accumulate_block4(dtype, a, p + g0, rows, n, 1, dim); break;
        }
    }
}

static void accumulate_block(int dtype, float *acc, const float (*p)[BLOCK], const char *const *rows,
                             int n, int group, int dim) {
    switch (dtype) {
        case KV_F32: accumulate_block_dt(KV_F32, acc, p, rows, n, group, dim); break;
        case KV_BF16: accumulate_block_dt(KV_BF16, acc, p, rows, n, group, dim); break;
        default: accumulate_block_dt(KV_F16, acc, p, rows, n, group, dim); break;
    }
}
#endif

#if defined(__AVX512F__)
/* The four lane sums of a0..a3 at once (halves folded, then three horizontal adds). */
static inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
#define FOLD(a) _mm256_add_ps(_mm512_castps512_ps256(a), \
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)))
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(FOLD(a0), FOLD(a1)), _mm256_hadd_ps(FOLD(a2), FOLD(a3)));
#undef FOLD
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* s[g][j] = q_g . k for gn (<= 4) query rows at once: each 16 columns of the K row loaded (and
 * converted) once for all of them, one combined reduction. */
static inline void scores4(int dtype, const float *q, const char *row, int gn, int dim, float (*s)[BLOCK], int j) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int d = 0; d < dim; d += LANES) {
        __m512 x = load16(dtype, row, d);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), x, a0);
        if (gn > 1) a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + dim + d), x, a1);
        if (gn > 2) a2 = _mm512_fmadd_ps(_mm512_loadu_ps(q + 2 * dim + d), x, a2);
        if (gn > 3) a3 = _mm512_fmadd_ps(_mm512_loadu_ps(q + 3 * dim + d), x, a3);
    }
    float out[4];
    _mm_storeu_ps(out, sum4(a0, a1, a2, a3));
    for (int g = 0; g < gn; g++) s[g][j] = out[g];
}

static inline void scores_row_dt(int dtype, const float *q, const char *row, int group, int dim,
                                 float (*s)[BLOCK], int j) {
    for (int g0 = 0; g0 < group; g0 += 4) {
        int gn = group - g0 < 4 ? group - g0 : 4;
        switch (gn) {
            case 4: scores4(dtype, q + g0 * dim, row, 4, dim, s + g0, j); break;
            case 3: scores4(dtype, q + g0 * dim, row, 3, dim, s + g0, j); break;
            case 2: scores4(dtype, q + g0 * dim, row, 2, dim, s + g0, j); break;
            default: scores4(dtype, q + g0 * dim, row, 1, dim, s + g0, j); break;
        }
    }
}

static void scores_row(int dtype, const float *q, const char *row, int group, int dim, float (*s)[BLOCK], int j) {
    switch (dtype) {
        case KV_F32: scores_row_dt(KV_F32, q, row, group, dim, s, j); break;
        case KV_BF16: scores_row_dt(KV_BF16, q, row, group, dim, s, j); break;
        default: scores_row_dt(KV_F16, q, row, group, dim, s, j); break;
    }
}
#endif

/* Rows a page apart (and pages anywhere in the pool) defeat the hardware prefetcher: each K/V row is
 * asked for AHEAD positions before it is read, so the loads overlap the arithmetic. */
#define AHEAD 32
static inline void prefetch_row(const void *base, int64_t idx, int elem, int row_bytes) {
    const char *p = (const char *)base + idx * elem;
    for (int off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

/* Element index of position t's row in a K/V pool with page stride sp and offset stride so. */
static inline int64_t row_at(const int64_t *pages, const int64_t *offsets, int64_t p_sl, int64_t o_sl,
                             int64_t psize, int64_t t, int64_t sp, int64_t so) {
    if (psize > 0) return pages[(t / psize) * p_sl] * sp + (t % psize) * so;
    return pages[t * p_sl] * sp + offsets[t * o_sl] * so;
}

static void one_head(int dtype, const float *q, const void *k, const void *v,
                     int64_t k_sp, int64_t k_so, int64_t v_sp, int64_t v_so, int64_t k_head, int64_t v_head,
                     const int64_t *pages, const int64_t *offsets, int64_t p_sl, int64_t o_sl, int64_t psize,
                     int64_t start, int64_t end, int group, int dim, float scale, float *out) {
    float qs[MAX_GROUP * MAX_DIM], acc[MAX_GROUP * MAX_DIM];  /* [G, D] each */
    float s[MAX_GROUP][BLOCK], m[MAX_GROUP], l[MAX_GROUP];
    float buf[MAX_DIM];
    int elem = dtype == KV_F32 ? 4 : 2, row_bytes = dim * elem;
    const char *vrows[BLOCK];
#if defined(__AVX512F__)
    const int vector_pv = dim % LANES == 0;
#else
    const int vector_pv = 0;
#endif
    for (int i = 0; i < group * dim; i++) { qs[i] = q[i] * scale; acc[i] = 0.0f; }
    for (int g = 0; g < group; g++) { m[g] = -INFINITY; l[g] = 0.0f; }
    for (int64_t t0 = start; t0 < end; t0 += BLOCK) {
        int n = (int)(end - t0 < BLOCK ? end - t0 : BLOCK);
        for (int j = 0; j < n; j++) {  /* scores of this block: s[g][j] = q_g . k_t */
            int64_t t = t0 + j;
            if (t + AHEAD < end)
                prefetch_row(k, row_at(pages, offsets, p_sl, o_sl, psize, t + AHEAD, k_sp, k_so) + k_head,
                             elem, row_bytes);
            vrows[j] = (const char *)v + (row_at(pages, offsets, p_sl, o_sl, psize, t, v_sp, v_so) + v_head) * elem;
            if (vector_pv) prefetch_row(vrows[j], 0, elem, row_bytes);  /* read once the block's scores are done */
            int64_t kidx = row_at(pages, offsets, p_sl, o_sl, psize, t, k_sp, k_so) + k_head;
#if defined(__AVX512F__)
            if (vector_pv) {
                scores_row(dtype, qs, (const char *)k + kidx * elem, group, dim, s, j);
                continue;
            }
#endif
            scores(qs, row_f32(dtype, k, kidx, dim, buf), group, dim, &s[0][j], BLOCK);
        }
        for (int g = 0; g < group; g++) {  /* rescale what came before to the new running max */
            float mx = block_max(s[g], n, m[g]);
            float alpha = expf(m[g] - mx), sum = block_exp(s[g], n, mx);
            l[g] = l[g] * alpha + sum;
            m[g] = mx;
            if (alpha != 1.0f)
                for (int d = 0; d < dim; d++) acc[g * dim + d] *= alpha;
        }
#if defined(__AVX512F__)
        if (vector_pv) {
            accumulate_block(dtype, acc, (const float (*)[BLOCK])s, vrows, n, group, dim);
            continue;
        }
#endif
        for (int j = 0; j < n; j++) {
            int64_t t = t0 + j;
            if (t + AHEAD < end)
                prefetch_row(v, row_at(pages, offsets, p_sl, o_sl, psize, t + AHEAD, v_sp, v_so) + v_head,
                             elem, row_bytes);
            const float *vr = row_f32(dtype, v, row_at(pages, offsets, p_sl, o_sl, psize, t, v_sp, v_so) + v_head, dim, buf);
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
                           float scale, int64_t window, int64_t page_size) {
    if (kv_heads <= 0 || heads % kv_heads || heads / kv_heads > MAX_GROUP || dim > MAX_DIM) return -1;
    int group = heads / kv_heads;
    #pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < batch; b++) {
        for (int h = 0; h < kv_heads; h++) {
            int64_t end = lengths[b];
            int64_t start = window > 0 && end > window ? end - window : 0;
            int64_t row = (b * heads + (int64_t)h * group) * dim;
            one_head(dtype, q + row, k, v, k_sp, k_so, v_sp, v_so, h * k_sh, h * v_sh,
                     pages + b * p_sb, offsets + b * o_sb, p_sl, o_sl, page_size, start, end, group, dim, scale,
                     out + row);
        }
    }
    return 0;
}

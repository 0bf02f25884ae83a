/* An MoE layer's routed experts on the CPU, for the few (token, expert) pairs of a decode step:
 *   y[t] = sum_k w[t,k] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),  e = expert_ids[t,k]
 * all in fp32. The reference is kernels/moe_gemm.py's moe_experts_reference; engine/model/layers.py's
 * Experts.grouped (torch._grouped_mm) is what the CPU runs otherwise. kernels/cpu/moe_experts.py
 * binds this.
 *
 * Why: torch's CPU _grouped_mm runs one matmul and one host read per expert for all E experts
 * (128 in Qwen3-30B-A3B), while a decode step hits at most T*K of them. Here only the experts hit
 * are read, each expert's weights exactly once per call whatever the number of its tokens (as
 * ggml's mul_mat_id): decode is memory-bound, and the few x and h rows stay in cache.
 *   1. The pairs p = t*K + k are grouped by expert (a stable counting sort over E).
 *   2. gate/up: OpenMP over (hit expert, block of ROW_BLOCK intermediate rows); each weight row
 *      is dotted with each of that expert's x rows, h[pair][i] = silu(g) * u into scratch
 *      [P, I] (pairs in sorted order, so one expert's h rows are contiguous).
 *   3. down: OpenMP over blocks of ROW_BLOCK output rows, so every y element has one writer (no
 *      atomics): y[t][r] += w * dot(down[e][r,:], h[pair]) over the hit experts in order.
 * The dots are OpenMP simd reductions, four x (or h) rows at a time against two weight rows (the
 * gate and up rows together; two rows of down): 6 loads for 8 products.
 *
 * Layouts (fp32; innermost stride 1):
 *   x          [T, H], row stride x_stride     gate_up [E, 2I, H] contiguous (rows :I gate, I: up)
 *   down       [E, H, I] contiguous            expert_ids [T, K] int64 contiguous
 *   weights    [T, K] contiguous               y [T, H] contiguous, written (not accumulated into)
 * Returns 0; -1 on a bad size, -2 when an expert id is outside [0, E) (nothing is read through
 * it), -3 when the scratch cannot be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROW_BLOCK 16
#define TILE 4

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/* Two weight rows a0, a1 (the gate and up rows, or two down rows) against TILE rows b in one pass:
   6 loads for 8 products. */
static inline void dot_tile2(const float *restrict a0, const float *restrict a1, const float *restrict const *b,
                             int64_t n, float *out0, float *out1) {
    const float *b0 = b[0], *b1 = b[1], *b2 = b[2], *b3 = b[3];
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f, t0 = 0.0f, t1 = 0.0f, t2 = 0.0f, t3 = 0.0f;
    #pragma omp simd reduction(+ : s0, s1, s2, s3, t0, t1, t2, t3)
    for (int64_t j = 0; j < n; j++) {
        const float v = a0[j], w = a1[j];
        s0 += v * b0[j]; t0 += w * b0[j];
        s1 += v * b1[j]; t1 += w * b1[j];
        s2 += v * b2[j]; t2 += w * b2[j];
        s3 += v * b3[j]; t3 += w * b3[j];
    }
    out0[0] = s0; out0[1] = s1; out0[2] = s2; out0[3] = s3;
    out1[0] = t0; out1[1] = t1; out1[2] = t2; out1[3] = t3;
}

/* silu(g . x) * (u . x) for one x row, both rows in one pass. */
static inline float gate_up_one(const float *restrict g, const float *restrict u, const float *restrict x,
                                int64_t n) {
    float gs = 0.0f, us = 0.0f;
    #pragma omp simd reduction(+ : gs, us)
    for (int64_t j = 0; j < n; j++) { gs += g[j] * x[j]; us += u[j] * x[j]; }
    return silu(gs) * us;
}

/* Two weight rows against one row b. */
static inline void dot2(const float *restrict a0, const float *restrict a1, const float *restrict b, int64_t n,
                        float *out0, float *out1) {
    float s = 0.0f, t = 0.0f;
    #pragma omp simd reduction(+ : s, t)
    for (int64_t j = 0; j < n; j++) { s += a0[j] * b[j]; t += a1[j] * b[j]; }
    *out0 = s; *out1 = t;
}

int moe_experts_rows(const float *x, int64_t tokens, int64_t x_stride, int64_t hidden,
                     const float *gate_up, const float *down, int64_t experts, int64_t inter,
                     const int64_t *expert_ids, const float *weights, int64_t top_k, float *y) {
    if (tokens < 0 || hidden <= 0 || experts <= 0 || inter <= 0 || top_k < 0) return -1;
    const int64_t pairs = tokens * top_k;
    if (pairs == 0) {
        for (int64_t t = 0; t < tokens; t++) memset(y + t * hidden, 0, (size_t)hidden * sizeof(float));
        return 0;
    }
    for (int64_t p = 0; p < pairs; p++)
        if (expert_ids[p] < 0 || expert_ids[p] >= experts) return -2;

    /* One allocation: start[E+1], sorted pair ids [P], hit experts [<= P], then h [P, I]. */
    const int64_t max_hit = pairs < experts ? pairs : experts;
    const size_t index_bytes = (size_t)(experts + 1 + pairs + max_hit) * sizeof(int64_t);
    char *scratch = malloc(index_bytes + (size_t)(pairs * inter) * sizeof(float));
    if (scratch == NULL) return -3;
    int64_t *start = (int64_t *)scratch, *sorted = start + experts + 1, *hit = sorted + pairs;
    float *h = (float *)(scratch + index_bytes);

    /* 1. Counting sort: start[e] .. start[e+1] are expert e's pairs in `sorted`, in pair order. */
    memset(start, 0, (size_t)(experts + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < pairs; p++) start[expert_ids[p] + 1]++;
    int64_t n_hit = 0;
    for (int64_t e = 0; e < experts; e++) {
        if (start[e + 1] > 0) hit[n_hit++] = e;
        start[e + 1] += start[e];
    }
    for (int64_t p = 0; p < pairs; p++) sorted[start[expert_ids[p]]++] = p;
    for (int64_t e = experts; e > 0; e--) start[e] = start[e - 1];  /* the fill moved each start to its end */
    start[0] = 0;

    const int64_t i_blocks = (inter + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t h_blocks = (hidden + ROW_BLOCK - 1) / ROW_BLOCK;
    #pragma omp parallel
    {
        /* 2. gate/up, with silu(g) * u into h. Dynamic: an expert with more tokens is more work. */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < n_hit * i_blocks; item++) {
            const int64_t e = hit[item / i_blocks], i0 = (item % i_blocks) * ROW_BLOCK;
            const int64_t i1 = i0 + ROW_BLOCK < inter ? i0 + ROW_BLOCK : inter;
            const int64_t first = start[e], count = start[e + 1] - first;
            const float *w_gate = gate_up + e * 2 * inter * hidden, *w_up = w_gate + inter * hidden;
            for (int64_t i = i0; i < i1; i++) {
                const float *g_row = w_gate + i * hidden, *u_row = w_up + i * hidden;
                int64_t j = 0;
                for (; j + TILE <= count; j += TILE) {
                    const float *xs[TILE];
                    float g[TILE], u[TILE];
                    for (int q = 0; q < TILE; q++) xs[q] = x + (sorted[first + j + q] / top_k) * x_stride;
                    dot_tile2(g_row, u_row, xs, hidden, g, u);
                    for (int q = 0; q < TILE; q++) h[(first + j + q) * inter + i] = silu(g[q]) * u[q];
                }
                for (; j < count; j++) {
                    const float *xr = x + (sorted[first + j] / top_k) * x_stride;
                    h[(first + j) * inter + i] = gate_up_one(g_row, u_row, xr, hidden);
                }
            }
        }
        /* (the implicit barrier: every h row is written before the down projection reads it) */

        /* 3. down, each thread owning whole rows of y. */
        #pragma omp for schedule(static)
        for (int64_t block = 0; block < h_blocks; block++) {
            const int64_t r0 = block * ROW_BLOCK, r1 = r0 + ROW_BLOCK < hidden ? r0 + ROW_BLOCK : hidden;
            for (int64_t t = 0; t < tokens; t++)
                for (int64_t r = r0; r < r1; r++) y[t * hidden + r] = 0.0f;
            for (int64_t n = 0; n < n_hit; n++) {
                const int64_t e = hit[n], first = start[e], count = start[e + 1] - first;
                const float *w_down = down + e * hidden * inter;
                for (int64_t r = r0; r < r1; r += 2) {  /* two rows at a time; an odd last row twice */
                    const int two = r + 1 < r1;
                    const float *d0 = w_down + r * inter, *d1 = two ? d0 + inter : d0;
                    int64_t j = 0;
                    for (; j + TILE <= count; j += TILE) {
                        const float *hs[TILE];
                        float s0[TILE], s1[TILE];
                        for (int q = 0; q < TILE; q++) hs[q] = h + (first + j + q) * inter;
                        dot_tile2(d0, d1, hs, inter, s0, s1);
                        for (int q = 0; q < TILE; q++) {
                            const int64_t p = sorted[first + j + q];
                            float *yr = y + (p / top_k) * hidden + r;
                            yr[0] += weights[p] * s0[q];
                            if (two) yr[1] += weights[p] * s1[q];
                        }
                    }
                    for (; j < count; j++) {
                        const int64_t p = sorted[first + j];
                        float s0, s1;
                        dot2(d0, d1, h + (first + j) * inter, inter, &s0, &s1);
                        float *yr = y + (p / top_k) * hidden + r;
                        yr[0] += weights[p] * s0;
                        if (two) yr[1] += weights[p] * s1;
                    }
                }
            }
        }
    }
    free(scratch);
    return 0;
}

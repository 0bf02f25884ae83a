/* The batched multi-adapter LoRA product on the CPU (punica's / S-LoRA's "BGMV"), each row through
 * its own resident adapter, in fp32:
 *   v[t] = a[s] @ x[t]  [R],   y[t] = sum_r v[t][r] * bt[s][r]  [out],   s = slots[t]
 * and y[t] = 0 where s == -1. The reference is kernels/lora.py's lora_delta_reference;
 * kernels/cpu/lora_rows.py binds this. Without it engine/lora/sites.py runs two GEMMs over all the
 * step's slots with each row's other slots masked: n slots' multiply-adds per row where one does.
 *
 * At decode a call is a weight read (a few rows; 8 slots of R=16 at in=1024, out=4096 are 2.5 MB),
 * so rows are grouped by slot first (a counting sort, as moe_experts.c groups pairs by expert) and
 * each used slot's A and B are read from memory once per call whatever the number of its rows:
 *   1. shrink: OpenMP over (piece, r), a piece being up to PIECE rows of one slot: a[s][r] is
 *      dotted with each row of the piece, TILE rows at a time, into the scratch v [rows, R].
 *   2. expand: each thread a contiguous range of output columns (R streams per slot); per slot,
 *      chunks of CHUNK columns of bt[s]'s R rows are read once and used for every row of the slot,
 *      ROWS_BLOCK rows at a time with B's vectors loaded once per block (8 rows of one slot, in=1024,
 *      out=4096, 2 threads: 80 -> 45 us), y[t][o] accumulated in registers over r: an axpy over
 *      contiguous o, no reduction.
 * The reduction over `in` runs in 16 independent lanes summed at the end, which gcc vectorises
 * without -ffast-math (no reassociation it would have to assume).
 *
 * lora_rows_add does the same for several linears that read the same rows (a layer's q/k/v, its
 * gate/up: the linears a FusedLinears runs together) in one call and one parallel region, and adds
 * each delta into the linear's output in place (y += delta, the delta summed in registers first, so
 * the result is bit for bit the delta's y.add_(delta)): at decode a call's fixed cost (the Python
 * binding, the thread team's two barriers, the scratch) is a fair part of its ~1 MB read, and a
 * separate add of every delta was ~9 us more a linear.
 *
 * lora_rows_add with bf16 = 1 takes the adapters' A and B in bfloat16 (lora.dtype=bfloat16: half the bytes a
 * decode step reads for them), x and y in fp32: each A row a work item dots is widened into the
 * thread's row buffer first, each chunk of B into the thread's pack (the fp32 path's own buffer), and
 * the products run as in fp32 on those exact values.
 *
 * Layouts (fp32, innermost stride 1):
 *   x [rows, in], row stride x_stride     a [S, R, in] contiguous     bt [S, R, out] contiguous
 *   slots [rows] int64                    y [rows, out], row stride y_stride, written (added to)
 * Returns 0; -1 on a bad size, -2 when a slot is outside [-1, S) (checked before anything is
 * written), -3 when the scratch cannot be allocated.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 16
#define TILE 4      /* x rows per pass over an A row: 4 independent chains, the A row loaded once */
#define PIECE 32    /* rows of one slot per shrink work item: long prefills still split over threads */
#define CHUNK 64    /* output columns accumulated in registers (expand_chunk's 4 x 16) */
#define ROWS_BLOCK 4  /* rows of one slot per pass of the expand over a chunk (expand_chunk_rows) */
/* The expand asks for B's columns AHEAD on into L2 (prefetcht1) as it reads its own: a thread's R
 * rows of a slot are R short streams (8 KB each at out=4096, 2 threads). 8 slots from DRAM: ~10%
 * (103 against 115 us); 2, 8 or 16 chunks ahead and prefetcht0 did no better. */
#define AHEAD (4 * CHUNK)
#define PREFETCH_LOCALITY 2
/* Threads pay for themselves above ~64K multiply-adds (a parallel region costs microseconds). */
#define PARALLEL_WORK (1 << 16)

static inline float sum_lanes(const float *acc) {
    float s[LANES / 2];
    for (int l = 0; l < LANES / 2; l++) s[l] = acc[l] + acc[l + LANES / 2];
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

/* dot(w, xs[q]) for TILE rows xs into out[q]. */
static inline void dot_tile(const float *restrict w, const float *restrict const *xs, int64_t n, float *out) {
    const float *restrict x0 = xs[0], *restrict x1 = xs[1], *restrict x2 = xs[2], *restrict x3 = xs[3];
    float a0[LANES] = {0}, a1[LANES] = {0}, a2[LANES] = {0}, a3[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) {
            const float wl = w[i + l];
            a0[l] += wl * x0[i + l];
            a1[l] += wl * x1[i + l];
            a2[l] += wl * x2[i + l];
            a3[l] += wl * x3[i + l];
        }
    for (int l = 0; i + l < n; l++) {  /* the last n % 16 */
        const float wl = w[i + l];
        a0[l] += wl * x0[i + l];
        a1[l] += wl * x1[i + l];
        a2[l] += wl * x2[i + l];
        a3[l] += wl * x3[i + l];
    }
    out[0] = sum_lanes(a0); out[1] = sum_lanes(a1); out[2] = sum_lanes(a2); out[3] = sum_lanes(a3);
}

static inline float dot(const float *restrict w, const float *restrict x, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += w[i + l] * x[i + l];
    for (int l = 0; i + l < n; l++) acc[l] += w[i + l] * x[i + l];
    return sum_lanes(acc);
}

static inline float bf16_value(uint16_t h) {
    union { uint32_t u; float f; } c = {(uint32_t)h << 16};
    return c.f;
}

/* dot for a bf16 w, each element widened where it is read (a row of one slot: no buffer round trip);
 * the same lanes and order as dot, so the same sum as dot on the widened row. */
static inline float dot_bf16(const uint16_t *restrict w, const float *restrict x, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += bf16_value(w[i + l]) * x[i + l];
    for (int l = 0; i + l < n; l++) acc[l] += bf16_value(w[i + l]) * x[i + l];
    return sum_lanes(acc);
}

/* 16 floats as one value (GNU C vectors, no intrinsics): gcc keeps the expand's accumulators in
 * registers (one AVX-512 vector, two AVX2 ones), where a float[64] accumulator stays on the stack and
 * every multiply-add waits on the store of the one before (8 rows of one slot, in=16, out=4096, one
 * thread: 38 against 26 us). Unaligned, and may alias the floats it is read from. */
typedef float vec16 __attribute__((vector_size(LANES * sizeof(float)), aligned(sizeof(float)), may_alias));
#define LOAD16(p) (*(const vec16 *)(p))

/* A chunk's 4 accumulators into y[0:CHUNK]: added to it, or written. */
static inline void store_chunk(float *y, vec16 a0, vec16 a1, vec16 a2, vec16 a3, int add) {
    if (add) {
        *(vec16 *)y += a0;
        *(vec16 *)(y + LANES) += a1;
        *(vec16 *)(y + 2 * LANES) += a2;
        *(vec16 *)(y + 3 * LANES) += a3;
    } else {
        *(vec16 *)y = a0;
        *(vec16 *)(y + LANES) = a1;
        *(vec16 *)(y + 2 * LANES) = a2;
        *(vec16 *)(y + 3 * LANES) = a3;
    }
}

/* y[0:n] = sum_r v[r] * b[r * b_stride + 0:n] for n <= CHUNK columns. */
static inline void expand_chunk(const float *restrict b, int64_t b_stride, const float *restrict v, int64_t rank,
                                float *restrict y, int64_t n, int add) {
    if (n == CHUNK) {  /* CHUNK / LANES independent chains over r */
        vec16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t r = 0; r < rank; r++) {
            const float vr = v[r], *br = b + r * b_stride;
            a0 += vr * LOAD16(br);
            a1 += vr * LOAD16(br + LANES);
            a2 += vr * LOAD16(br + 2 * LANES);
            a3 += vr * LOAD16(br + 3 * LANES);
        }
        store_chunk(y, a0, a1, a2, a3, add);
        return;
    }
    float acc[CHUNK] = {0};  /* the last columns of a row */
    for (int64_t r = 0; r < rank; r++) {
        const float vr = v[r], *restrict br = b + r * b_stride;
        for (int64_t l = 0; l < n; l++) acc[l] += vr * br[l];
    }
    if (add)
        for (int64_t l = 0; l < n; l++) y[l] += acc[l];
    else
        memcpy(y, acc, (size_t)n * sizeof(float));
}

/* 16 bf16 values widened to a vec16 in registers (the bf16 bits are the float's high half). */
typedef uint16_t hvec16 __attribute__((vector_size(LANES * sizeof(uint16_t)), aligned(sizeof(uint16_t)), may_alias));
typedef uint32_t uvec16 __attribute__((vector_size(LANES * sizeof(uint32_t))));
static inline vec16 load16_bf16(const uint16_t *p) {
    return (vec16)(__builtin_convertvector(*(const hvec16 *)p, uvec16) << 16);
}

/* expand_chunk of a full chunk for one row, B in bf16 widened as read (a slot with one row at decode:
 * no pack round trip); the same chains and order as expand_chunk on the widened values. */
static inline void expand_chunk_bf16(const uint16_t *restrict b, int64_t b_stride, const float *restrict v,
                                     int64_t rank, float *restrict y, int add) {
    vec16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t r = 0; r < rank; r++) {
        const float vr = v[r];
        const uint16_t *br = b + r * b_stride;
        a0 += vr * load16_bf16(br);
        a1 += vr * load16_bf16(br + LANES);
        a2 += vr * load16_bf16(br + 2 * LANES);
        a3 += vr * load16_bf16(br + 3 * LANES);
    }
    store_chunk(y, a0, a1, a2, a3, add);
}

/* expand_chunk for ROWS_BLOCK rows of one slot at once (a full chunk): each of B's vectors is loaded
 * once for the block's rows, ROWS_BLOCK x 4 accumulators (16 of AVX-512's 32 registers), so a step's
 * rows of one adapter are multiply-adds, not loads of B again per row. */
static inline void expand_chunk_rows(const float *restrict b, int64_t b_stride, const float *const *v, int64_t rank,
                                     float *const *y, int add) {
    vec16 acc[ROWS_BLOCK][4] = {{{0}}};
    for (int64_t r = 0; r < rank; r++) {
        const float *br = b + r * b_stride;
        const vec16 b0 = LOAD16(br), b1 = LOAD16(br + LANES), b2 = LOAD16(br + 2 * LANES), b3 = LOAD16(br + 3 * LANES);
        for (int q = 0; q < ROWS_BLOCK; q++) {
            const float vr = v[q][r];
            acc[q][0] += vr * b0;
            acc[q][1] += vr * b1;
            acc[q][2] += vr * b2;
            acc[q][3] += vr * b3;
        }
    }
    for (int q = 0; q < ROWS_BLOCK; q++)
        for (int k = 0; k < 4; k++) {
            if (add) *(vec16 *)(y[q] + k * LANES) += acc[q][k];
            else *(vec16 *)(y[q] + k * LANES) = acc[q][k];
        }
}

/* bf16 -> fp32 is exact: the bf16 bits are the float's high half. */
static inline void widen_bf16(const uint16_t *restrict src, float *restrict dst, int64_t n) {
    uint32_t *restrict d = (uint32_t *)dst;
    for (int64_t i = 0; i < n; i++) d[i] = (uint32_t)src[i] << 16;
}

/* Every entry: n_sites linears over the same rows, site i with a[i] [S, R, in], bt[i] [S, R, outs[i]]
 * and y[i] [rows, outs[i]] (row stride y_strides[i]); `add`: y += delta, else y = delta; `bf16`: a and
 * bt hold bfloat16 (uint16) elements, else float. */
static int lora_sites(const float *x, int64_t rows, int64_t x_stride, int64_t in, const int64_t *slots,
                      int64_t num_slots, int64_t rank, int64_t n_sites, const void *const *as,
                      const void *const *bts, const int64_t *outs, float *const *ys, const int64_t *y_strides,
                      int add, int bf16) {
    const size_t wsize = bf16 ? sizeof(uint16_t) : sizeof(float);
    if (rows < 0 || in < 0 || rank < 0 || num_slots < 0 || x_stride < 0 || n_sites < 0) return -1;
    int64_t all_out = 0;
    for (int64_t i = 0; i < n_sites; i++) {
        if (outs[i] < 0 || y_strides[i] < outs[i]) return -1;
        all_out += outs[i];
    }
    for (int64_t t = 0; t < rows; t++)
        if (slots[t] < -1 || slots[t] >= num_slots) return -2;
    if (rows == 0 || n_sites == 0) return 0;

    /* One allocation: start[buckets + 1], order[rows], piece[rows + 1], then v [n_sites, rows, R]. Bucket
     * b holds slot b - 1: bucket 0 the rows without an adapter. */
    const int64_t buckets = num_slots + 1;
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    const size_t index_bytes = (size_t)(buckets + 1 + 2 * rows + 1) * sizeof(int64_t);
    const int64_t row_buffer = bf16 ? in : 0;  /* floats a thread widens an A row into */
    char *scratch = malloc(index_bytes + (size_t)(n_sites * rows * rank + threads * (rank * CHUNK + row_buffer))
                                         * sizeof(float));
    if (scratch == NULL) return -3;
    int64_t *start = (int64_t *)scratch, *order = start + buckets + 1, *piece = order + rows;
    float *vs_all = (float *)(scratch + index_bytes), *packs = vs_all + n_sites * rows * rank;
    float *row_buffers = packs + threads * rank * CHUNK;

    /* Counting sort: order[start[b] .. start[b+1]) are bucket b's rows, in row order. */
    memset(start, 0, (size_t)(buckets + 1) * sizeof(int64_t));
    for (int64_t t = 0; t < rows; t++) start[slots[t] + 2]++;
    for (int64_t b = 1; b <= buckets; b++) start[b] += start[b - 1];
    for (int64_t t = 0; t < rows; t++) order[start[slots[t] + 1]++] = t;
    for (int64_t b = buckets; b > 0; b--) start[b] = start[b - 1];  /* the fill moved each start to its end */
    start[0] = 0;

    /* Pieces: runs of at most PIECE rows of one slot; piece p is order[piece[p] .. piece[p+1]). */
    int64_t pieces = 0;
    for (int64_t b = 1; b < buckets; b++)
        for (int64_t j = start[b]; j < start[b + 1]; j += PIECE) piece[pieces++] = j;
    piece[pieces] = rows;

    #pragma omp parallel if ((rows - start[1]) * rank * (n_sites * in + all_out) >= PARALLEL_WORK)
    {
        int nt = 1, id = 0;
#ifdef _OPENMP
        nt = omp_get_num_threads();
        id = omp_get_thread_num();
#endif
        float *row = row_buffers + id * row_buffer;
        /* 1. shrink: v[i][t][r] = a[i][s][r] . x[t], items over (site, piece, r) */
        #pragma omp for schedule(static)
        for (int64_t item = 0; item < n_sites * pieces * rank; item++) {
            const int64_t i = item / (pieces * rank), p = item / rank % pieces, r = item % rank;
            const int64_t first = piece[p], last = piece[p + 1];
            const int64_t at = (slots[order[first]] * rank + r) * in;
            const float *w = (const float *)as[i] + at;
            float *v = vs_all + i * rows * rank;
            if (bf16 && last - first < TILE) {  /* a row or few of this slot: widened as read */
                for (int64_t j = first; j < last; j++)
                    v[order[j] * rank + r] = dot_bf16((const uint16_t *)as[i] + at, x + order[j] * x_stride, in);
                continue;
            }
            if (bf16) {  /* widened once for the piece's rows */
                widen_bf16((const uint16_t *)as[i] + at, row, in);
                w = row;
            }
            int64_t j = first;
            for (; j + TILE <= last; j += TILE) {
                const float *xs[TILE];
                float d[TILE];
                for (int q = 0; q < TILE; q++) xs[q] = x + order[j + q] * x_stride;
                dot_tile(w, xs, in, d);
                for (int q = 0; q < TILE; q++) v[order[j + q] * rank + r] = d[q];
            }
            for (; j < last; j++) v[order[j] * rank + r] = dot(w, x + order[j] * x_stride, in);
        }
        /* (the implicit barrier: all of v is written before the expand reads it) */

        /* 2. expand: of each site, this thread's columns [o0, o1) of every row, slot by slot. */
        float *pack = packs + id * rank * CHUNK;
        for (int64_t i = 0; i < n_sites; i++) {
            const int64_t out = outs[i], y_stride = y_strides[i];
            const char *bt = bts[i];
            const float *v = vs_all + i * rows * rank;
            float *y = ys[i];
            const int64_t chunks = (out + CHUNK - 1) / CHUNK;
            const int64_t o0 = chunks * id / nt * CHUNK, o1_chunk = chunks * (id + 1) / nt * CHUNK;
            const int64_t o1 = o1_chunk < out ? o1_chunk : out;
            if (o0 >= o1) continue;
            if (!add)
                for (int64_t j = 0; j < start[1]; j++)
                    memset(y + order[j] * y_stride + o0, 0, (size_t)(o1 - o0) * sizeof(float));
            for (int64_t b = 1; b < buckets; b++) {
                const int64_t first = start[b], last = start[b + 1];
                if (first == last) continue;
                int64_t next = b + 1;
                while (next < buckets && start[next] == start[next + 1]) next++;
                const char *bs = bt + (size_t)((b - 1) * rank * out) * wsize;  /* this slot's B: [R, out] */
                const char *next_bs = next < buckets ? bt + (size_t)((next - 1) * rank * out) * wsize : NULL;
                for (int64_t o = o0; o < o1; o += CHUNK) {
                    const int64_t n = o1 - o < CHUNK ? o1 - o : CHUNK;
                    /* The chunk AHEAD columns on in this thread's order: this slot's, then the next's. */
                    int64_t ahead = o + AHEAD;
                    const char *pb = bs;
                    if (ahead >= o1) {
                        ahead = o0 + (ahead - o1);
                        pb = next_bs;
                    }
                    if (pb != NULL && ahead < o1)
                        for (int64_t r = 0; r < rank; r++)
                            for (int64_t l = 0; l < CHUNK && ahead + l < o1; l += LANES)
                                __builtin_prefetch(pb + (size_t)(r * out + ahead + l) * wsize, 0, PREFETCH_LOCALITY);
                    if (bf16 && n == CHUNK && last - first == 1) {  /* one row: B widened as read */
                        const int64_t t = order[first];
                        expand_chunk_bf16((const uint16_t *)bs + o, out, v + t * rank, rank, y + t * y_stride + o, add);
                        continue;
                    }
                    /* The chunk's B: in place (fp32), else widened into the pack. */
                    const float *chunk = (const float *)bs + o;
                    int64_t chunk_stride = out;
                    if (bf16) {
                        for (int64_t r = 0; r < rank; r++)
                            widen_bf16((const uint16_t *)bs + r * out + o, pack + r * CHUNK, n);
                        chunk = pack;
                        chunk_stride = CHUNK;
                    }
                    int64_t j = first;
                    if (n == CHUNK)  /* blocks of rows: B's vectors loaded once for each block */
                        for (; j + ROWS_BLOCK <= last; j += ROWS_BLOCK) {
                            const float *vq[ROWS_BLOCK];
                            float *yq[ROWS_BLOCK];
                            for (int q = 0; q < ROWS_BLOCK; q++) {
                                vq[q] = v + order[j + q] * rank;
                                yq[q] = y + order[j + q] * y_stride + o;
                            }
                            expand_chunk_rows(chunk, chunk_stride, vq, rank, yq, add);
                        }
                    /* B's rows lie `out` apart (16 KB at out=4096: every row of a chunk in one L1 set,
                     * so a chunk read for several rows came from L2 each time): packed, it stays in
                     * L1 (8 rows of one slot, in=16, out=4096, one thread: 61 -> 26 us). */
                    if (!bf16 && last - j > 1) {
                        for (int64_t r = 0; r < rank; r++)
                            memcpy(pack + r * CHUNK, (const float *)bs + r * out + o, (size_t)n * sizeof(float));
                        chunk = pack;
                        chunk_stride = CHUNK;
                    }
                    for (; j < last; j++) {  /* the rows past the last block, one at a time */
                        const int64_t t = order[j];
                        expand_chunk(chunk, chunk_stride, v + t * rank, rank, y + t * y_stride + o, n, add);
                    }
                }
            }
        }
    }
    free(scratch);
    return 0;
}

int lora_rows(const float *x, int64_t rows, int64_t x_stride, int64_t in, const int64_t *slots, int64_t num_slots,
              const float *a, const float *bt, int64_t rank, int64_t out, float *y, int64_t y_stride) {
    const void *a_any = a, *bt_any = bt;
    return lora_sites(x, rows, x_stride, in, slots, num_slots, rank, 1, &a_any, &bt_any, &out, &y, &y_stride, 0, 0);
}

int lora_rows_add(const float *x, int64_t rows, int64_t x_stride, int64_t in, const int64_t *slots,
                  int64_t num_slots, int64_t rank, int64_t n_sites, const void *const *as, const void *const *bts,
                  const int64_t *outs, float *const *ys, const int64_t *y_strides, int64_t bf16) {
    return lora_sites(x, rows, x_stride, in, slots, num_slots, rank, n_sites, as, bts, outs, ys, y_strides, 1,
                      bf16 != 0);
}

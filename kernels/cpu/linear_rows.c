/* A linear layer over the few rows of a decode step: y[r, :] = x[r, :] W^T (+ b), fp32 out,
 * W [out, in] row-major (nn.Linear's own layout: no packing, no copy) in fp32 or bf16, the dot
 * products accumulated in fp32. bf16 weights are widened to fp32 (a shift); with them the call
 * means what oneDNN's bf16 inner product means (engine.weight_dtype=bfloat16, as llama.cpp runs a bf16
 * GGUF): the rows are rounded to bf16 first and the outputs after (round to nearest even).
 *
 * The reference is F.linear in float64 (kernels/cpu/linear_rows.py, tests/test_cpu_linear_rows.py).
 * At 1-8 rows a linear is a weight read: each weight is loaded once and used for every row, so
 * the kernel is written for streaming (ggml's mul_mat at a decode's row counts is the same idea).
 * engine/model/cpu_linear.py measures it against oneDNN at load and runs whichever is faster on
 * the CPU at hand.
 *
 * A call may name several weights ("segments") that read the same rows: a fused q|k|v or
 * gate|up writes each segment's outputs side by side into y, one parallel region for all of them,
 * with the weights left where they are (separate memory-mapped tensors).
 *
 * Work split: output tiles of OB weight rows, each thread a contiguous run of tiles (a stream per
 * thread); a tile keeps R x OB accumulators in registers across the whole `in` dimension and
 * reduces each once at the end. Rows beyond ROWS_MAX run as further passes of ROWS_MAX.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
/* The AVX-512 form uses BW and VL (16-bit masked loads) too: a CPU with AVX512F alone (Knights
 * Landing) builds the AVX2 form. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif
#if HAVE_AVX512 || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define ROWS_MAX 8
#define SEGMENTS_MAX 8
#define WEIGHT_FP32 0
#define WEIGHT_BF16 1
/* Tile loops unrolled whole, so the accumulator array becomes registers. */
#define UNROLLED _Pragma("GCC unroll 8")

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* v rounded to the nearest bf16 (ties to even), as an fp32. */
static inline float round_bf16(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    if ((bits & 0x7F800000u) != 0x7F800000u) bits += 0x7FFFu + ((bits >> 16) & 1u);
    else if (bits & 0x007FFFFFu) bits |= 0x00400000u;  /* a NaN stays one (quiet) when its low bits go */
    bits &= 0xFFFF0000u;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* Each row of a tile is a short stream (a 1024-wide fp32 row is one 4 KiB page, where the hardware
 * prefetchers stop), so a tile asks for the rows two tiles ahead into L2 as it reads its own. At 8
 * rows this took the kernel from 31 to 54 GB/s (2 threads; oneDNN 47 in the same run). */
#define PREFETCH_HINT _MM_HINT_T1
#define PREFETCH_TILES 2

#if HAVE_AVX512
/* Weight rows per tile: as many as keep R x OB accumulators, OB weights and a row within 32
 * registers (measured: 6 and 3 beat 4 and 2 at 8 rows, 30 against 23 GB/s). */
#define TILE_WIDTH(R) ((R) <= 4 ? 6 : 3)

/* Keeps a loaded vector in its register: without it gcc folds the load into every FMA that reads
 * it (R loads of each weight vector where one does). */
#define IN_REGISTER(v) __asm__("" : "+v"(v))

/* 16 weights from element i of a row, widened to fp32; `m` masks a tail. */
static inline __attribute__((always_inline)) __m512 load_w(const void *row, int bf16, int64_t i, __mmask16 m) {
    if (bf16) {
        __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)row + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(m, (const float *)row + i);
}

/* One tile: R rows x OB weight rows starting at `w`, outputs to y columns [col, col + OB). R and
 * OB are constants at every call site, so the accumulators live in registers (<= 24 of 32). */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_stride, int64_t in,
                                                       const void *w, int bf16, const int R, const int OB,
                                                       const float *bias, float *y, int64_t y_stride, int64_t col) {
    const int64_t esize = bf16 ? 2 : 4, ahead = PREFETCH_TILES * OB * in * esize;
    __m512 acc[ROWS_MAX][6];
    UNROLLED for (int r = 0; r < R; r++)
        UNROLLED for (int o = 0; o < OB; o++) acc[r][o] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= in; i += 16) {
        __m512 wv[6];
        UNROLLED for (int o = 0; o < OB; o++) {
            _mm_prefetch((const char *)w + (o * in + i) * esize + ahead, PREFETCH_HINT);
            wv[o] = load_w((const char *)w + o * in * esize, bf16, i, (__mmask16)0xFFFF);
            IN_REGISTER(wv[o]);
        }
        UNROLLED for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_loadu_ps(x + r * x_stride + i);
            IN_REGISTER(xv);
            UNROLLED for (int o = 0; o < OB; o++) acc[r][o] = _mm512_fmadd_ps(xv, wv[o], acc[r][o]);
        }
    }
    if (i < in) {
        const __mmask16 m = (__mmask16)((1u << (in - i)) - 1u);
        __m512 wv[6];
        UNROLLED for (int o = 0; o < OB; o++) wv[o] = load_w((const char *)w + o * in * esize, bf16, i, m);
        UNROLLED for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_maskz_loadu_ps(m, x + r * x_stride + i);
            UNROLLED for (int o = 0; o < OB; o++) acc[r][o] = _mm512_fmadd_ps(xv, wv[o], acc[r][o]);
        }
    }
    UNROLLED for (int r = 0; r < R; r++)
        UNROLLED for (int o = 0; o < OB; o++)
            y[r * y_stride + col + o] = _mm512_reduce_add_ps(acc[r][o]) + (bias ? bias[o] : 0.0f);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 (16 registers of 8 floats): R x OB accumulators, OB weights and a row within 16. */
#define TILE_WIDTH(R) ((R) <= 2 ? 4 : (R) <= 4 ? 2 : 1)
#define IN_REGISTER(v) __asm__("" : "+x"(v))

/* 8 weights from element i of a row, widened to fp32. */
static inline __attribute__((always_inline)) __m256 load_w(const void *row, int bf16, int64_t i) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)row + i);
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_stride, int64_t in,
                                                       const void *w, int bf16, const int R, const int OB,
                                                       const float *bias, float *y, int64_t y_stride, int64_t col) {
    const int64_t esize = bf16 ? 2 : 4, ahead = PREFETCH_TILES * OB * in * esize;
    __m256 acc[ROWS_MAX][4];
    float tail[ROWS_MAX][4];
    UNROLLED for (int r = 0; r < R; r++)
        UNROLLED for (int o = 0; o < OB; o++) { acc[r][o] = _mm256_setzero_ps(); tail[r][o] = 0.0f; }
    int64_t i = 0;
    for (; i + 8 <= in; i += 8) {
        __m256 wv[4];
        UNROLLED for (int o = 0; o < OB; o++) {
            _mm_prefetch((const char *)w + (o * in + i) * esize + ahead, PREFETCH_HINT);
            wv[o] = load_w((const char *)w + o * in * esize, bf16, i);
            IN_REGISTER(wv[o]);
        }
        UNROLLED for (int r = 0; r < R; r++) {
            __m256 xv = _mm256_loadu_ps(x + r * x_stride + i);
            IN_REGISTER(xv);
            UNROLLED for (int o = 0; o < OB; o++) acc[r][o] = _mm256_fmadd_ps(xv, wv[o], acc[r][o]);
        }
    }
    for (; i < in; i++)  /* the last in % 8 */
        UNROLLED for (int o = 0; o < OB; o++) {
            const float wi = bf16 ? bf16_to_f32(((const uint16_t *)w)[o * in + i]) : ((const float *)w)[o * in + i];
            UNROLLED for (int r = 0; r < R; r++) tail[r][o] += x[r * x_stride + i] * wi;
        }
    UNROLLED for (int r = 0; r < R; r++)
        UNROLLED for (int o = 0; o < OB; o++)
            y[r * y_stride + col + o] = sum8(acc[r][o]) + tail[r][o] + (bias ? bias[o] : 0.0f);
}
#else
/* Portable form (no AVX2): the compiler vectorizes the inner reduction. */
#define TILE_WIDTH(R) 1
static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_stride, int64_t in,
                                                       const void *w, int bf16, const int R, const int OB,
                                                       const float *bias, float *y, int64_t y_stride, int64_t col) {
    for (int o = 0; o < OB; o++) {
        float acc[ROWS_MAX] = {0};
        if (bf16) {
            const uint16_t *wr = (const uint16_t *)w + o * in;
            for (int r = 0; r < R; r++) {
                const float *xr = x + r * x_stride;
                float s = 0.0f;
                #pragma omp simd reduction(+ : s)
                for (int64_t i = 0; i < in; i++) s += xr[i] * bf16_to_f32(wr[i]);
                acc[r] = s;
            }
        } else {
            const float *wr = (const float *)w + o * in;
            for (int r = 0; r < R; r++) {
                const float *xr = x + r * x_stride;
                float s = 0.0f;
                #pragma omp simd reduction(+ : s)
                for (int64_t i = 0; i < in; i++) s += xr[i] * wr[i];
                acc[r] = s;
            }
        }
        for (int r = 0; r < R; r++) y[r * y_stride + col + o] = acc[r] + (bias ? bias[o] : 0.0f);
    }
}
#endif

static inline int tile_width(int64_t rows) { return TILE_WIDTH(rows); }

/* Tile `t` of R rows (a compile-time constant per case): OB weight rows, or what is left. */
#define TILE_CASE(R)                                                                                   \
    case R:                                                                                            \
        if (n == ob) tile(x, x_stride, in, wrow, bf16, R, TILE_WIDTH(R), brow, y, y_stride, col);  \
        else for (int64_t k = 0; k < n; k++)                                                           \
            tile(x, x_stride, in, (const char *)wrow + k * in * esize, bf16, R, 1,                     \
                 brow ? brow + k : 0, y, y_stride, col + k);                                           \
        break;

static void pass(const float *x, int64_t rows, int64_t x_stride, int64_t in, int64_t segments,
                 const void *const *weights, const int64_t *outs, const float *const *biases, int bf16,
                 float *y, int64_t y_stride) {
    const int64_t ob = tile_width(rows), esize = bf16 ? 2 : 4;
    int64_t first_tile[SEGMENTS_MAX + 1], first_col[SEGMENTS_MAX + 1];
    first_tile[0] = first_col[0] = 0;
    for (int64_t s = 0; s < segments; s++) {
        first_tile[s + 1] = first_tile[s] + (outs[s] + ob - 1) / ob;
        first_col[s + 1] = first_col[s] + outs[s];
    }
    const int64_t tiles = first_tile[segments];
    /* Threads pay for themselves above ~64K multiply-adds (a barrier costs microseconds). */
    #pragma omp parallel for schedule(static) if (rows * in * first_col[segments] >= (1 << 16))
    for (int64_t t = 0; t < tiles; t++) {
        int64_t s = 0;
        while (t >= first_tile[s + 1]) s++;
        const int64_t o0 = (t - first_tile[s]) * ob;
        const int64_t n = outs[s] - o0 < ob ? outs[s] - o0 : ob, col = first_col[s] + o0;
        const void *wrow = (const char *)weights[s] + o0 * in * esize;
        const float *brow = biases[s] ? biases[s] + o0 : 0;
        switch (rows) {
            TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4)
            TILE_CASE(5) TILE_CASE(6) TILE_CASE(7) TILE_CASE(8)
        }
    }
}

/* x: rows x in fp32, row stride x_stride; weights[s]: outs[s] x in (fp32 or bf16, contiguous);
 * biases[s]: outs[s] fp32 or NULL; y: rows x sum(outs) fp32, row stride y_stride.
 * Returns 0, -1 for shapes it does not take (the caller's bug), -2 out of memory. */
int linear_rows(const float *x, int64_t rows, int64_t x_stride, int64_t in, int64_t segments,
                const void *const *weights, const int64_t *outs, const float *const *biases,
                int64_t weight_dtype, float *y, int64_t y_stride) {
    if (rows < 0 || in <= 0 || segments < 1 || segments > SEGMENTS_MAX) return -1;
    if (weight_dtype != WEIGHT_FP32 && weight_dtype != WEIGHT_BF16) return -1;
    int64_t total = 0;
    for (int64_t s = 0; s < segments; s++) {
        if (outs[s] <= 0 || !weights[s]) return -1;
        total += outs[s];
    }
    if (x_stride < in || y_stride < total) return -1;
    const int bf16 = weight_dtype == WEIGHT_BF16;
    float *rounded = 0;
    if (bf16 && rows > 0) {  /* the rows rounded once, not at every tile that reads them */
        rounded = malloc((size_t)(rows * in) * sizeof(float));
        if (!rounded) return -2;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < in; i++) rounded[r * in + i] = round_bf16(x[r * x_stride + i]);
        x = rounded;
        x_stride = in;
    }
    for (int64_t r = 0; r < rows; r += ROWS_MAX) {
        const int64_t n = rows - r < ROWS_MAX ? rows - r : ROWS_MAX;
        pass(x + r * x_stride, n, x_stride, in, segments, weights, outs, biases, bf16, y + r * y_stride, y_stride);
    }
    if (bf16) {
        for (int64_t r = 0; r < rows; r++)
            for (int64_t o = 0; o < total; o++) y[r * y_stride + o] = round_bf16(y[r * y_stride + o]);
    }
    free(rounded);
    return 0;
}

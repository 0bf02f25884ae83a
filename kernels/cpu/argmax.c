/* Greedy sampling's argmax over rows on the CPU: for each row, the index of its largest value,
 * the lowest among equals, and the first NaN where a row holds one: torch.argmax's answer, its
 * oracle (tests/test_cpu_argmax.py).
 *
 * torch's CPU argmax is a scalar loop: ~150 µs for a decode step's [64, 4096] fp32 logits, ten
 * times its vectorised amax. Here two vectorised passes: the row's max (and whether it has a NaN),
 * then the first block of 16 that holds it, then the first index inside that block.
 * kernels/cpu/argmax.py binds this.
 */
#include <math.h>
#include <stdint.h>

#define BLOCK 16

static int64_t first_equal(const float *row, int64_t cols, float m) {
    for (int64_t b = 0; b < cols; b += BLOCK) {
        const int64_t end = b + BLOCK < cols ? b + BLOCK : cols;
        int hit = 0;
        #pragma omp simd reduction(| : hit)
        for (int64_t j = b; j < end; j++) hit |= row[j] == m;
        if (hit)
            for (int64_t j = b; j < end; j++)
                if (row[j] == m) return j;
    }
    return 0; /* every value is -inf: the first one, as torch says */
}

static int64_t first_nan(const float *row, int64_t cols) {
    for (int64_t j = 0; j < cols; j++)
        if (isnan(row[j])) return j;
    return 0;
}

int argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t row_stride, int64_t *out) {
    if (cols <= 0 || rows < 0) return -1;
    /* Threads only pay for themselves past a quarter of a million values. */
    #pragma omp parallel for schedule(static) if (rows * cols >= (1 << 18))
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * row_stride;
        float m = -INFINITY;
        int nan = 0;
        #pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t j = 0; j < cols; j++) {
            m = row[j] > m ? row[j] : m;
            nan |= row[j] != row[j];
        }
        out[r] = nan ? first_nan(row, cols) : first_equal(row, cols, m);
    }
    return 0;
}

/* The argmax of each row as greedy sampling's processed logits would give it, read from the raw
 * logits with no copy: NaN as -inf and everything above `ceiling` (+inf too) as `ceiling`, what
 * engine/sampling/sampler.py's process_logits makes of a row nothing else touches
 * (nan_to_num(nan=-inf, posinf=ceiling).clamp(max=ceiling)). Its oracle is torch.argmax of that. */
static inline float capped(float v, float ceiling) { return v > ceiling ? ceiling : v; }

int argmax_rows_capped(const float *x, int64_t rows, int64_t cols, int64_t row_stride, float ceiling,
                       int64_t *out) {
    if (cols <= 0 || rows < 0) return -1;
    #pragma omp parallel for schedule(static) if (rows * cols >= (1 << 18))
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * row_stride;
        float m = -INFINITY;
        #pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < cols; j++) {
            const float v = capped(row[j], ceiling); /* NaN stays NaN and never wins a > */
            m = v > m ? v : m;
        }
        int64_t at = -1;
        if (m > -INFINITY) {
            for (int64_t b = 0; b < cols && at < 0; b += BLOCK) {
                const int64_t end = b + BLOCK < cols ? b + BLOCK : cols;
                int hit = 0;
                #pragma omp simd reduction(| : hit)
                for (int64_t j = b; j < end; j++) hit |= capped(row[j], ceiling) == m;
                if (hit)
                    for (int64_t j = b; j < end && at < 0; j++)
                        if (capped(row[j], ceiling) == m) at = j;
            }
        }
        out[r] = at < 0 ? 0 : at; /* every value -inf or NaN: all are -inf, the first wins */
    }
    return 0;
}

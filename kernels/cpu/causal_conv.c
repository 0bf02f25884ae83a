/* The GDN layers' depthwise causal conv over a prefill chunk on the CPU, in one pass: each
 * output is the dot product of a channel's K weights with its last K inputs (the carried taps
 * before the chunk's first), through SiLU, written time-major as the projections produced the
 * input. The torch reference (kernels/causal_conv.py: causal_conv1d) calls F.conv1d with
 * groups=C, which oneDNN runs far below the memory's pace; kernels/cpu/causal_conv.py binds this.
 *
 *   x      [T, C] at row stride x_stride (the chunk's mixed q|k|v rows)
 *   wt     [K, C] the weights, tap-major (contiguous over channels)
 *   state  [C, K-1] the inputs before the chunk (read only)
 *   out    [T, C]
 *   taps   [C, K-1] the chunk's last K-1 inputs, the next chunk's state (needs T >= K-1)
 * Returns 0, or -1 if T < K-1 or K > 16.
 */
#include <math.h>
#include <stdint.h>

#define MAX_KERNEL 16

int causal_conv_prefill(const float *x, int64_t x_stride, const float *wt, const float *state,
                        int64_t t_len, int64_t channels, int64_t kernel, float *out, float *taps) {
    const int64_t k1 = kernel - 1;
    if (kernel < 1 || kernel > MAX_KERNEL || t_len < k1) return -1;
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < t_len; t++) {
        float *o = out + t * channels;
        for (int64_t c = 0; c < channels; c++) o[c] = 0.0f;
        for (int64_t k = 0; k < kernel; k++) {
            const int64_t src = t + k - k1;  /* input time of tap k; < 0: the carried state */
            const float *wk = wt + k * channels;
            if (src >= 0) {
                const float *row = x + src * x_stride;
                for (int64_t c = 0; c < channels; c++) o[c] += wk[c] * row[c];
            } else {
                const int64_t j = src + k1;
                for (int64_t c = 0; c < channels; c++) o[c] += wk[c] * state[c * k1 + j];
            }
        }
        for (int64_t c = 0; c < channels; c++) o[c] = o[c] / (1.0f + expf(-o[c]));
    }
    for (int64_t j = 0; j < k1; j++) {
        const float *row = x + (t_len - k1 + j) * x_stride;
        for (int64_t c = 0; c < channels; c++) taps[c * k1 + j] = row[c];
    }
    return 0;
}

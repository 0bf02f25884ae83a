/* RMSNorm over rows on the CPU, in both of the models' forms:
 *   plain:          out = w * x / rms(x)          (Llama, Qwen2/3, Mistral)
 *   zero-centered:  out = (1 + w) * x / rms(x)    (Qwen3.5 / Qwen3-Next)
 * with rms(x) = sqrt(mean(x^2) + eps), all in fp32.
 *
 * The references are the torch forms of engine/model/layers.py's RMSNorm (F.rms_norm, and the
 * zero-centered chain of about a dozen ops), which a hybrid model's decode step runs ~40 times:
 * ~500 small ops a step. kernels/cpu/rms_norm.py binds this.
 *
 * Rows are addressed as outer x inner (a [T, H, D] view of q or k heads inside a fused
 * projection's output is T outer rows of H inner rows): row (o, i) starts at
 * x + o * outer_stride + i * inner_stride and holds `dim` contiguous floats. out is contiguous,
 * [outer, inner, dim].
 */
#include <math.h>
#include <stdint.h>

int rms_norm_rows(const float *x, int64_t outer, int64_t outer_stride, int64_t inner, int64_t inner_stride,
                  int64_t dim, const float *w, float eps, int64_t zero_centered, float *out) {
    if (dim <= 0 || outer < 0 || inner < 0) return -1;
    const int64_t rows = outer * inner;
    /* Threads only pay for themselves on a prefill chunk's rows. */
    #pragma omp parallel for schedule(static) if (rows * dim >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        const float *src = x + (r / inner) * outer_stride + (r % inner) * inner_stride;
        float *dst = out + r * dim;
        float ss = 0.0f;
        #pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < dim; j++) ss += src[j] * src[j];
        const float inv_rms = 1.0f / sqrtf(ss / (float)dim + eps);
        if (zero_centered) {
            #pragma omp simd
            for (int64_t j = 0; j < dim; j++) dst[j] = (src[j] * inv_rms) * (1.0f + w[j]);
        } else {
            #pragma omp simd
            for (int64_t j = 0; j < dim; j++) dst[j] = w[j] * (src[j] * inv_rms);
        }
    }
    return 0;
}

/* One Gated DeltaNet layer's decode step for B sequences on the CPU, fused, from its input
 * projections to the input of its output projection: the gates (beta = sigmoid(b), log decay
 * g = -exp(A_log) softplus(a + dt_bias)), the causal conv over the carried taps, the head split,
 * q/k L2 normalisation, the gated delta rule with each state updated where it lies in its slot,
 * and the output's gated RMSNorm (w * rmsnorm(o) * silu(z)): no gather, no scatter, no
 * intermediate tensors, and none of the ~30 small torch ops per layer those steps take.
 *
 * The torch references are kernels/causal_conv.py (causal_conv1d, T = 1), kernels/gated_delta.py
 * (gated_delta_decode_step_) and the layer's own gates and GatedRMSNorm
 * (engine/model/gated_deltanet.py, layers.py); kernels/cpu/gdn_decode.py binds this.
 *
 * Per (sequence, value head) the state S is Dk x Dv fp32 (64 KiB at 128 x 128): it is read from
 * memory once, for S^T k, and the update S' = decay S + k delta^T with out = S'^T q is a second
 * pass over the same 64 KiB while it is still in this core's L2. The torch reference makes six
 * passes (mul_, bmm, baddbmm_ read and write, bmm), as six ops per head group per sequence.
 *
 * A sequence may bring several tokens (`runs`: sequence i's rows are runs[i] .. runs[i+1]-1, in
 * order; NULL: one row each): a speculative verify's pending token and drafts, a short turn. Its
 * tokens step through the recurrence one after another inside the work item of each (sequence,
 * head), so the head's state is read from memory once for all of them and stays in L2 between
 * tokens; position by position, each call would stream every sequence's state again (8 sequences
 * of 5 tokens, bench hybrid geometry: 0.78 ms a layer per position).
 *
 * Layouts (all fp32, innermost stride 1), R the rows (runs[B], or B):
 *   x        [R, C]           the step's mixed q|k|v projections, one row per token
 *   a, b     [R, Hv]          the decay and write-strength projections, before their gates
 *   a_log, dt_bias [Hv]       the decay's per-head parameters
 *   z        [R, Hv, Dv]      the output gate's projection
 *   norm_w   [Dv]             the gated RMSNorm's weight (eps: its epsilon)
 *   w        [C, K]           depthwise conv weight
 *   conv     pool + slot * conv_slot_stride + conv_offset: [C, K-1] taps of that sequence
 *   state    pool + slot * state_slot_stride + state_offset: [Hv, Dk, Dv] of that sequence
 *   y        [R, C]           scratch: the conv's output
 *   out      [R, Hv, Dv]      normed and gated: the output projection's input
 *   slots    [B]              each sequence's state slot
 * Returns 0, or -1 when a size exceeds the fixed per-thread buffers.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#define MAX_HEAD_DIM 256
/* Sequence b's rows: [FIRST_ROW(b), END_ROW(b)). */
#define FIRST_ROW(b) (runs != NULL ? runs[(b)] : (b))
#define END_ROW(b) (runs != NULL ? runs[(b) + 1] : (b) + 1)

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

int gdn_decode_layer(const float *x, const float *a, const float *b_proj, const float *a_log,
                     const float *dt_bias, const float *z, const float *norm_w, float eps, const float *w,
                    float *conv_pool, int64_t conv_slot_stride, int64_t conv_offset,
                    float *state_pool, int64_t state_slot_stride, int64_t state_offset,
                    const int64_t *slots, int64_t batch, int64_t hk, int64_t hv, int64_t dk, int64_t dv,
                    int64_t kernel, float *y, float *out, const int64_t *runs) {
    if (dk > MAX_HEAD_DIM || dv > MAX_HEAD_DIM || kernel < 1 || hk <= 0 || hv % hk != 0) return -1;
    if (runs != NULL)
        for (int64_t b = 0; b < batch; b++)
            if (runs[b + 1] < runs[b]) return -1;
    const int64_t key_dim = hk * dk, channels = 2 * key_dim + hv * dv, taps = kernel - 1;

    /* The conv: one dot product per channel over its K-1 carried inputs and the new one. */
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t c = 0; c < channels; c++) {
            float *tap = conv_pool + slots[b] * conv_slot_stride + conv_offset + c * taps;
            const float *wc = w + c * kernel;
            for (int64_t r = FIRST_ROW(b); r < END_ROW(b); r++) {
                const float xn = x[r * channels + c];
                float acc = 0.0f;
                for (int64_t t = 0; t < taps; t++) acc += tap[t] * wc[t];
                acc += xn * wc[taps];
                y[r * channels + c] = silu(acc);
                for (int64_t t = 0; t + 1 < taps; t++) tap[t] = tap[t + 1];
                if (taps > 0) tap[taps - 1] = xn;
            }
        }
    }

    /* The delta rule, one (sequence, value head) per iteration. */
    const int64_t group = hv / hk;
    const float q_scale = 1.0f / sqrtf((float)dk);
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t h = 0; h < hv; h++) {
            const int64_t kh = h / group;
            float *s = state_pool + slots[b] * state_slot_stride + state_offset + h * dk * dv;
            for (int64_t r = FIRST_ROW(b); r < END_ROW(b); r++) {  /* the sequence's tokens in order */
                const float *yq = y + r * channels + kh * dk;
                const float *yk = y + r * channels + key_dim + kh * dk;
                const float *yv = y + r * channels + 2 * key_dim + h * dv;
                float q[MAX_HEAD_DIM], k[MAX_HEAD_DIM], delta[MAX_HEAD_DIM], o[MAX_HEAD_DIM];
                float qq = 0.0f, kk = 0.0f;
                for (int64_t i = 0; i < dk; i++) { qq += yq[i] * yq[i]; kk += yk[i] * yk[i]; }
                const float qn = q_scale / sqrtf(qq + 1e-6f), kn = 1.0f / sqrtf(kk + 1e-6f);
                for (int64_t i = 0; i < dk; i++) { q[i] = yq[i] * qn; k[i] = yk[i] * kn; }

                /* softplus as torch's (threshold 20: the identity above it) */
                const float shifted = a[r * hv + h] + dt_bias[h];
                const float softplus = shifted > 20.0f ? shifted : log1pf(expf(shifted));
                const float decay = expf(-expf(a_log[h]) * softplus);
                const float strength = 1.0f / (1.0f + expf(-b_proj[r * hv + h]));
                for (int64_t j = 0; j < dv; j++) delta[j] = 0.0f;
                for (int64_t i = 0; i < dk; i++) {  /* S^T k, before the decay */
                    const float ki = k[i];
                    const float *row = s + i * dv;
                    for (int64_t j = 0; j < dv; j++) delta[j] += ki * row[j];
                }
                for (int64_t j = 0; j < dv; j++) {
                    delta[j] = (yv[j] - decay * delta[j]) * strength;
                    o[j] = 0.0f;
                }
                for (int64_t i = 0; i < dk; i++) {  /* S' = decay S + k delta^T; out = S'^T q */
                    const float ki = k[i], qi = q[i];
                    float *row = s + i * dv;
                    for (int64_t j = 0; j < dv; j++) {
                        const float updated = decay * row[j] + ki * delta[j];
                        row[j] = updated;
                        o[j] += qi * updated;
                    }
                }
                /* The gated RMSNorm over this head's output, in the reference's order of products. */
                float oo = 0.0f;
                for (int64_t j = 0; j < dv; j++) oo += o[j] * o[j];
                const float inv_rms = 1.0f / sqrtf(oo / (float)dv + eps);
                const float *zr = z + (r * hv + h) * dv;
                float *dst = out + (r * hv + h) * dv;
                for (int64_t j = 0; j < dv; j++) dst[j] = norm_w[j] * (o[j] * inv_rms) * silu(zr[j]);
            }
        }
    }
    return 0;
}

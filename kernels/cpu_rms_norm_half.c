/* RMSNorm on CPU for bfloat16 and float16, with the residual add before it: in one pass over each row what
 * worker_proc/elementwise.py's torch ops give in that dtype, op for op,
 *   total = round(x + residual)                  (written over x, the layer's own output)
 *   h = float(total);  r = 1 / sqrt(sum(h * h) / d + eps)
 *   out = round(round(h * r) * weight)
 * round() being the dtype's round to nearest even, as torch rounds each op's float32 result. One step is
 * not torch's: the sum of squares is taken in another order than torch's mean (float32 either way, ~1e-7
 * relative in r), so a result can differ from torch's by one step of the dtype where h * r lies within
 * that of a rounding boundary; everything else is bit for bit. Compiled with -ffp-contract=off
 * (kernels/cpu_native.py), so no product is fused into a sum that torch rounds between.
 *
 * One stream's decode step calls it twice a layer on one row of a few KB, where torch's sequence is six
 * ops (~25-30 us each call on this CPU); rows of a prefill step are split over the threads.
 */
#include <math.h>

#include "cpu_half.h"

static inline __attribute__((always_inline)) void norm_row(uint16_t *x, const uint16_t *residual, const uint16_t *w,
                                                           uint16_t *out, int64_t d, float eps, const int bf16) {
    hvec acc = hbroadcast(0.0f);
    int64_t i = 0;
    if (residual) {
        for (; i + HALF_VW <= d; i += HALF_VW) {
            const hvec t = round_half(load_half(x + i, bf16) + load_half(residual + i, bf16), bf16);
            store_half(x + i, t, bf16);
            acc += t * t;
        }
    } else {
        for (; i + HALF_VW <= d; i += HALF_VW) {
            const hvec t = load_half(x + i, bf16);
            acc += t * t;
        }
    }
    float sum = hsum(acc);
    for (; i < d; i++) {
        float t = half_to_f32(x[i], bf16);
        if (residual) {
            t = half_to_f32(f32_to_half(t + half_to_f32(residual[i], bf16), bf16), bf16);
            x[i] = f32_to_half(t, bf16);
        }
        sum += t * t;
    }
    const float r = 1.0f / sqrtf(sum / (float)d + eps);
    const hvec rv = hbroadcast(r);
    for (i = 0; i + HALF_VW <= d; i += HALF_VW)
        store_half(out + i, round_half(load_half(x + i, bf16) * rv, bf16) * load_half(w + i, bf16), bf16);
    for (; i < d; i++) {
        const float y = half_to_f32(f32_to_half(half_to_f32(x[i], bf16) * r, bf16), bf16);
        out[i] = f32_to_half(y * half_to_f32(w[i], bf16), bf16);
    }
}

/* x [rows, d] contiguous (residual, if not NULL, added into it first, [rows, d] contiguous), weight
 * [weight_rows, d], row t normed by weight row t % weight_rows (1: one weight for every row; a [tokens, heads, d]
 * x with per-head weights, Qwen3's and Gemma 3's q and k norms over one fused tensor, passes heads), out
 * [rows, d] contiguous; all of the dtype. */
#define DEFINE_NORM(name, BF16)                                                                              \
    void name(uint16_t *x, const uint16_t *residual, const uint16_t *weight, uint16_t *out, int64_t rows,   \
              int64_t d, float eps, int64_t weight_rows) {                                                   \
        _Pragma("omp parallel for schedule(static) if (rows * d > (1 << 17))")                               \
        for (int64_t t = 0; t < rows; t++)                                                                   \
            norm_row(x + t * d, residual ? residual + t * d : NULL, weight + (t % weight_rows) * d,          \
                     out + t * d, d, eps, BF16);                                                             \
    }

DEFINE_NORM(rms_norm_bf16, 1)
DEFINE_NORM(rms_norm_f16, 0)

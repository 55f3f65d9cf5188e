/* exp(x) for the x <= 0 of a softmax, shared by the native attention kernels: 2^n * p(r) with
 * x = n ln2 + r, |r| <= ln2/2, and a degree-6 polynomial (error < 2 ulp). Written so the
 * compiler vectorizes the loops over keys that call it. */
#ifndef PAGEDSERVE_CPU_SOFTMAX_EXP_H
#define PAGEDSERVE_CPU_SOFTMAX_EXP_H
#include <stdint.h>

static inline float softmax_exp(float x) {
    if (x < -87.0f) return 0.0f;
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { float f; int32_t i; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

#endif

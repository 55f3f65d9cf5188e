/* An FP8 checkpoint's activations on CPU (worker_proc/models/fp8_linear.py): each row of x rounded through
 * float8_e4m3fn and back, with torch's roundings of compressed-tensors' forward, which in torch is nine ops a
 * layer (~0.1 ms at one row, 8-12 ms of a 0.5B's decode step): here one pass over the row.
 *   dynamic (static_scale 0): scale = max|row| / 448 (or the given row_max / 448), rounded to x's dtype, the
 *                             dtype's eps where 0; v = x / scale rounded to x's dtype, clamped to +-448, rounded
 *                             to e4m3 (nearest even), times scale rounded to x's dtype;
 *   static:                   the same in float32 with the checkpoint's scale, the result rounded once to x's dtype.
 * kind: 0 float32, 1 bfloat16, 2 float16. Compiled with -ffp-contract=off: every product is rounded as torch's. */
#include <stdint.h>

#include "cpu_half.h"

#define FP8_MAX 448.0f
#define FP8_RUN 64 /* values at a time: a fixed trip count, so the compiler vectorizes the rounding */
#define FP8_PARALLEL_MIN 65536

static inline float at(const void *x, int kind, int64_t i) {
    return kind == 0 ? ((const float *)x)[i] : half_to_f32(((const uint16_t *)x)[i], kind == 1);
}

static inline float in_kind(float v, int kind) {
    return kind == 0 ? v : half_to_f32(f32_to_half(v, kind == 1), kind == 1);
}

/* |v| <= 448 to the nearest float8_e4m3fn value (ties to even): 3 mantissa bits from 2^-6 up, multiples of
 * 2^-9 below (its subnormals). */
static inline float e4m3(float v) {
    const uint32_t u = f32_to_bits(v), a = u & 0x7fffffffu;
    const float normal = bits_to_f32((a + 0x7ffffu + ((a >> 20) & 1u)) & 0xfff00000u);
    const float small = __builtin_rintf(bits_to_f32(a) * 512.0f) * (1.0f / 512.0f);
    return bits_to_f32(f32_to_bits(bits_to_f32(a) < 0x1p-6f ? small : normal) | (u & 0x80000000u));
}

static void round_row(const void *x, int kind, void *out, int64_t cols, float scale, int dynamic) {
    for (int64_t j = 0; j < cols; j += FP8_RUN) {
        const int64_t len = cols - j < FP8_RUN ? cols - j : FP8_RUN;
        float v[FP8_RUN];
        for (int64_t t = 0; t < len; t++) v[t] = at(x, kind, j + t);
        for (int t = 0; t < FP8_RUN; t++) {
            float q = dynamic ? in_kind(v[t] / scale, kind) : v[t] / scale;
            q = q < -FP8_MAX ? -FP8_MAX : q > FP8_MAX ? FP8_MAX : q;
            v[t] = e4m3(q) * scale;
        }
        if (kind == 0)
            for (int64_t t = 0; t < len; t++) ((float *)out)[j + t] = v[t];
        else
            for (int64_t t = 0; t < len; t++) ((uint16_t *)out)[j + t] = f32_to_half(v[t], kind == 1);
    }
}

/* x [rows, cols] (row stride ldx) -> out [rows, cols] contiguous, both of ``kind``. ``row_max`` [rows] of kind, or
 * NULL (each row's own max |x|); ``static_scale`` > 0: the static scheme. Returns 0, or -1 for a bad argument. */
int fp8_round_rows(const void *x, int kind, int64_t rows, int64_t cols, int64_t ldx, const void *row_max,
                   float static_scale, void *out) {
    if (kind < 0 || kind > 2 || rows < 0 || cols < 1 || ldx < cols || static_scale < 0.0f) return -1;
    const int64_t bytes = kind == 0 ? 4 : 2;
    const float eps = kind == 0 ? 0x1p-23f : kind == 1 ? 0x1p-7f : 0x1p-10f;
#pragma omp parallel for schedule(static) if (rows > 1 && rows * cols >= FP8_PARALLEL_MIN)
    for (int64_t i = 0; i < rows; i++) {
        const void *row = (const char *)x + i * ldx * bytes;
        void *dst = (char *)out + i * cols * bytes;
        if (static_scale > 0.0f) {
            round_row(row, kind, dst, cols, static_scale, 0);
            continue;
        }
        float top = 0.0f;
        if (row_max != NULL) {
            top = at(row_max, kind, i);
        } else {
            for (int64_t j = 0; j < cols; j++) {
                const float a = __builtin_fabsf(at(row, kind, j));
                top = a > top ? a : top;
            }
        }
        float scale = in_kind(top / FP8_MAX, kind);
        round_row(row, kind, dst, cols, scale == 0.0f ? eps : scale, 1);
    }
    return 0;
}

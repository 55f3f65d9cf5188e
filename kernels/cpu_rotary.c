/* Rotary position embedding on CPU, float32, bit for bit what worker_proc/rotary.py computes
 * with torch ops (and so what HF computes): per head, with x1, x2 the two halves,
 *   out1 = x1 * cos - x2 * sin,   out2 = x2 * cos + x1 * sin,
 * each product rounded on its own. This file is compiled with -ffp-contract=off (see
 * kernels/cpu_native.py): a fused multiply-add would round once and differ in the last bit.
 *
 *   x      [T, H, D] floats; rows T apart by x_row floats, heads D apart (a view of qkv)
 *   cos    [P, D/2], sin [P, D/2]: the table, one row per position
 *   pos    [T] int64
 *   out    [T, H, D] contiguous
 */
#include <stdint.h>

void rotary_f32(const float *x, int64_t x_row, const float *cos_table, const float *sin_table,
                const int64_t *pos, float *out, int64_t tokens, int64_t heads, int64_t d) {
    const int64_t half = d / 2;
#pragma omp parallel for schedule(static) if (tokens * heads * d > (1 << 17))
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_table + pos[t] * half, *s = sin_table + pos[t] * half;
        for (int64_t h = 0; h < heads; h++) {
            const float *x1 = x + t * x_row + h * d, *x2 = x1 + half;
            float *o1 = out + (t * heads + h) * d, *o2 = o1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i] * c[i], b = x2[i] * s[i];
                const float e = x2[i] * c[i], f = x1[i] * s[i];
                o1[i] = a - b;
                o2[i] = e + f;
            }
        }
    }
}

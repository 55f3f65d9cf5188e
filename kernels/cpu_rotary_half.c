/* Rotary position embedding on CPU for bfloat16 and float16, bit for bit what
 * worker_proc/rotary.py's torch ops give in that dtype: per head, with x1, x2 the two halves,
 *   out1 = round(round(x1 * cos) - round(x2 * sin)),   out2 = round(round(x2 * cos) + round(x1 * sin)),
 * round() being the dtype's round to nearest even, as torch rounds each op's float32 result.
 * The product of two halves is exact in float32, so the first rounding is torch's; the sum of
 * two rounded products is rounded to float32 and then to the dtype, as torch's op does it.
 * Compiled with -ffp-contract=off, as cpu_rotary.c is (kernels/cpu_native.py).
 *
 * The layout is cpu_rotary.c's: x [T, H, D] halves with rows x_row apart, cos/sin [P, D/2] in the
 * same dtype, pos [T] int64, out [T, H, D] contiguous.
 */
#include "cpu_half.h"

static inline float rounded(float x, int bf16) { return half_to_f32(f32_to_half(x, bf16), bf16); }

static inline __attribute__((always_inline)) void rotate_head(const uint16_t *x1, const uint16_t *c,
                                                              const uint16_t *s, uint16_t *o1, int64_t half,
                                                              const int bf16) {
    const uint16_t *x2 = x1 + half;
    uint16_t *o2 = o1 + half;
    int64_t i = 0;
    for (; i + HALF_VW <= half; i += HALF_VW) {
        const hvec a = load_half(x1 + i, bf16), b = load_half(x2 + i, bf16);
        const hvec cv = load_half(c + i, bf16), sv = load_half(s + i, bf16);
        store_half(o1 + i, round_half(a * cv, bf16) - round_half(b * sv, bf16), bf16);
        store_half(o2 + i, round_half(b * cv, bf16) + round_half(a * sv, bf16), bf16);
    }
    for (; i < half; i++) {
        const float a = half_to_f32(x1[i], bf16), b = half_to_f32(x2[i], bf16);
        const float cv = half_to_f32(c[i], bf16), sv = half_to_f32(s[i], bf16);
        o1[i] = f32_to_half(rounded(a * cv, bf16) - rounded(b * sv, bf16), bf16);
        o2[i] = f32_to_half(rounded(b * cv, bf16) + rounded(a * sv, bf16), bf16);
    }
}

/* The dtype a literal in each body, so OpenMP's outlined loop is compiled for it. */
#define DEFINE_ROTARY(name, BF16)                                                                         \
    void name(const uint16_t *x, int64_t x_row, const uint16_t *cos_table, const uint16_t *sin_table,      \
              const int64_t *pos, uint16_t *out, int64_t tokens, int64_t heads, int64_t d) {               \
        const int64_t half = d / 2;                                                                        \
        _Pragma("omp parallel for schedule(static) if (tokens * heads * d > (1 << 17))")                   \
        for (int64_t t = 0; t < tokens; t++)                                                               \
            for (int64_t h = 0; h < heads; h++)                                                            \
                rotate_head(x + t * x_row + h * d, cos_table + pos[t] * half, sin_table + pos[t] * half,   \
                            out + (t * heads + h) * d, half, BF16);                                        \
    }

DEFINE_ROTARY(rotary_bf16, 1)
DEFINE_ROTARY(rotary_f16, 0)

/* Rotary of q and k and the KV write in one call (a decode layer's three torch-level steps were
 * ~20 us of Python and dispatch a layer, more than the work): as rotary_* above, x's last
 * ``kv_heads`` heads of a token being its key, and then that key (rotated, from out) and the value
 * v [T, kv_heads, D] (rows v_row apart) are copied to slot slots[t] of k_cache / v_cache
 * [num_slots, kv_heads, D]; slot -1 is padding, skipped. Returns -1, writing nothing, when a slot
 * is past the cache or below -1. */
#define DEFINE_ROTARY_WRITE_KV(name, rotary)                                                               \
    int name(const uint16_t *x, int64_t x_row, const uint16_t *cos_table, const uint16_t *sin_table,       \
             const int64_t *pos, uint16_t *out, int64_t tokens, int64_t heads, int64_t d,                  \
             const uint16_t *v, int64_t v_row, int64_t kv_heads, const int64_t *slots, uint16_t *k_cache,  \
             uint16_t *v_cache, int64_t num_slots) {                                                       \
        for (int64_t t = 0; t < tokens; t++)                                                               \
            if (slots[t] < -1 || slots[t] >= num_slots) return -1;                                         \
        rotary(x, x_row, cos_table, sin_table, pos, out, tokens, heads, d);                                \
        const int64_t row = kv_heads * d;                                                                  \
        for (int64_t t = 0; t < tokens; t++) {                                                             \
            if (slots[t] < 0) continue;                                                                    \
            memcpy(k_cache + slots[t] * row, out + (t * heads + heads - kv_heads) * d, row * 2);           \
            memcpy(v_cache + slots[t] * row, v + t * v_row, row * 2);                                      \
        }                                                                                                  \
        return 0;                                                                                          \
    }

DEFINE_ROTARY_WRITE_KV(rotary_write_kv_bf16, rotary_bf16)
DEFINE_ROTARY_WRITE_KV(rotary_write_kv_f16, rotary_f16)

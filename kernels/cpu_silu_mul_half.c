/* A gated MLP's activation on CPU for bfloat16 and float16 rows: out = silu(gate) * up, with torch's two
 * roundings (worker_proc/elementwise.py's F.silu(gate).mul_(up) in that dtype):
 *   s = round(g / (1 + exp(-g)))    (float32 inside, as torch's silu on a half tensor)
 *   out = round(float(s) * float(up))
 * silu is cpu_softmax_exp.h's (its exp < 2 ulp in float32, against torch's 1), so a result can differ from
 * torch's by one step of the dtype where silu's float32 value lies within a few ulp of a rounding boundary.
 * Compiled with -ffp-contract=off (kernels/cpu_native.py).
 *
 * One stream's decode step takes it once a layer on one row of a few thousand values, where torch's split,
 * silu and mul_ are three ops (~10-20 us a layer on a 0.5B); rows of a prefill step are split over the threads.
 */
#include "cpu_half.h"
#include "cpu_softmax_exp.h"

/* From this many values the rows are split over the threads (torch splits its ops from 32768 elements). */
#define SILU_PARALLEL_MIN 16384
#define SILU_RUN 64 /* values widened at a time: a fixed trip count, so the compiler vectorizes the exp's loop */

static inline __attribute__((always_inline)) void silu_mul_row(const uint16_t *restrict gate,
                                                               const uint16_t *restrict up,
                                                               uint16_t *restrict out, int64_t size, const int bf16) {
    for (int64_t i = 0; i < size; i += SILU_RUN) {
        const int64_t len = size - i < SILU_RUN ? size - i : SILU_RUN;
        float g[SILU_RUN], s[SILU_RUN];
        for (int j = 0; j < SILU_RUN; j++) g[j] = j < len ? half_to_f32(gate[i + j], bf16) : 0.0f;
        for (int j = 0; j < SILU_RUN; j++) s[j] = silu(g[j]);
        for (int64_t j = 0; j < len; j++) {
            const float rounded = half_to_f32(f32_to_half(s[j], bf16), bf16);
            out[i + j] = f32_to_half(rounded * half_to_f32(up[i + j], bf16), bf16);
        }
    }
}

/* gate_up [rows, 2 * size] contiguous (each row's gate, then its up), out [rows, size] contiguous. */
#define DEFINE_SILU_MUL(name, BF16)                                                                          \
    void name(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t size) {                         \
        _Pragma("omp parallel for schedule(static) if (rows > 1 && rows * size >= SILU_PARALLEL_MIN)")       \
        for (int64_t t = 0; t < rows; t++)                                                                   \
            silu_mul_row(gate_up + t * 2 * size, gate_up + t * 2 * size + size, out + t * size, size, BF16); \
    }

DEFINE_SILU_MUL(silu_mul_bf16, 1)
DEFINE_SILU_MUL(silu_mul_f16, 0)

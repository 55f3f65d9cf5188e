/* LoRA's shrink and expand on CPU for tokens grouped by adapter slot: each token is multiplied by its
 * own slot's A and B only (Punica's BGMV and SGMV in one form: a segment is the tokens of one slot,
 * read and written in place by index, so the batch is neither gathered nor scattered).
 *
 * A decode step's few tokens per adapter would spend most of a GEMM call on its setup, and a dense
 * product over every slot's weights multiplies each token by every other slot's zeros too. Here a
 * weight row (shrink) or a block of B (expand) is widened to float32 once per segment and every token
 * of the segment is multiplied by it from the cache; the sums are float32.
 *
 *   shrink: s[t, n] = sum_k x[t, k] * a[slot, n, k]        x float32, a [slots, N, K], s float32
 *   expand: y[t, o] += sum_r s[t, r] * b[slot, r, o]        b [slots, R, out], y float32 or half, once rounded
 *
 * Weights are bfloat16, float16 or float32 (``half``: 0 float32, 1 bfloat16, 2 float16). Rows of a
 * slot past its adapter's rank (``ranks``) are zeros and skipped: shrink row n is rank n % R.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_half.h"

#define LANES 16  /* independent partial sums: the loops vectorize without reassociating */
#define OUT_BLOCK 256  /* expand: output columns per work item (R x OUT_BLOCK float32 stays in L1) */

static void widen_row(const void *w, int64_t start, int64_t count, int half, float *out) {
    if (half == 0) {
        memcpy(out, (const float *)w + start, count * sizeof(float));
    } else if (half == 1) {
        const uint16_t *p = (const uint16_t *)w + start;
        for (int64_t i = 0; i < count; i++) out[i] = bf16_to_f32(p[i]);
    } else {
        const uint16_t *p = (const uint16_t *)w + start;
        for (int64_t i = 0; i < count; i++) out[i] = f16_to_f32(p[i]);
    }
}

static inline float dot(const float *restrict x, const float *restrict w, int64_t k) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= k; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += x[i + j] * w[i + j];
    float sum = 0.0f;
    for (; i < k; i++) sum += x[i] * w[i];
    for (int j = 0; j < LANES; j++) sum += acc[j];
    return sum;
}

void lora_shrink(const float *x, int64_t ldx, int64_t k, const void *a, int half, int64_t n, int64_t r_max,
                 const int64_t *tokens, const int64_t *starts, const int64_t *slots, const int64_t *ranks,
                 int64_t num_segments, float *s, int64_t lds) {
#pragma omp parallel
    {
        float row[k];
#pragma omp for collapse(2) schedule(static)
        for (int64_t seg = 0; seg < num_segments; seg++) {
            for (int64_t r = 0; r < n; r++) {
                const int64_t slot = slots[seg];
                if (r % r_max >= ranks[slot]) {
                    for (int64_t i = starts[seg]; i < starts[seg + 1]; i++) s[tokens[i] * lds + r] = 0.0f;
                    continue;
                }
                widen_row(a, (slot * n + r) * k, k, half, row);
                for (int64_t i = starts[seg]; i < starts[seg + 1]; i++) {
                    const int64_t t = tokens[i];
                    s[t * lds + r] = dot(x + t * ldx, row, k);
                }
            }
        }
    }
}

void lora_expand(const float *s, int64_t lds, const void *b, int half, int64_t r_max, int64_t out,
                 const int64_t *tokens, const int64_t *starts, const int64_t *slots, const int64_t *ranks,
                 int64_t num_segments, void *y, int64_t ldy, int y_half) {
    const int64_t blocks = (out + OUT_BLOCK - 1) / OUT_BLOCK;
#pragma omp parallel
    {
        float weights[r_max * OUT_BLOCK];
        float acc[OUT_BLOCK];
#pragma omp for collapse(2) schedule(static)
        for (int64_t seg = 0; seg < num_segments; seg++) {
            for (int64_t block = 0; block < blocks; block++) {
                const int64_t slot = slots[seg], rank = ranks[slot];
                const int64_t o0 = block * OUT_BLOCK, width = out - o0 < OUT_BLOCK ? out - o0 : OUT_BLOCK;
                for (int64_t r = 0; r < rank; r++)
                    widen_row(b, (slot * r_max + r) * out + o0, width, half, weights + r * OUT_BLOCK);
                for (int64_t i = starts[seg]; i < starts[seg + 1]; i++) {
                    const int64_t t = tokens[i];
                    const float *st = s + t * lds;
                    for (int64_t o = 0; o < width; o++) acc[o] = 0.0f;
                    for (int64_t r = 0; r < rank; r++) {
                        const float sv = st[r];
                        const float *w = weights + r * OUT_BLOCK;
                        for (int64_t o = 0; o < width; o++) acc[o] += sv * w[o];
                    }
                    if (y_half == 0) {
                        float *yt = (float *)y + t * ldy + o0;
                        for (int64_t o = 0; o < width; o++) yt[o] += acc[o];
                    } else {
                        uint16_t *yt = (uint16_t *)y + t * ldy + o0;
                        for (int64_t o = 0; o < width; o++)
                            yt[o] = f32_to_half(half_to_f32(yt[o], y_half == 1) + acc[o], y_half == 1);
                    }
                }
            }
        }
    }
}

/* LoRA's shrink and expand on CPU for tokens grouped by adapter slot: each token is multiplied by its
 * own slot's A and B only (Punica's BGMV and SGMV in one form: a segment is the tokens of one slot,
 * read and written in place by index, so the batch is neither gathered nor scattered).
 *
 * A decode step's few tokens per adapter would spend most of a GEMM call on its setup, and a dense
 * product over every slot's weights multiplies each token by every other slot's zeros too. Here a row
 * of A (shrink) is read and widened once per segment and four tokens at a time take their dot products
 * from it in registers; a block of B (expand) is widened to float32 once per segment, then summed
 * over the ranks for each token in registers. Sums are float32, four vectors' chains at once, and a
 * projection group takes one parallel region (lora_shrink_expand).
 *
 *   shrink: s[t, n] = sum_k x[t, k] * a[slot, n, k]        x of either kind (widened as read), a [slots, N, K], s float32
 *   expand: y[t, o] += sum_r s[t, r] * b[slot, r, o]        b [slots, R, out], y float32 or half, once rounded
 *
 * Weights are bfloat16, float16 or float32 (``half``: 0 float32, 1 bfloat16, 2 float16). Rows of a
 * slot past its adapter's rank (``ranks``) are zeros and skipped: shrink row n is rank n % R.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_half.h"

#define OUT_BLOCK 256  /* expand: output columns per work item (R x OUT_BLOCK float32 stays in L1) */
#define CHUNK (4 * HALF_VW)  /* expand: output columns summed in four registers over the ranks */

/* weight[at .. at + HALF_VW) as float32 */
static inline hvec load_weight(const void *w, int64_t at, int half) {
    if (half == 0) return load_f32((const float *)w + at);
    return load_half((const uint16_t *)w + at, half == 1);
}

static inline float weight_scalar(const void *w, int64_t at, int half) {
    if (half == 0) return ((const float *)w)[at];
    return half_to_f32(((const uint16_t *)w)[at], half == 1);
}

/* out[j] = x[rows[j]] . w[at .. at + k) for j < cnt (at most four rows of x, of kind ``x_half``, ldx apart): the weight
 * row is loaded and widened once for all of them, not once per token (a decode step's shrink is that
 * widening, not its FMAs: 11 -> 3 ms a step at 32 tokens over 8 adapters). Two FMA chains a row; rows
 * past ``cnt`` repeat the first and are dropped. */
static inline void dots4(const void *x, int x_half, int64_t ldx, const int64_t *rows, int cnt, const void *w,
                         int64_t at, int64_t k, int half, float *out) {
    const int64_t xr0 = rows[0] * ldx, xr1 = rows[cnt > 1 ? 1 : 0] * ldx;
    const int64_t xr2 = rows[cnt > 2 ? 2 : 0] * ldx, xr3 = rows[cnt > 3 ? 3 : 0] * ldx;
    hvec a0 = {0}, b0 = {0}, a1 = {0}, b1 = {0}, a2 = {0}, b2 = {0}, a3 = {0}, b3 = {0};
    int64_t i = 0;
    for (; i + 2 * HALF_VW <= k; i += 2 * HALF_VW) {
        const hvec w0 = load_weight(w, at + i, half), w1 = load_weight(w, at + i + HALF_VW, half);
        a0 += load_weight(x, xr0 + i, x_half) * w0; b0 += load_weight(x, xr0 + i + HALF_VW, x_half) * w1;
        a1 += load_weight(x, xr1 + i, x_half) * w0; b1 += load_weight(x, xr1 + i + HALF_VW, x_half) * w1;
        a2 += load_weight(x, xr2 + i, x_half) * w0; b2 += load_weight(x, xr2 + i + HALF_VW, x_half) * w1;
        a3 += load_weight(x, xr3 + i, x_half) * w0; b3 += load_weight(x, xr3 + i + HALF_VW, x_half) * w1;
    }
    for (; i + HALF_VW <= k; i += HALF_VW) {
        const hvec w0 = load_weight(w, at + i, half);
        a0 += load_weight(x, xr0 + i, x_half) * w0; a1 += load_weight(x, xr1 + i, x_half) * w0;
        a2 += load_weight(x, xr2 + i, x_half) * w0; a3 += load_weight(x, xr3 + i, x_half) * w0;
    }
    const int64_t xr[4] = {xr0, xr1, xr2, xr3};
    float sums[4] = {hsum(a0 + b0), hsum(a1 + b1), hsum(a2 + b2), hsum(a3 + b3)};
    for (; i < k; i++) {
        const float wi = weight_scalar(w, at + i, half);
        for (int j = 0; j < 4; j++) sums[j] += weight_scalar(x, xr[j] + i, x_half) * wi;
    }
    for (int j = 0; j < cnt; j++) out[j] = sums[j];
}

static void widen_row(const void *w, int64_t start, int64_t count, int half, float *out) {
    int64_t i = 0;
    for (; i + HALF_VW <= count; i += HALF_VW) *(hvec_unaligned *)(out + i) = load_weight(w, start + i, half);
    for (; i < count; i++) out[i] = weight_scalar(w, start + i, half);
}

/* y[0 .. width) += acc, rounded once to y's kind */
static inline void add_into(void *y, int64_t at, const float *acc, int64_t width, int y_half) {
    int64_t o = 0;
    if (y_half == 0) {
        float *yt = (float *)y + at;
        for (; o + HALF_VW <= width; o += HALF_VW) *(hvec_unaligned *)(yt + o) = load_f32(yt + o) + load_f32(acc + o);
        for (; o < width; o++) yt[o] += acc[o];
        return;
    }
    uint16_t *yt = (uint16_t *)y + at;
    for (; o + HALF_VW <= width; o += HALF_VW)
        store_half(yt + o, load_half(yt + o, y_half == 1) + load_f32(acc + o), y_half == 1);
    for (; o < width; o++) yt[o] = f32_to_half(half_to_f32(yt[o], y_half == 1) + acc[o], y_half == 1);
}

/* One thread's share of the shrink (inside a parallel region): work items are (segment, row of A). */
static void shrink_items(const void *x, int x_half, int64_t ldx, int64_t k, const void *a, int half, int64_t n, int64_t r_max,
                         const int64_t *tokens, const int64_t *starts, const int64_t *slots, const int64_t *ranks,
                         int64_t num_segments, float *s, int64_t lds) {
#pragma omp for collapse(2) schedule(static)
    for (int64_t seg = 0; seg < num_segments; seg++) {
        for (int64_t r = 0; r < n; r++) {
            const int64_t slot = slots[seg];
            const int zero = r % r_max >= ranks[slot];
            for (int64_t i = starts[seg]; i < starts[seg + 1]; i += 4) {
                const int cnt = starts[seg + 1] - i < 4 ? (int)(starts[seg + 1] - i) : 4;
                float out[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                if (!zero) dots4(x, x_half, ldx, tokens + i, cnt, a, (slot * n + r) * k, k, half, out);
                for (int j = 0; j < cnt; j++) s[tokens[i + j] * lds + r] = out[j];
            }
        }
    }
}

/* One thread's share of an expand: work items are (segment, block of OUT_BLOCK output columns). */
static void expand_items(const float *s, int64_t lds, const void *b, int half, int64_t r_max, int64_t out,
                         const int64_t *tokens, const int64_t *starts, const int64_t *slots, const int64_t *ranks,
                         int64_t num_segments, void *y, int64_t ldy, int y_half, float *weights, float *acc) {
    const int64_t blocks = (out + OUT_BLOCK - 1) / OUT_BLOCK;
#pragma omp for collapse(2) schedule(static) nowait
    for (int64_t seg = 0; seg < num_segments; seg++) {
        for (int64_t block = 0; block < blocks; block++) {
            const int64_t slot = slots[seg], rank = ranks[slot];
            const int64_t o0 = block * OUT_BLOCK, width = out - o0 < OUT_BLOCK ? out - o0 : OUT_BLOCK;
            for (int64_t r = 0; r < rank; r++)
                widen_row(b, (slot * r_max + r) * out + o0, width, half, weights + r * OUT_BLOCK);
            for (int64_t i = starts[seg]; i < starts[seg + 1]; i++) {
                const int64_t t = tokens[i];
                const float *st = s + t * lds;
                int64_t c = 0;
                for (; c + CHUNK <= width; c += CHUNK) {
                    hvec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                    for (int64_t r = 0; r < rank; r++) {
                        const hvec sv = hbroadcast(st[r]);
                        const float *w = weights + r * OUT_BLOCK + c;
                        a0 += sv * load_f32(w);
                        a1 += sv * load_f32(w + HALF_VW);
                        a2 += sv * load_f32(w + 2 * HALF_VW);
                        a3 += sv * load_f32(w + 3 * HALF_VW);
                    }
                    *(hvec_unaligned *)(acc + c) = a0;
                    *(hvec_unaligned *)(acc + c + HALF_VW) = a1;
                    *(hvec_unaligned *)(acc + c + 2 * HALF_VW) = a2;
                    *(hvec_unaligned *)(acc + c + 3 * HALF_VW) = a3;
                }
                for (int64_t o = c; o < width; o++) {
                    float sum = 0.0f;
                    for (int64_t r = 0; r < rank; r++) sum += st[r] * weights[r * OUT_BLOCK + o];
                    acc[o] = sum;
                }
                add_into(y, t * ldy + o0, acc, width, y_half);
            }
        }
    }
}

/* A projection group in one parallel region (one fork and join where a shrink and its expands would
 * take one each): the shrink of its modules' A at once into s, then each module's expand (``bs[j]``
 * [slots, R, outs[j]]) from s's columns j * R into ``ys[j]`` (rows ldy apart), the modules whose
 * ``expand[j]`` is 0 skipped. A step's hundreds of joins cost more than their work where the cores
 * are shared, so one per group. */
void lora_shrink_expand(const void *x, int x_half, int64_t ldx, int64_t k, const void *a, int half, int64_t modules,
                        int64_t r_max, const int64_t *tokens, const int64_t *starts, const int64_t *slots,
                        const int64_t *ranks, int64_t num_segments, float *s, int64_t lds, const int64_t *bs,
                        const int64_t *outs, const int64_t *ys, const int64_t *expand, int64_t ldy, int y_half) {
#pragma omp parallel
    {
        float weights[r_max * OUT_BLOCK], acc[OUT_BLOCK];
        shrink_items(x, x_half, ldx, k, a, half, modules * r_max, r_max, tokens, starts, slots, ranks, num_segments, s,
                     lds);  /* its omp for ends with a barrier: s is complete below */
        for (int64_t j = 0; j < modules; j++)
            if (expand[j])
                expand_items(s + j * r_max, lds, (const void *)bs[j], half, r_max, outs[j], tokens, starts, slots,
                             ranks, num_segments, (void *)ys[j], ldy, y_half, weights, acc);
    }
}

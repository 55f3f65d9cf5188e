/* LoRA's shrink and expand on CPU for tokens grouped by adapter slot: each token is multiplied by its
 * own slot's A and B only (Punica's BGMV and SGMV in one form: a segment is the tokens of one slot,
 * read and written in place by index, so the batch is neither gathered nor scattered).
 *
 *   shrink: s[i, n] = sum_k x[t_i, k] * a[slot, n, k]      x [T, K], a [slots, N, K], s float32 (rows in segment order)
 *   expand: y[t_i, c_j + o] += sum_r s[i, jR + r] * b_j[slot, r, o]      b_j [slots, R, out_j], y float32 or half
 *
 * A decode step is a read of the adapters' weights (the 0.5B shape, 8 slots of rank 16 on all seven
 * projections: 141 MB a step beside the base's 0.99 GB), with a few tokens per slot to multiply them by.
 * So each vector of a weight is loaded once per four tokens and used by all four in registers: the
 * shrink takes a row of A by four tokens (bfloat16 x and A with AVX512-BF16: vdpbf16ps, 32 products an
 * instruction and no widening; otherwise widened to float32 and FMA), the expand one vector of B,
 * widened, by four tokens' rank sums over 64 columns, added into y where they end (no delta tensor, y
 * rounded once). Both prefetch their weight streams (and the expand y's rows), which the hardware's
 * prefetchers leave to memory latency. A prompt chunk's long segment is cut into blocks of TOKEN_BLOCK
 * tokens, whose x rows the shrink reads again for each row of A from L2, four rows of A at a time in
 * bfloat16. Sums are float32; a projection group takes one parallel region (lora_shrink_expand).
 *
 * Weights are bfloat16, float16 or float32 (``kind``: 0 float32, 1 bfloat16, 2 float16). Rows of a
 * slot past its adapter's rank (``ranks``) are zeros and skipped: shrink row n is rank n % R.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_half.h"

#define TOKENS 4  /* tokens that share each load of a weight */
#define VECS 4  /* expand: column vectors a token sums in registers (with TOKENS: 16 accumulators) */
#define TOKEN_BLOCK 64  /* tokens of one segment per work item */
#define LONG_BLOCK 16  /* a block of this many tokens takes the shrink four rows of A at a time (bfloat16) */
#define OUT_BLOCK 256  /* expand: output columns per work item */
/* How far ahead the weights are prefetched: the shrink a row of A's elements ahead, the expand (whose tiles
 * step through B's R rows 64 columns at a time: R streams) bytes ahead in each row. A cold decode step's
 * deltas (24 layers of the 0.5B shape, 8 slots, one thread) took 14.9 ms without and 8.3 ms with them. */
#define SHRINK_PREFETCH 4096
#define EXPAND_PREFETCH 512
/* and y's rows, bytes ahead: a prompt chunk's outputs are past the caches (512 tokens over 8 slots, one
 * thread: the gate/up expands' 73 ms went to 36) */
#define Y_PREFETCH 512

static inline __attribute__((always_inline)) hvec load_kind(const void *p, int64_t at, const int kind) {
    if (kind == 0) return load_f32((const float *)p + at);
    return kind == 1 ? load_bf16((const uint16_t *)p + at) : load_f16((const uint16_t *)p + at);
}

static inline __attribute__((always_inline)) float scalar_kind(const void *p, int64_t at, const int kind) {
    if (kind == 0) return ((const float *)p)[at];
    return half_to_f32(((const uint16_t *)p)[at], kind == 1);
}

/* out[j] = x[xoff[j] ..] . w[0 .. k) for TOKENS rows of x (X, W: the kinds, widened as read), two FMA chains a
 * row. ``w`` is read PREFETCH elements ahead: a segment's rows of A are one sequential stream. */
static inline __attribute__((always_inline)) void dots_wide(const void *x, const int64_t *xoff, const void *w,
                                                            int64_t k, const int X, const int W, float *out) {
    hvec acc[2][TOKENS];
    for (int j = 0; j < TOKENS; j++) acc[0][j] = acc[1][j] = (hvec){0};
    int64_t i = 0;
    for (; i + 2 * HALF_VW <= k; i += 2 * HALF_VW) {
        const hvec w0 = load_kind(w, i, W), w1 = load_kind(w, i + HALF_VW, W);
        __builtin_prefetch((const char *)w + (i + SHRINK_PREFETCH) * (W == 0 ? 4 : 2), 0, 3);
        if (W == 0) __builtin_prefetch((const float *)w + i + SHRINK_PREFETCH + HALF_VW, 0, 3);
        for (int j = 0; j < TOKENS; j++) {
            acc[0][j] += load_kind(x, xoff[j] + i, X) * w0;
            acc[1][j] += load_kind(x, xoff[j] + i + HALF_VW, X) * w1;
        }
    }
    for (; i + HALF_VW <= k; i += HALF_VW) {
        const hvec wv = load_kind(w, i, W);
        for (int j = 0; j < TOKENS; j++) acc[0][j] += load_kind(x, xoff[j] + i, X) * wv;
    }
    for (int j = 0; j < TOKENS; j++) {
        float sum = hsum(acc[0][j] + acc[1][j]);
        for (int64_t t = i; t < k; t++) sum += scalar_kind(x, xoff[j] + t, X) * scalar_kind(w, t, W);
        out[j] = sum;
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && HALF_VW == 16
#define SHRINK_DPBF16 1
/* dots_wide of bfloat16 x and w by vdpbf16ps: pairs of products summed into float32 lanes, no widening. */
static inline __attribute__((always_inline)) void dots_bf16(const uint16_t *x, const int64_t *xoff, const uint16_t *w,
                                                            int64_t k, float *out) {
    __m512 acc[2][TOKENS];
    for (int j = 0; j < TOKENS; j++) acc[0][j] = acc[1][j] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + i), w1 = (__m512bh)_mm512_loadu_si512(w + i + 32);
        __builtin_prefetch(w + i + SHRINK_PREFETCH, 0, 3);
        __builtin_prefetch(w + i + 32 + SHRINK_PREFETCH, 0, 3);
        for (int j = 0; j < TOKENS; j++) {
            acc[0][j] = _mm512_dpbf16_ps(acc[0][j], (__m512bh)_mm512_loadu_si512(x + xoff[j] + i), w0);
            acc[1][j] = _mm512_dpbf16_ps(acc[1][j], (__m512bh)_mm512_loadu_si512(x + xoff[j] + i + 32), w1);
        }
    }
    for (; i < k; i += 32) {  /* the last k % 64: masked loads, zeros past k */
        const __mmask32 mask = k - i >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (k - i)) - 1);
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + i);
        for (int j = 0; j < TOKENS; j++)
            acc[0][j] = _mm512_dpbf16_ps(acc[0][j], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + xoff[j] + i), wv);
    }
    for (int j = 0; j < TOKENS; j++) out[j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][j], acc[1][j]));
}

/* out[q * TOKENS + j] = x[xoff[j] ..] . w[q * k ..] for ROWS4 rows of w: a prompt chunk's shrink, where the x rows
 * (from L2) are what a row at a time reads most; 16 sums in registers, half the loads a product. */
#define ROWS4 4
static inline void dots_bf16_rows4(const uint16_t *x, const int64_t *xoff, const uint16_t *w, int64_t k, float *out) {
    __m512 acc[ROWS4][TOKENS];
    for (int q = 0; q < ROWS4; q++)
        for (int j = 0; j < TOKENS; j++) acc[q][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 32) {
        const __mmask32 mask = k - i >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (k - i)) - 1);
        __m512bh wv[ROWS4];
        for (int q = 0; q < ROWS4; q++) wv[q] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + q * k + i);
        for (int j = 0; j < TOKENS; j++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + xoff[j] + i);
            for (int q = 0; q < ROWS4; q++) acc[q][j] = _mm512_dpbf16_ps(acc[q][j], xv, wv[q]);
        }
    }
    for (int q = 0; q < ROWS4; q++)
        for (int j = 0; j < TOKENS; j++) out[q * TOKENS + j] = _mm512_reduce_add_ps(acc[q][j]);
}
#endif

/* out[j] = x[xoff[j] ..] . a[at .. at + k), with the kinds as constants where they are one. */
static void dots(const void *x, int x_kind, const int64_t *xoff, const void *a, int a_kind, int64_t at, int64_t k,
                 float *out) {
    if (x_kind == 1 && a_kind == 1) {
#ifdef SHRINK_DPBF16
        dots_bf16((const uint16_t *)x, xoff, (const uint16_t *)a + at, k, out);
#else
        dots_wide(x, xoff, (const uint16_t *)a + at, k, 1, 1, out);
#endif
    } else if (x_kind == 0 && a_kind == 0) {
        dots_wide(x, xoff, (const float *)a + at, k, 0, 0, out);
    } else if (x_kind == 2 && a_kind == 2) {
        dots_wide(x, xoff, (const uint16_t *)a + at, k, 2, 2, out);
    } else {  /* x in another dtype than the weights: not what a model runs, kept correct */
        const void *w = a_kind == 0 ? (const void *)((const float *)a + at) : (const void *)((const uint16_t *)a + at);
        dots_wide(x, xoff, w, k, x_kind, a_kind, out);
    }
}

/* s[i, row] for a segment's tokens i0 .. i1 (positions in ``tokens``, rows of s): row ``row`` of its slot's A
 * (from element ``at``) by TOKENS tokens at a time. */
static void shrink_block(const void *x, int x_kind, int64_t ldx, int64_t k, const void *a, int a_kind, int64_t at,
                         const int64_t *tokens, int64_t i0, int64_t i1, float *s, int64_t lds, int64_t row, int rows) {
    for (int64_t i = i0; i < i1; i += TOKENS) {
        const int cnt = i1 - i < TOKENS ? (int)(i1 - i) : TOKENS;
        int64_t xoff[TOKENS];
        for (int j = 0; j < TOKENS; j++) xoff[j] = tokens[i + (j < cnt ? j : 0)] * ldx;  /* past cnt: repeats, dropped */
        float out[4 * TOKENS];
#ifdef SHRINK_DPBF16
        if (rows == ROWS4)
            dots_bf16_rows4((const uint16_t *)x, xoff, (const uint16_t *)a + at, k, out);
        else
#endif
            dots(x, x_kind, xoff, a, a_kind, at, k, out);
        for (int q = 0; q < rows; q++)
            for (int j = 0; j < cnt; j++) s[(i + j) * lds + row + q] = out[q * TOKENS + j];
    }
}

/* y[at + v * HALF_VW ..] += acc[v] for V vectors, rounded once to y's kind */
static inline __attribute__((always_inline)) void add_into(void *y, int64_t at, const hvec *acc, const int V, int y_kind) {
    for (int v = 0; v < V; v++) {
        if (y_kind == 0) {
            float *yt = (float *)y + at + v * HALF_VW;
            *(hvec_unaligned *)yt = load_f32(yt) + acc[v];
        } else {
            uint16_t *yt = (uint16_t *)y + at + v * HALF_VW;
            store_half(yt, load_half(yt, y_kind == 1) + acc[v], y_kind == 1);
        }
    }
}

/* acc[t][v] = st[t][:rank] . b[:rank, v * HALF_VW ..] (b rows ldb apart, from element at): each vector of b
 * loaded and widened once for the TOKENS tokens. */
static inline __attribute__((always_inline)) void expand_tile(const float *const st[TOKENS], const void *b, int64_t at,
                                                              int64_t ldb, int64_t rank, const int V, const int B,
                                                              hvec acc[TOKENS][VECS]) {
    for (int t = 0; t < TOKENS; t++)
        for (int v = 0; v < V; v++) acc[t][v] = (hvec){0};
    for (int64_t r = 0; r < rank; r++) {
        hvec wv[VECS];
        const char *ahead = (const char *)b + (at + r * ldb) * (B == 0 ? 4 : 2) + EXPAND_PREFETCH;
        __builtin_prefetch(ahead, 0, 3);
        __builtin_prefetch(ahead + 64, 0, 3);
        for (int v = 0; v < V; v++) wv[v] = load_kind(b, at + r * ldb + v * HALF_VW, B);
        for (int t = 0; t < TOKENS; t++) {
            const hvec sv = hbroadcast(st[t][r]);
            for (int v = 0; v < V; v++) acc[t][v] += sv * wv[v];
        }
    }
}

/* y[t_i, col + o] += s[i, :rank] . b[:rank, o] for a segment's tokens i0 .. i1 and columns o0 .. o0 + width of
 * b ([rank rows, ldb]: one slot's, from element ``at``); B: b's kind. */
static inline __attribute__((always_inline)) void expand_block(const float *s, int64_t lds, const void *b, const int B,
                                                               int64_t at, int64_t ldb, int64_t rank, int64_t o0,
                                                               int64_t width, const int64_t *tokens, int64_t i0,
                                                               int64_t i1, void *y, int64_t ldy, int64_t col,
                                                               int y_kind) {
    for (int64_t i = i0; i < i1; i += TOKENS) {
        const int cnt = i1 - i < TOKENS ? (int)(i1 - i) : TOKENS;
        const float *st[TOKENS];
        int64_t yrow[TOKENS];
        for (int t = 0; t < TOKENS; t++) {
            st[t] = s + (i + (t < cnt ? t : 0)) * lds;  /* past cnt: repeats, not stored */
            yrow[t] = tokens[i + (t < cnt ? t : 0)] * ldy + col;
        }
        hvec acc[TOKENS][VECS];
        int64_t c = 0;
        for (; c + VECS * HALF_VW <= width; c += VECS * HALF_VW) {
            for (int t = 0; t < cnt; t++) {  /* y's rows: a prompt chunk's are past the caches */
                const char *ahead = (const char *)y + (yrow[t] + o0 + c) * (y_kind == 0 ? 4 : 2) + Y_PREFETCH;
                __builtin_prefetch(ahead, 1, 3);
                __builtin_prefetch(ahead + 64, 1, 3);
            }
            expand_tile(st, b, at + o0 + c, ldb, rank, VECS, B, acc);
            for (int t = 0; t < cnt; t++) add_into(y, yrow[t] + o0 + c, acc[t], VECS, y_kind);
        }
        for (; c + HALF_VW <= width; c += HALF_VW) {
            expand_tile(st, b, at + o0 + c, ldb, rank, 1, B, acc);
            for (int t = 0; t < cnt; t++) add_into(y, yrow[t] + o0 + c, acc[t], 1, y_kind);
        }
        for (; c < width; c++)
            for (int t = 0; t < cnt; t++) {
                float sum = 0.0f;
                for (int64_t r = 0; r < rank; r++) sum += st[t][r] * scalar_kind(b, at + r * ldb + o0 + c, B);
                const int64_t o = yrow[t] + o0 + c;
                if (y_kind == 0)
                    ((float *)y)[o] += sum;
                else
                    ((uint16_t *)y)[o] = f32_to_half(half_to_f32(((uint16_t *)y)[o], y_kind == 1) + sum, y_kind == 1);
            }
    }
}

/* A work item's tokens: positions first .. last of ``tokens``, all on ``seg``'s slot. */
typedef struct {
    int64_t seg, first, last;
} token_block;

/* A projection group in one parallel region (one fork and join where a shrink and its expands would
 * take one each: a step's hundreds of joins cost more than their work where the cores are shared):
 * the shrink of all its modules' A at once (a [slots, modules * R, K]) into s, then each module j's
 * expand (``bs[j]`` [slots, R, outs[j]]) from s's columns jR .. into y's columns cols[j] .. (y's rows
 * ldy apart), the modules whose ``expand[j]`` is 0 skipped. ``tokens``: the adapter tokens' rows of x
 * and y in segment order, segment i ``tokens[starts[i] .. starts[i + 1])`` on slot ``slots[i]``.
 * Returns 0, or -1 where its scratch could not be allocated. */
int lora_shrink_expand(const void *x, int x_kind, int64_t ldx, int64_t k, const void *a, int kind, int64_t modules,
                       int64_t r_max, const int64_t *tokens, const int64_t *starts, const int64_t *slots,
                       const int64_t *ranks, int64_t num_segments, void *y, int64_t ldy, int y_kind,
                       const int64_t *bs, const int64_t *outs, const int64_t *cols, const int64_t *expand) {
    const int64_t n = modules * r_max, lds = n, count = starts[num_segments];
    int64_t num_blocks = 0;
    for (int64_t seg = 0; seg < num_segments; seg++)
        num_blocks += (starts[seg + 1] - starts[seg] + TOKEN_BLOCK - 1) / TOKEN_BLOCK;
    float *s = malloc((size_t)(count > 0 ? count : 1) * (size_t)lds * sizeof(float));
    token_block *blocks = malloc((size_t)(num_blocks > 0 ? num_blocks : 1) * sizeof(token_block));
    if (s == NULL || blocks == NULL) {
        free(s);
        free(blocks);
        return -1;
    }
    num_blocks = 0;
    for (int64_t seg = 0; seg < num_segments; seg++)
        for (int64_t i = starts[seg]; i < starts[seg + 1]; i += TOKEN_BLOCK)
            blocks[num_blocks++] = (token_block){seg, i, i + TOKEN_BLOCK < starts[seg + 1] ? i + TOKEN_BLOCK : starts[seg + 1]};
#pragma omp parallel
    {
#pragma omp for collapse(2) schedule(static)
        for (int64_t blk = 0; blk < num_blocks; blk++) {
            for (int64_t row = 0; row < n; row++) {
                const token_block tb = blocks[blk];
                const int64_t slot = slots[tb.seg];
                if (row % r_max >= ranks[slot]) continue;  /* past the adapter's rank: zeros, and no expand reads them */
                int rows = 1;
#ifdef SHRINK_DPBF16
                if (x_kind == 1 && kind == 1 && tb.last - tb.first >= LONG_BLOCK && r_max % ROWS4 == 0) {
                    /* a long block's rows four at a time (of one module: those past the rank skipped together), by
                     * the item of the first */
                    if (row % ROWS4) continue;
                    rows = ROWS4;
                }
#endif
                shrink_block(x, x_kind, ldx, k, a, kind, (slot * n + row) * k, tokens, tb.first, tb.last, s, lds, row,
                             rows);
            }
        }  /* the omp for ends with a barrier: s is complete below */
        for (int64_t j = 0; j < modules; j++) {
            if (!expand[j]) continue;
            const int64_t out = outs[j], col_blocks = (out + OUT_BLOCK - 1) / OUT_BLOCK;
            const void *b = (const void *)bs[j];
#pragma omp for collapse(2) schedule(static) nowait
            for (int64_t blk = 0; blk < num_blocks; blk++) {
                for (int64_t cb = 0; cb < col_blocks; cb++) {
                    const token_block tb = blocks[blk];
                    const int64_t slot = slots[tb.seg], rank = ranks[slot];
                    const int64_t o0 = cb * OUT_BLOCK, width = out - o0 < OUT_BLOCK ? out - o0 : OUT_BLOCK;
                    const int64_t at = slot * r_max * out;
                    if (rank == 0) continue;
                    if (kind == 1)
                        expand_block(s + j * r_max, lds, b, 1, at, out, rank, o0, width, tokens, tb.first, tb.last, y,
                                     ldy, cols[j], y_kind);
                    else if (kind == 0)
                        expand_block(s + j * r_max, lds, b, 0, at, out, rank, o0, width, tokens, tb.first, tb.last, y,
                                     ldy, cols[j], y_kind);
                    else
                        expand_block(s + j * r_max, lds, b, 2, at, out, rank, o0, width, tokens, tb.first, tb.last, y,
                                     ldy, cols[j], y_kind);
                }
            }
        }
    }
    free(s);
    free(blocks);
    return 0;
}

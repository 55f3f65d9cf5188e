/* Paged decode attention on CPU for bfloat16 and float16 caches and queries: the contract of
 * cpu_decode_attention.c (one query per request, read in place from the block cache, only the
 * visible slots touched), with each key and value widened to float32 in registers as it is read
 * (cpu_half.h) and float32 arithmetic throughout; the output is rounded once to the query's dtype.
 *
 * Half the bytes of float32 per key, which is what a decode step spends its time reading. Scores
 * are taken SCORE_KEYS keys at a time and their sums reduced together; with AVX512-BF16 the q.k
 * products of bfloat16 are vdpbf16ps (32 pairs an instruction, no widening). Values are summed in
 * register tiles of HEAD_TILE query heads x COL_VECS vectors of columns, each value row widened
 * once per tile and used by every head of the tile (the query heads of a KV head share it).
 */
#include <math.h>
#include <stdlib.h>

#include "cpu_half.h"
#include "cpu_softmax_exp.h"

#define SCORE_KEYS 8
#if HALF_VW == 16
#define HEAD_TILE 4 /* 16 accumulators + 4 value vectors of the 32 zmm registers */
#define COL_VECS 4
#elif HALF_VW == 8
#define HEAD_TILE 2 /* 8 + 4 of the 16 ymm registers */
#define COL_VECS 4
#else
#define HEAD_TILE 2
#define COL_VECS 2
#endif
#if defined(__AVX512BF16__) && HALF_VW == 16
#define DPBF16 1
#else
#define DPBF16 0
#endif

const char *cpu_kernel_variant(void) {
#if DPBF16
    return "avx512bf16";
#elif HALF_VW == 16
    return "avx512";
#elif HALF_VW == 8
    return "avx2";
#else
    return "scalar";
#endif
}

/* out[j] = scale * (sum of acc[j]'s lanes), j < SCORE_KEYS (eight): 512-bit sums folded to 256
 * bits, then reduced together (sum_eight_keys). */
static inline void reduce_keys(const hvec acc[SCORE_KEYS], float scale, float *out) {
#if HALF_VW >= 8
    __m256 a[SCORE_KEYS];
    for (int j = 0; j < SCORE_KEYS; j++)
#if HALF_VW == 16
        a[j] = _mm256_add_ps(_mm512_castps512_ps256((__m512)acc[j]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)acc[j]), 1)));
#else
        a[j] = (__m256)acc[j];
#endif
    sum_eight_keys(a, scale, out);
#else
    for (int j = 0; j < SCORE_KEYS; j++) out[j] = hsum(acc[j]) * scale;
#endif
}

/* Scores of SCORE_KEYS consecutive slots (row halves apart) for one query head: qh its halves,
 * qf the same widened. */
static inline __attribute__((always_inline)) void score_keys(const uint16_t *qh, const float *qf, const uint16_t *k0,
                                                             int64_t row, int64_t d, float scale, float *out,
                                                             const int bf16) {
    hvec acc[SCORE_KEYS] = {{0}};
    int64_t i = 0;
#if DPBF16
    if (bf16 && d % 32 == 0) {
        for (; i < d; i += 32) {
            const __m512bh qv = (__m512bh)_mm512_loadu_si512(qh + i);
            for (int j = 0; j < SCORE_KEYS; j++)
                acc[j] = (hvec)_mm512_dpbf16_ps((__m512)acc[j], qv, (__m512bh)_mm512_loadu_si512(k0 + j * row + i));
        }
    }
#else
    (void)qh;
#endif
    for (; i + HALF_VW <= d; i += HALF_VW) {
        const hvec qv = load_f32(qf + i);
        for (int j = 0; j < SCORE_KEYS; j++) acc[j] += qv * load_half(k0 + j * row + i, bf16);
    }
    reduce_keys(acc, scale, out);
    if (i < d)
        for (int j = 0; j < SCORE_KEYS; j++) {
            float tail = 0.0f;
            for (int64_t c = i; c < d; c++) tail += qf[c] * half_to_f32(k0[j * row + c], bf16);
            out[j] += tail * scale;
        }
}

static inline __attribute__((always_inline)) float score_key(const float *qf, const uint16_t *k, int64_t d,
                                                             float scale, const int bf16) {
    hvec acc = {0};
    int64_t i = 0;
    for (; i + HALF_VW <= d; i += HALF_VW) acc += load_f32(qf + i) * load_half(k + i, bf16);
    float sum = hsum(acc);
    for (; i < d; i++) sum += qf[i] * half_to_f32(k[i], bf16);
    return sum * scale;
}

/* Output columns col..col+nv*HALF_VW of query heads h0..h0+nh-1 (weights p, n per head, with
 * their 1/sum in inv), from the values at col of each visible slot (col includes the KV head). */
static inline __attribute__((always_inline)) void weigh_values(
    const uint16_t *v, const int32_t *table, int64_t lo, int64_t hi, int64_t bs, int64_t row, int64_t col,
    const float *p, int64_t n, const float *inv, uint16_t *out, int64_t d, const int nh, const int nv, const int bf16) {
    hvec o[HEAD_TILE][COL_VECS] = {{{0}}};
    for (int64_t pos = lo; pos < hi;) {
        const int64_t end = (pos / bs + 1) * bs < hi ? (pos / bs + 1) * bs : hi;
        const uint16_t *vr = v + ((int64_t)table[pos / bs] * bs + pos % bs) * row + col;
        for (; pos < end; pos++, vr += row) {
            hvec x[COL_VECS];
            for (int t = 0; t < nv; t++) x[t] = load_half(vr + t * HALF_VW, bf16);
            for (int g = 0; g < nh; g++) {
                const hvec w = hbroadcast(p[g * n + pos - lo]);
                for (int t = 0; t < nv; t++) o[g][t] += w * x[t];
            }
        }
    }
    for (int g = 0; g < nh; g++)
        for (int t = 0; t < nv; t++) store_half(out + g * d + t * HALF_VW, o[g][t] * hbroadcast(inv[g]), bf16);
}

/* The columns past the last whole vector (head dims that are no multiple of HALF_VW). */
static void weigh_value_tail(const uint16_t *v, const int32_t *table, int64_t lo, int64_t hi, int64_t bs,
                             int64_t row, int64_t col, int64_t count, const float *p, float inv,
                             uint16_t *out, const int bf16) {
    for (int64_t c = 0; c < count; c++) {
        float sum = 0.0f;
        for (int64_t pos = lo; pos < hi; pos++)
            sum += p[pos - lo] * half_to_f32(v[((int64_t)table[pos / bs] * bs + pos % bs) * row + col + c], bf16);
        out[c] = f32_to_half(sum * inv, bf16);
    }
}

#define WEIGH(nh, nv) weigh_values(v, table, lo, hi, bs, row, kh * d + c0, scores + h0 * n, n, inv_sum + h0, \
                                   ob + h0 * d + c0, d, nh, nv, bf16)
#define WEIGH_HEADS(nv)                        \
    switch (nh) {                              \
    case 1: WEIGH(1, nv); break;               \
    case 2: WEIGH(2, nv); break;               \
    case 3: WEIGH(HEAD_TILE > 2 ? 3 : 1, nv); break; \
    default: WEIGH(HEAD_TILE, nv);             \
    }

/* One request, as attend_request in cpu_decode_attention.c: every visible slot's keys scored
 * (all heads of a slot are adjacent), one softmax per head, then the values weighed. */
static inline __attribute__((always_inline)) void attend_request_half(
    const uint16_t *qb, const uint16_t *k, const uint16_t *v, const int32_t *table, int64_t lo, int64_t hi,
    uint16_t *ob, float *scores, float *qf, int64_t hq, int64_t hkv, int64_t group, const int64_t d, int64_t row,
    int64_t bs, float scale, const float *sinks, const int bf16) {
    const int64_t n = hi - lo;
    for (int64_t i = 0; i < hq * d; i++) qf[i] = half_to_f32(qb[i], bf16);
    for (int64_t pos = lo; pos < hi;) {
        const int64_t end = (pos / bs + 1) * bs < hi ? (pos / bs + 1) * bs : hi;
        const uint16_t *kr = k + ((int64_t)table[pos / bs] * bs + pos % bs) * row;
        prefetch_next_block(k, v, table, pos, hi, bs, row, sizeof(uint16_t));
        for (; pos + SCORE_KEYS <= end; pos += SCORE_KEYS, kr += SCORE_KEYS * row)
            for (int64_t kh = 0, h = 0; kh < hkv; kh++)
                for (int64_t g = 0; g < group; g++, h++)
                    score_keys(qb + h * d, qf + h * d, kr + kh * d, row, d, scale, scores + h * n + pos - lo, bf16);
        for (; pos < end; pos++, kr += row)
            for (int64_t kh = 0, h = 0; kh < hkv; kh++)
                for (int64_t g = 0; g < group; g++, h++)
                    scores[h * n + pos - lo] = score_key(qf + h * d, kr + kh * d, d, scale, bf16);
    }
    float inv_sum[hq];
    for (int64_t h = 0; h < hq; h++) inv_sum[h] = decode_softmax(scores + h * n, n, sinks ? sinks[h] : -INFINITY);
    for (int64_t kh = 0; kh < hkv; kh++)
        for (int64_t h0 = kh * group; h0 < (kh + 1) * group; h0 += HEAD_TILE) {
            const int64_t nh = (kh + 1) * group - h0 < HEAD_TILE ? (kh + 1) * group - h0 : HEAD_TILE;
            int64_t c0 = 0;
            for (; c0 + COL_VECS * HALF_VW <= d; c0 += COL_VECS * HALF_VW) WEIGH_HEADS(COL_VECS)
            for (; c0 + HALF_VW <= d; c0 += HALF_VW) WEIGH_HEADS(1)
            if (c0 < d)
                for (int64_t h = h0; h < h0 + nh; h++)
                    weigh_value_tail(v, table, lo, hi, bs, row, kh * d + c0, d - c0, scores + h * n, inv_sum[h],
                                     ob + h * d + c0, bf16);
        }
}

/* The dtype is a literal in each entry's body, so every inner loop is compiled for it (a
 * parameter would reach OpenMP's outlined loop as a run-time value). A work item is a request, or, where the
 * batch is smaller than the team (one stream), a request's KV head and the query heads that share it: each head's
 * scores, softmax and weighed values are its own, so the bits are the same either way, and one stream's attention
 * is not one thread's while the others wait. */
#define ATTEND_HALF(D, BF)                                                                                      \
    attend_request_half(qb + kh0 * group * d, k + kh0 * d, v + kh0 * d, table, lo, hi, ob + kh0 * group * d,  \
                        scores, qf, heads * group, heads, group, D, row, bs, scale,                            \
                        sinks ? sinks + kh0 * group : NULL, BF)
#define DEFINE_DECODE(name, BF16)                                                                             \
    void name(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int32_t *tables,                 \
              int64_t table_stride, const int64_t *first, const int64_t *last, uint16_t *out, int64_t batch,  \
              int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale, const float *sinks) {               \
        const int64_t group = hq / hkv, row = hkv * d;                                                        \
        const int64_t split = batch < omp_threads() ? hkv : 1, heads = hkv / split, items = batch * split;    \
        _Pragma("omp parallel if (items > 1)") {                                                               \
            float *scores = NULL, *qf = malloc(sizeof(float) * hq * d);                                        \
            int64_t capacity = 0;                                                                              \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < items; item++) {            \
                const int64_t b = item / split, kh0 = item % split * heads;                                   \
                const int64_t lo = first[b], hi = last[b] + 1;                                                 \
                if (capacity < hq * (hi - lo)) {                                                               \
                    free(scores);                                                                              \
                    capacity = hq * (hi - lo);                                                                 \
                    scores = (float *)malloc(sizeof(float) * capacity);                                        \
                }                                                                                              \
                const uint16_t *qb = q + b * hq * d;                                                           \
                const int32_t *table = tables + b * table_stride;                                              \
                uint16_t *ob = out + b * hq * d;                                                               \
                switch (d) {                                                                                   \
                case 64: ATTEND_HALF(64, BF16); break;                                                              \
                case 128: ATTEND_HALF(128, BF16); break;                                                            \
                default: ATTEND_HALF(d, BF16);                                                                    \
                }                                                                                              \
            }                                                                                                  \
            free(scores);                                                                                      \
            free(qf);                                                                                          \
        }                                                                                                      \
    }

DEFINE_DECODE(paged_decode_attention_bf16, 1)
DEFINE_DECODE(paged_decode_attention_f16, 0)

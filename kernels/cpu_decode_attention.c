/* Paged decode attention on CPU: one query token per request, read straight from the block
 * cache (no gathered copy), float32 arithmetic.
 *
 * Built at run time by kernels/cpu_native.py with the machine's own compiler and loaded
 * through ctypes; torch's OpenMP runtime (libgomp.so.1, already loaded by torch) runs the
 * parallel loop, so it uses the worker's torch threads.
 *
 * Contract (kernels.reference.paged_attention, restricted to one query per request):
 *   q        [B, Hq, D]            the queries
 *   k, v     [N, bs, Hkv, D]       the cache of one layer
 *   tables   [B, table_stride]     int32 block ids
 *   first    [B] int64             first visible position (sliding window; 0 otherwise)
 *   last     [B] int64             the query's position (seq_len - 1), always visible
 *   sinks    [Hq] or NULL          a logit per query head in every softmax, weighing no value (gpt-oss)
 *   out      [B, Hq, D]
 * Query head h reads KV head h / (Hq / Hkv), as HF's repeat_kv pairs them.
 * Only visible slots are read, so stale data elsewhere in a block is never touched.
 */
#include <math.h>
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#include "cpu_softmax_exp.h"

#define LANES 16

static inline float dot(const float *a, const float *b, int64_t d) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    if (d % LANES)
        for (; i < d; i++) acc[i % LANES] += a[i] * b[i];
    /* a tree of lane-wise adds, which vectorizes, rather than a serial chain */
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

#if defined(__AVX2__) && defined(__FMA__)
/* Eight keys' scores at once: each key's products are summed lane-wise in a register, and the
 * eight registers are then reduced together (sum_eight_keys, cpu_softmax_exp.h). */
#define SCORE_KEYS 8
static inline void scores8(const float *q, const float *k0, int64_t row, int64_t d, float scale, float *out) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + j * row + i), a[j]);
    }
    sum_eight_keys(a, scale, out);
}
#else
#define SCORE_KEYS 0
#endif

#if defined(__AVX512F__)
/* The values' pass with each output row held in registers over all of a request's slots: up
 * to 4 query heads of one KV head (16 zmm for d = 64) per pass, instead of a load and a store
 * of every output row for every slot. Per output element the operations and their order are
 * the plain loop's (o = fma(p, v, o) from 0, slot by slot): the same bits as that loop built
 * for this CPU (checked when it landed, bench/log/2026-11-26.md "CPU: issue 31's served fp32 Llama"). */
#define VALUES_IN_REGISTERS 1
#define VHEADS 4
static inline __attribute__((always_inline)) void values_in_registers(
    const float *scores, const float *v, const int32_t *table, int64_t lo, int64_t hi, float *ob, int64_t hkv,
    int64_t group, const int64_t d, int64_t row, int64_t bs) {
    const int64_t n = hi - lo, vecs = d / 16, heads = d <= 64 ? VHEADS : 2;
    for (int64_t kh = 0; kh < hkv; kh++)
        for (int64_t g0 = 0; g0 < group; g0 += heads) {
            const int64_t gn = group - g0 < heads ? group - g0 : heads, h0 = kh * group + g0;
            __m512 acc[VHEADS][4];
            for (int g = 0; g < VHEADS; g++)
                for (int j = 0; j < 4; j++) acc[g][j] = _mm512_setzero_ps();
            /* d = 128 takes 2 heads of 8 vectors: its accumulators are the same 16 registers */
            __m512 *wide = &acc[0][0];
            for (int64_t pos = lo; pos < hi;) {
                const int64_t end = (pos / bs + 1) * bs < hi ? (pos / bs + 1) * bs : hi;
                const float *vh = v + ((int64_t)table[pos / bs] * bs + pos % bs) * row + kh * d;
                for (; pos < end; pos++, vh += row) {
                    const float *p = scores + h0 * n + pos - lo;
                    if (d <= 64) {
                        __m512 vv[4];
                        for (int j = 0; j < 4; j++)
                            if (j < vecs) vv[j] = _mm512_loadu_ps(vh + 16 * j);
                        for (int g = 0; g < VHEADS; g++)
                            if (g < gn) {
                                const __m512 pg = _mm512_set1_ps(p[g * n]);
                                for (int j = 0; j < 4; j++)
                                    if (j < vecs) acc[g][j] = _mm512_fmadd_ps(pg, vv[j], acc[g][j]);
                            }
                    } else {
                        for (int g = 0; g < 2; g++)
                            if (g < gn) {
                                const __m512 pg = _mm512_set1_ps(p[g * n]);
                                for (int j = 0; j < 8; j++)
                                    if (j < vecs) wide[g * 8 + j] = _mm512_fmadd_ps(pg, _mm512_loadu_ps(vh + 16 * j),
                                                                                     wide[g * 8 + j]);
                            }
                    }
                }
            }
            for (int64_t g = 0; g < gn; g++)
                for (int64_t j = 0; j < vecs; j++)
                    _mm512_storeu_ps(ob + (h0 + g) * d + 16 * j, d <= 64 ? acc[g][j] : wide[g * 8 + j]);
        }
}
#else
#define VALUES_IN_REGISTERS 0
#endif

#if SCORE_KEYS && !VALUES_IN_REGISTERS
/* The values' pass on AVX2: each slot's value row of a KV head is loaded once per 64 floats and
 * added into every query head of its group, with the operations and order of the plain loop
 * (o = fma(p, v, o), slot by slot), so the same bits; the plain loop ran 1.2x longer on a warm
 * layer (bench/log/2026-11-27.md "CPU: the served small-llama side by side again"). Keeping a
 * head's output in registers instead re-reads the values once per head (tried, slower). */
#define VALUES_BY_KV_HEAD 1
static inline __attribute__((always_inline)) void values_by_kv_head(
    const float *scores, const float *v, const int32_t *table, int64_t lo, int64_t hi, float *ob, int64_t hq,
    int64_t hkv, int64_t group, const int64_t d, int64_t row, int64_t bs) {
    const int64_t n = hi - lo;
    memset(ob, 0, sizeof(float) * hq * d);
    for (int64_t pos = lo; pos < hi;) {
        const int64_t end = (pos / bs + 1) * bs < hi ? (pos / bs + 1) * bs : hi;
        const float *vr = v + ((int64_t)table[pos / bs] * bs + pos % bs) * row;
        for (; pos < end; pos++, vr += row)
            for (int64_t kh = 0; kh < hkv; kh++)
                for (int64_t c = 0; c < d; c += 64) {
                    const int64_t vecs = d - c < 64 ? (d - c) / 8 : 8;
                    __m256 vv[8];
                    for (int j = 0; j < 8; j++)
                        if (j < vecs) vv[j] = _mm256_loadu_ps(vr + kh * d + c + 8 * j);
                    for (int64_t g = 0, h = kh * group; g < group; g++, h++) {
                        const __m256 p = _mm256_broadcast_ss(scores + h * n + pos - lo);
                        float *o = ob + h * d + c;
                        for (int j = 0; j < 8; j++)
                            if (j < vecs) _mm256_storeu_ps(o + 8 * j, _mm256_fmadd_ps(p, vv[j], _mm256_loadu_ps(o + 8 * j)));
                    }
                }
    }
}
#else
#define VALUES_BY_KV_HEAD 0
#endif

/* One request: its slots are read row by row (all KV heads of a slot are adjacent), once
 * for the scores and once for the values. Inlined into each case of the switch below, so
 * the common head sizes get loops of a known length (unrolled, kept in registers). */
static inline __attribute__((always_inline)) void attend_request(
    const float *qb, const float *k, const float *v, const int32_t *table, int64_t lo, int64_t hi, float *ob,
    float *scores, int64_t hq, int64_t hkv, int64_t group, const int64_t d, int64_t row, int64_t bs, float scale,
    const float *sinks) {
    const int64_t n = hi - lo;
    for (int64_t pos = lo; pos < hi;) {
        const int64_t end = (pos / bs + 1) * bs < hi ? (pos / bs + 1) * bs : hi;
        const float *kr = k + ((int64_t)table[pos / bs] * bs + pos % bs) * row;
        prefetch_next_block(k, v, table, pos, hi, bs, row, sizeof(float));
#if SCORE_KEYS
        if (d % 8 == 0)
            for (; pos + SCORE_KEYS <= end; pos += SCORE_KEYS, kr += SCORE_KEYS * row)
                for (int64_t kh = 0, h = 0; kh < hkv; kh++)
                    for (int64_t g = 0; g < group; g++, h++)
                        scores8(qb + h * d, kr + kh * d, row, d, scale, scores + h * n + pos - lo);
#endif
        for (; pos < end; pos++, kr += row)
            for (int64_t kh = 0, h = 0; kh < hkv; kh++)
                for (int64_t g = 0; g < group; g++, h++)
                    scores[h * n + pos - lo] = dot(qb + h * d, kr + kh * d, d) * scale;
    }
    float inv_sum[hq];
    for (int64_t h = 0; h < hq; h++) inv_sum[h] = decode_softmax(scores + h * n, n, sinks ? sinks[h] : -INFINITY);
#if VALUES_IN_REGISTERS
    if (d % 16 == 0 && d <= 128)
        values_in_registers(scores, v, table, lo, hi, ob, hkv, group, d, row, bs);
    else
#endif
#if VALUES_BY_KV_HEAD
    if (d % 8 == 0)
        values_by_kv_head(scores, v, table, lo, hi, ob, hq, hkv, group, d, row, bs);
    else
#endif
    {
        memset(ob, 0, sizeof(float) * hq * d);
        for (int64_t pos = lo; pos < hi;) {
            const int64_t end = (pos / bs + 1) * bs < hi ? (pos / bs + 1) * bs : hi;
            const float *vr = v + ((int64_t)table[pos / bs] * bs + pos % bs) * row;
            for (; pos < end; pos++, vr += row)
                for (int64_t kh = 0, h = 0; kh < hkv; kh++)
                    for (int64_t g = 0; g < group; g++, h++) {
                        const float p = scores[h * n + pos - lo], *vh = vr + kh * d;
                        float *o = ob + h * d;
                        for (int64_t i = 0; i < d; i++) o[i] += p * vh[i];
                    }
        }
    }
    for (int64_t h = 0; h < hq; h++)
        for (int64_t i = 0; i < d; i++) ob[h * d + i] *= inv_sum[h];
}

/* A work item is a request, or, where the batch is smaller than the team (one stream), a request's KV head and the
 * query heads that share it: each head's scores, softmax and values are its own, so the bits are the same either
 * way (cpu_decode_attention_half.c does the same). */
#define ATTEND_F32(D)                                                                                         \
    attend_request(qb + kh0 * group * d, k + kh0 * d, v + kh0 * d, table, lo, hi, ob + kh0 * group * d, scores, \
                   heads * group, heads, group, D, row, bs, scale, sinks ? sinks + kh0 * group : NULL)

void paged_decode_attention_f32(const float *q, const float *k, const float *v, const int32_t *tables,
                                int64_t table_stride, const int64_t *first, const int64_t *last, float *out,
                                int64_t batch, int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale,
                                const float *sinks) {
    const int64_t group = hq / hkv;
    const int64_t row = hkv * d; /* floats per cache slot */
    const int64_t split = batch < omp_threads() ? hkv : 1, heads = hkv / split, items = batch * split;
#pragma omp parallel if (items > 1)
    {
        float *scores = NULL;
        int64_t capacity = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            const int64_t b = item / split, kh0 = item % split * heads;
            const int64_t lo = first[b], hi = last[b] + 1;
            if (capacity < hq * (hi - lo)) {
                free(scores);
                capacity = hq * (hi - lo);
                scores = (float *)malloc(sizeof(float) * capacity);
            }
            const float *qb = q + b * hq * d;
            const int32_t *table = tables + b * table_stride;
            float *ob = out + b * hq * d;
            switch (d) {
            case 32: ATTEND_F32(32); break;
            case 64: ATTEND_F32(64); break;
            case 128: ATTEND_F32(128); break;
            default: ATTEND_F32(d);
            }
        }
        free(scores);
    }
}

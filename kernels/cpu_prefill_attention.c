/* Causal attention of prefill chunks, float32, on CPU.
 *
 * torch's SDPA spends most of a small-head call on per-block overhead: at head_dim 32 and a
 * 160-token chunk it reaches ~45 GFLOP/s against ~190 for the model's matmuls. Here a block of
 * QB queries scores KT keys at a time from a transposed copy of K (QB x KT accumulators that
 * stay in registers, each key row loaded once per block), softmaxes each row exactly (max, exp,
 * sum; no online rescaling, the whole row fits in cache), then sums V weighted, DB columns of
 * all QB queries at a time (each V row loaded once per block).
 *
 * Built at run time by kernels/cpu_native.py, as cpu_decode_attention.c is.
 *
 * Contract (kernels.reference.paged_attention, keys given as rows rather than cache slots):
 *   q          rows of [Hq * D] floats, row stride q_stride (floats), heads contiguous in a row
 *   k, v       rows of [Hkv * D] floats, row strides k_stride, v_stride
 *   qfirst, kfirst, ctx, len  [C] int64: chunk c's queries are rows qfirst[c]..+len[c]-1, its
 *              keys rows kfirst[c]..+ctx[c]+len[c]-1 (ctx[c] cached tokens, then its own), and
 *              its query i sees keys 0..ctx[c]+i
 *   sinks      [Hq] or NULL: a logit per query head in every row's softmax, weighing no value (gpt-oss)
 *   out        rows of [Hq * D] floats, row stride out_stride; only the chunks' rows are written
 * D must be a multiple of DB and at most MAX_D (cpu_native.supports_prefill checks).
 * Query head h reads KV head h / (Hq / Hkv), as HF's repeat_kv pairs them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_softmax_exp.h"

/* Register tiles, in vectors of VW floats: QB queries x KT keys of scores, then QB queries x DB
 * output columns. A tile's accumulators, one row of keys (or values) and a broadcast must fit
 * in the vector registers, 32 of 512 bits with AVX-512 but 16 of 256 bits with AVX2, where
 * AVX-512's tile would spill (1.15x slower on a Zen 1 EPYC, bench/log/2026-11-26.md); AVX2's 6 x 16
 * (12 accumulators, 15 registers) ran the 0.5B's 1024-token step 1.2-1.5x as fast as 4 x 16
 * (bench/log/2026-11-28.md "CPU: huge pages and a fused SiLU gate"). The sums run in the same order whatever the
 * tile, so every tile gives the same bits. */
#if defined(__AVX512F__)
#define VW 16
#define QB 8
#define KT 32
#define DB 32
#elif defined(__AVX__)
#define VW 8
#define QB 6
#define KT 16
#define DB 16
#else
#define VW 4
#define QB 4
#define KT 8
#define DB 8
#endif
#define LANES 16
#define MAX_D 256

typedef float vec __attribute__((vector_size(VW * sizeof(float))));
typedef float vec_unaligned __attribute__((vector_size(VW * sizeof(float)), aligned(sizeof(float))));

static inline vec load_vec(const float *p) { return *(const vec_unaligned *)p; }
static inline void store_vec(float *p, vec x) { *(vec_unaligned *)p = x; }
static inline vec broadcast(float x) { return (vec){0} + x; }

/* Row i of scores (n visible keys, kend in the block) becomes its unnormalized softmax;
 * returns 1 / its sum. Lane-wise max and sum, so the loops vectorize without -ffast-math. The
 * head's ``sink`` joins the max and the sum (-INFINITY: none, and no bit changes). */
static float softmax_row(float *s, int64_t n, int64_t kend, float sink) {
    float mx[LANES], sum[LANES];
    for (int l = 0; l < LANES; l++) { mx[l] = -INFINITY; sum[l] = 0.0f; }
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) mx[l] = s[j + l] > mx[l] ? s[j + l] : mx[l];
    for (; j < n; j++) mx[0] = s[j] > mx[0] ? s[j] : mx[0];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) mx[l] = mx[l + w] > mx[l] ? mx[l + w] : mx[l];
    const float m = sink > mx[0] ? sink : mx[0];
    for (j = 0; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) { s[j + l] = softmax_exp(s[j + l] - m); sum[l] += s[j + l]; }
    for (; j < n; j++) { s[j] = softmax_exp(s[j] - m); sum[0] += s[j]; }
    for (; j < kend; j++) s[j] = 0.0f;  /* keys after this query: weight 0 in the block's sum */
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) sum[l] += sum[l + w];
    return 1.0f / (sum[0] + softmax_exp(sink - m));
}

/* One query head, queries q0..q0+nq-1 (nq <= QB) of a chunk after ctx cached keys. kt: [D][lpad]
 * transposed keys of its KV head; scores: [QB][lpad] scratch. */
static void attend_block(const float *q, int64_t q_stride, const float *kt, int64_t lpad,
                         const float *v, int64_t v_stride, float *out, int64_t out_stride,
                         int64_t ctx, int64_t q0, int64_t nq, int64_t d, float scale, float sink, float *scores) {
    const int64_t kend = ctx + q0 + nq;  /* keys the block's last query sees */
    float qs[QB][MAX_D];
    for (int64_t i = 0; i < QB; i++)
        for (int64_t c = 0; c < d; c++) qs[i][c] = i < nq ? q[(q0 + i) * q_stride + c] * scale : 0.0f;
    for (int64_t j0 = 0; j0 < kend; j0 += KT) {
        vec acc[QB][KT / VW] = {{0}};
        for (int64_t c = 0; c < d; c++) {
            vec krow[KT / VW];
            for (int t = 0; t < KT / VW; t++) krow[t] = load_vec(kt + c * lpad + j0 + t * VW);
            for (int i = 0; i < QB; i++) {
                const vec qv = broadcast(qs[i][c]);
                for (int t = 0; t < KT / VW; t++) acc[i][t] += qv * krow[t];
            }
        }
        for (int i = 0; i < QB; i++)
            for (int t = 0; t < KT / VW; t++) store_vec(scores + i * lpad + j0 + t * VW, acc[i][t]);
    }
    float inv[QB];
    for (int64_t i = 0; i < nq; i++) inv[i] = softmax_row(scores + i * lpad, ctx + q0 + i + 1, kend, sink);
    for (int64_t i = nq; i < QB; i++) memset(scores + i * lpad, 0, (size_t)kend * sizeof(float));
    for (int64_t c0 = 0; c0 < d; c0 += DB) {
        vec o[QB][DB / VW] = {{0}};
        for (int64_t j = 0; j < kend; j++) {
            vec vrow[DB / VW];
            for (int t = 0; t < DB / VW; t++) vrow[t] = load_vec(v + j * v_stride + c0 + t * VW);
            for (int i = 0; i < QB; i++) {
                const vec p = broadcast(scores[i * lpad + j]);
                for (int t = 0; t < DB / VW; t++) o[i][t] += p * vrow[t];
            }
        }
        for (int64_t i = 0; i < nq; i++)
            for (int t = 0; t < DB / VW; t++)
                store_vec(out + (q0 + i) * out_stride + c0 + t * VW, o[i][t] * broadcast(inv[i]));
    }
}

/* Returns 0; -2 when a chunk's rows fall outside q (q_rows) or k and v (k_rows), before anything
 * is read; -1 when scratch memory could not be had (nothing written then for that chunk). */
int prefill_attention_f32(const float *q, int64_t q_stride, int64_t q_rows, const float *k, int64_t k_stride,
                          const float *v, int64_t v_stride, int64_t k_rows, const int64_t *qfirst,
                          const int64_t *kfirst, const int64_t *ctx, const int64_t *len, int64_t num_chunks,
                          float *out, int64_t out_stride, int64_t hq, int64_t hkv, int64_t d, float scale,
                          const float *sinks) {
    const int64_t group = hq / hkv;
    int failed = 0;
    for (int64_t c = 0; c < num_chunks; c++)
        if (qfirst[c] < 0 || kfirst[c] < 0 || ctx[c] < 0 || len[c] < 1 || qfirst[c] + len[c] > q_rows
            || kfirst[c] + ctx[c] + len[c] > k_rows)
            return -2;
    for (int64_t c = 0; c < num_chunks; c++) {
        const int64_t row0 = qfirst[c], key0 = kfirst[c], before = ctx[c], n = len[c];
        const int64_t keys = before + n, lpad = (keys + KT - 1) / KT * KT;
        float *kt = malloc((size_t)(hkv * d * lpad) * sizeof(float));
        if (kt == NULL) { failed = 1; continue; }
        for (int64_t h = 0; h < hkv; h++)
            for (int64_t col = 0; col < d; col++) {
                float *row = kt + (h * d + col) * lpad;
                for (int64_t j = 0; j < keys; j++) row[j] = k[(key0 + j) * k_stride + h * d + col];
                for (int64_t j = keys; j < lpad; j++) row[j] = 0.0f;
            }
        const int64_t num_blocks = (n + QB - 1) / QB;
        #pragma omp parallel
        {
            float *scores = malloc((size_t)(QB * lpad) * sizeof(float));
            if (scores == NULL) {
                #pragma omp atomic write
                failed = 1;
            }
            #pragma omp for collapse(2) schedule(dynamic)
            for (int64_t h = 0; h < hq; h++)
                for (int64_t b = 0; b < num_blocks; b++) {
                    if (scores == NULL) continue;
                    const int64_t q0 = b * QB, kh = h / group;
                    attend_block(q + row0 * q_stride + h * d, q_stride, kt + kh * d * lpad, lpad,
                                 v + key0 * v_stride + kh * d, v_stride, out + row0 * out_stride + h * d,
                                 out_stride, before, q0, n - q0 < QB ? n - q0 : QB, d, scale,
                                 sinks ? sinks[h] : -INFINITY, scores);
                }
            free(scores);
        }
        free(kt);
    }
    return failed ? -1 : 0;
}

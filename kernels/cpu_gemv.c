/* Decode-step products of a few rows: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), M = 1..8, from the
 * weight as it is loaded, row-major [N, K] with each row's K contiguous.
 *
 * One stream's decode step is bound by reading the weights: every weight byte is used M times, a
 * few multiply-adds per byte where this CPU does tens per byte it reads from memory. So the kernel
 * only has to keep the memory busy: each thread takes a contiguous range of rows (OpenMP splits the
 * row blocks statically, so both cores stream), walks R rows of W at once along K, 64 bytes of each
 * row a step (one cache line), multiplies them by the M rows of x (which stay in L1) into R x M
 * vector accumulators, prefetches the rows a few blocks ahead, and reduces each accumulator to its
 * sum at the end of the block. R is as large as the registers allow at that M (R x M accumulators,
 * R weight vectors, one x vector).
 *
 * Instructions, picked at compile time (the library is built with -march=native, cpu_native.py):
 *   bfloat16 with AVX512-BF16: vdpbf16ps, pairs of bfloat16 products summed into float32 lanes
 *            (products exact, sums float32; the instruction rounds to nearest even and flushes
 *            subnormals, whatever MXCSR says);
 *   otherwise (float32, float16, and bfloat16 without AVX512-BF16): the weights and x widened to
 *            float32 exactly (cpu_half.h: 16 lanes on AVX-512, 8 on AVX2 + FMA + F16C, GCC's
 *            generic vectors elsewhere) and float32 multiply-adds.
 * The result is rounded once to the rows' dtype (or kept in float32: lm_head's logits), the bias
 * (in the weight's dtype) added in float32 first, as oneDNN does. Sums run in another order than
 * oneDNN's, so results may differ from F.linear in the last bits (tests/unit/test_cpu_gemv.py).
 * cpu_kernel_variant() (cpu_decode_attention_half.c) names the instructions for the worker's log.
 *
 * gemv_panels_bf16 (at the end) is the bfloat16 kernel the worker takes by default at 1-4 rows: the weight
 * packed at load so that each thread reads one sequential stream and each vdpbf16ps yields 16 outputs.
 * On one core of this Zen 5 it read the 0.5B's step at ~90% of the core's read bandwidth, where the
 * row-major walk above (R interleaved row streams, a horizontal sum per output) read it at ~75%
 * (bench/RESULTS.md, "CPU: one stream at the memory's speed").
 */
#include <stdint.h>

#include "cpu_half.h"

#define GEMV_MAX_ROWS 8
#define PARALLEL_MIN_MACS (1 << 17)
/* The rows this many rows ahead are prefetched while a block runs (one line per row a step). */
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 32
#endif

#if defined(__AVX512F__)
#define VREGS 32
#else
#define VREGS 16
#endif

/* Weight rows per block at M rows of x: R * M accumulators + R weight vectors + one x vector fit the
 * vector registers (32 on AVX-512, 16 on AVX2), and R is at least 1. */
#if VREGS == 32
#define ROWS_PER_BLOCK(M) ((M) == 1 ? 8 : (M) == 2 ? 6 : (M) <= 5 ? 4 : 3)
#else
#define ROWS_PER_BLOCK(M) ((M) == 1 ? 6 : (M) == 2 ? 4 : (M) == 3 ? 3 : (M) <= 6 ? 2 : 1)
#endif

static inline void prefetch(const void *p) { __builtin_prefetch(p, 0, 3); }

static inline float finish(float sum, const uint16_t *bias_half, const float *bias_f32, int64_t j, int bf16) {
    if (bias_f32) return sum + bias_f32[j];
    if (bias_half) return sum + half_to_f32(bias_half[j], bf16);
    return sum;
}

/* out element (i, j): float32, or the rows' half dtype rounded to nearest even. */
static inline void put(void *out, int64_t ldo, int64_t i, int64_t j, float v, int out_kind) {
    if (out_kind == 0)
        ((float *)out)[i * ldo + j] = v;
    else
        ((uint16_t *)out)[i * ldo + j] = f32_to_half(v, out_kind == 1);
}

/* ---- bfloat16 with AVX512-BF16 ---------------------------------------------------------------------- */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define GEMV_BF16_DPBF16 1
/* sums[r * M + i] = x[i, :k] . w[r, :k] for R rows of w. */
static inline __attribute__((always_inline)) void block_dpbf16(const uint16_t *restrict x, const int64_t ldx,
                                                               const uint16_t *restrict w, const int64_t ldw,
                                                               const int64_t k, const int M, const int R,
                                                               const int kind, float *restrict sums) {
    (void)kind;
    __m512 acc[8][8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) acc[r][i] = _mm512_setzero_ps();
    const uint16_t *ahead = w + (int64_t)PREFETCH_ROWS * ldw;
    int64_t kk = 0;
    for (; kk + 32 <= k; kk += 32) {
        __m512bh wv[8];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            wv[r] = (__m512bh)_mm512_loadu_si512(w + r * ldw + kk);
            prefetch(ahead + r * ldw + kk);
        }
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * ldx + kk);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], xv, wv[r]);
        }
    }
    if (kk < k) {  /* the last k % 32: masked loads, zeros past k */
        const __mmask32 mask = (__mmask32)((1ull << (k - kk)) - 1);
        __m512bh wv[8];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * ldw + kk);
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * ldx + kk);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], xv, wv[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) sums[r * M + i] = _mm512_reduce_add_ps(acc[r][i]);
}
#endif

/* ---- widened to float32 (every dtype, every ISA) -------------------------------------------------------- */
/* X and W: 0 float32, 1 bfloat16, 2 float16. */
static inline __attribute__((always_inline)) hvec load_kind(const void *p, int64_t at, const int kind) {
    if (kind == 0) return load_f32((const float *)p + at);
    return kind == 1 ? load_bf16((const uint16_t *)p + at) : load_f16((const uint16_t *)p + at);
}

static inline __attribute__((always_inline)) float scalar_kind(const void *p, int64_t at, const int kind) {
    if (kind == 0) return ((const float *)p)[at];
    return half_to_f32(((const uint16_t *)p)[at], kind == 1);
}

static inline __attribute__((always_inline)) void block_widened(const void *restrict x, const int64_t ldx,
                                                                const void *restrict w, const int64_t ldw,
                                                                const int64_t k, const int M, const int R,
                                                                const int kind, float *restrict sums) {
    const int size = kind == 0 ? 4 : 2;
    const char *wb = (const char *)w;
    hvec acc[8][8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) acc[r][i] = hbroadcast(0.0f);
    const char *ahead = wb + (int64_t)PREFETCH_ROWS * ldw * size;
    int64_t kk = 0;
    for (; kk + HALF_VW <= k; kk += HALF_VW) {
        hvec wv[8];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            wv[r] = load_kind(w, r * ldw + kk, kind);
            prefetch(ahead + (r * ldw + kk) * size);
        }
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            const hvec xv = load_kind(x, i * ldx + kk, kind);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) acc[r][i] += xv * wv[r];
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            float s = hsum(acc[r][i]);
            for (int64_t t = kk; t < k; t++) s += scalar_kind(x, i * ldx + t, kind) * scalar_kind(w, r * ldw + t, kind);
            sums[r * M + i] = s;
        }
}

/* Rows [n0, n1) of out, R at a time, the last n % R one at a time. */
#define DEFINE_RANGE(NAME, BLOCK, KIND, SIZE)                                                                     \
    static inline __attribute__((always_inline)) void NAME(const void *x, int64_t ldx, int64_t k, const void *w,  \
                                                           int64_t ldw, int64_t n0, int64_t n1, const void *bias, \
                                                           int bias_f32, void *out, int64_t ldo, int out_kind,     \
                                                           int bf16, const int M, const int R) {                  \
        const uint16_t *bias_half = bias_f32 ? NULL : (const uint16_t *)bias;                                     \
        const float *bias_float = bias_f32 ? (const float *)bias : NULL;                                          \
        float sums[8 * 8];                                                                                        \
        int64_t j = n0;                                                                                           \
        for (; j + R <= n1; j += R) {                                                                             \
            BLOCK(x, ldx, (const void *)((const char *)w + j * ldw * (SIZE)), ldw, k, M, R, KIND, sums);          \
            for (int r = 0; r < R; r++)                                                                           \
                for (int i = 0; i < M; i++)                                                                       \
                    put(out, ldo, i, j + r, finish(sums[r * M + i], bias_half, bias_float, j + r, bf16), out_kind); \
        }                                                                                                         \
        for (; j < n1; j++) {                                                                                     \
            BLOCK(x, ldx, (const void *)((const char *)w + j * ldw * (SIZE)), ldw, k, M, 1, KIND, sums);          \
            for (int i = 0; i < M; i++)                                                                           \
                put(out, ldo, i, j, finish(sums[i], bias_half, bias_float, j, bf16), out_kind);                   \
        }                                                                                                         \
    }

DEFINE_RANGE(range_f32, block_widened, 0, 4)
DEFINE_RANGE(range_f16, block_widened, 2, 2)
#if defined(GEMV_BF16_DPBF16)
DEFINE_RANGE(range_bf16, block_dpbf16, 1, 2)
#else
DEFINE_RANGE(range_bf16, block_widened, 1, 2)
#endif

/* The threads split the row blocks (contiguous ranges, so each streams its part of W once). */
#define DEFINE_GEMV_M(S, M)                                                                                        \
    static void gemv_##S##_##M(const void *x, int64_t ldx, int64_t k, const void *w, int64_t ldw, int64_t n,        \
                               const void *bias, int bias_f32, void *out, int64_t ldo, int out_kind) {              \
        const int R = ROWS_PER_BLOCK(M);                                                                           \
        const int64_t blocks = (n + R - 1) / R, macs = (M) * n * k;                                                \
        _Pragma("omp parallel for schedule(static) if (macs >= PARALLEL_MIN_MACS)")                                \
        for (int64_t b = 0; b < blocks; b++) {                                                                     \
            const int64_t n0 = b * R, n1 = n0 + R < n ? n0 + R : n;                                                \
            range_##S(x, ldx, k, w, ldw, n0, n1, bias, bias_f32, out, ldo, out_kind, BF16_##S, M, R);              \
        }                                                                                                          \
    }
#define BF16_f32 0
#define BF16_bf16 1
#define BF16_f16 0
#define FLOAT_f32 1
#define FLOAT_bf16 0
#define FLOAT_f16 0

#define DEFINE_GEMV(S)                                                                                             \
    DEFINE_GEMV_M(S, 1) DEFINE_GEMV_M(S, 2) DEFINE_GEMV_M(S, 3) DEFINE_GEMV_M(S, 4)                                \
    DEFINE_GEMV_M(S, 5) DEFINE_GEMV_M(S, 6) DEFINE_GEMV_M(S, 7) DEFINE_GEMV_M(S, 8)                                \
    int gemv_##S(const void *x, int64_t ldx, int64_t m, int64_t k, const void *w, int64_t ldw, int64_t n,          \
                 const void *bias, int bias_f32, void *out, int64_t ldo, int out_kind) {                           \
        static void (*const by_rows[GEMV_MAX_ROWS + 1])(const void *, int64_t, int64_t, const void *, int64_t,     \
                                                        int64_t, const void *, int, void *, int64_t, int) = {      \
            NULL, gemv_##S##_1, gemv_##S##_2, gemv_##S##_3, gemv_##S##_4,                                          \
            gemv_##S##_5, gemv_##S##_6, gemv_##S##_7, gemv_##S##_8};                                               \
        if (m < 1 || m > GEMV_MAX_ROWS) return -1;                                                                 \
        by_rows[m](x, ldx, k, w, ldw, n, bias, bias_f32 || FLOAT_##S, out, ldo, out_kind);                                      \
        return 0;                                                                                                  \
    }

/* x [m, k] (row stride ldx) and w [n, k] (row stride ldw) of dtype S (float32, bfloat16, float16), bias [n]
 * of S (bias_f32 = 0) or float32 (= 1; always, for S float32) or NULL; out [m, n] (row stride ldo) float32 (out_kind 0), bfloat16
 * (1) or float16 (2). Returns -1 (nothing written) unless 1 <= m <= 8. */
DEFINE_GEMV(f32)
DEFINE_GEMV(bf16)
DEFINE_GEMV(f16)

/* ---- bfloat16 panels for vdpbf16ps: the weight packed once at load as [ceil(N/16)][ceil(K/2)][16][2] -------
 * (a panel's 16 rows, each k pair of a row adjacent), zero past N and K: one 64-byte line is the next k pair
 * of 16 outputs, so a thread reads its panels as one sequential stream, and each x pair is a 32-bit
 * broadcast; each accumulator holds 16 outputs, no horizontal sums. U sets of accumulators take every U-th
 * k pair, so the dot products' latency never bounds a row. Returns -1 without AVX512-BF16 (never chosen). */
#if defined(GEMV_BF16_DPBF16)
#define PANEL_UNROLL(M) ((M) <= 3 ? 4 : (M) <= 6 ? 3 : 2)
static inline __attribute__((always_inline)) void panel_dpbf16(const uint16_t *restrict x, const int64_t ldx,
                                                               const uint16_t *restrict panel, const int64_t kp,
                                                               const int M, const int U, __m512 *restrict sums) {
    __m512 acc[4][8];
#pragma GCC unroll 4
    for (int u = 0; u < U; u++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) acc[u][i] = _mm512_setzero_ps();
    int64_t p = 0;
    for (; p + U <= kp; p += U) {
        prefetch(panel + (p + PREFETCH_ROWS) * 32);
#pragma GCC unroll 4
        for (int u = 0; u < U; u++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(panel + (p + u) * 32);
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) {
                uint32_t pair;
                memcpy(&pair, x + i * ldx + 2 * (p + u), sizeof pair);
                acc[u][i] = _mm512_dpbf16_ps(acc[u][i], (__m512bh)_mm512_set1_epi32((int)pair), wv);
            }
        }
    }
    for (; p < kp; p++) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(panel + p * 32);
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            uint32_t pair;
            memcpy(&pair, x + i * ldx + 2 * p, sizeof pair);
            acc[0][i] = _mm512_dpbf16_ps(acc[0][i], (__m512bh)_mm512_set1_epi32((int)pair), wv);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; i++) {
        __m512 s = acc[0][i];
#pragma GCC unroll 4
        for (int u = 1; u < U; u++) s = _mm512_add_ps(s, acc[u][i]);
        sums[i] = s;
    }
}

#define DEFINE_PANELS_M(M)                                                                                         \
    static void gemv_panels_bf16_##M(const uint16_t *x, int64_t ldx, int64_t k, const uint16_t *packed, int64_t n, \
                                     const uint16_t *bias, void *out, int64_t ldo, int out_kind) {                  \
        const int64_t panels = (n + 15) / 16, kp = (k + 1) / 2, macs = (M) * n * k;                                \
        _Pragma("omp parallel for schedule(static) if (macs >= PARALLEL_MIN_MACS)")                                \
        for (int64_t b = 0; b < panels; b++) {                                                                     \
            __m512 sums[8];                                                                                        \
            float lanes[16];                                                                                       \
            panel_dpbf16(x, ldx, packed + b * kp * 32, kp, M, PANEL_UNROLL(M), sums);                              \
            const int64_t cols = n - b * 16 < 16 ? n - b * 16 : 16;                                                \
            for (int i = 0; i < M; i++) {                                                                          \
                _mm512_storeu_ps(lanes, sums[i]);                                                                  \
                for (int64_t c = 0; c < cols; c++)                                                                 \
                    put(out, ldo, i, b * 16 + c, finish(lanes[c], bias, NULL, b * 16 + c, 1), out_kind);          \
            }                                                                                                      \
        }                                                                                                          \
    }
DEFINE_PANELS_M(1) DEFINE_PANELS_M(2) DEFINE_PANELS_M(3) DEFINE_PANELS_M(4)
DEFINE_PANELS_M(5) DEFINE_PANELS_M(6) DEFINE_PANELS_M(7) DEFINE_PANELS_M(8)
#endif

/* x [m, k] bfloat16 (row stride ldx; its k must be even unless the last pair's second half is readable: the
 * caller pads), packed as above, bias [n] bfloat16 or NULL, out as gemv_bf16's. */
int gemv_panels_bf16(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                     const uint16_t *bias, void *out, int64_t ldo, int out_kind) {
#if defined(GEMV_BF16_DPBF16)
    static void (*const by_rows[GEMV_MAX_ROWS + 1])(const uint16_t *, int64_t, int64_t, const uint16_t *, int64_t,
                                                    const uint16_t *, void *, int64_t, int) = {
        NULL, gemv_panels_bf16_1, gemv_panels_bf16_2, gemv_panels_bf16_3, gemv_panels_bf16_4,
        gemv_panels_bf16_5, gemv_panels_bf16_6, gemv_panels_bf16_7, gemv_panels_bf16_8};
    if (m < 1 || m > GEMV_MAX_ROWS) return -1;
    by_rows[m](x, ldx, k, packed, n, bias, out, ldo, out_kind);
    return 0;
#else
    (void)x; (void)ldx; (void)m; (void)k; (void)packed; (void)n; (void)bias; (void)out; (void)ldo; (void)out_kind;
    return -1;
#endif
}

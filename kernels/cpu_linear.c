/* Linear layers on AVX2 + FMA with float32 sums: out[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 *
 * oneDNN's packed float32 matmul ran a 0.5B model's projections at 56-94% of a Zen 4's FMA peak,
 * lowest at the few rows of a decode step and on gate_up (the widest, most of a layer's FLOPs),
 * and each call costs ~20 us of framework time, a hundred calls a decode step (bench/log/2026-11-28.md,
 * "CPU: a native linear layer on AVX2"). This kernel runs one register tile of 6 rows x 16
 * columns (12 accumulators, BLIS's Haswell shape) over a weight packed once at load into panels
 * of 16 columns, [N/16][K][16]:
 *
 * - the threads split the panels, so every weight byte is read from memory once per k-block,
 *   however many rows (a decode step is bound by that stream);
 * - each panel's k-block (at most KC x 16 floats) stays in L2 while every 6-row tile of x passes
 *   over it; x's k-block (rows x KC) is reread from L2 or L3 for each panel, which costs far
 *   less than streaming the weight again;
 * - K above KC is split into k-blocks, the output tile accumulating across them, so a panel's
 *   block still fits L2 on the down projection (K = 4864).
 *
 * Dot products are summed in another order than oneDNN's or oneMKL's, so results may differ from
 * F.linear in the last bits (greedy parity with transformers: tests/unit/test_model_parity.py).
 * linear_bf16 and linear_f16 take weights kept in half precision (widened exactly in registers),
 * with float32 rows and results.
 * Without AVX2, FMA and F16C, linear_f32_available() = 0 and the worker keeps oneDNN.
 */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_softmax_exp.h"

#define NR 16
#define MR 6
#define KC 1024
#define PARALLEL_MIN_MACS (1 << 17)

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

int linear_f32_available(void) { return 1; }

/* One register tile: ROWS rows x 16 columns of out = (or +=) x[rows, k0:k0+kc] @ panel[k0:k0+kc]
 * (+ bias on the last k-block). Each row's two accumulators are named variables: GCC keeps an
 * array of 24 vectors on the stack, storing each accumulator every k (a third of the FMA rate).
 * Rows 1 and 2 also sum odd k into a second pair, so FMA latency does not bound the few-row
 * tiles of a decode step, whose weight stream is the limit. */
#define ROWS_1(f) f(0)
#define ROWS_2(f) ROWS_1(f) f(1)
#define ROWS_3(f) ROWS_2(f) f(2)
#define ROWS_4(f) ROWS_3(f) f(3)
#define ROWS_5(f) ROWS_4(f) f(4)
#define ROWS_6(f) ROWS_5(f) f(5)
#define DECLARE(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = _mm256_setzero_ps();
#define DECLARE_ODD(r) __m256 d##r##0 = _mm256_setzero_ps(), d##r##1 = _mm256_setzero_ps();
#define FMA_ROW(r)                                                        \
    {                                                                     \
        const __m256 a = _mm256_broadcast_ss(x + (r) * ldx + k);          \
        c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);                        \
        c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);                        \
    }
#define FMA_ROW_ODD(r)                                                    \
    {                                                                     \
        const __m256 a = _mm256_broadcast_ss(x + (r) * ldx + k + 1);      \
        d##r##0 = _mm256_fmadd_ps(a, e0, d##r##0);                        \
        d##r##1 = _mm256_fmadd_ps(a, e1, d##r##1);                        \
    }
#define JOIN_ODD(r) c##r##0 = _mm256_add_ps(c##r##0, d##r##0); c##r##1 = _mm256_add_ps(c##r##1, d##r##1);
#define STORE_ROW(r) store_row(out + (r) * ldo, c##r##0, c##r##1, accumulate, bias, cols);

static inline __attribute__((always_inline)) void store_row(float *restrict o, __m256 v0, __m256 v1,
                                                            const int accumulate, const float *restrict bias,
                                                            const int64_t cols) {
    if (cols == NR) {
        if (accumulate) {
            v0 = _mm256_add_ps(_mm256_loadu_ps(o), v0);
            v1 = _mm256_add_ps(_mm256_loadu_ps(o + 8), v1);
        }
        if (bias) {
            v0 = _mm256_add_ps(v0, _mm256_loadu_ps(bias));
            v1 = _mm256_add_ps(v1, _mm256_loadu_ps(bias + 8));
        }
        _mm256_storeu_ps(o, v0);
        _mm256_storeu_ps(o + 8, v1);
        return;
    }
    float lanes[NR];  /* the last panel of an N that is not a multiple of 16 */
    _mm256_storeu_ps(lanes, v0);
    _mm256_storeu_ps(lanes + 8, v1);
    for (int64_t c = 0; c < cols; c++) {
        const float v = accumulate ? o[c] + lanes[c] : lanes[c];
        o[c] = bias ? v + bias[c] : v;
    }
}

/* A panel row's 16 weights as two float32 vectors: float32 as stored; bfloat16 widened by a 16-bit
 * shift and float16 by F16C, both exact, so a half-precision weight gives the same products as
 * its float32 copy would, from half the bytes. */
#define LOAD_f32(p) _mm256_loadu_ps(p)
#define LOAD_bf16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define LOAD_f16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define WEIGHT_f32 float
#define WEIGHT_bf16 uint16_t
#define WEIGHT_f16 uint16_t

#define TILE_ARGS(T)                                                                                      \
    const float *restrict x, const int64_t ldx, const T *restrict panel, const int64_t kc,              \
        float *restrict out, const int64_t ldo, const int accumulate, const float *restrict bias,       \
        const int64_t cols
#define DEFINE_TILE(R, S)                                                               \
    static void tile_##R##_##S(TILE_ARGS(WEIGHT_##S)) {                                 \
        ROWS_##R(DECLARE)                                                               \
        for (int64_t k = 0; k < kc; k++) {                                              \
            const __m256 b0 = LOAD_##S(panel + k * NR);                                 \
            const __m256 b1 = LOAD_##S(panel + k * NR + 8);                             \
            ROWS_##R(FMA_ROW)                                                           \
        }                                                                               \
        ROWS_##R(STORE_ROW)                                                             \
    }
#define DEFINE_SPLIT_TILE(R, S)                                                         \
    static void tile_##R##_##S(TILE_ARGS(WEIGHT_##S)) {                                 \
        ROWS_##R(DECLARE) ROWS_##R(DECLARE_ODD)                                         \
        int64_t k = 0;                                                                  \
        for (; k + 1 < kc; k += 2) {                                                    \
            const __m256 b0 = LOAD_##S(panel + k * NR);                                 \
            const __m256 b1 = LOAD_##S(panel + k * NR + 8);                             \
            const __m256 e0 = LOAD_##S(panel + k * NR + NR);                            \
            const __m256 e1 = LOAD_##S(panel + k * NR + NR + 8);                        \
            ROWS_##R(FMA_ROW) ROWS_##R(FMA_ROW_ODD)                                     \
        }                                                                               \
        for (; k < kc; k++) {                                                           \
            const __m256 b0 = LOAD_##S(panel + k * NR);                                 \
            const __m256 b1 = LOAD_##S(panel + k * NR + 8);                             \
            ROWS_##R(FMA_ROW)                                                           \
        }                                                                               \
        ROWS_##R(JOIN_ODD)                                                              \
        ROWS_##R(STORE_ROW)                                                             \
    }

/* One panel's columns of out for all m rows: the k-blocks in turn, each passing every 6-row tile
 * of x over the panel's block while it sits in L2, accumulating in out after the first. */
#define DEFINE_PANEL(S)                                                                                        \
    static void panel_product_##S(const float *x, int64_t ldx, int64_t m, int64_t k, const WEIGHT_##S *panel0, \
                                  int64_t cols, const float *bias, float *out, int64_t ldo) {                  \
        static void (*const tiles[MR + 1])(TILE_ARGS(WEIGHT_##S)) = {                                          \
            NULL, tile_1_##S, tile_2_##S, tile_3_##S, tile_4_##S, tile_5_##S, tile_6_##S};                   \
        for (int64_t k0 = 0; k0 < k; k0 += KC) {                                                               \
            const int64_t kc = k - k0 < KC ? k - k0 : KC;                                                      \
            const float *b = k0 + kc == k ? bias : NULL;                                                       \
            const WEIGHT_##S *panel = panel0 + k0 * NR;                                                        \
            int64_t i = 0;                                                                                     \
            for (; i + MR <= m; i += MR)                                                                       \
                tile_6_##S(x + i * ldx + k0, ldx, panel, kc, out + i * ldo, ldo, k0 > 0, b, cols);             \
            if (i < m)                                                                                         \
                tiles[m - i](x + i * ldx + k0, ldx, panel, kc, out + i * ldo, ldo, k0 > 0, b, cols);           \
        }                                                                                                      \
    }

/* x [m, k] float32 (row stride ldx), packed [ceil(n/16)][k][16] of S weights (zero past n), bias
 * [n] float32 or NULL, out [m, n] float32 (row stride ldo). The threads split the panels; a
 * cache-resident model's one-row product is a few microseconds of work, where waking the second
 * thread would cost as much. */
#define DEFINE_LINEAR(S)                                                                                       \
    DEFINE_SPLIT_TILE(1, S)                                                                                    \
    DEFINE_SPLIT_TILE(2, S)                                                                                    \
    DEFINE_TILE(3, S)                                                                                          \
    DEFINE_TILE(4, S)                                                                                          \
    DEFINE_TILE(5, S)                                                                                          \
    DEFINE_TILE(6, S)                                                                                          \
    DEFINE_PANEL(S)                                                                                            \
    void linear_##S(const float *x, int64_t ldx, int64_t m, int64_t k, const WEIGHT_##S *packed, int64_t n,   \
                    const float *bias, float *out, int64_t ldo) {                                             \
        const int64_t panels = (n + NR - 1) / NR;                                                              \
        _Pragma("omp parallel for schedule(static) if (m * n * k >= PARALLEL_MIN_MACS)")                       \
        for (int64_t p = 0; p < panels; p++)                                                                   \
            panel_product_##S(x, ldx, m, k, packed + p * k * NR, n - p * NR < NR ? n - p * NR : NR,            \
                              bias ? bias + p * NR : NULL, out + p * NR, ldo);                                 \
    }                                                                                                          \
    DEFINE_SILU_GATE(S)

/* A row's 16 columns of silu(g) * u = g / (1 + exp(-g)) * u, in transformers' order, into its
 * first cols of o (cpu_softmax_exp.h's silu). */
static inline void silu_mul_row(const float *restrict g, const float *restrict u, float *restrict o,
                                const int64_t cols) {
    float v[NR];
    for (int c = 0; c < NR; c++) v[c] = silu(g[c]) * u[c];
    for (int64_t c = 0; c < cols; c++) o[c] = v[c];
}

/* Each thread's gate and up columns of one panel pair, [m][16] each, kept for the next call:
 * L2-sized for a prefill step's rows. */
static __thread float *gate_scratch;
static __thread int64_t gate_scratch_rows;

static float *scratch_for(int64_t m) {
    if (m > gate_scratch_rows) {
        free(gate_scratch);
        gate_scratch = aligned_alloc(64, (size_t)m * 2 * NR * sizeof(float));
        gate_scratch_rows = gate_scratch ? m : 0;
    }
    return gate_scratch;
}

/* out[m, size] = silu(x @ Wg^T + bg) * (x @ Wu^T + bu), the gated MLP's input to down_proj, from
 * one packed gate_up weight whose panels alternate gate and up ([2 * ceil(size/16)][k][16]) and
 * bias [2 * size] or NULL. The gate_up product (twice out's size) never reaches memory: a 0.5B
 * prefill step's is 33 MB a layer, written, faulted in and read back by a separate SiLU pass.
 * The gate and up values are linear()'s, bit for bit. Returns -1 without memory for a thread's
 * scratch. */
#define DEFINE_SILU_GATE(S)                                                                                    \
    int silu_gate_##S(const float *x, int64_t ldx, int64_t m, int64_t k, const WEIGHT_##S *packed,             \
                      int64_t size, const float *bias, float *out, int64_t ldo) {                              \
        const int64_t pairs = (size + NR - 1) / NR;                                                            \
        int failed = 0;                                                                                        \
        _Pragma("omp parallel if (2 * m * size * k >= PARALLEL_MIN_MACS)")                                     \
        {                                                                                                      \
            float *const gate = scratch_for(m), *const up = gate ? gate + m * NR : NULL;                       \
            if (!gate) {                                                                                       \
                _Pragma("omp atomic write")                                                                    \
                failed = 1;                                                                                    \
            }                                                                                                  \
            _Pragma("omp for schedule(static)")                                                                \
            for (int64_t p = 0; p < pairs; p++) {                                                              \
                if (!gate) continue;                                                                           \
                const int64_t cols = size - p * NR < NR ? size - p * NR : NR;                                  \
                panel_product_##S(x, ldx, m, k, packed + 2 * p * k * NR, cols, bias ? bias + p * NR : NULL,   \
                                  gate, NR);                                                                   \
                panel_product_##S(x, ldx, m, k, packed + (2 * p + 1) * k * NR, cols,                          \
                                  bias ? bias + size + p * NR : NULL, up, NR);                                \
                for (int64_t i = 0; i < m; i++)                                                                \
                    silu_mul_row(gate + i * NR, up + i * NR, out + i * ldo + p * NR, cols);                    \
            }                                                                                                  \
        }                                                                                                      \
        return failed ? -1 : 0;                                                                                \
    }

DEFINE_LINEAR(f32)
DEFINE_LINEAR(bf16)
DEFINE_LINEAR(f16)

#else

int linear_f32_available(void) { return 0; }

/* Never called: linear_f32_available() = 0 keeps the worker on oneDNN. */
#define DEFINE_ABSENT(S, T)                                                                                 \
    void linear_##S(const float *x, int64_t ldx, int64_t m, int64_t k, const T *packed, int64_t n,          \
                    const float *bias, float *out, int64_t ldo) {                                          \
        (void)x; (void)ldx; (void)m; (void)k; (void)packed; (void)n; (void)bias; (void)out; (void)ldo;    \
    }
DEFINE_ABSENT(f32, float)
DEFINE_ABSENT(bf16, uint16_t)
DEFINE_ABSENT(f16, uint16_t)
#define DEFINE_ABSENT_GATE(S, T)                                                                           \
    int silu_gate_##S(const float *x, int64_t ldx, int64_t m, int64_t k, const T *packed, int64_t size,    \
                      const float *bias, float *out, int64_t ldo) {                                       \
        (void)x; (void)ldx; (void)m; (void)k; (void)packed; (void)size; (void)bias; (void)out; (void)ldo; \
        return -1;                                                                                         \
    }
DEFINE_ABSENT_GATE(f32, float)
DEFINE_ABSENT_GATE(bf16, uint16_t)
DEFINE_ABSENT_GATE(f16, uint16_t)

#endif

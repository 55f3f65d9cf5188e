/* Decode-step products on int8 (or float8_e4m3fn: gemv_fp8_blocks) weights in blocks: out[M, N] = x[M, K] @ W^T,
 * M = 1..8, where W[j, t] = q[j, t] * scale[j, t / G], q int8 [N, K] row-major and scale float32 [N, K / G], one per
 * block of G inputs (GGUF's Q6_K: G = 16; compressed-tensors' int8 groups; G = K: one per output channel).
 * torch has no grouped int8 op: one _weight_int8pack_mm call per block of inputs ran a 0.5B's step 10-20x
 * slower than per-channel int8 (bench/log), and a dequantized copy per call reads the weight three times over.
 *
 * As cpu_gemv.c: a decode step is bound by reading the weights, so each thread takes a contiguous
 * range of R-row blocks (OpenMP, static), walks R rows of q at once along K (prefetching ahead),
 * and multiplies them by the M rows of x (float32, in L1). Each vector of q is widened to float32
 * exactly; for one or two rows of x (decode) a block's products are summed unscaled and the sum scaled
 * once, else each vector is multiplied by its block's scale first (the float32 weight the dequantized
 * layer holds, q * scale). The products are summed in float32, in another order than F.linear's
 * (tests/e2e/test_kernels_cpu_gemv_int8.py bounds the difference). x is float32 (the caller widens
 * bfloat16 / float16 rows once per call); out is float32 or a half dtype, rounded once.
 */
#include <stdint.h>

#include "cpu_gemv_rows.h"

#define INT8_GEMV_MAX_ROWS 8
#define INT8_PARALLEL_MIN_MACS (1 << 17)
#define INT8_PREFETCH_BYTES 16384
#define INT8_PREFETCH_ROWS 32
/* R x M accumulators, R weight vectors and one x vector in the vector registers (32 on AVX-512). */
#define INT8_ROWS_PER_BLOCK(M) ((M) == 1 ? 8 : (M) == 2 ? 6 : (M) <= 5 ? 4 : 3)

/* HALF_VW weights from p widened to float32 exactly: int8 values, or (fp8) float8_e4m3fn bytes as cpu_half.h's
 * fp8_e4m3_scaled reads them (2^-120 times their value; gemv_fp8_blocks' scales carry the 2^120), in vectors. */
static inline hvec load_q(const int8_t *p, const int fp8) {
#if HALF_VW == 16
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    if (!fp8) return (hvec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    const __m512i t = _mm512_cvtepu8_epi32(b);
    const __m512i magnitude = _mm512_slli_epi32(_mm512_and_si512(t, _mm512_set1_epi32(0x7f)), 20);
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(t, _mm512_set1_epi32(0x80)), 24);
    return (hvec)_mm512_castsi512_ps(_mm512_or_si512(magnitude, sign));
#elif HALF_VW == 8
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    if (!fp8) return (hvec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    const __m256i t = _mm256_cvtepu8_epi32(b);
    const __m256i magnitude = _mm256_slli_epi32(_mm256_and_si256(t, _mm256_set1_epi32(0x7f)), 20);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(t, _mm256_set1_epi32(0x80)), 24);
    return (hvec)_mm256_castsi256_ps(_mm256_or_si256(magnitude, sign));
#else
    hvec v;
    for (int i = 0; i < HALF_VW; i++) v[i] = fp8 ? fp8_e4m3_scaled((uint8_t)p[i]) : (float)p[i];
    return v;
#endif
}

/* sums[r * M + i] = x[i, :k] . (q[r, :k] * its blocks' scales) for R rows. k % g == 0, g % HALF_VW == 0. */
static inline __attribute__((always_inline)) void block_i8(const float *restrict x, const int64_t ldx,
                                                           const int8_t *restrict q, const int64_t ldq,
                                                           const float *restrict s, const int64_t lds,
                                                           const int64_t k, const int64_t g, const int M,
                                                           const int R, float *restrict sums, const int fp8) {
    hvec acc[8][8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) acc[r][i] = hbroadcast(0.0f);
    /* The reads ahead: where a block's R rows are a short run of bytes (K = 896: 7 KB), that run's bytes
     * INT8_PREFETCH_BYTES on, a line for every 64 read (a 0.5B's gate_up 8.3 ms a step against 12.3 for the rows
     * ahead); where they are long (K = 4864: 39 KB) the same columns INT8_PREFETCH_ROWS rows on, which keep up with
     * the reads there (4.1-4.3 ms against 5.3). */
    const int linear = R * ldq <= INT8_PREFETCH_BYTES;
    const int8_t *ahead = linear ? q + INT8_PREFETCH_BYTES : q + (int64_t)INT8_PREFETCH_ROWS * ldq;
    /* For one or two rows of x a block's products are summed unscaled and scaled once: a weight is a widening, a
     * conversion and an FMA, not also a multiply (a 0.5B's W8A16 decode read its int8 weights at 15.5 GB/s of the two
     * threads' ~32 with the multiply). More rows keep the scaled weights: their sums would not fit the registers. */
    const int factored = M <= 2;
    for (int64_t kk = 0; kk < k; kk += g) {
        hvec scale[8], part[8][2];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            scale[r] = hbroadcast(s[r * lds + kk / g]);
#pragma GCC unroll 2
            for (int i = 0; i < 2; i++) part[r][i] = hbroadcast(0.0f);
        }
        for (int64_t c = kk; c < kk + g; c += HALF_VW) {
            hvec wv[8];
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                wv[r] = factored ? load_q(q + r * ldq + c, fp8) : load_q(q + r * ldq + c, fp8) * scale[r];
                if ((c & 63) == 0) __builtin_prefetch(linear ? ahead + c * R + r * 64 : ahead + r * ldq + c, 0, 3);
            }
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) {
                const hvec xv = load_f32(x + i * ldx + c);
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    if (factored)
                        part[r][i] += xv * wv[r];
                    else
                        acc[r][i] += xv * wv[r];
                }
            }
        }
        if (factored)
#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
#pragma GCC unroll 2
                for (int i = 0; i < M; i++) acc[r][i] += part[r][i] * scale[r];
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) sums[r * M + i] = hsum(acc[r][i]);
}

/* sums of a block of rows j .. j + rows for GEMV_ROW_BLOCKS (inside gemv_int8_M / gemv_fp8_M, whose locals it
 * reads) */
#define INT8_BLOCK(M, j, rows, sums) block_i8(x, ldx, q + (j) * k, k, s + (j) * lds, lds, k, g, M, rows, sums, 0)
#define FP8_BLOCK(M, j, rows, sums) block_i8(x, ldx, q + (j) * k, k, s + (j) * lds, lds, k, g, M, rows, sums, 1)

#define DEFINE_GEMV_M(NAME, BLOCK, M)                                                                             \
    static void NAME##_##M(const float *x, int64_t ldx, int64_t k, const int8_t *q, const float *s, int64_t g,   \
                           int64_t n, void *out, int64_t ldo, int out_kind) {                                     \
        const int R = INT8_ROWS_PER_BLOCK(M);                                                                     \
        const int64_t lds = k / g;                                                                                \
        GEMV_ROW_BLOCKS(M, R, n, (M) * n * k, INT8_PARALLEL_MIN_MACS, out, ldo, out_kind, BLOCK);                 \
    }
#define DEFINE_GEMV(NAME, BLOCK)                                                                                  \
    DEFINE_GEMV_M(NAME, BLOCK, 1) DEFINE_GEMV_M(NAME, BLOCK, 2) DEFINE_GEMV_M(NAME, BLOCK, 3)                     \
    DEFINE_GEMV_M(NAME, BLOCK, 4) DEFINE_GEMV_M(NAME, BLOCK, 5) DEFINE_GEMV_M(NAME, BLOCK, 6)                     \
    DEFINE_GEMV_M(NAME, BLOCK, 7) DEFINE_GEMV_M(NAME, BLOCK, 8)
DEFINE_GEMV(gemv_int8, INT8_BLOCK)
DEFINE_GEMV(gemv_fp8, FP8_BLOCK)

typedef void (*gemv_rows_fn)(const float *, int64_t, int64_t, const int8_t *, const float *, int64_t, int64_t, void *,
                             int64_t, int);

static int gemv_blocks(const gemv_rows_fn *by_rows, const float *x, int64_t ldx, int64_t m, int64_t k,
                       const int8_t *q, const float *scales, int64_t g, int64_t n, void *out, int64_t ldo,
                       int out_kind) {
    if (m < 1 || g < HALF_VW || g % HALF_VW || k % g) return -1;
    const int64_t size = out_kind == 0 ? 4 : 2;
    for (int64_t i = 0; i < m; i += INT8_GEMV_MAX_ROWS) {
        const int64_t rows = m - i < INT8_GEMV_MAX_ROWS ? m - i : INT8_GEMV_MAX_ROWS;
        by_rows[rows](x + i * ldx, ldx, k, q, scales, g, n, (char *)out + i * ldo * size, ldo, out_kind);
    }
    return 0;
}

/* x [m, k] float32 (row stride ldx), q [n, k] int8 contiguous, scales [n, k / g] float32 contiguous, out [m, n]
 * (row stride ldo) float32 (out_kind 0), bfloat16 (1) or float16 (2). More than 8 rows (a short prefill chunk)
 * go 8 at a time, each pass streaming the weight again: up to a few tens of rows that still beats making the
 * dequantized weight for F.linear (the caller's crossover). Returns -1 (nothing written) unless m >= 1, g is a
 * multiple of the vector width and k of g. */
int gemv_int8_blocks(const float *x, int64_t ldx, int64_t m, int64_t k, const int8_t *q, const float *scales,
                     int64_t g, int64_t n, void *out, int64_t ldo, int out_kind) {
    static const gemv_rows_fn by_rows[INT8_GEMV_MAX_ROWS + 1] = {
        NULL, gemv_int8_1, gemv_int8_2, gemv_int8_3, gemv_int8_4, gemv_int8_5, gemv_int8_6, gemv_int8_7, gemv_int8_8};
    return gemv_blocks(by_rows, x, ldx, m, k, q, scales, g, n, out, ldo, out_kind);
}

/* The same for float8_e4m3fn weights (q: their bytes), each scale already multiplied by 2^120 (load_q's). */
int gemv_fp8_blocks(const float *x, int64_t ldx, int64_t m, int64_t k, const int8_t *q, const float *scales,
                    int64_t g, int64_t n, void *out, int64_t ldo, int out_kind) {
    static const gemv_rows_fn by_rows[INT8_GEMV_MAX_ROWS + 1] = {
        NULL, gemv_fp8_1, gemv_fp8_2, gemv_fp8_3, gemv_fp8_4, gemv_fp8_5, gemv_fp8_6, gemv_fp8_7, gemv_fp8_8};
    return gemv_blocks(by_rows, x, ldx, m, k, q, scales, g, n, out, ldo, out_kind);
}

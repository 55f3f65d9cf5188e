/* Decode-step products on int4 weights in groups: out[M, N] = x[M, K] @ W^T, M = 1..8, where
 * W[j, t] = (u[j, t] - z[j, t / G]) * scale[j, t / G]: u the unsigned nibble (the signed value + 8),
 * z 8 (symmetric: GGUF's Q4_0, compressed-tensors' W4A16) or 8 + the group's zero point (asymmetric),
 * scale float32, one per group of G inputs (a multiple of 32). Decode reads every weight once a step,
 * so bytes are the time: 4 bits a weight plus 32 bits a group (0.53 bytes a weight at G = 128, against
 * bfloat16's 2). torch's _weight_int4pack_mm_for_cpu runs about a row of x at a time and dequantizes
 * into the activations' dtype (bench/scripts/quant_bench.py: 1.5x bfloat16 decode, not the 3.8x the bytes allow).
 *
 * Layout (pack_int4_blocks in kernels/cpu_native.py): row j is K / 2 bytes; each 32 inputs c..c+31 are
 * 16 bytes, byte i holding input c+i in its low nibble and c+16+i in its high one (GGUF Q4_0's own block
 * payload), so one 16-byte load widened to 32-bit lanes gives two vectors by a mask and a shift.
 *
 * As cpu_gemv_int8.c: each thread takes a contiguous range of R-row blocks (OpenMP, static), walks R rows
 * of nibbles at once along K (prefetching rows ahead) and multiplies them by the M rows of x (float32, in L1).
 * A one-stream step is bound by the nibbles' reads only if a weight costs a few instructions, so:
 *   AVX-512: a table per row and group of the 16 weights (v - z) * scale, made once a group; vpermps looks a
 *            nibble up by its low 4 bits: a weight is one shuffle from the float32 value the dequantized
 *            layer holds (one rounding), then the FMAs;
 *   else:    (8 lanes: no 16-entry lookup) the nibbles' products with x summed per group, scaled once, and
 *            z times the group's sum of x taken off at the end: a mask or shift, a conversion, the FMAs.
 * The products are summed in float32 (tests/e2e/test_kernels_cpu_gemv_int4.py bounds the difference).
 */
#include <stdint.h>

#include "cpu_gemv_rows.h"

#define INT4_GEMV_MAX_ROWS 8
#define INT4_PARALLEL_MIN_MACS (1 << 17)
#define INT4_PREFETCH_ROWS 32
#define INT4_CHUNK 32 /* inputs in one 16-byte run of nibbles */
/* R x M accumulators (and, the factored form, as many group sums), R weight vectors and an x vector. */
#define INT4_ROWS_PER_BLOCK(M) ((M) == 1 ? 8 : (M) == 2 ? 6 : (M) <= 5 ? 4 : 3)

/* HALF_VW bytes from p, each widened to a 32-bit lane. */
static inline hivec load_u8(const uint8_t *p) {
#if HALF_VW == 16
    return (hivec)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif HALF_VW == 8
    return (hivec)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    hivec v;
    for (int i = 0; i < HALF_VW; i++) v[i] = p[i];
    return v;
#endif
}

#if HALF_VW != 16
/* sums[r * M + i] = x[i, :k] . W[r, :k] for R rows. k % g == 0, g % INT4_CHUNK == 0. zeros NULL: z = 8.
 * xsum[i * lds + group]: the sum of row i of x over the group (the factored form above). */
static inline __attribute__((always_inline)) void block_i4(const float *restrict x, const int64_t ldx,
                                                           const float *restrict xsum, const uint8_t *restrict u,
                                                           const int64_t ldu, const float *restrict s,
                                                           const float *restrict z, const int64_t lds,
                                                           const int64_t k, const int64_t g, const int M,
                                                           const int R, float *restrict sums) {
    hvec acc[8][8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) acc[r][i] = hbroadcast(0.0f);
    const uint8_t *ahead = u + (int64_t)INT4_PREFETCH_ROWS * ldu;
    for (int64_t kk = 0; kk < k; kk += g) {
        hvec part[8][8];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) part[r][i] = hbroadcast(0.0f);
        for (int64_t c = kk; c < kk + g; c += INT4_CHUNK) {
            const int64_t byte = c / 2;
            if ((byte & 63) == 0)
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) __builtin_prefetch(ahead + r * ldu + byte, 0, 3);
#pragma GCC unroll 2
            for (int h = 0; h < 16; h += HALF_VW) {
                hivec packed[8];
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) packed[r] = load_u8(u + r * ldu + byte + h);
                /* the low nibbles are inputs c+h.., the high ones c+16+h.. */
#pragma GCC unroll 2
                for (int half = 0; half < 2; half++) {
                    hvec wv[8];
#pragma GCC unroll 8
                    for (int r = 0; r < R; r++)
                        wv[r] = __builtin_convertvector(half ? packed[r] >> 4 : packed[r] & 15, hvec);
#pragma GCC unroll 8
                    for (int i = 0; i < M; i++) {
                        const hvec xv = load_f32(x + i * ldx + c + 16 * half + h);
#pragma GCC unroll 8
                        for (int r = 0; r < R; r++) part[r][i] += xv * wv[r];
                    }
                }
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const hvec scale = hbroadcast(s[r * lds + kk / g]);
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) acc[r][i] += part[r][i] * scale;
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            /* sum over groups of scale * z * (the group's sum of x): as many terms as groups, vectorized */
            const float *sr = s + r * lds, *zr = z ? z + r * lds : NULL, *xi = xsum + i * lds;
            hvec offsets = hbroadcast(0.0f);
            int64_t grp = 0;
            for (; grp + HALF_VW <= lds; grp += HALF_VW)
                offsets += load_f32(sr + grp) * (zr ? load_f32(zr + grp) : hbroadcast(8.0f)) * load_f32(xi + grp);
            float offset = hsum(offsets);
            for (; grp < lds; grp++) offset += sr[grp] * (zr ? zr[grp] : 8.0f) * xi[grp];
            sums[r * M + i] = hsum(acc[r][i]) - offset;
        }
}

#else
/* The same by the tables above (xsum unused). */
static inline __attribute__((always_inline)) void block_i4(const float *restrict x, const int64_t ldx,
                                                           const float *restrict xsum, const uint8_t *restrict u,
                                                           const int64_t ldu, const float *restrict s,
                                                           const float *restrict z, const int64_t lds,
                                                           const int64_t k, const int64_t g, const int M,
                                                           const int R, float *restrict sums) {
    (void)xsum;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const hvec centered = (hvec)iota - 8.0f; /* symmetric: v - 8, a group's table one multiply (Q4_0: every 32) */
    hvec acc[8][8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) acc[r][i] = hbroadcast(0.0f);
    const uint8_t *ahead = u + (int64_t)INT4_PREFETCH_ROWS * ldu;
    for (int64_t kk = 0; kk < k; kk += g) {
        __m512 table[8];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            table[r] = (__m512)((z ? (hvec)iota - hbroadcast(z[r * lds + kk / g]) : centered) *
                                hbroadcast(s[r * lds + kk / g]));
        for (int64_t c = kk; c < kk + g; c += INT4_CHUNK) {
            const int64_t byte = c / 2;
            if ((byte & 63) == 0)
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) __builtin_prefetch(ahead + r * ldu + byte, 0, 3);
            __m512i packed[8];
#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
                packed[r] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(u + r * ldu + byte)));
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                hvec wv[8];
#pragma GCC unroll 8
                for (int r = 0; r < R; r++)
                    wv[r] = (hvec)_mm512_permutexvar_ps(half ? _mm512_srli_epi32(packed[r], 4) : packed[r],
                                                        table[r]);
#pragma GCC unroll 8
                for (int i = 0; i < M; i++) {
                    const hvec xv = load_f32(x + i * ldx + c + 16 * half);
#pragma GCC unroll 8
                    for (int r = 0; r < R; r++) acc[r][i] += xv * wv[r];
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) sums[r * M + i] = hsum(acc[r][i]);
}
#endif

/* sums of a block of rows j .. j + rows for GEMV_ROW_BLOCKS (inside gemv_int4_M, whose locals it reads) */
#define INT4_BLOCK(M, j, rows, sums)                                                                              \
    block_i4(x, ldx, xsum, u + (j) * ldu, ldu, s + (j) * lds, z ? z + (j) * lds : NULL, lds, k, g, M, rows, sums)

#define DEFINE_INT4_M(M)                                                                                          \
    static void gemv_int4_##M(const float *x, int64_t ldx, const float *xsum, int64_t k, const uint8_t *u,        \
                              const float *s, const float *z, int64_t g, int64_t n, void *out, int64_t ldo,       \
                              int out_kind) {                                                                     \
        const int R = INT4_ROWS_PER_BLOCK(M);                                                                     \
        const int64_t lds = k / g, ldu = k / 2;                                                                   \
        GEMV_ROW_BLOCKS(M, R, n, (M) * n * k, INT4_PARALLEL_MIN_MACS, out, ldo, out_kind, INT4_BLOCK);            \
    }
DEFINE_INT4_M(1) DEFINE_INT4_M(2) DEFINE_INT4_M(3) DEFINE_INT4_M(4)
DEFINE_INT4_M(5) DEFINE_INT4_M(6) DEFINE_INT4_M(7) DEFINE_INT4_M(8)

/* x [m, k] float32 (row stride ldx), u [n, k / 2] nibbles (the layout above) contiguous, scales [n, k / g]
 * float32 contiguous, zeros NULL (symmetric) or [n, k / g] float32 (8 + zero point), out [m, n] (row stride
 * ldo) float32 (out_kind 0), bfloat16 (1) or float16 (2). More than 8 rows go 8 at a time, each pass
 * streaming the weight again (the caller's crossover decides how many). Returns -1 (nothing written)
 * unless m >= 1, g is a multiple of 32 and k of g. */
int gemv_int4_blocks(const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *u, const float *scales,
                     const float *zeros, int64_t g, int64_t n, void *out, int64_t ldo, int out_kind) {
    static void (*const by_rows[INT4_GEMV_MAX_ROWS + 1])(const float *, int64_t, const float *, int64_t,
                                                         const uint8_t *, const float *, const float *, int64_t,
                                                         int64_t, void *, int64_t, int) = {
        NULL, gemv_int4_1, gemv_int4_2, gemv_int4_3, gemv_int4_4, gemv_int4_5, gemv_int4_6, gemv_int4_7, gemv_int4_8};
    if (m < 1 || g < INT4_CHUNK || g % INT4_CHUNK || k % g) return -1;
    const int64_t size = out_kind == 0 ? 4 : 2, groups = k / g;
    float xsum[INT4_GEMV_MAX_ROWS * groups]; /* a few KB: 8 rows x K / 32 at most */
    for (int64_t i = 0; i < m; i += INT4_GEMV_MAX_ROWS) {
        const int64_t rows = m - i < INT4_GEMV_MAX_ROWS ? m - i : INT4_GEMV_MAX_ROWS;
        for (int64_t row = 0; row < (HALF_VW == 16 ? 0 : rows); row++) /* the factored form's group sums of x */
            for (int64_t grp = 0; grp < groups; grp++) {
                float sum = 0.0f;
                for (int64_t t = grp * g; t < (grp + 1) * g; t++) sum += x[(i + row) * ldx + t];
                xsum[row * groups + grp] = sum;
            }
        by_rows[rows](x + i * ldx, ldx, xsum, k, u, scales, zeros, g, n, (char *)out + i * ldo * size, ldo,
                      out_kind);
    }
    return 0;
}

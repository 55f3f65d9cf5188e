/* Decode-step products on int4 weights in groups: out[M, N] = x[M, K] @ W^T, M = 1..8, where
 * W[j, t] = (u[j, t] - z[j, t / G]) * scale[j, t / G]: u the unsigned nibble (the signed value + 8),
 * z 8 (symmetric: GGUF's Q4_0, compressed-tensors' W4A16) or 8 + the group's zero point (asymmetric),
 * scale float32, one per group of G inputs (a multiple of 32); or W[j, t] = scale * u - min[j, t / G], a float32
 * min per group (GGUF's Q4_K: d * sc and dmin * m, the min no multiple of the scale, the scale possibly 0), where
 * each form below takes the min in place of scale * z. Decode reads every weight once a step,
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
 *   AVX512-BF16, x in bfloat16: the table above costs a shuffle and an FMA a weight in float32 (25-29 GB/s of
 *            nibbles on one 2.6 GHz Zen 5 core, arithmetic-bound). vdpbf16ps takes 32 weights at once as
 *            bfloat16 words, and a nibble becomes one with no lookup: in each 16-bit lane of a 64-byte load,
 *            nibble j shifted down by 4j, masked and or-ed into 1.0's bits (0x3F80 | u) is 1 + u / 128 exactly:
 *            three shifts, three vpternlogd and an or for 128 weights, none of them a shuffle. A group sums
 *            x * (128 + u) / 128 (two bfloat16's products are exact in float32), is scaled once, and
 *            sum x * (u - z) = 128 * that - (128 + z) * sum x, the last term a group's sum of x taken off at
 *            the end as in the 8-lane form (what it cancels is ~17x the result: float32 keeps ~2^-20 of it,
 *            far inside bfloat16's output rounding). A lane's 4 nibbles are 4 inputs of one run of 32, so x is
 *            copied once a call into that order (arrange_bf16_x); a float32 lane then sums a pair from one
 *            run, and a run's scale is its lanes'. 41 GB/s with the weight in L2, ~4 cycles a 64-byte load.
 *            x in float32 or float16 keeps the float32 forms: rounding it to bfloat16 would change the answer.
 * The products are summed in float32 (tests/e2e/test_kernels_cpu_gemv_int4.py bounds the difference).
 */
#include <stdint.h>
#include <stdlib.h>

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
                                                           const float *restrict z, const float *restrict mn,
                                                           const int64_t lds,
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
            /* sum over groups of scale * z (or the min) * (the group's sum of x): as many terms as groups */
            const float *sr = s + r * lds, *zr = z ? z + r * lds : NULL, *mr = mn ? mn + r * lds : NULL,
                        *xi = xsum + i * lds;
            hvec offsets = hbroadcast(0.0f);
            int64_t grp = 0;
            for (; grp + HALF_VW <= lds; grp += HALF_VW)
                offsets += (mr ? load_f32(mr + grp)
                               : load_f32(sr + grp) * (zr ? load_f32(zr + grp) : hbroadcast(8.0f))) *
                           load_f32(xi + grp);
            float offset = hsum(offsets);
            for (; grp < lds; grp++) offset += (mr ? mr[grp] : sr[grp] * (zr ? zr[grp] : 8.0f)) * xi[grp];
            sums[r * M + i] = hsum(acc[r][i]) - offset;
        }
}

#else
/* The same by the tables above (xsum unused). */
static inline __attribute__((always_inline)) void block_i4(const float *restrict x, const int64_t ldx,
                                                           const float *restrict xsum, const uint8_t *restrict u,
                                                           const int64_t ldu, const float *restrict s,
                                                           const float *restrict z, const float *restrict mn,
                                                           const int64_t lds,
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
            table[r] = mn ? (__m512)((hvec)iota * hbroadcast(s[r * lds + kk / g]) - hbroadcast(mn[r * lds + kk / g]))
                          : (__m512)((z ? (hvec)iota - hbroadcast(z[r * lds + kk / g]) : centered) *
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

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && HALF_VW == 16
#define INT4_DPBF16 1
#define INT4_STEP 128 /* inputs in one 64-byte load: 4 runs of 32 */
/* A block's R rows are one run of bytes: prefetched as a line a row and step, this far ahead of the block (the
 * hardware's prefetchers hardly help here: none at all read 4.7 GB/s). Rows ahead (the float32 forms' 32) are 78 KB
 * at K = 4864 and leave each call's first rows unprefetched: 16 KB, and those first, read a 0.5B's step of int4
 * GEMVs in 8.9 ms against 9.9-11.2 (4 KB: 12.1, 8 KB: 8.8-11.1, 32 KB: 9.6-9.8; a loaded machine). */
#define INT4_PREFETCH_BYTES 16384
#define INT4_BIAS 128.0f /* a nibble u as the bfloat16 word 0x3F80 | u: 1 + u / 128 */
/* rows of weights in a block: R x M sums and as many a span's partial sums, 4 weight vectors, x from memory */
#define INT4_DPBF16_ROWS(M) ((M) == 1 ? 8 : (M) == 2 ? 4 : (M) == 3 ? 3 : (M) == 4 ? 2 : 1)

/* The scale of each float32 lane's run (lanes 4q..4q+3: run q = inputs c + 32q..) of the step at input c, where
 * groups are not whole steps (g 32, 64, 96, ...); 0 past k (those lanes' sums are 0, x is zero there). */
static inline __m512 run_scales(const float *restrict s, const int64_t c, const int64_t g, const int64_t k) {
    const __m512i run_of_lane = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const int64_t runs = (k - c) / INT4_CHUNK < 4 ? (k - c) / INT4_CHUNK : 4;
    __m128 by_run;
    if (g == INT4_CHUNK) { /* Q4_0: the 4 runs' scales are adjacent */
        by_run = _mm_maskz_loadu_ps((__mmask8)((1 << runs) - 1), s + c / INT4_CHUNK);
    } else {
        float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int q = 0; q < runs; q++) t[q] = s[(c + INT4_CHUNK * q) / g];
        by_run = _mm_loadu_ps(t);
    }
    return _mm512_permutexvar_ps(run_of_lane, _mm512_castps128_ps512(by_run));
}

/* sums[r * M + i] = x[i, :k] . W[r, :k] for R rows by vdpbf16ps. xp: x in bfloat16 in the words' order (ldxp:
 * k rounded up to 128, zeros past k); xsum[i * lds + group] the sum of row i of x over the group. */
static inline __attribute__((always_inline)) void block_i4_dpbf16(const uint16_t *restrict xp, const int64_t ldxp,
                                                                  const float *restrict xsum,
                                                                  const uint8_t *restrict u, const int64_t ldu,
                                                                  const float *restrict s, const float *restrict z,
                                                                  const float *restrict mn, const int64_t lds,
                                                                  const int64_t k,
                                                                  const int64_t g, const int M, const int R,
                                                                  float *restrict sums) {
    const __m512i nibble = _mm512_set1_epi16(0x000F), one = _mm512_set1_epi16(0x3F80);
    __m512 acc[8][8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) acc[r][i] = _mm512_setzero_ps();
    /* a span's sums share a scale per lane: a group of whole steps (W4A16 g128: one broadcast, one multiply a
     * group), else one step, whose runs' scales differ */
    const int whole_steps = g % INT4_STEP == 0;
    const int64_t span = whole_steps ? g : INT4_STEP;
    for (int64_t c0 = 0, grp = 0; c0 < k; c0 += span, grp++) {
        __m512 part[8][8];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) part[r][i] = _mm512_setzero_ps();
        for (int64_t c = c0; c < c0 + span && c < k; c += INT4_STEP) {
            const int64_t byte = c / 2;
            /* a step past k reads only its bytes: the rest are 0, words 1.0 against x's zeros */
            const __mmask64 live = k - c >= INT4_STEP ? ~(__mmask64)0 : (((__mmask64)1 << ((k - c) / 2)) - 1);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                __builtin_prefetch(u + INT4_PREFETCH_BYTES + (c / INT4_STEP * R + r) * 64, 0, 3);
                const __m512i w = _mm512_maskz_loadu_epi8(live, u + r * ldu + byte);
                /* each 16-bit lane's 4 nibbles into the mantissa's low bits of 1.0: (A & B) | C is 0xEA */
                const __m512bh w0 = (__m512bh)_mm512_ternarylogic_epi32(w, nibble, one, 0xEA),
                               w1 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 4), nibble, one, 0xEA),
                               w2 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 8), nibble, one, 0xEA),
                               w3 = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 12), one);
#pragma GCC unroll 8
                for (int i = 0; i < M; i++) {
                    const uint16_t *xs = xp + i * ldxp + c;
                    part[r][i] = _mm512_dpbf16_ps(part[r][i], w0, (__m512bh)_mm512_loadu_si512(xs));
                    part[r][i] = _mm512_dpbf16_ps(part[r][i], w1, (__m512bh)_mm512_loadu_si512(xs + 32));
                    part[r][i] = _mm512_dpbf16_ps(part[r][i], w2, (__m512bh)_mm512_loadu_si512(xs + 64));
                    part[r][i] = _mm512_dpbf16_ps(part[r][i], w3, (__m512bh)_mm512_loadu_si512(xs + 96));
                }
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m512 scale = whole_steps ? _mm512_set1_ps(s[r * lds + grp]) : run_scales(s + r * lds, c0, g, k);
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) acc[r][i] = _mm512_fmadd_ps(part[r][i], scale, acc[r][i]);
        }
    }
    /* Each row's offset, the sum over groups of (scale * (128 + z), or 128 scale + the min) * (the group's sum of
     * x), is taken off lane by lane before the one reduction a row: a group count under 16 (K = 896 at g128: 7) is
     * one masked load, and a 1-row block of 8 reduces its 8 vectors together (the reductions were a third of a
     * small layer's time: K = 896 is 7 steps a row). */
    __m512 total[8][8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            const float *sr = s + r * lds, *zr = z ? z + r * lds : NULL, *mr = mn ? mn + r * lds : NULL,
                        *xi = xsum + i * lds;
            __m512 offsets = _mm512_setzero_ps();
            for (int64_t grp = 0; grp < lds; grp += 16) {
                const __mmask16 in = lds - grp >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (lds - grp)) - 1);
                const __m512 sv = _mm512_maskz_loadu_ps(in, sr + grp);
                const __m512 coef =
                    mr ? _mm512_fmadd_ps(sv, _mm512_set1_ps(INT4_BIAS), _mm512_maskz_loadu_ps(in, mr + grp))
                       : _mm512_mul_ps(sv, _mm512_add_ps(_mm512_set1_ps(INT4_BIAS),
                                                         zr ? _mm512_maskz_loadu_ps(in, zr + grp)
                                                            : _mm512_set1_ps(8.0f)));
                offsets = _mm512_fmadd_ps(coef, _mm512_maskz_loadu_ps(in, xi + grp), offsets);
            }
            total[r][i] = _mm512_fmsub_ps(_mm512_set1_ps(INT4_BIAS), acc[r][i], offsets);
        }
    if (M == 1 && R == 8) {
        /* 8 vectors to 8 sums: 128-bit chunks folded pairwise, then lanes, row c in chunk c % 4 */
        __m512 pair[4];
        for (int p = 0; p < 4; p++)
            pair[p] = _mm512_add_ps(_mm512_shuffle_f32x4(total[2 * p][0], total[2 * p + 1][0], 0x44),
                                    _mm512_shuffle_f32x4(total[2 * p][0], total[2 * p + 1][0], 0xEE));
        const __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(pair[0], pair[1], 0x88),
                                        _mm512_shuffle_f32x4(pair[0], pair[1], 0xDD)),
                     hi = _mm512_add_ps(_mm512_shuffle_f32x4(pair[2], pair[3], 0x88),
                                        _mm512_shuffle_f32x4(pair[2], pair[3], 0xDD));
        const __m512 t = _mm512_add_ps(_mm512_unpacklo_ps(lo, hi), _mm512_unpackhi_ps(lo, hi));
        const __m512 rows = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));
        _mm256_storeu_ps(sums, _mm512_castps512_ps256(
                                   _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0,
                                                                           0, 0),
                                                         rows)));
        return;
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) sums[r * M + i] = _mm512_reduce_add_ps(total[r][i]);
}

#define INT4_BLOCK_DPBF16(M, j, rows, sums)                                                                       \
    block_i4_dpbf16(xp, ldxp, xsum, u + (j) * ldu, ldu, s + (j) * lds, z ? z + (j) * lds : NULL,                 \
                    mn ? mn + (j) * lds : NULL, lds, k, g, M, rows, sums)

#define DEFINE_INT4_DPBF16_M(M)                                                                                   \
    static void gemv_int4_dpbf16_##M(const uint16_t *xp, int64_t ldxp, const float *xsum, int64_t k,              \
                                     const uint8_t *u, const float *s, const float *z, const float *mn,          \
                                     int64_t g, int64_t n,                                                        \
                                     void *out, int64_t ldo, int out_kind) {                                      \
        const int R = INT4_DPBF16_ROWS(M);                                                                        \
        const int64_t lds = k / g, ldu = k / 2;                                                                   \
        for (int64_t b_ = 0; b_ < INT4_PREFETCH_BYTES && b_ < n * ldu; b_ += 64) /* the first blocks' too */      \
            __builtin_prefetch(u + b_, 0, 3);                                                                     \
        GEMV_ROW_BLOCKS(M, R, n, (M) * n * k, INT4_PARALLEL_MIN_MACS, out, ldo, out_kind, INT4_BLOCK_DPBF16);     \
    }
DEFINE_INT4_DPBF16_M(1) DEFINE_INT4_DPBF16_M(2) DEFINE_INT4_DPBF16_M(3) DEFINE_INT4_DPBF16_M(4)
DEFINE_INT4_DPBF16_M(5) DEFINE_INT4_DPBF16_M(6) DEFINE_INT4_DPBF16_M(7) DEFINE_INT4_DPBF16_M(8)

/* rows of bfloat16 x into xp, zeros past k, and each row's group sums. A step's 16-bit lane p of weights (bytes 2p,
 * 2p + 1 of its 64: run q = p / 8, e = 2 (p % 8)) holds inputs 32q + e, + 16 + e, + e + 1, + 16 + e + 1 in its
 * 4 nibbles, which the 4 words w0..w3 take in turn: x's 4 vectors of the step are those inputs, lane by lane.
 * (Run at every call: two-source word permutes, not a scalar loop, which cost as much as a small layer's GEMV.) */
static void arrange_bf16_x(const uint16_t *x, int64_t ldx, int64_t rows, int64_t k, int64_t g, uint16_t *xp,
                           int64_t ldxp, float *xsum) {
    static const int nibble_input[4] = {0, 16, 1, 17}; /* w0..w3's input past 32q + e */
    __m512i pick[4]; /* lane p < 16 from runs 0 | 1 (indices 32..63 the second), p >= 16 from runs 2 | 3 */
    for (int t = 0; t < 4; t++) {
        uint16_t idx[32];
        for (int p = 0; p < 32; p++) idx[p] = (uint16_t)(32 * ((p / 8) % 2) + 2 * (p % 8) + nibble_input[t]);
        pick[t] = _mm512_loadu_si512(idx);
    }
    for (int64_t i = 0; i < rows; i++) {
        const uint16_t *xi = x + i * ldx;
        uint16_t *pi = xp + i * ldxp;
        for (int64_t c = 0; c < ldxp; c += INT4_STEP) {
            __m512i run[4];
            for (int q = 0; q < 4; q++) /* k - c is a multiple of 32: a run is all in or all out */
                run[q] = c + INT4_CHUNK * q < k ? _mm512_loadu_si512(xi + c + INT4_CHUNK * q) : _mm512_setzero_si512();
            for (int t = 0; t < 4; t++)
                _mm512_storeu_si512(pi + c + 32 * t,
                                    _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_permutex2var_epi16(run[0], pick[t], run[1]),
                                                            _mm512_permutex2var_epi16(run[2], pick[t], run[3])));
        }
        for (int64_t grp = 0; grp < k / g; grp++) {
            __m512 sum = _mm512_setzero_ps();
            for (int64_t t = grp * g; t < (grp + 1) * g; t += 16) /* bfloat16 to float32: the bits shifted up */
                sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(
                                             _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xi + t))), 16)));
            xsum[i * (k / g) + grp] = _mm512_reduce_add_ps(sum);
        }
    }
}
#endif

const char *gemv_int4_variant(void) {
#if defined(INT4_DPBF16)
    return "avx512bf16";
#elif HALF_VW == 16
    return "avx512";
#elif HALF_VW == 8
    return "avx2";
#else
    return "scalar";
#endif
}

/* sums of a block of rows j .. j + rows for GEMV_ROW_BLOCKS (inside gemv_int4_M, whose locals it reads) */
#define INT4_BLOCK(M, j, rows, sums)                                                                              \
    block_i4(x, ldx, xsum, u + (j) * ldu, ldu, s + (j) * lds, z ? z + (j) * lds : NULL, mn ? mn + (j) * lds : NULL, \
             lds, k, g, M, rows, sums)

#define DEFINE_INT4_M(M)                                                                                          \
    static void gemv_int4_##M(const float *x, int64_t ldx, const float *xsum, int64_t k, const uint8_t *u,        \
                              const float *s, const float *z, const float *mn, int64_t g, int64_t n, void *out,   \
                              int64_t ldo, int out_kind) {                                                        \
        const int R = INT4_ROWS_PER_BLOCK(M);                                                                     \
        const int64_t lds = k / g, ldu = k / 2;                                                                   \
        GEMV_ROW_BLOCKS(M, R, n, (M) * n * k, INT4_PARALLEL_MIN_MACS, out, ldo, out_kind, INT4_BLOCK);            \
    }
DEFINE_INT4_M(1) DEFINE_INT4_M(2) DEFINE_INT4_M(3) DEFINE_INT4_M(4)
DEFINE_INT4_M(5) DEFINE_INT4_M(6) DEFINE_INT4_M(7) DEFINE_INT4_M(8)

/* x [m, k] (row stride ldx) float32 (x_kind 0), bfloat16 (1) or float16 (2); u [n, k / 2] nibbles (the layout
 * above) contiguous, scales [n, k / g] float32 contiguous, zeros NULL (symmetric) or [n, k / g] float32 (8 + zero
 * point), mins NULL or [n, k / g] float32 with zeros NULL: W = scale * u - min (GGUF's Q4_K, whose offset dmin * m
 * is no multiple of the scale; the table form's weight is then the float32 value gguf dequantizes to), out [m, n]
 * (row stride ldo) float32 (out_kind 0), bfloat16 (1) or float16 (2). More than 8 rows go 8 at a time, each pass
 * streaming the weight again (the caller's crossover decides how many). bfloat16 x takes vdpbf16ps where the CPU
 * has it (gemv_int4_variant()), the others float32 sums of x widened. Returns -1 (nothing written) unless m >= 1, g
 * is a multiple of 32 and k of g (and zeros or mins is NULL); -2 if a buffer for x could not be had. */
int gemv_int4_blocks(const void *x, int x_kind, int64_t ldx, int64_t m, int64_t k, const uint8_t *u,
                     const float *scales, const float *zeros, const float *mins, int64_t g, int64_t n, void *out,
                     int64_t ldo, int out_kind) {
    typedef void (*by_rows_fn)(const float *, int64_t, const float *, int64_t, const uint8_t *, const float *,
                               const float *, const float *, int64_t, int64_t, void *, int64_t, int);
    static const by_rows_fn by_rows[INT4_GEMV_MAX_ROWS + 1] = {
        NULL, gemv_int4_1, gemv_int4_2, gemv_int4_3, gemv_int4_4, gemv_int4_5, gemv_int4_6, gemv_int4_7, gemv_int4_8};
    if (m < 1 || g < INT4_CHUNK || g % INT4_CHUNK || k % g || x_kind < 0 || x_kind > 2 || (zeros && mins)) return -1;
    const int64_t size = out_kind == 0 ? 4 : 2, groups = k / g;
    const int64_t pass = m < INT4_GEMV_MAX_ROWS ? m : INT4_GEMV_MAX_ROWS;
    float xsum[INT4_GEMV_MAX_ROWS * groups]; /* a few KB: 8 rows x K / 32 at most */
#if defined(INT4_DPBF16)
    if (x_kind == 1) {
        typedef void (*dpbf16_fn)(const uint16_t *, int64_t, const float *, int64_t, const uint8_t *, const float *,
                                  const float *, const float *, int64_t, int64_t, void *, int64_t, int);
        static const dpbf16_fn by_rows_dpbf16[INT4_GEMV_MAX_ROWS + 1] = {
            NULL, gemv_int4_dpbf16_1, gemv_int4_dpbf16_2, gemv_int4_dpbf16_3, gemv_int4_dpbf16_4,
            gemv_int4_dpbf16_5, gemv_int4_dpbf16_6, gemv_int4_dpbf16_7, gemv_int4_dpbf16_8};
        const int64_t ldxp = (k + INT4_STEP - 1) / INT4_STEP * INT4_STEP;
        uint16_t *xp = malloc((size_t)(pass * ldxp) * sizeof *xp);
        if (!xp) return -2;
        for (int64_t i = 0; i < m; i += INT4_GEMV_MAX_ROWS) {
            const int64_t rows = m - i < INT4_GEMV_MAX_ROWS ? m - i : INT4_GEMV_MAX_ROWS;
            arrange_bf16_x((const uint16_t *)x + i * ldx, ldx, rows, k, g, xp, ldxp, xsum);
            by_rows_dpbf16[rows](xp, ldxp, xsum, k, u, scales, zeros, mins, g, n, (char *)out + i * ldo * size, ldo,
                                 out_kind);
        }
        free(xp);
        return 0;
    }
#endif
    float *widened = NULL; /* half x as float32, a pass at a time */
    if (x_kind != 0 && !(widened = malloc((size_t)(pass * k) * sizeof *widened))) return -2;
    for (int64_t i = 0; i < m; i += INT4_GEMV_MAX_ROWS) {
        const int64_t rows = m - i < INT4_GEMV_MAX_ROWS ? m - i : INT4_GEMV_MAX_ROWS;
        const float *xf = (const float *)x + i * ldx;
        int64_t ldf = ldx;
        if (widened) {
            for (int64_t row = 0; row < rows; row++)
                for (int64_t t = 0; t < k; t++)
                    widened[row * k + t] = half_to_f32(((const uint16_t *)x)[(i + row) * ldx + t], x_kind == 1);
            xf = widened;
            ldf = k;
        }
        for (int64_t row = 0; row < (HALF_VW == 16 ? 0 : rows); row++) /* the factored form's group sums of x */
            for (int64_t grp = 0; grp < groups; grp++) {
                float sum = 0.0f;
                for (int64_t t = grp * g; t < (grp + 1) * g; t++) sum += xf[row * ldf + t];
                xsum[row * groups + grp] = sum;
            }
        by_rows[rows](xf, ldf, xsum, k, u, scales, zeros, mins, g, n, (char *)out + i * ldo * size, ldo, out_kind);
    }
    free(widened);
    return 0;
}

/* GGUF Q8_0 and Q5_0 matrices times x as llama.cpp's CPU backend multiplies them, for any number of rows of x:
 * out[M, N] = x[M, K] @ W^T with x quantized per block of 32 (Q8_0's activations, below), each block's 32 products
 * summed exactly in int32, then, block after block in float32, out += isum * (d_w * d_x).
 *
 * The weight is packed at load in panels of 16 rows (cpu_q8_0_panels.h; cpu_quantized.pack_q8_0_panels and
 * pack_q5_0_panels): per block of 32 inputs, 8 runs, run t holding the panel's 16 rows at inputs 4t .. 4t + 3 (one
 * int32 lane a row) as unsigned bytes, Q8_0 as stored (value + 128), Q5_0 widened from its nibbles and fifth bits
 * (value + 16) in a few instructions. So a run is one vector of 16 rows' 4 inputs, and one vpdpbusd multiplies it by
 * 4 broadcast bytes of a row of x: a row of x costs 8 vpdpbusd, a conversion, two multiplies and an add for 16 x 32
 * products. The earlier rows-in-tiles form put its lanes along K, so every 64 products brought a conversion, a
 * multiply and an FMA, then a reduction per output, and every 8 rows of x another pass over the weight. Here up to
 * 8 rows of x take a pass over a panel with their int32 sums and float accumulators in registers, and more rows
 * take more passes over the same panel while it is in cache: the weight streams from memory once whatever M is.
 * Two threads, a 0.5B's gate_up at 16 rows, hot: 0.44 against 1.86 ms; its lm_head at 16 rows 12.9 against 24.1;
 * from a cold weight faster than a bfloat16 product on a dequantized copy at every row count measured, up to 512
 * (bench/log, seventh session).
 *
 *   AVX512-VNNI: the int32 lanes start at -128 * the x block's byte sum (-16 * for Q5_0: shifted down, exactly),
 *                made when x is quantized, which cancels the weight's offset: a lane's sum is the block's exact
 *                sum of q * xq.
 *   AVX2:        a run in two halves of 8 rows; vpmaddubsw's pairs saturate at int16, so Q8_0 multiplies |q| by xq
 *                with q's sign (|xq| <= 127: a pair at most 2 * 128 * 127), Q5_0 its u < 32 by xq with the same
 *                offset correction; vpmaddwd widens the pairs. Two rows of x a pass (16 registers); 9-25x the plain
 *                loops on a 0.5B's gate_up (bench/log, seventh session).
 *   otherwise:   the same sums in plain loops.
 * q8_0_variant() names the choice. The float arithmetic is the reference's, operation by operation (this file is
 * compiled with -ffp-contract=off: no multiply and add fuse), so the outputs are the torch reference's bits
 * (tests/e2e/test_kernels_cpu_gemm_q8_0.py) whatever the thread count: each output is one thread's, the panels
 * split over the threads (static).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_half.h"
#include "cpu_q8_0_panels.h"

/* x quantized per block of 32 as llama.cpp's CPU backend quantizes it for a Q8_0 product: d = max|x| / 127,
 * xq = round-half-even(x / d) clamped to [-128, 127], the quotient exact (vdivps, as torch's division in the tests'
 * reference); a zero block: xq = 0, d = 0. */
#define Q8_BLOCK 32

#if defined(__AVX512F__)
/* 16 values of x from element i (x_kind 0 float32, 1 bfloat16, 2 float16), widened. */
static inline __m512 x_load16(const void *x, int x_kind, int64_t i) {
    if (x_kind == 0) return _mm512_loadu_ps((const float *)x + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    if (x_kind == 1) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}
#else
static inline float x_at(const void *x, int x_kind, int64_t i) {
    return x_kind == 0 ? ((const float *)x)[i] : half_to_f32(((const uint16_t *)x)[i], x_kind == 1);
}
#endif

/* x's block of 32 from element b into xq[0 .. 32); returns its d. */
static inline float q8_quantize_block(const void *x, int x_kind, int64_t b, int8_t *xq) {
#if defined(__AVX512F__)
    const __m512 lo = x_load16(x, x_kind, b), hi = x_load16(x, x_kind, b + 16);
    const float scale = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi))) / 127.0f;
    const __m512 vscale = _mm512_set1_ps(scale), low = _mm512_set1_ps(-128.0f), high = _mm512_set1_ps(127.0f);
    const __m512 halves[2] = {lo, hi};
    for (int h = 0; h < 2; h++) {  /* 0 / 0: 0 */
        __m512 r = _mm512_roundscale_ps(_mm512_div_ps(halves[h], vscale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm512_min_ps(_mm512_max_ps(r, low), high);
        if (scale == 0.0f) r = _mm512_setzero_ps();
        _mm512_mask_cvtepi32_storeu_epi8(xq + 16 * h, 0xffff, _mm512_cvtps_epi32(r));
    }
    return scale;
#else
    float v[Q8_BLOCK], amax = 0.0f;
    for (int t = 0; t < Q8_BLOCK; t++) {
        v[t] = x_at(x, x_kind, b + t);
        const float a = __builtin_fabsf(v[t]);
        amax = a > amax ? a : amax;
    }
    const float scale = amax / 127.0f;
    for (int t = 0; t < Q8_BLOCK; t++) {  /* rint: half to even */
        float r = scale == 0.0f ? 0.0f : __builtin_rintf(v[t] / scale);
        r = r < -128.0f ? -128.0f : r > 127.0f ? 127.0f : r;
        xq[t] = (int8_t)r;
    }
    return scale;
#endif
}

#define Q8P_ROWS Q8_0_PANEL_ROWS
#define Q8P_MR 8                             /* rows of x a pass over a panel */
#define Q8P_PARALLEL_MIN_MACS (1 << 17)
#define Q8P_PREFETCH_BYTES 4096
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q8P_VNNI 1
#elif defined(__AVX2__) && defined(__F16C__)
#define Q8P_AVX2 1
#endif

const char *q8_0_variant(void) {
#if defined(Q8P_VNNI)
    return "avx512vnni";
#elif defined(Q8P_AVX2)
    return "avx2";
#else
    return "portable";
#endif
}

/* One call's quantized x: row i's values at xq + i * k, its blocks' d at d + i * nb and -128 * each block's byte
 * sum at corr + i * nb (nb = k / 32). */
typedef struct {
    int8_t *xq;
    int32_t *corr;
    float *d;
    int64_t k, nb;
} q8p_x;

#if defined(Q8P_VNNI)
/* Run t of a block's weight as vpdpbusd's unsigned bytes: Q8_0's as stored, Q5_0's (five) widened (its u). */
static inline __attribute__((always_inline)) __m512i panel_run(const uint8_t *restrict wb, const int t, const int five) {
    return five ? q5_0_panel_run(wb, t) : _mm512_loadu_si512(wb + 64 * t);
}
#elif !defined(Q8P_AVX2)
/* Value e of row c in run t of a block's weight, signed. */
static inline int32_t panel_value(const uint8_t *wb, const int t, const int c, const int e, const int five) {
    return five ? q5_0_panel_u(wb, t, 4 * c + e) - 16 : (int32_t)wb[64 * t + 4 * c + e] - 128;
}
#endif

#if !defined(Q8P_VNNI) && defined(Q8P_AVX2)
/* Half h (rows 8h .. 8h + 7) of run t, as vpmaddubsw's operands: Q8_0's as the signed values' magnitudes (*w: the
 * values, whose signs x takes), Q5_0's as u = value + 16 (unsigned, < 32: no pair of products saturates int16). */
static inline __attribute__((always_inline)) __m256i avx2_run(const uint8_t *restrict wb, const int t, const int h,
                                                              const int five, __m256i *w) {
    if (!five) {
        *w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wb + 64 * t + 32 * h)), _mm256_set1_epi8((char)0x80));
        return _mm256_abs_epi8(*w);
    }
    const __m256i pair = _mm256_loadu_si256((const __m256i *)(wb + 64 * (t / 2) + 32 * h));
    const __m256i u = _mm256_and_si256(t % 2 ? _mm256_srli_epi16(pair, 4) : pair, _mm256_set1_epi8(0x0F));
    int32_t bits;
    memcpy(&bits, wb + Q5_0_PANEL_NIBBLE_BYTES + 8 * t + 4 * h, 4);
    /* byte i of the half gets bit i of the 32: its word byte i / 8, then its bit by a mask and a compare */
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(bits),
                                               _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2,
                                                                2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_add_epi8(u, _mm256_and_si256(set, _mm256_set1_epi8(16)));
}

/* panel_rows for R (1 or 2) rows of x from row i: 16-bit pair sums widened by vpmaddwd, in two halves of 8 rows. */
static inline __attribute__((always_inline)) void avx2_rows(const q8p_x *restrict s, const int64_t i, const int R,
                                                            const uint8_t *restrict w, const uint16_t *restrict sc,
                                                            const int five, float acc_out[][Q8P_ROWS]) {
    const int64_t nb = s->nb, k = s->k, block_bytes = five ? Q5_0_PANEL_BLOCK_BYTES : Q8_0_PANEL_BLOCK_BYTES;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[2][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + b * block_bytes;
        __builtin_prefetch(wb + Q8P_PREFETCH_BYTES, 0, 3);
        __m256i sums[2][2];
        for (int r = 0; r < R; r++)
            sums[r][0] = sums[r][1] = _mm256_set1_epi32(five ? s->corr[(i + r) * nb + b] >> 3 : 0);
#pragma GCC unroll 8
        for (int t = 0; t < Q8_BLOCK / 4; t++)
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                __m256i values;
                const __m256i a = avx2_run(wb, t, h, five, &values);
                for (int r = 0; r < R; r++) {
                    int32_t four;
                    memcpy(&four, s->xq + (i + r) * k + b * Q8_BLOCK + 4 * t, 4);
                    const __m256i xb = _mm256_set1_epi32(four);
                    const __m256i pairs = _mm256_maddubs_epi16(a, five ? xb : _mm256_sign_epi8(xb, values));
                    sums[r][h] = _mm256_add_epi32(sums[r][h], _mm256_madd_epi16(pairs, ones));
                }
            }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + b * Q8P_ROWS + 8 * h)));
            for (int r = 0; r < R; r++) {
                const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(s->d[(i + r) * nb + b]));
                acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(_mm256_cvtepi32_ps(sums[r][h]), scale));
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(acc_out[r], acc[r][0]);
        _mm256_storeu_ps(acc_out[r] + 8, acc[r][1]);
    }
}
#endif

/* acc[i][c] = x row i0 + i . W row (panel's) c, for M rows: w and sc are the panel's weight and scales; five: Q5_0's
 * layout (values + 16: the correction -128 * the byte sum shifted down, exactly, to -16 *). */
static inline __attribute__((always_inline)) void panel_rows(const q8p_x *restrict s, const int64_t i0, const int M,
                                                             const uint8_t *restrict w, const uint16_t *restrict sc,
                                                             const int five, float acc_out[Q8P_MR][Q8P_ROWS]) {
    const int64_t nb = s->nb, k = s->k, block_bytes = five ? Q5_0_PANEL_BLOCK_BYTES : Q8_0_PANEL_BLOCK_BYTES;
#if defined(Q8P_VNNI)
    __m512 acc[Q8P_MR];
#pragma GCC unroll 8
    for (int i = 0; i < M; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + b * block_bytes;
        __builtin_prefetch(wb + Q8P_PREFETCH_BYTES, 0, 3);
        __builtin_prefetch(wb + Q8P_PREFETCH_BYTES + 256, 0, 3);
        __m512i sums[Q8P_MR];
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) sums[i] = _mm512_set1_epi32(s->corr[(i0 + i) * nb + b] >> (five ? 3 : 0));
#pragma GCC unroll 8
        for (int t = 0; t < Q8_BLOCK / 4; t++) {
            const __m512i wv = panel_run(wb, t, five);
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) {
                int32_t four;
                memcpy(&four, s->xq + (i0 + i) * k + b * Q8_BLOCK + 4 * t, 4);
                sums[i] = _mm512_dpbusd_epi32(sums[i], wv, _mm512_set1_epi32(four));
            }
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + b * Q8P_ROWS)));
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(s->d[(i0 + i) * nb + b]));
            acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_cvtepi32_ps(sums[i]), scale));
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; i++) _mm512_storeu_ps(acc_out[i], acc[i]);
#elif defined(Q8P_AVX2)
    (void)nb, (void)k, (void)block_bytes;
#pragma GCC unroll 4
    for (int i = 0; i < M; i += 2) {  /* 16 registers: two rows of x a pass over the panel's block, it in L1 */
        if (M - i >= 2)
            avx2_rows(s, i0 + i, 2, w, sc, five, acc_out + i);
        else
            avx2_rows(s, i0 + i, 1, w, sc, five, acc_out + i);
    }
#else
    for (int i = 0; i < M; i++)
        for (int c = 0; c < Q8P_ROWS; c++) acc_out[i][c] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + b * block_bytes;
        for (int i = 0; i < M; i++) {
            const int8_t *xq = s->xq + (i0 + i) * k + b * Q8_BLOCK;
            int32_t sums[Q8P_ROWS] = {0};
            for (int t = 0; t < Q8_BLOCK / 4; t++)
                for (int c = 0; c < Q8P_ROWS; c++)
                    for (int e = 0; e < 4; e++) sums[c] += panel_value(wb, t, c, e, five) * xq[4 * t + e];
            const float dx = s->d[(i0 + i) * nb + b];
            for (int c = 0; c < Q8P_ROWS; c++) {
                const float scale = f16_to_f32(sc[b * Q8P_ROWS + c]) * dx;
                acc_out[i][c] = acc_out[i][c] + (float)sums[c] * scale;
            }
        }
    }
#endif
}

/* A panel's sums for M rows of x from row i0, written to out's rows i0 .. i0 + M at columns j .. j + cols. */
static void put_panel(float acc[Q8P_MR][Q8P_ROWS], const int M, const int64_t i0, const int64_t j, const int cols,
                      void *out, const int64_t ldo, const int out_kind) {
    for (int i = 0; i < M; i++) {
        const int64_t at = (i0 + i) * ldo + j;
        if (cols == Q8P_ROWS && out_kind != 0) {
            for (int c = 0; c < Q8P_ROWS; c += HALF_VW) store_half((uint16_t *)out + at + c, load_f32(acc[i] + c), out_kind == 1);
        } else if (cols == Q8P_ROWS) {
            memcpy((float *)out + at, acc[i], sizeof acc[i]);
        } else {
            for (int c = 0; c < cols; c++) {
                if (out_kind == 0)
                    ((float *)out)[at + c] = acc[i][c];
                else
                    ((uint16_t *)out)[at + c] = f32_to_half(acc[i][c], out_kind == 1);
            }
        }
    }
}

#define Q8P_CASE(M) case M: if (five) panel_rows(s, i0, M, w, sc, 1, acc); else panel_rows(s, i0, M, w, sc, 0, acc); break;

/* Panel p over every row of x, Q8P_MR at a time (constant counts and forms: each unrolled into registers). */
static void panel(const q8p_x *s, const int64_t m, const uint8_t *w, const uint16_t *sc, const int five,
                  const int64_t p, const int64_t n, void *out, const int64_t ldo, const int out_kind) {
    const int64_t j = p * Q8P_ROWS;
    const int cols = n - j < Q8P_ROWS ? (int)(n - j) : Q8P_ROWS;
    for (int64_t i0 = 0; i0 < m; i0 += Q8P_MR) {
        float acc[Q8P_MR][Q8P_ROWS];
        const int rows = m - i0 < Q8P_MR ? (int)(m - i0) : Q8P_MR;
        switch (rows) {
            Q8P_CASE(1) Q8P_CASE(2) Q8P_CASE(3) Q8P_CASE(4) Q8P_CASE(5) Q8P_CASE(6) Q8P_CASE(7) Q8P_CASE(8)
        }
        put_panel(acc, rows, i0, j, cols, out, ldo, out_kind);
    }
}

/* x [m, k] (x_kind 0 float32, 1 bfloat16, 2 float16; row stride ldx) @ a weight packed in panels (cpu_q8_0_panels.h;
 * five: Q5_0's, else Q8_0's) with its scales [ceil(n / 16), k / 32, 16] float16 -> out [m, n] (row stride ldo;
 * out_kind 0 float32, 1 bfloat16, 2 float16, rounded once). Returns 0, or -1 (nothing written) unless m, n >= 1
 * and k is a multiple of 32, or when the scratch cannot be had. */
static int gemm_panels(const void *x, int x_kind, int64_t ldx, int64_t m, int64_t k, const uint8_t *w,
                       const uint16_t *scales, int64_t n, void *out, int64_t ldo, int out_kind, const int five) {
    if (m < 1 || n < 1 || k < Q8_BLOCK || k % Q8_BLOCK || x_kind < 0 || x_kind > 2 || out_kind < 0 || out_kind > 2)
        return -1;
    const int64_t nb = k / Q8_BLOCK, x_size = x_kind == 0 ? 4 : 2;
    const int64_t panel_bytes = nb * (five ? Q5_0_PANEL_BLOCK_BYTES : Q8_0_PANEL_BLOCK_BYTES);
    char *scratch = malloc((size_t)(m * k + 2 * m * nb * 4));
    if (scratch == NULL) return -1;
    q8p_x s = {(int8_t *)scratch, (int32_t *)(scratch + m * k), (float *)(scratch + m * k + m * nb * 4), k, nb};
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < nb; b++) {
            int8_t *xq = s.xq + i * k + b * Q8_BLOCK;
            s.d[i * nb + b] = q8_quantize_block((const char *)x + i * ldx * x_size, x_kind, b * Q8_BLOCK, xq);
            int32_t sum = 0;
            for (int t = 0; t < Q8_BLOCK; t++) sum += xq[t];
            s.corr[i * nb + b] = -128 * sum;
        }
    const int64_t panels = (n + Q8P_ROWS - 1) / Q8P_ROWS;
#pragma omp parallel for schedule(static) if (m * n * k >= Q8P_PARALLEL_MIN_MACS)
    for (int64_t p = 0; p < panels; p++)
        panel(&s, m, w + p * panel_bytes, scales + p * nb * Q8P_ROWS, five, p, n, out, ldo, out_kind);
    free(scratch);
    return 0;
}

int gemm_q8_0_panels(const void *x, int x_kind, int64_t ldx, int64_t m, int64_t k, const uint8_t *w,
                     const uint16_t *scales, int64_t n, void *out, int64_t ldo, int out_kind) {
    return gemm_panels(x, x_kind, ldx, m, k, w, scales, n, out, ldo, out_kind, 0);
}

int gemm_q5_0_panels(const void *x, int x_kind, int64_t ldx, int64_t m, int64_t k, const uint8_t *w,
                     const uint16_t *scales, int64_t n, void *out, int64_t ldo, int out_kind) {
    return gemm_panels(x, x_kind, ldx, m, k, w, scales, n, out, ldo, out_kind, 1);
}

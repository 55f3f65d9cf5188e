/* W8A8: out[M, N] = (xq[M, K] @ q[N, K]^T) * x_scale[M] * w_scale[N], where q is the checkpoint's int8 weight
 * (per output channel, symmetric) and xq each row of x quantized to int8 on entry (symmetric, per token:
 * scale = max|row| / 127, a zero row 1; xq = round-half-even(x / scale)), the int8 products summed exactly in
 * int32. torch's _int_mm ran a decode row slower than bf16's GEMV and the per-token quantization as five torch
 * ops read x five times (bench/log); here x is read once, quantized into a scratch row, and every output
 * column block multiplies all rows from registers.
 *
 * The weight is packed at load (kernels/cpu_native.py pack_w8a8_weight) in panels of 16 output columns,
 * four consecutive K bytes per int32 lane: [ceil(N / 16), ceil(K / 4), 16, 4], zero past N and K, so one
 * 64-byte load is a panel's 16 columns at 4 inputs, what one vpdpbusd multiplies by 4 broadcast bytes of x.
 *   AVX512-VNNI: vpdpbusd multiplies unsigned by signed bytes, so the scratch holds xq + 128 (1..255) and the
 *                sums lose 128 * the column's weight sum (precomputed at load: ``bias128``); K < 65793 keeps
 *                255 * 128 * K inside int32.
 *   AVX2:        vpmaddubsw's pair sums saturate at int16, so |q| (<= 128) is the unsigned side and xq with
 *                q's sign (|xq| <= 127) the signed one: a pair is at most 2 * 128 * 127 < 32768, exact; then
 *                vpmaddwd widens the pairs to int32.
 *   otherwise:   plain int32 loops.
 * Threads split the output columns in blocks of W8A8_NP panels (static: each reads its own weight once);
 * each block walks the rows W8A8_MR at a time, the block's weight staying in cache across them.
 *
 * A gated MLP's gate_up (w8a8_silu_gate) is packed with its panels alternating 16 gate and 16 up columns, so
 * a block holds both halves of its outputs and the tile's epilogue writes silu(gate) * up: the [M, 2 * size]
 * product never reaches memory, and the separate activation pass over it (~190 us a layer at 64 rows of the
 * 0.5B, bench/log) is gone. Its roundings are the unfused path's: gate and up rounded to x's dtype, then
 * cpu_silu_mul_half.c's two (this file too is compiled with -ffp-contract=off).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_half.h"
#include "cpu_softmax_exp.h"

#define W8A8_PANEL 16
#define W8A8_PARALLEL_MIN_MACS (1 << 17)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define W8A8_VNNI 1
#define W8A8_MR 6 /* 6 x 4 accumulators + 4 weight vectors + a broadcast: 29 of 32 registers */
#define W8A8_NP 4
#define W8A8_X_OFFSET 128
#elif defined(__AVX2__)
#define W8A8_AVX2 1
#define W8A8_MR 2 /* 2 x 4 accumulators (2 panels of 2 halves) + weights, their signs and temporaries: 16 */
#define W8A8_NP 2
#define W8A8_X_OFFSET 0
#else
#define W8A8_MR 4
#define W8A8_NP 2 /* even: a gated block holds whole (gate, up) panel pairs */
#define W8A8_X_OFFSET 0
#endif

const char *w8a8_variant(void) {
#if defined(W8A8_VNNI)
    return "avx512vnni";
#elif defined(W8A8_AVX2)
    return "avx2";
#else
    return "scalar";
#endif
}

static float half_at(const void *x, int x_kind, int64_t i) {
    return x_kind == 0 ? ((const float *)x)[i] : half_to_f32(((const uint16_t *)x)[i], x_kind == 1);
}

#if defined(__AVX512F__)
/* Up to 16 values of row from t (lanes of ``mask``), widened to float32; the others 0. */
static inline __m512 load16(const void *row, int x_kind, int64_t t, __mmask16 mask) {
    if (x_kind == 0) return _mm512_maskz_loadu_ps(mask, (const float *)row + t);
    const __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)row + t);
    if (x_kind == 1) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}
#endif

/* Row i of x (x_kind: 0 float32, 1 bfloat16, 2 float16) quantized into dst[0 .. k4 * 4) (+ W8A8_X_OFFSET, zero
 * past k); its scale, as quantize_per_token computes it in float32: from the row's max |x|, or ``absmax`` where
 * not NULL (a whole row's, of which x holds a tensor-parallel rank's slice). */
static float quantize_row(const void *x, int x_kind, int64_t ldx, int64_t i, int64_t k, int64_t k4, uint8_t *dst,
                          const float *absmax) {
#if defined(__AVX512F__)
    const void *row = (const char *)x + i * ldx * (x_kind == 0 ? 4 : 2);
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t t = 0; t < k && absmax == NULL; t += 16) {
        const __mmask16 mask = k - t >= 16 ? 0xffff : (__mmask16)((1u << (k - t)) - 1);
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(row, x_kind, t, mask)));
    }
    float scale = (absmax != NULL ? absmax[i] : _mm512_reduce_max_ps(vmax)) / 127.0f;
    if (scale == 0.0f) scale = 1.0f;
    const __m512 vscale = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-128.0f), hi = _mm512_set1_ps(127.0f);
    const __m512i offset = _mm512_set1_epi32(W8A8_X_OFFSET);
    for (int64_t t = 0; t < k; t += 16) {
        const __mmask16 mask = k - t >= 16 ? 0xffff : (__mmask16)((1u << (k - t)) - 1);
        /* the exact quotient (vdivps, as torch's division), rounded half to even, clamped */
        __m512 v = _mm512_roundscale_ps(_mm512_div_ps(load16(row, x_kind, t, mask), vscale),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
        _mm512_mask_cvtepi32_storeu_epi8(dst + t, mask, _mm512_add_epi32(_mm512_cvtps_epi32(v), offset));
    }
    for (int64_t t = k; t < k4 * 4; t++) dst[t] = W8A8_X_OFFSET;
    return scale;
#else
    float top = 0.0f;
    float row[k > 0 ? k : 1];
    for (int64_t t = 0; t < k; t++) {
        row[t] = half_at(x, x_kind, i * ldx + t);
        const float a = __builtin_fabsf(row[t]);
        top = a > top ? a : top;
    }
    float scale = (absmax != NULL ? absmax[i] : top) / 127.0f;
    if (scale == 0.0f) scale = 1.0f;
    for (int64_t t = 0; t < k; t++) {
        float v = __builtin_rintf(row[t] / scale);  /* the default rounding: half to even, torch.round's */
        v = v < -128.0f ? -128.0f : v > 127.0f ? 127.0f : v;
        dst[t] = (uint8_t)((int32_t)v + W8A8_X_OFFSET);
    }
    for (int64_t t = k; t < k4 * 4; t++) dst[t] = W8A8_X_OFFSET;
    return scale;
#endif
}

/* acc[r * W8A8_NP * 16 + p * 16 + c] = xq[r] . q[column p * 16 + c] for MR rows and NP panels, K4 steps of 4; xq
 * is a row tile's scratch (interleaved: step t's 4 bytes of row r at xq[t * W8A8_MR * 4 + r * 4], so one pointer
 * and constant offsets address every row's broadcast). */
static inline __attribute__((always_inline)) void tile(const uint8_t *restrict xq, const int8_t *restrict w,
                                                       int64_t k4, const int MR, const int NP, int32_t *restrict acc) {
#if defined(W8A8_VNNI)
    __m512i sums[W8A8_MR][W8A8_NP];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int p = 0; p < NP; p++) sums[r][p] = _mm512_setzero_si512();
    for (int64_t t = 0; t < k4; t++) {
        __m512i wv[W8A8_NP];
#pragma GCC unroll 8
        for (int p = 0; p < NP; p++) {
            wv[p] = _mm512_loadu_si512(w + (p * k4 + t) * 64);
            /* held in a register: GCC otherwise folds the load into every row's vpdpbusd, MR loads where one
             * will do, and the loads, not the multiplies, set the pace */
#ifndef W8A8_NO_PIN
            __asm__("" : "+v"(wv[p]));
#endif
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            int32_t four;
            memcpy(&four, xq + (t * W8A8_MR + r) * 4, 4);
            const __m512i xb = _mm512_set1_epi32(four);
#pragma GCC unroll 8
            for (int p = 0; p < NP; p++) sums[r][p] = _mm512_dpbusd_epi32(sums[r][p], xb, wv[p]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int p = 0; p < NP; p++) _mm512_storeu_si512(acc + (r * W8A8_NP + p) * 16, sums[r][p]);
#elif defined(W8A8_AVX2)
    __m256i sums[W8A8_MR][W8A8_NP][2];
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int p = 0; p < NP; p++) sums[r][p][0] = sums[r][p][1] = _mm256_setzero_si256();
    for (int64_t t = 0; t < k4; t++) {
        __m256i wv[W8A8_NP][2], aw[W8A8_NP][2];
#pragma GCC unroll 8
        for (int p = 0; p < NP; p++)
            for (int h = 0; h < 2; h++) {
                wv[p][h] = _mm256_loadu_si256((const __m256i *)(w + (p * k4 + t) * 64 + 32 * h));
                aw[p][h] = _mm256_abs_epi8(wv[p][h]);
            }
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            int32_t four;
            memcpy(&four, xq + (t * W8A8_MR + r) * 4, 4);
            const __m256i xb = _mm256_set1_epi32(four);
#pragma GCC unroll 8
            for (int p = 0; p < NP; p++)
                for (int h = 0; h < 2; h++) {
                    const __m256i pairs = _mm256_maddubs_epi16(aw[p][h], _mm256_sign_epi8(xb, wv[p][h]));
                    sums[r][p][h] = _mm256_add_epi32(sums[r][p][h], _mm256_madd_epi16(pairs, ones));
                }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int p = 0; p < NP; p++)
            for (int h = 0; h < 2; h++)
                _mm256_storeu_si256((__m256i *)(acc + (r * W8A8_NP + p) * 16 + 8 * h), sums[r][p][h]);
#else
    for (int r = 0; r < MR; r++)
        for (int p = 0; p < NP; p++) {
            int32_t *a = acc + (r * W8A8_NP + p) * 16;
            for (int c = 0; c < 16; c++) a[c] = 0;
            for (int64_t t = 0; t < k4; t++) {
                const int8_t *wp = w + (p * k4 + t) * 64;
                const int8_t *xp = (const int8_t *)(xq + (t * W8A8_MR + r) * 4);
                for (int c = 0; c < 16; c++)
                    for (int b = 0; b < 4; b++) a[c] += (int32_t)xp[b] * wp[4 * c + b];
            }
        }
#endif
}

/* The tile's sums, less the offset's share, scaled (acc * x_scale * w_scale, in that order: the reference's) and
 * stored as out_kind: 0 float32, 1 bfloat16, 2 float16, 3 the int32 sums themselves (tests). */
static void put_tile(const int32_t *acc, int rows, int64_t i0, int64_t j0, int panels, int64_t n,
                     const int32_t *bias128, const float *x_scale, const float *w_scale, void *out, int64_t ldo,
                     int out_kind) {
    for (int r = 0; r < rows; r++)
        for (int p = 0; p < panels; p++) {
            const int64_t j = j0 + p * 16;
            const int cols = n - j < 16 ? (int)(n - j) : 16;
            const int32_t *a = acc + (r * W8A8_NP + p) * 16;
            const int64_t at = (i0 + r) * ldo + j;
#if defined(__AVX512F__)
            if (cols == 16 && out_kind != 3) {
                __m512i sums = _mm512_loadu_si512(a);
                if (W8A8_X_OFFSET) sums = _mm512_sub_epi32(sums, _mm512_loadu_si512(bias128 + j));
                const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(x_scale[i0 + r])),
                                               _mm512_loadu_ps(w_scale + j));
                if (out_kind == 0) {
                    _mm512_storeu_ps((float *)out + at, v);
                } else if (out_kind == 1) {  /* f32_to_bf16's rounding, 16 lanes at once (NaN: 0x7fc0) */
                    const __m512i u = _mm512_castps_si512(v);
                    __m512i b = _mm512_srli_epi32(
                        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
                    b = _mm512_mask_mov_epi32(b, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
                    _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), _mm512_cvtepi32_epi16(b));
                } else {
                    _mm256_storeu_si256((__m256i *)((uint16_t *)out + at),
                                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                }
                continue;
            }
#endif
            for (int c = 0; c < cols; c++) {
                const int32_t s = a[c] - (W8A8_X_OFFSET ? bias128[j + c] : 0);
                if (out_kind == 3) {
                    ((int32_t *)out)[at + c] = s;
                    continue;
                }
                const float v = (float)s * x_scale[i0 + r] * w_scale[j + c];
                if (out_kind == 0)
                    ((float *)out)[at + c] = v;
                else
                    ((uint16_t *)out)[at + c] = f32_to_half(v, out_kind == 1);
            }
        }
}

static inline float rounded_to(float v, int out_kind) {
    return out_kind == 0 ? v : half_to_f32(f32_to_half(v, out_kind == 1), out_kind == 1);
}

#if defined(__AVX512F__)
/* v rounded to out_kind (0 float32, 1 bfloat16, 2 float16) and widened back: f32_to_half's bits, 16 lanes. */
static inline __m512 rounded16(__m512 v, int out_kind) {
    if (out_kind == 2) return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    if (out_kind == 0) return v;
    const __m512i u = _mm512_castps_si512(v);
    __m512i b = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                 _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
    b = _mm512_and_si512(b, _mm512_set1_epi32((int)0xffff0000u));
    b = _mm512_mask_mov_epi32(b, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(b);
}

/* A panel's 16 sums, less the offset's share, times both scales (put_tile's arithmetic). */
static inline __m512 scaled16(const int32_t *a, const int32_t *bias, float x_scale, const float *w_scale) {
    __m512i sums = _mm512_loadu_si512(a);
    if (W8A8_X_OFFSET) sums = _mm512_sub_epi32(sums, _mm512_loadu_si512(bias));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(x_scale)), _mm512_loadu_ps(w_scale));
}
#endif

/* put_tile for a gate_up packed by pack_w8a8_weight(q, gate_size): panel pairs (gate, up) from packed column
 * j0 (even panels: gate), each pair's 16 outputs silu(gate) * up at column j0 / 2 of out (out_kind 0-2). */
static void put_gated_tile(const int32_t *acc, int rows, int64_t i0, int64_t j0, int panels, const int32_t *bias128,
                           const float *x_scale, const float *w_scale, void *out, int64_t ldo, int out_kind) {
    for (int r = 0; r < rows; r++)
        for (int p = 0; p + 1 < panels; p += 2) {
            const int64_t j = j0 + p * 16, at = (i0 + r) * ldo + j / 2;
            const int32_t *ag = acc + (r * W8A8_NP + p) * 16, *au = ag + 16;
            const float xs = x_scale[i0 + r];
#if defined(__AVX512F__)
            const __m512 g = rounded16(scaled16(ag, bias128 + j, xs, w_scale + j), out_kind);
            const __m512 u = rounded16(scaled16(au, bias128 + j + 16, xs, w_scale + j + 16), out_kind);
            const __m512 o = _mm512_mul_ps(rounded16(silu16(g), out_kind), u);
            if (out_kind == 0)
                _mm512_storeu_ps((float *)out + at, o);
            else if (out_kind == 2)
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + at),
                                    _mm512_cvtps_ph(o, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            else
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + at),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded16(o, 1)), 16)));
#else
            for (int c = 0; c < 16; c++) {
                const float g = rounded_to((float)(ag[c] - (W8A8_X_OFFSET ? bias128[j + c] : 0)) * xs * w_scale[j + c],
                                           out_kind);
                const float u = rounded_to(
                    (float)(au[c] - (W8A8_X_OFFSET ? bias128[j + 16 + c] : 0)) * xs * w_scale[j + 16 + c], out_kind);
                const float o = rounded_to(silu(g), out_kind) * u;
                if (out_kind == 0)
                    ((float *)out)[at + c] = o;
                else
                    ((uint16_t *)out)[at + c] = f32_to_half(o, out_kind == 1);
            }
#endif
        }
}

#define W8A8_TILE(MR, NP) tile(xq + i * ldq, w + j / 16 * k4 * 64, k4, MR, NP, acc)

/* One column block (up to W8A8_NP panels from column j) over every row. */
static void column_block(const uint8_t *xq, int64_t ldq, int64_t m, int64_t k4, const int8_t *w, int64_t j,
                         int64_t n, const int32_t *bias128, const float *x_scale, const float *w_scale, void *out,
                         int64_t ldo, int out_kind, int gated) {
    int32_t acc[W8A8_MR * W8A8_NP * 16];
    const int64_t left = (n - j + 15) / 16;
    const int panels = left < W8A8_NP ? (int)left : W8A8_NP;
    /* With several row tiles the block's first tile would wait on memory for its weights while the later ones
     * find them in cache: each tile instead fetches its share of the next block's weights (those a static
     * split most likely gives this thread next), so the memory streams under the arithmetic. */
    const int64_t tiles = (m + W8A8_MR - 1) / W8A8_MR, block_bytes = (int64_t)W8A8_NP * k4 * 64;
    const int64_t next_panels = left - W8A8_NP < W8A8_NP ? left - W8A8_NP : W8A8_NP;
    const int64_t next_bytes = tiles < 2 || next_panels <= 0 ? 0 : next_panels * k4 * 64;
    const char *next = (const char *)(w + j / 16 * k4 * 64 + block_bytes);
    for (int64_t i = 0; i < m; i += W8A8_MR) {
        const int rows = m - i < W8A8_MR ? (int)(m - i) : W8A8_MR;
        const int64_t tile_index = i / W8A8_MR;
        for (int64_t b = next_bytes * tile_index / tiles; b < next_bytes * (tile_index + 1) / tiles; b += 64)
            __builtin_prefetch(next + b, 0, 2);
        if (panels == W8A8_NP) {
            switch (rows) {  /* constant tile shapes: every loop above unrolled into registers */
            case W8A8_MR: W8A8_TILE(W8A8_MR, W8A8_NP); break;
#if W8A8_MR > 5
            case 5: W8A8_TILE(5, W8A8_NP); break;
            case 4: W8A8_TILE(4, W8A8_NP); break;
#endif
#if W8A8_MR > 3
            case 3: W8A8_TILE(3, W8A8_NP); break;
#endif
#if W8A8_MR > 2
            case 2: W8A8_TILE(2, W8A8_NP); break;
#endif
            default: W8A8_TILE(1, W8A8_NP); break;
            }
        } else {
            for (int r = 0; r < rows; r++)
                for (int p = 0; p < panels; p++) {
                    int32_t one[W8A8_MR * W8A8_NP * 16];
                    tile(xq + i * ldq + r * 4, w + (j / 16 + p) * k4 * 64, k4, 1, 1, one);
                    memcpy(acc + (r * W8A8_NP + p) * 16, one, 16 * sizeof(int32_t));
                }
        }
        if (gated)
            put_gated_tile(acc, rows, i, j, panels, bias128, x_scale, w_scale, out, ldo, out_kind);
        else
            put_tile(acc, rows, i, j, panels, n, bias128, x_scale, w_scale, out, ldo, out_kind);
    }
}

static int product(const void *x, int x_kind, int64_t ldx, int64_t m, int64_t k, const int8_t *w,
                   const int32_t *bias128, const float *w_scale, int64_t n, void *out, int64_t ldo, int out_kind,
                   float *x_scale_out, const float *x_absmax, int gated) {
    if (m < 1 || k < 1 || n < 1 || k >= 65793 || x_kind < 0 || x_kind > 2 || out_kind < 0 || out_kind > 3) return -1;
    if (gated && (n % 32 || out_kind == 3)) return -1;
    const int64_t k4 = (k + 3) / 4, ldq = k4 * 4;
    const int64_t padded_m = (m + W8A8_MR - 1) / W8A8_MR * W8A8_MR;  /* whole tiles: tile() reads none past them */
    uint8_t *xq = malloc((size_t)(padded_m * ldq) + (size_t)m * sizeof(float));
    if (xq == NULL) return -1;
    float *x_scale = (float *)(xq + padded_m * ldq);  /* ldq is a multiple of 4: aligned */
    const int parallel = m * n * k >= W8A8_PARALLEL_MIN_MACS;
    const int64_t tiles = (m + W8A8_MR - 1) / W8A8_MR;
#pragma omp parallel for schedule(static) if (parallel && m > 1)
    for (int64_t tl = 0; tl < tiles; tl++) {  /* each row quantized, then interleaved into its tile (tile()) */
        uint8_t *dst = xq + tl * W8A8_MR * ldq;
        int32_t rows[W8A8_MR][ldq / 4 > 0 ? ldq / 4 : 1];
        const int64_t count = m - tl * W8A8_MR < W8A8_MR ? m - tl * W8A8_MR : W8A8_MR;
        for (int64_t r = 0; r < count; r++)
            x_scale[tl * W8A8_MR + r] = quantize_row(x, x_kind, ldx, tl * W8A8_MR + r, k, k4, (uint8_t *)rows[r],
                                                     x_absmax);
        for (int64_t t = 0; t < k4; t++)
            for (int64_t r = 0; r < count; r++) memcpy(dst + (t * W8A8_MR + r) * 4, &rows[r][t], 4);
    }
    const int64_t block = (int64_t)W8A8_NP * 16, blocks = (n + block - 1) / block;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t b = 0; b < blocks; b++)
        column_block(xq, ldq, m, k4, w, b * block, n, bias128, x_scale, w_scale, out, ldo, out_kind, gated);
    if (x_scale_out != NULL) memcpy(x_scale_out, x_scale, (size_t)m * sizeof(float));
    free(xq);
    return 0;
}

/* x [m, k] (x_kind 0 float32, 1 bfloat16, 2 float16; row stride ldx) @ the packed weight (n columns) -> out [m, n]
 * (row stride ldo, out_kind as put_tile's). ``bias128`` [ceil(n / 16) * 16] int32: 128 * each column's weight sum
 * (read by the VNNI variant only); ``w_scale`` [n] float32; ``x_scale_out``, where not NULL, gets the m row scales;
 * ``x_absmax`` [m] float32, where not NULL, is each row's max |x| to scale by (a whole row's, x a slice of it).
 * Returns 0, or -1 (nothing written) for a bad shape or no memory for the scratch. */
int w8a8_linear(const void *x, int x_kind, int64_t ldx, int64_t m, int64_t k, const int8_t *w,
                const int32_t *bias128, const float *w_scale, int64_t n, void *out, int64_t ldo, int out_kind,
                float *x_scale_out, const float *x_absmax) {
    return product(x, x_kind, ldx, m, k, w, bias128, w_scale, n, out, ldo, out_kind, x_scale_out, x_absmax, 0);
}

/* The same product for a gate_up of n = 2 * size columns (n a multiple of 32) packed with alternating 16-column
 * gate and up panels: out [m, size] (row stride ldo, out_kind 0-2) = silu(gate) * up, rounded as the file's head
 * says. */
int w8a8_silu_gate(const void *x, int x_kind, int64_t ldx, int64_t m, int64_t k, const int8_t *w,
                   const int32_t *bias128, const float *w_scale, int64_t n, void *out, int64_t ldo, int out_kind) {
    return product(x, x_kind, ldx, m, k, w, bias128, w_scale, n, out, ldo, out_kind, NULL, NULL, 1);
}

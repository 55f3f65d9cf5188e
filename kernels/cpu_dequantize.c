/* A quantized weight made float for one prefill product: out[N, K] (float32, bfloat16 or float16) from the layouts
 * the decode kernels read (int8 or float8_e4m3fn in blocks, Q8_0 and Q5_0 in panels, int4 nibbles in runs of 32).
 *
 * From enough rows of x a layer multiplies a copy of its weight dequantized for the call, by torch's matmul,
 * instead of running the decode kernels row block by row block (worker_proc/models/quantized_linear.py,
 * DEQUANTIZE_MIN_ROWS). torch's ops made that copy in four passes over a float32 temporary of the whole matrix
 * (the integers unpacked, widened, scaled, rounded): a 0.5B's gate_up took 10-20 ms on two threads, 3-6x the
 * product itself at 64 rows of x (bench/log). Here each row is made in one float32 row buffer that stays in L1 and
 * is rounded to the dtype once, so the weight is read once and the copy written once.
 *
 * The values are torch's, bit for bit: q * scale in float32 (int8, Q8_0, Q5_0), (nibble - z) * scale or, for a
 * GGUF Q4_K, nibble * scale - min, each operation rounded as torch rounds it (this file is compiled with
 * -ffp-contract=off, so no multiply and subtract fuse), then one rounding to the dtype (cpu_half.h).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_half.h"
#include "cpu_q8_0_panels.h"

/* the formats, as cpu_quantized.DEQUANTIZE_FORMATS names them */
enum { DQ_INT8_BLOCKS = 0, DQ_Q8_0_PANELS = 1, DQ_Q5_0_PANELS = 2, DQ_INT4_BLOCKS = 3, DQ_FP8_BLOCKS = 4 };
#define DQ_PARALLEL_MIN (1 << 16)  /* weights: below this a fork costs more than the rows */

/* the row's scales as float32 (float16 ones widened exactly; Q8_0's and Q5_0's in panel order: [panel][block][16]) */
static void row_scales(const void *scales, const int scales_f16, const int panels, const int64_t j,
                       const int64_t groups, float *restrict s) {
    if (panels) {
        const uint16_t *h = (const uint16_t *)scales + j / Q8_0_PANEL_ROWS * groups * Q8_0_PANEL_ROWS + j % Q8_0_PANEL_ROWS;
        for (int64_t c = 0; c < groups; c++) s[c] = f16_to_f32(h[c * Q8_0_PANEL_ROWS]);
    } else if (scales_f16) {
        const uint16_t *h = (const uint16_t *)scales + j * groups;
        for (int64_t c = 0; c < groups; c++) s[c] = f16_to_f32(h[c]);
    } else {
        memcpy(s, (const float *)scales + j * groups, groups * sizeof(float));
    }
}

/* 16 or 32 values times their scale (constant trip counts: whole vectors) */
static inline void scale_16(const int8_t *restrict q, const float scale, float *restrict v) {
    for (int t = 0; t < 16; t++) v[t] = (float)q[t] * scale;
}

static inline void scale_block(const int8_t *restrict q, const float scale, float *restrict v) {
    for (int t = 0; t < 32; t++) v[t] = (float)q[t] * scale;
}

static void row_int8_blocks(const int8_t *restrict q, const float *restrict s, const int64_t k, const int64_t g,
                            float *restrict v) {
    for (int64_t c = 0, grp = 0; c < k; c += g, grp++)
        for (int64_t t = c; t < c + g; t += 16) scale_16(q + t, s[grp], v + t);  /* g: a multiple of 16 */
}

/* float8_e4m3fn bytes in blocks, each scale times 2^120 (cpu_half.h's fp8_e4m3_scaled): each product is value *
 * scale, rounded once as compressed-tensors' float32 product is. */
static void row_fp8_blocks(const uint8_t *restrict q, const float *restrict s, const int64_t k, const int64_t g,
                           float *restrict v) {
    for (int64_t c = 0, grp = 0; c < k; c += g, grp++)
        for (int64_t t = c; t < c + g; t++) v[t] = fp8_e4m3_scaled(q[t]) * s[grp];
}

/* Panel p of a Q8_0 or Q5_0 (five) weight in panels (cpu_q8_0_panels.h) as its 16 rows' signed values, row-major in
 * vals [16, k]: each block's runs made bytes (Q5_0's nibbles and fifth bits joined), then each row's 4 values of a
 * run put in place (a 4-byte transpose), so a row is then read contiguously. */
static void unpack_panel(const uint8_t *restrict w, const int five, const int64_t p, const int64_t k,
                         int8_t *restrict vals) {
    const int64_t nb = k / 32, block_bytes = five ? Q5_0_PANEL_BLOCK_BYTES : Q8_0_PANEL_BLOCK_BYTES;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + (p * nb + b) * block_bytes;
        uint8_t runs[8][64];
        for (int t = 0; t < 8; t++) {
            if (!five) {
                for (int i = 0; i < 64; i++) runs[t][i] = blk[64 * t + i] ^ 0x80;  /* value + 128 -> the value */
                continue;
            }
#if defined(__AVX512BW__)
            _mm512_storeu_si512(runs[t], _mm512_sub_epi8(q5_0_panel_run(blk, t), _mm512_set1_epi8(16)));
#else
            for (int i = 0; i < 64; i++) runs[t][i] = (uint8_t)(q5_0_panel_u(blk, t, i) - 16);
#endif
        }
        for (int r = 0; r < Q8_0_PANEL_ROWS; r++)
            for (int t = 0; t < 8; t++) memcpy(vals + r * k + b * 32 + 4 * t, runs[t] + 4 * r, 4);
    }
}

/* row j of a weight in panels: from its panel's values (unpacked into vals when *held is another panel) */
static void row_panels(const uint8_t *restrict w, const int five, const int64_t j, const float *restrict s,
                       const int64_t k, int8_t *restrict vals, int64_t *held, float *restrict v) {
    if (*held != j / Q8_0_PANEL_ROWS) {
        *held = j / Q8_0_PANEL_ROWS;
        unpack_panel(w, five, *held, k, vals);
    }
    const int8_t *q = vals + j % Q8_0_PANEL_ROWS * k;
    for (int64_t c = 0; c < k; c += 32) scale_block(q + c, s[c / 32], v + c);
}

/* byte i of a run of 32 inputs: input i in its low nibble, input 16 + i in its high one (cpu_gemv_int4.c's) */
static void row_int4_blocks(const uint8_t *restrict p, const float *restrict s, const float *restrict z,
                            const float *restrict m, const int64_t k, const int64_t g, float *restrict v) {
    for (int64_t c = 0; c < k; c += 32, p += 16) {
        float nib[32];
        for (int i = 0; i < 16; i++) {
            nib[i] = (float)(p[i] & 15);
            nib[16 + i] = (float)(p[i] >> 4);
        }
        const int64_t grp = c / g;
        if (m)
            for (int t = 0; t < 32; t++) v[c + t] = nib[t] * s[grp] - m[grp];
        else
            for (int t = 0; t < 32; t++) v[c + t] = (nib[t] - (z ? z[grp] : 8.0f)) * s[grp];
    }
}

static void put_row(const float *restrict v, const int64_t k, void *out, const int out_kind) {
    if (out_kind == 0) {
        memcpy(out, v, k * sizeof(float));
    } else if (out_kind == 1) {
        uint16_t *restrict o = out;
        for (int64_t t = 0; t < k; t++) o[t] = f32_to_bf16(v[t]);
    } else {
        uint16_t *restrict o = out;
        for (int64_t t = 0; t < k; t++) o[t] = f32_to_f16(v[t]);
    }
}

/* out[N, K] = the weight as floats. format: DQ_*; w: the packed weight; scales [N, K / group] float32 or float16
 * (scales_f16), Q8_0's and Q5_0's float16 in panel order (group 32); int8 blocks of a multiple of 16, int4 groups of
 * 32; zeros / mins [N, K / group] float32 or NULL (int4 only: z = 8 when both are NULL). out_kind 0 float32, 1 bfloat16, 2 float16. 0, -1 for shapes the format cannot hold, -2 without
 * memory for a row buffer. */
int dequantize_weight(const int format, const void *w, const void *scales, const int scales_f16, const float *zeros,
                      const float *mins, const int64_t group, const int64_t n, const int64_t k, void *out,
                      const int out_kind) {
    if (n < 0 || k <= 0 || group <= 0 || k % group || out_kind < 0 || out_kind > 2) return -1;
    if ((format == DQ_Q8_0_PANELS || format == DQ_Q5_0_PANELS) && (group != 32 || !scales_f16)) return -1;
    if ((format == DQ_INT8_BLOCKS || format == DQ_FP8_BLOCKS) && group % 16) return -1;
    if (format == DQ_INT4_BLOCKS && (group % 32 || scales_f16 || (zeros && mins))) return -1;
    if (format < DQ_INT8_BLOCKS || format > DQ_FP8_BLOCKS) return -1;
    const int64_t groups = k / group, elem = out_kind == 0 ? 4 : 2;
    int failed = 0;
#pragma omp parallel if (n * k >= DQ_PARALLEL_MIN) reduction(| : failed)
    {
        const int panels = format == DQ_Q8_0_PANELS || format == DQ_Q5_0_PANELS;
        float *buf = malloc((k + groups) * sizeof(float) + (panels ? Q8_0_PANEL_ROWS * k : 0));
        float *s = buf ? buf + k : NULL;
        int8_t *vals = buf ? (int8_t *)(s + groups) : NULL;  /* a panel's values (panel formats) */
        int64_t held = -1;
        /* every thread meets the loop (a work-sharing construct), with or without its buffer */
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) {
            if (buf == NULL) {
                failed = 1;
                continue;
            }
            row_scales(scales, scales_f16, panels, j, groups, s);
            if (format == DQ_INT8_BLOCKS)
                row_int8_blocks((const int8_t *)w + j * k, s, k, group, buf);
            else if (format == DQ_FP8_BLOCKS)
                row_fp8_blocks((const uint8_t *)w + j * k, s, k, group, buf);
            else if (panels)
                row_panels(w, format == DQ_Q5_0_PANELS, j, s, k, vals, &held, buf);
            else
                row_int4_blocks((const uint8_t *)w + j * (k / 2), s, zeros ? zeros + j * groups : NULL,
                                mins ? mins + j * groups : NULL, k, group, buf);
            put_row(buf, k, (char *)out + j * k * elem, out_kind);
        }
        free(buf);
    }
    return failed ? -2 : 0;
}

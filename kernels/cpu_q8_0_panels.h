/* GGUF Q8_0 and Q5_0 weights in panels of 16 rows, the layout their kernel (cpu_gemm_q8_0.c) and their dequantizer
 * (cpu_dequantize.c) read; packed by cpu_quantized.pack_q8_0_panels and pack_q5_0_panels.
 *
 * Per panel and block of 32 inputs, 8 runs of 64 values, run t the panel's 16 rows at inputs 4t .. 4t + 3 (4
 * consecutive values a row), so a run is what one vpdpbusd multiplies by 4 broadcast bytes of x; the float16 scales
 * in the same order, [panel][block][16]; rows past N zeros (scale 0).
 *   Q8_0: a byte a value, value + 128: 512 bytes a block.
 *   Q5_0: u = value + 16; the runs in pairs, 64 bytes a pair (byte i: the even run's u[i] & 15 low, the odd run's
 *         high), then each run's fifth bits in 8 bytes (bit i, little-endian: u[i] >> 4): 320 bytes a block.
 */
#pragma once

#include <stdint.h>
#include <string.h>
#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

#define Q8_0_PANEL_ROWS 16
#define Q8_0_PANEL_BLOCK_BYTES 512
#define Q5_0_PANEL_NIBBLE_BYTES 256
#define Q5_0_PANEL_BLOCK_BYTES 320

/* u (value + 16) of value i of run t in a Q5_0 panel's block blk. */
static inline int q5_0_panel_u(const uint8_t *blk, const int t, const int i) {
    const int nibble = (blk[64 * (t / 2) + i] >> (4 * (t % 2))) & 15;
    return nibble | ((blk[Q5_0_PANEL_NIBBLE_BYTES + 8 * t + i / 8] >> (i % 8)) & 1) << 4;
}

#if defined(__AVX512BW__)
/* Run t of a Q5_0 panel's block as its 64 u: the pair's nibbles masked, the fifth bits added under their mask. */
static inline __attribute__((always_inline)) __m512i q5_0_panel_run(const uint8_t *blk, const int t) {
    const __m512i pair = _mm512_loadu_si512(blk + 64 * (t / 2));
    const __m512i u = _mm512_and_si512(t % 2 ? _mm512_srli_epi16(pair, 4) : pair, _mm512_set1_epi8(0x0F));
    uint64_t bits;
    memcpy(&bits, blk + Q5_0_PANEL_NIBBLE_BYTES + 8 * t, 8);
    return _mm512_mask_add_epi8(u, _cvtu64_mask64(bits), u, _mm512_set1_epi8(16));
}
#endif

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

#define Q8_0_PANEL_ROWS 16
#define Q5_0_PANEL_NIBBLE_BYTES 256
#define Q5_0_PANEL_BLOCK_BYTES 320

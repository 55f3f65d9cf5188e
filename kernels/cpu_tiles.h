/* The tiled weight layouts of GGUF's Q8_0 and Q5_0 (cpu_native.pack_q8_0_tiles, pack_q5_0), shared by their decode
 * kernels (cpu_gemv_int8.c) and their dequantizer (cpu_dequantize.c).
 *
 * Rows in tiles of 8, the tile's runs of the same 64 inputs side by side (run_bytes each: 64 for Q8_0, 40 for
 * Q5_0), so a block of 8 rows is one stream the prefetchers follow; row-major, 8 rows are 8 short streams (896 bytes
 * at 896 inputs) and a cold Q8_0 gate_up ran at 8-9 GB/s on one thread, tiled (Q5_0) at 13-16 (bench/log). */
#pragma once

#include <stdint.h>

#define TILE_ROWS 8
/* A Q5_0 run of 64 inputs: 32 bytes of nibbles (byte t: u[t] & 15 low, u[t + 32] & 15 high, u = v + 16), then the
 * 64 fifth bits (bit t: u[t] >> 4). */
#define Q5_CHUNK_BYTES 40
#define Q5_ROW_BYTES(k) ((k) / 64 * Q5_CHUNK_BYTES)

/* Row jr's first run, in a weight of ldw bytes a row. */
static inline const uint8_t *tile_row(const uint8_t *w, const int64_t jr, const int64_t ldw, const int run_bytes) {
    return w + jr / TILE_ROWS * TILE_ROWS * ldw + jr % TILE_ROWS * run_bytes;
}

/* The output-row blocking the quantized GEMVs share (cpu_gemv_int8.c, cpu_gemv_int4.c): a block of R output rows
 * is one work item, so each weight row is streamed once for all M rows of x; the items are split over the threads
 * (static: contiguous weight for each) once the product is large enough to pay for a fork; the last n % R rows go
 * one at a time. What differs between the formats is only how a block's sums are made (BLOCK). */
#pragma once

#include <stdint.h>

#include "cpu_half.h"

/* out[i, j] = v as float32 (out_kind 0), bfloat16 (1) or float16 (2), rounded once. */
static inline void gemv_put(void *out, int64_t ldo, int64_t i, int64_t j, float v, int out_kind) {
    if (out_kind == 0)
        ((float *)out)[i * ldo + j] = v;
    else
        ((uint16_t *)out)[i * ldo + j] = f32_to_half(v, out_kind == 1);
}

/* Every output row j < n of M rows of x: BLOCK(M, j, rows, sums) fills sums[r * M + i] (r < rows <= 8, i < M)
 * with x[i] . W[j + r]; each sum is written to out (row stride ldo) in its kind. Parallel when macs >= min_macs. */
#define GEMV_ROW_BLOCKS(M, R, n, macs, min_macs, out, ldo, out_kind, BLOCK)                                       \
    do {                                                                                                          \
        const int64_t gemv_blocks_ = ((n) + (R) - 1) / (R), gemv_macs_ = (macs), gemv_min_macs_ = (min_macs);    \
        _Pragma("omp parallel for schedule(static) if (gemv_macs_ >= gemv_min_macs_)")                           \
        for (int64_t b_ = 0; b_ < gemv_blocks_; b_++) {                                                           \
            float sums_[8 * 8];                                                                                   \
            const int64_t j_ = b_ * (R);                                                                          \
            if (j_ + (R) <= (n)) {                                                                                \
                BLOCK(M, j_, R, sums_);                                                                           \
                for (int r_ = 0; r_ < (R); r_++)                                                                  \
                    for (int i_ = 0; i_ < (M); i_++)                                                              \
                        gemv_put(out, ldo, i_, j_ + r_, sums_[r_ * (M) + i_], out_kind);                          \
            } else {                                                                                              \
                for (int64_t jj_ = j_; jj_ < (n); jj_++) {                                                        \
                    BLOCK(M, jj_, 1, sums_);                                                                      \
                    for (int i_ = 0; i_ < (M); i_++) gemv_put(out, ldo, i_, jj_, sums_[i_], out_kind);            \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
    } while (0)

/* Decode-step products on int8 weights in blocks: out[M, N] = x[M, K] @ W^T, M = 1..8, where
 * W[j, t] = q[j, t] * scale[j, t / G], q int8 [N, K] row-major and scale float32 [N, K / G], one per
 * block of G inputs (GGUF's Q8_0: G = 32; compressed-tensors' int8 groups). torch has no grouped int8
 * op: one _weight_int8pack_mm call per block of inputs ran a 0.5B's step 10-20x slower than per-channel
 * int8 (bench/log), and a dequantized copy per call reads the weight three times over.
 *
 * As cpu_gemv.c: a decode step is bound by reading the weights, so each thread takes a contiguous
 * range of R-row blocks (OpenMP, static), walks R rows of q at once along K (prefetching rows ahead),
 * and multiplies them by the M rows of x (float32, in L1). Each vector of q is widened to float32
 * exactly and multiplied by its block's scale, which rounds it to the float32 weight the dequantized
 * layer holds (q * scale, one rounding); the products are summed in float32, in another order than
 * F.linear's (tests/unit/test_cpu_gemv_int8.py bounds the difference). x is float32 (the caller widens
 * bfloat16 / float16 rows once per call); out is float32 or a half dtype, rounded once.
 */
#include <stdint.h>

#include "cpu_gemv_rows.h"
#include "cpu_tiles.h"

#define INT8_GEMV_MAX_ROWS 8
#define INT8_PARALLEL_MIN_MACS (1 << 17)
#define INT8_PREFETCH_ROWS 32
/* R x M accumulators, R weight vectors and one x vector in the vector registers (32 on AVX-512). */
#define INT8_ROWS_PER_BLOCK(M) ((M) == 1 ? 8 : (M) == 2 ? 6 : (M) <= 5 ? 4 : 3)

/* HALF_VW int8 values from p, widened to float32 exactly. */
static inline hvec load_i8(const int8_t *p) {
#if HALF_VW == 16
    return (hvec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif HALF_VW == 8
    return (hvec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    hvec v;
    for (int i = 0; i < HALF_VW; i++) v[i] = (float)p[i];
    return v;
#endif
}

/* sums[r * M + i] = x[i, :k] . (q[r, :k] * its blocks' scales) for R rows. k % g == 0, g % HALF_VW == 0. */
static inline __attribute__((always_inline)) void block_i8(const float *restrict x, const int64_t ldx,
                                                           const int8_t *restrict q, const int64_t ldq,
                                                           const float *restrict s, const int64_t lds,
                                                           const int64_t k, const int64_t g, const int M,
                                                           const int R, float *restrict sums) {
    hvec acc[8][8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) acc[r][i] = hbroadcast(0.0f);
    const int8_t *ahead = q + (int64_t)INT8_PREFETCH_ROWS * ldq;
    for (int64_t kk = 0; kk < k; kk += g) {
        hvec scale[8];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) scale[r] = hbroadcast(s[r * lds + kk / g]);
        for (int64_t c = kk; c < kk + g; c += HALF_VW) {
            hvec wv[8];
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                wv[r] = load_i8(q + r * ldq + c) * scale[r];
                if ((c & 63) == 0) __builtin_prefetch(ahead + r * ldq + c, 0, 3);
            }
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) {
                const hvec xv = load_f32(x + i * ldx + c);
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) acc[r][i] += xv * wv[r];
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) sums[r * M + i] = hsum(acc[r][i]);
}

/* sums of a block of rows j .. j + rows for GEMV_ROW_BLOCKS (inside gemv_int8_M, whose locals it reads) */
#define INT8_BLOCK(M, j, rows, sums) block_i8(x, ldx, q + (j) * k, k, s + (j) * lds, lds, k, g, M, rows, sums)

#define DEFINE_INT8_M(M)                                                                                          \
    static void gemv_int8_##M(const float *x, int64_t ldx, int64_t k, const int8_t *q, const float *s,            \
                              int64_t g, int64_t n, void *out, int64_t ldo, int out_kind) {                       \
        const int R = INT8_ROWS_PER_BLOCK(M);                                                                     \
        const int64_t lds = k / g;                                                                                \
        GEMV_ROW_BLOCKS(M, R, n, (M) * n * k, INT8_PARALLEL_MIN_MACS, out, ldo, out_kind, INT8_BLOCK);            \
    }
DEFINE_INT8_M(1) DEFINE_INT8_M(2) DEFINE_INT8_M(3) DEFINE_INT8_M(4)
DEFINE_INT8_M(5) DEFINE_INT8_M(6) DEFINE_INT8_M(7) DEFINE_INT8_M(8)

/* x [m, k] float32 (row stride ldx), q [n, k] int8 contiguous, scales [n, k / g] float32 contiguous, out [m, n]
 * (row stride ldo) float32 (out_kind 0), bfloat16 (1) or float16 (2). More than 8 rows (a short prefill chunk)
 * go 8 at a time, each pass streaming the weight again: up to a few tens of rows that still beats making the
 * dequantized weight for F.linear (the caller's crossover). Returns -1 (nothing written) unless m >= 1, g is a
 * multiple of the vector width and k of g. */
int gemv_int8_blocks(const float *x, int64_t ldx, int64_t m, int64_t k, const int8_t *q, const float *scales,
                     int64_t g, int64_t n, void *out, int64_t ldo, int out_kind) {
    static void (*const by_rows[INT8_GEMV_MAX_ROWS + 1])(const float *, int64_t, int64_t, const int8_t *,
                                                         const float *, int64_t, int64_t, void *, int64_t, int) = {
        NULL, gemv_int8_1, gemv_int8_2, gemv_int8_3, gemv_int8_4, gemv_int8_5, gemv_int8_6, gemv_int8_7, gemv_int8_8};
    if (m < 1 || g < HALF_VW || g % HALF_VW || k % g) return -1;
    const int64_t size = out_kind == 0 ? 4 : 2;
    for (int64_t i = 0; i < m; i += INT8_GEMV_MAX_ROWS) {
        const int64_t rows = m - i < INT8_GEMV_MAX_ROWS ? m - i : INT8_GEMV_MAX_ROWS;
        by_rows[rows](x + i * ldx, ldx, k, q, scales, g, n, (char *)out + i * ldo * size, ldo, out_kind);
    }
    return 0;
}

/* ---------------------------------------------------------------- Q8_0 x Q8_0: llama.cpp's arithmetic
 *
 * The same weights (blocks of 32, a float16 scale each: the file's own, 2 bytes a block less to stream than
 * float32's) times activations quantized per block of 32 too, as
 * llama.cpp's CPU backend multiplies a Q8_0 matrix: each block of a row of x gets d = max|x| / 127 and
 * xq = round-half-even(x / d) clamped to [-128, 127] (a zero block: xq = 0, d = 0), the 32 int8 products summed
 * exactly in int32, then out = sum over blocks of isum * (d_w * d_x) in float32. Decode is bound by reading the
 * weight: the widening kernel above spends ~16 vector instructions on 64 weight bytes and ran the 0.5B step's
 * matrices at ~21 GB/s on one core; here 64 bytes are one vpdpbusd, one conversion and one FMA (bench/log).
 *
 *   AVX512-VNNI: vpdpbusd multiplies unsigned by signed bytes: the weight is made unsigned (q ^ 0x80 = q + 128,
 *                one XOR) and x is the signed side; the accumulator starts at -128 * the x bytes' sum of its
 *                lane (made once per call), so each lane's int32 is exact. A 512-bit vector is two blocks:
 *                lanes 0-7 the first, 8-15 the second, each lane's sum scaled by its block's d_w * d_x.
 *   otherwise:   each block's int32 sum in plain loops (the compiler vectorizes them), then the same scaling.
 * x is read in its own dtype (float32, bfloat16, float16) and quantized once per call into a scratch that
 * every thread reads; the output-row blocks and threads are GEMV_ROW_BLOCKS', as above. */
#include <stdlib.h>

#define Q8_BLOCK 32
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q8_VNNI 1
#endif

const char *q8_0_variant(void) {
#if defined(Q8_VNNI)
    return "avx512vnni";
#else
    return "portable";
#endif
}

/* One call's quantized x: row i's int8 values at xq + i * kp (zero past k), for VNNI each lane's -128 * its four
 * bytes' sum at corr + i * kp / 4 and its block's d at d + i * kp / 4 (a lane per 4 inputs; 0 past k); the
 * portable loops read d per block at d + i * kp / 4 + b * 8. kp: k rounded up to 64 (a vector's two blocks). */
typedef struct {
    int8_t *xq;
    int32_t *corr;
    float *d;
    int64_t kp;
} q8_x;

#if defined(__AVX512F__)
/* 16 values of x from element i (x_kind 0 float32, 1 bfloat16, 2 float16), widened. */
static inline __m512 x_load16(const void *x, int x_kind, int64_t i) {
    if (x_kind == 0) return _mm512_loadu_ps((const float *)x + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    if (x_kind == 1) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}
#else
static float x_at(const void *x, int x_kind, int64_t i) {
    return x_kind == 0 ? ((const float *)x)[i] : half_to_f32(((const uint16_t *)x)[i], x_kind == 1);
}
#endif

/* One row of x (k inputs, a multiple of 32) quantized into s's row i. */
static void q8_quantize_row(const void *x, int x_kind, int64_t k, const q8_x *s, int64_t i) {
    int8_t *xq = s->xq + i * s->kp;
    int32_t *corr = s->corr + i * s->kp / 4;
    float *d = s->d + i * s->kp / 4;
    for (int64_t b = 0; b < k; b += Q8_BLOCK) {
#if defined(__AVX512F__)
        const __m512 lo = x_load16(x, x_kind, b), hi = x_load16(x, x_kind, b + 16);
        const float scale = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi))) / 127.0f;
        const __m512 vscale = _mm512_set1_ps(scale), low = _mm512_set1_ps(-128.0f), high = _mm512_set1_ps(127.0f);
        const __m512 halves[2] = {lo, hi};
        for (int h = 0; h < 2; h++) {  /* the exact quotient (vdivps), rounded half to even, clamped; 0 / 0: 0 */
            __m512 r = _mm512_roundscale_ps(_mm512_div_ps(halves[h], vscale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            r = _mm512_min_ps(_mm512_max_ps(r, low), high);
            if (scale == 0.0f) r = _mm512_setzero_ps();
            _mm512_mask_cvtepi32_storeu_epi8(xq + b + 16 * h, 0xffff, _mm512_cvtps_epi32(r));
        }
#else
        float v[Q8_BLOCK], amax = 0.0f;
        for (int t = 0; t < Q8_BLOCK; t++) {
            v[t] = x_at(x, x_kind, b + t);
            const float a = __builtin_fabsf(v[t]);
            amax = a > amax ? a : amax;
        }
        const float scale = amax / 127.0f;
        for (int t = 0; t < Q8_BLOCK; t++) {  /* the exact quotient, rounded half to even (rint), clamped */
            float r = scale == 0.0f ? 0.0f : __builtin_rintf(v[t] / scale);
            r = r < -128.0f ? -128.0f : r > 127.0f ? 127.0f : r;
            xq[b + t] = (int8_t)r;
        }
#endif
        for (int lane = 0; lane < Q8_BLOCK / 4; lane++) {
            const int8_t *four = xq + b + 4 * lane;
            corr[b / 4 + lane] = -128 * (four[0] + four[1] + four[2] + four[3]);
            d[b / 4 + lane] = scale;
        }
    }
    memset(xq + k, 0, (size_t)(s->kp - k));
    for (int64_t lane = k / 4; lane < s->kp / 4; lane++) corr[lane] = 0, d[lane] = 0.0f;
}

#if defined(Q8_VNNI)
/* Chunk c's (two blocks') quantized x of M rows: bytes, each lane's correction (corr_shift: -128 * its bytes' sum
 * shifted down, exactly, to the weights' offset) and each lane's block d. */
static inline __attribute__((always_inline)) void q8_x_chunk(const q8_x *restrict s, const int64_t c, const int M,
                                                             const int corr_shift, __m512i *xv, __m512i *corr,
                                                             __m512 *xd) {
#pragma GCC unroll 8
    for (int i = 0; i < M; i++) {
        xv[i] = _mm512_loadu_si512(s->xq + i * s->kp + c);
        corr[i] = _mm512_srai_epi32(_mm512_loadu_si512(s->corr + i * s->kp / 4 + c / 4), corr_shift);
        xd[i] = _mm512_loadu_ps(s->d + i * s->kp / 4 + c / 4);
    }
}

/* acc[i] += each lane's exact block sum of the unsigned weight bytes wv times x row i (less the offset through
 * corr), times its blocks' d_w * d_x; two: the two blocks' float16 d_w (the second 0 for a missing block). */
static inline __attribute__((always_inline)) void q8_accumulate(__m512 *acc, const __m512i wv, const int32_t two,
                                                                const __m512i *xv, const __m512i *corr,
                                                                const __m512 *xd, const int M) {
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512 ew = _mm512_permutexvar_ps(  /* each block's scale widened to its half */
        halves, _mm512_castps256_ps512(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(two)))));
#pragma GCC unroll 8
    for (int i = 0; i < M; i++) {
        const __m512i isum = _mm512_dpbusd_epi32(corr[i], wv, xv[i]);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(ew, xd[i]), acc[i]);
    }
}

static inline __attribute__((always_inline)) void q8_zero(__m512 acc[8][8], const int R, const int M) {
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) acc[r][i] = _mm512_setzero_ps();
}

static inline __attribute__((always_inline)) void q8_reduce(__m512 acc[8][8], const int R, const int M,
                                                            float *restrict sums) {
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) sums[r * M + i] = _mm512_reduce_add_ps(acc[r][i]);
}
#endif

/* A weight in tiles (gemv_q8_0_tiles, gemv_q5_0): cpu_tiles.h. */
#define TILE_PREFETCH_BYTES 4096

/* sums[r * M + i] = x[i] . W[j + r] for R rows of the weight (row-major at row stride ldq, or in tiles: ``tiled``;
 * scales at row stride lds from row j's). */
static inline __attribute__((always_inline)) void block_q8(const q8_x *restrict s, const int8_t *restrict q,
                                                           const int64_t j, const int tiled,
                                                           const int64_t ldq, const uint16_t *restrict w_scale,
                                                           const int64_t lds, const int64_t k, const int M,
                                                           const int R, float *restrict sums) {
#if defined(Q8_VNNI)
    __m512 acc[8][8];
    q8_zero(acc, R, M);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const int8_t *row[8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) row[r] = tiled ? (const int8_t *)tile_row((const uint8_t *)q, j + r, ldq, 64)
                                               : q + (j + r) * ldq;
    const int64_t stride = tiled ? TILE_ROWS : 1, ahead = tiled ? TILE_PREFETCH_BYTES : INT8_PREFETCH_ROWS * ldq;
    for (int64_t c = 0; c < k; c += 2 * Q8_BLOCK) {
        const int whole = c + 2 * Q8_BLOCK <= k;  /* else one block left: its upper half is zeros */
        const __mmask64 bytes = whole ? ~(__mmask64)0 : (__mmask64)0xffffffffu;
        __m512i xv[8], corr[8];
        __m512 xd[8];
        q8_x_chunk(s, c, M, 0, xv, corr, xd);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const int8_t *p = row[r] + c * stride;
            const __m512i wv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(bytes, p), flip);
            __builtin_prefetch(p + ahead, 0, 3);
            const uint16_t *ws = w_scale + r * lds + c / Q8_BLOCK;
            int32_t two = ws[0];  /* one block left: its scale, and 0 for the empty half (whose sums are 0) */
            if (whole) memcpy(&two, ws, 4);  /* the two blocks' float16 scales */
            q8_accumulate(acc[r], wv, two, xv, corr, xd, M);
        }
    }
    q8_reduce(acc, R, M, sums);
#else
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) {
            const int8_t *w = tiled ? (const int8_t *)tile_row((const uint8_t *)q, j + r, ldq, 64) : q + (j + r) * ldq;
            const int8_t *xq = s->xq + i * s->kp;
            const int64_t stride = tiled ? TILE_ROWS : 1;
            float total = 0.0f;
            for (int64_t b = 0; b < k; b += Q8_BLOCK) {
                int32_t isum = 0;
                for (int t = 0; t < Q8_BLOCK; t++) isum += (int32_t)w[b / 64 * 64 * stride + b % 64 + t] * xq[b + t];
                total += (float)isum * (f16_to_f32(w_scale[r * lds + b / Q8_BLOCK]) * s->d[i * s->kp / 4 + b / 4]);
            }
            sums[r * M + i] = total;
        }
#endif
}

#define Q8_ROWS(M, j, rows, sums) block_q8(&s, (const int8_t *)w, j, 0, ldw, w_scale + (j) * lds, lds, k, M, rows, sums)
#define Q8T_ROWS(M, j, rows, sums) block_q8(&s, (const int8_t *)w, j, 1, ldw, w_scale + (j) * lds, lds, k, M, rows, sums)

/* FORM##_M: the products of M rows of x, a weight row ROW_BYTES(k) bytes of the form, blocks of rows by FORM_ROWS */
#define DEFINE_Q8_FORM_M(FORM, FORM_ROWS, ROW_BYTES, M)                                                          \
    static void FORM##_##M(q8_x s, int64_t k, const void *weight, const uint16_t *w_scale, int64_t n, void *out,  \
                           int64_t ldo, int out_kind) {                                                           \
        const uint8_t *w = weight;                                                                                \
        const int R = INT8_ROWS_PER_BLOCK(M);                                                                     \
        const int64_t lds = k / Q8_BLOCK, ldw = ROW_BYTES(k);                                                     \
        GEMV_ROW_BLOCKS(M, R, n, (M) * n * k, INT8_PARALLEL_MIN_MACS, out, ldo, out_kind, FORM_ROWS);             \
    }
#define Q8_ROW_BYTES(k) (k)
#define DEFINE_Q8_M(M) DEFINE_Q8_FORM_M(gemv_q8, Q8_ROWS, Q8_ROW_BYTES, M) \
                       DEFINE_Q8_FORM_M(gemv_q8t, Q8T_ROWS, Q8_ROW_BYTES, M)
DEFINE_Q8_M(1) DEFINE_Q8_M(2) DEFINE_Q8_M(3) DEFINE_Q8_M(4)
DEFINE_Q8_M(5) DEFINE_Q8_M(6) DEFINE_Q8_M(7) DEFINE_Q8_M(8)

/* x [m, k] (x_kind 0 float32, 1 bfloat16, 2 float16; row stride ldx) @ (q [n, k] int8 * scales [n, k / 32]
 * float16).T with x quantized per block of 32 as above; out [m, n] (row stride ldo) as gemv_int8_blocks'.
 * Rows go 8 at a time, each pass streaming the weight. Returns -1 (nothing written) unless m >= 1 and k is a
 * multiple of 32, or when the scratch cannot be had. */
typedef void (*q8_rows_fn)(q8_x, int64_t, const void *, const uint16_t *, int64_t, void *, int64_t, int);

/* x's rows quantized 8 at a time into a scratch of kp bytes a row (kp: k rounded up to 64), each pass's products
 * by rows[its count]. -1 when the scratch cannot be had. */
static int q8_passes(const void *x, int x_kind, int64_t ldx, int64_t m, int64_t k, int64_t kp, const void *w,
                     const uint16_t *scales, int64_t n, void *out, int64_t ldo, int out_kind,
                     const q8_rows_fn by_rows[INT8_GEMV_MAX_ROWS + 1]) {
    const int64_t rows_max = m < INT8_GEMV_MAX_ROWS ? m : INT8_GEMV_MAX_ROWS;
    q8_x s = {NULL, NULL, NULL, kp};
    char *scratch = aligned_alloc(64, (size_t)(rows_max * kp * 3));  /* xq, corr, d: kp bytes each a row */
    if (scratch == NULL) return -1;
    s.xq = (int8_t *)scratch;
    s.corr = (int32_t *)(scratch + rows_max * kp);
    s.d = (float *)(scratch + 2 * rows_max * kp);
    const int64_t x_size = x_kind == 0 ? 4 : 2, out_size = out_kind == 0 ? 4 : 2;
    for (int64_t i = 0; i < m; i += INT8_GEMV_MAX_ROWS) {
        const int64_t rows = m - i < INT8_GEMV_MAX_ROWS ? m - i : INT8_GEMV_MAX_ROWS;
        for (int64_t r = 0; r < rows; r++)
            q8_quantize_row((const char *)x + (i + r) * ldx * x_size, x_kind, k, &s, r);
        by_rows[rows](s, k, w, scales, n, (char *)out + i * ldo * out_size, ldo, out_kind);
    }
    free(scratch);
    return 0;
}

int gemv_q8_0(const void *x, int x_kind, int64_t ldx, int64_t m, int64_t k, const int8_t *q, const uint16_t *scales,
              int64_t n, void *out, int64_t ldo, int out_kind) {
    static const q8_rows_fn by_rows[INT8_GEMV_MAX_ROWS + 1] = {
        NULL, gemv_q8_1, gemv_q8_2, gemv_q8_3, gemv_q8_4, gemv_q8_5, gemv_q8_6, gemv_q8_7, gemv_q8_8};
    if (m < 1 || k < Q8_BLOCK || k % Q8_BLOCK || x_kind < 0 || x_kind > 2) return -1;
    return q8_passes(x, x_kind, ldx, m, k, (k + 63) / 64 * 64, q, scales, n, out, ldo, out_kind, by_rows);
}

/* gemv_q8_0 on q in tiles (above; cpu_native.pack_q8_0_tiles): [ceil(n / 8) * 8, k] int8, k a multiple of 64. */
int gemv_q8_0_tiles(const void *x, int x_kind, int64_t ldx, int64_t m, int64_t k, const int8_t *q,
                    const uint16_t *scales, int64_t n, void *out, int64_t ldo, int out_kind) {
    static const q8_rows_fn by_rows[INT8_GEMV_MAX_ROWS + 1] = {
        NULL, gemv_q8t_1, gemv_q8t_2, gemv_q8t_3, gemv_q8t_4, gemv_q8t_5, gemv_q8t_6, gemv_q8t_7, gemv_q8t_8};
    if (m < 1 || k < 64 || k % 64 || x_kind < 0 || x_kind > 2) return -1;
    return q8_passes(x, x_kind, ldx, m, k, k, q, scales, n, out, ldo, out_kind, by_rows);
}

/* ---------------------------------------------------------------- Q5_0 x Q8_0: 5-bit weights, llama.cpp's sum
 *
 * A GGUF Q5_0 matrix (values v in [-16, 15], a float16 d per block of 32) read as Q8_0 streams 34 bytes a block;
 * packed here (cpu_native.pack_q5_0) it streams 22: per 64 inputs, 32 bytes of nibbles (byte t: u[t] & 15 low,
 * u[t + 32] & 15 high, u = v + 16) then the 64 fifth bits (bit t: u[t] >> 4), 40 bytes, beside the same float16
 * scales. The x side and the sums are gemv_q8_0's: u unsigned is vpdpbusd's unsigned side, so the accumulator
 * starts at -16 * the lane's x bytes (the q8_x correction, -128 *, shifted down by 3: exact), and each lane's
 * int32 is the block's exact sum of v * xq, scaled as above: the outputs equal gemv_q8_0's on the same values,
 * bit for bit. A few more instructions a 64 inputs (the nibbles' shift, insert and mask; the fifth bits added
 * under a mask) for 35% fewer bytes. Rows in tiles of 8, as gemv_q8_0_tiles'. */

static inline __attribute__((always_inline)) void block_q5(const q8_x *restrict s, const uint8_t *restrict w,
                                                           const int64_t j, const int64_t ldw, const uint16_t *restrict w_scale,
                                                           const int64_t lds, const int64_t k, const int M,
                                                           const int R, float *restrict sums) {
#if defined(Q8_VNNI)
    __m512 acc[8][8];
    q8_zero(acc, R, M);
    const __m512i low4 = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
    const uint8_t *row[8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) row[r] = tile_row(w, j + r, ldw, Q5_CHUNK_BYTES);
    for (int64_t c = 0, at = 0; c < k; c += 2 * Q8_BLOCK, at += TILE_ROWS * Q5_CHUNK_BYTES) {
        __m512i xv[8], corr[8];
        __m512 xd[8];
        q8_x_chunk(s, c, M, 3, xv, corr, xd);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const uint8_t *p = row[r] + at;
            const __m256i nib = _mm256_loadu_si256((const __m256i *)p);
            __m512i wv = _mm512_and_si512(
                _mm512_inserti64x4(_mm512_castsi256_si512(nib), _mm256_srli_epi16(nib, 4), 1), low4);
            uint64_t bits;
            memcpy(&bits, p + 32, 8);
            wv = _mm512_mask_add_epi8(wv, _cvtu64_mask64(bits), wv, fifth);
            __builtin_prefetch(p + TILE_PREFETCH_BYTES, 0, 3);
            int32_t two;
            memcpy(&two, w_scale + r * lds + c / Q8_BLOCK, 4);  /* the two blocks' float16 scales */
            q8_accumulate(acc[r], wv, two, xv, corr, xd, M);
        }
    }
    q8_reduce(acc, R, M, sums);
#else
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) {
            const uint8_t *row = tile_row(w, j + r, ldw, Q5_CHUNK_BYTES);
            const int8_t *xq = s->xq + i * s->kp;
            float total = 0.0f;
            for (int64_t b = 0; b < k; b += Q8_BLOCK) {
                const uint8_t *chunk = row + b / 64 * TILE_ROWS * Q5_CHUNK_BYTES;
                const int upper = (int)(b % 64) / Q8_BLOCK;  /* the chunk's second block: high nibbles, bits 32-63 */
                int32_t isum = 0;
                for (int t = 0; t < Q8_BLOCK; t++) {
                    const int u = (upper ? chunk[t] >> 4 : chunk[t] & 15) |
                                  ((chunk[32 + (upper * 32 + t) / 8] >> ((upper * 32 + t) % 8)) & 1) << 4;
                    isum += (u - 16) * xq[b + t];
                }
                total += (float)isum * (f16_to_f32(w_scale[r * lds + b / Q8_BLOCK]) * s->d[i * s->kp / 4 + b / 4]);
            }
            sums[r * M + i] = total;
        }
#endif
}

#define Q5_ROWS(M, j, rows, sums) block_q5(&s, w, j, ldw, w_scale + (j) * lds, lds, k, M, rows, sums)
#define DEFINE_Q5_M(M) DEFINE_Q8_FORM_M(gemv_q5, Q5_ROWS, Q5_ROW_BYTES, M)
DEFINE_Q5_M(1) DEFINE_Q5_M(2) DEFINE_Q5_M(3) DEFINE_Q5_M(4)
DEFINE_Q5_M(5) DEFINE_Q5_M(6) DEFINE_Q5_M(7) DEFINE_Q5_M(8)

/* gemv_q8_0 with the weight packed as above (w [n, k / 64 * 40] uint8, scales [n, k / 32] float16): the same
 * x quantization and the same sums. Returns -1 (nothing written) unless m >= 1 and k is a multiple of 64, or when
 * the scratch cannot be had. */
int gemv_q5_0(const void *x, int x_kind, int64_t ldx, int64_t m, int64_t k, const uint8_t *w, const uint16_t *scales,
              int64_t n, void *out, int64_t ldo, int out_kind) {
    static const q8_rows_fn by_rows[INT8_GEMV_MAX_ROWS + 1] = {
        NULL, gemv_q5_1, gemv_q5_2, gemv_q5_3, gemv_q5_4, gemv_q5_5, gemv_q5_6, gemv_q5_7, gemv_q5_8};
    if (m < 1 || k < 64 || k % 64 || x_kind < 0 || x_kind > 2) return -1;
    return q8_passes(x, x_kind, ldx, m, k, k, w, scales, n, out, ldo, out_kind, by_rows);
}

/* pack_q5_0's tiles back to the values [n, k] int8 (n rows of them), for a layer's dequantized weight (prefill):
 * torch's uint8 shifts took 6x the int8 layer's whole dequantize. */
void unpack_q5_0_tiles(const uint8_t *w, int64_t n, int64_t k, int8_t *out) {
    const int64_t ldw = Q5_ROW_BYTES(k);
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *row = tile_row(w, j, ldw, Q5_CHUNK_BYTES);
        int8_t *o = out + j * k;
        for (int64_t c = 0; c < k; c += 64, o += 64) {
            const uint8_t *run = row + c / 64 * TILE_ROWS * Q5_CHUNK_BYTES;
            uint64_t bits;
            memcpy(&bits, run + 32, 8);
            for (int t = 0; t < 32; t++) {
                o[t] = (int8_t)(((run[t] & 15) | ((bits >> t) & 1) << 4) - 16);
                o[t + 32] = (int8_t)(((run[t] >> 4) | ((bits >> (t + 32)) & 1) << 4) - 16);
            }
        }
    }
}

/* A mixture-of-experts layer's routed experts in one call: every active expert's gate_up, its activation,
 * and its down, each output row scaled by its routing weight and added into its token's row.
 *
 * A decode step reads each active expert's weights once for its few rows (Qwen3-30B-A3B's shape: 8-77 experts
 * of 9.4 MB a layer); the work is the memory's. One call instead of two matmuls per active expert keeps both
 * cores streaming weights the whole time, with no fork, no call overhead and no half-empty second core per
 * expert, and the [rows, 2I] products and the per-expert outputs never reach memory.
 *
 * Weights: each layer's experts stacked as panels for vdpbf16ps (cpu_gemv.c's gemv_panels layout, per expert):
 *   gate_up [E][I16][2][Hp][16][2]: per block of 16 intermediate features, gate's panel then up's, each a k pair
 *           of 16 outputs per 64-byte line (Hp = ceil(H / 2) pairs; I16 = ceil(I / 16));
 *   down    [E][H16][Ip][16][2]: per block of 16 outputs, Ip = 8 * I16 pairs of the padded intermediate.
 * Zero past H and I, so a padded feature's activation is 0 and adds nothing to down.
 *
 * One OpenMP region, two phases split between the threads by (expert, block of 16 outputs):
 *   1. each thread takes the same share of every active expert's gate_up blocks (a contiguous run of its
 *      weights), whatever the rows per expert: both cores stream even when one expert has every row;
 *      the activation is applied in registers and the hidden row, rounded to bfloat16, written to scratch;
 *   2. after a barrier, each thread takes a contiguous share of the output's column blocks and walks the
 *      active experts in ascending order over it: a token's experts are added in the order transformers'
 *      experts loop adds them, and no two threads write one element.
 * An expert no pair routes to is never touched. Rows run 1..ROW_CHUNK at a time against one block, so a
 * block's panel (64 KB of gate_up at H = 2048) is read from memory once and from the caches after.
 * Each thread reads its share of an expert as one or two sequential streams, which the hardware prefetcher
 * follows: software prefetches 16-128 lines ahead (cpu_gemv.c's) cost a fifth of the bandwidth on Zen 4
 * (20.6 against 25.9 GB/s on one core at one token; the measurement log of issue 52's kernel).
 *
 * Roundings are transformers' in bfloat16 (kernels/moe_reference.py, op for op): each product, then its
 * bias added, SiLU(gate) and its product with up (or each op of gpt-oss's clamped SwiGLU), down's product
 * and bias, its scaling by the routing weight, and each add into the token's row.
 * Only the dot products' summation order differs from oneDNN's.
 *
 * Instructions (the library is built with -march=native, cpu_native.py): vdpbf16ps with AVX512-BF16; otherwise
 * each 64-byte line's bfloat16 pairs widened to float32 (the even k by a shift, the odd by a mask) and float32
 * multiply-adds, on 16 lanes (AVX-512), 8 (AVX2) or GCC's generic vectors. cpu_kernel_variant() names it.
 */
#include <stdlib.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cpu_half.h"
#include "cpu_softmax_exp.h"

#if defined(__AVX512BF16__) && HALF_VW == 16
#define MOE_DPBF16 1
#else
#define MOE_DPBF16 0
#endif
#define NSUB (16 / HALF_VW) /* vectors per 16 outputs */
#if HALF_VW == 16
#define ROW_CHUNK 8
#elif HALF_VW == 8
#define ROW_CHUNK 2
#else
#define ROW_CHUNK 1
#endif
/* Below this many weight bytes to read, one thread (a fork costs more than it saves). */
#define PARALLEL_MIN_BYTES (256 << 10)

typedef uint32_t huvec_unaligned __attribute__((vector_size(HALF_VW * sizeof(float)), aligned(4)));

/* One 64-byte panel line: 16 outputs' k pair. */
typedef struct {
#if MOE_DPBF16
    __m512bh w;
#else
    hvec even[NSUB], odd[NSUB];
#endif
} wline;

typedef struct {
    hvec v[NSUB];
} acc16;

static inline __attribute__((always_inline)) wline load_line(const uint16_t *p) {
    wline l;
#if MOE_DPBF16
    l.w = (__m512bh)_mm512_loadu_si512(p);
#else
    for (int s = 0; s < NSUB; s++) {
        const huvec lanes = *(const huvec_unaligned *)(p + 2 * HALF_VW * s);
        l.even[s] = (hvec)(lanes << 16);
        l.odd[s] = (hvec)(lanes & 0xffff0000u);
    }
#endif
    return l;
}

/* acc += x's pair (two bfloat16 at x) times the line. */
static inline __attribute__((always_inline)) void line_fma(acc16 *acc, const wline *l, const uint16_t *x) {
    uint32_t pair;
    memcpy(&pair, x, sizeof pair);
#if MOE_DPBF16
    acc->v[0] = (hvec)_mm512_dpbf16_ps((__m512)acc->v[0], (__m512bh)_mm512_set1_epi32((int)pair), l->w);
#else
    const hvec xe = hbroadcast(bits_to_f32(pair << 16)), xo = hbroadcast(bits_to_f32(pair & 0xffff0000u));
    for (int s = 0; s < NSUB; s++) acc->v[s] += xe * l->even[s] + xo * l->odd[s];
#endif
}

static inline __attribute__((always_inline)) void acc_zero(acc16 *a) {
    for (int s = 0; s < NSUB; s++) a->v[s] = hbroadcast(0.0f);
}

static inline __attribute__((always_inline)) void acc_add(acc16 *a, const acc16 *b) {
    for (int s = 0; s < NSUB; s++) a->v[s] += b->v[s];
}

static inline __attribute__((always_inline)) void acc_store(float *out, const acc16 *a) {
    for (int s = 0; s < NSUB; s++) memcpy(out + s * HALF_VW, &a->v[s], sizeof(hvec));
}

static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

/* U chains per row so that the products' latency never bounds a row's sums. */
#define UNROLL(M) ((M) <= 2 ? 4 : (M) <= 4 ? 2 : 1)

/* sums[i * 16 + c] (i < M) = row i . the panel's column c, over kp pairs; TWO: a second panel (up) too. */
static inline __attribute__((always_inline)) void panel_rows(const uint16_t *const *rows, const uint16_t *pa,
                                                             const uint16_t *pb, const int64_t kp, const int M,
                                                             const int TWO, float *sa, float *sb) {
    enum { UMAX = 4 };
    const int U = UNROLL(M) > (TWO ? 2 : 4) ? (TWO ? 2 : 4) : UNROLL(M);
    acc16 a[UMAX][8], b[UMAX][8];  /* M <= ROW_CHUNK <= 8 at run time */
#pragma GCC unroll 4
    for (int u = 0; u < U; u++)
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            acc_zero(&a[u][i]);
            if (TWO) acc_zero(&b[u][i]);
        }
    int64_t p = 0;
    for (; p + U <= kp; p += U) {
#pragma GCC unroll 4
        for (int u = 0; u < U; u++) {
            const wline la = load_line(pa + (p + u) * 32);
            wline lb;
            if (TWO) lb = load_line(pb + (p + u) * 32);
#pragma GCC unroll 8
            for (int i = 0; i < M; i++) {
                line_fma(&a[u][i], &la, rows[i] + 2 * (p + u));
                if (TWO) line_fma(&b[u][i], &lb, rows[i] + 2 * (p + u));
            }
        }
    }
    for (; p < kp; p++) {
        const wline la = load_line(pa + p * 32);
        wline lb;
        if (TWO) lb = load_line(pb + p * 32);
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            line_fma(&a[0][i], &la, rows[i] + 2 * p);
            if (TWO) line_fma(&b[0][i], &lb, rows[i] + 2 * p);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; i++) {
#pragma GCC unroll 4
        for (int u = 1; u < U; u++) {
            acc_add(&a[0][i], &a[u][i]);
            if (TWO) acc_add(&b[0][i], &b[u][i]);
        }
        acc_store(sa + i * 16, &a[0][i]);
        if (TWO) acc_store(sb + i * 16, &b[0][i]);
    }
}

#define DEFINE_PANEL_ROWS(M)                                                                                    \
    static void gate_up_rows_##M(const uint16_t *const *rows, const uint16_t *g, const uint16_t *u, int64_t kp,  \
                                 float *sg, float *su) {                                                         \
        panel_rows(rows, g, u, kp, M, 1, sg, su);                                                               \
    }                                                                                                           \
    static void down_rows_##M(const uint16_t *const *rows, const uint16_t *d, int64_t kp, float *sd) {           \
        panel_rows(rows, d, NULL, kp, M, 0, sd, NULL);                                                          \
    }
DEFINE_PANEL_ROWS(1) DEFINE_PANEL_ROWS(2) DEFINE_PANEL_ROWS(3) DEFINE_PANEL_ROWS(4)
DEFINE_PANEL_ROWS(5) DEFINE_PANEL_ROWS(6) DEFINE_PANEL_ROWS(7) DEFINE_PANEL_ROWS(8)

typedef void (*gate_up_fn)(const uint16_t *const *, const uint16_t *, const uint16_t *, int64_t, float *, float *);
typedef void (*down_fn)(const uint16_t *const *, const uint16_t *, int64_t, float *);
static const gate_up_fn GATE_UP[9] = {NULL, gate_up_rows_1, gate_up_rows_2, gate_up_rows_3, gate_up_rows_4,
                                      gate_up_rows_5, gate_up_rows_6, gate_up_rows_7, gate_up_rows_8};
static const down_fn DOWN[9] = {NULL, down_rows_1, down_rows_2, down_rows_3, down_rows_4,
                                down_rows_5, down_rows_6, down_rows_7, down_rows_8};

/* A product rounded, then its bias (or none) added and rounded again: transformers' F.linear, then + bias. */
static inline float biased(float sum, const uint16_t *bias) {
    const float product = round_bf16(sum);
    return bias ? round_bf16(product + bf16_to_f32(*bias)) : product;
}

/* The hidden row's 16 features from gate's and up's sums (biased):
 * silu(g) * u (activation 0) or gpt-oss's clamped SwiGLU (1), every op rounded to bfloat16 where torch rounds. */
static inline void activate(const float *sg, const float *su, const uint16_t *bg, const uint16_t *bu, int cols,
                            int activation, float alpha, float limit, uint16_t *out) {
    float h[16];
    for (int c = 0; c < 16; c++) {
        const float g = biased(sg[c], bg && c < cols ? bg + c : NULL);
        const float u = biased(su[c], bu && c < cols ? bu + c : NULL);
        if (activation == 0) {
            const float e = -g < 88.0f ? -g : 88.0f;
            h[c] = round_bf16(round_bf16(g / (1.0f + exp_normal(e > -87.0f ? e : -87.0f))) * u);
        } else {
            const float gc = g < limit ? g : limit;  /* clamp(max=limit), NaN kept */
            const float uc = u < -limit ? -limit : u > limit ? limit : u;
            const float z = -round_bf16(gc * alpha);
            const float sig = round_bf16(1.0f / (1.0f + exp_normal(z < 88.0f ? (z > -87.0f ? z : -87.0f) : 88.0f)));
            h[c] = round_bf16(round_bf16(uc + 1.0f) * round_bf16(gc * sig));
        }
    }
    for (int c = 0; c < 16; c++) out[c] = f32_to_bf16(h[c]);
}

static inline int64_t share(int64_t n, int part, int parts) { return n * part / parts; }

/* x [tokens, hidden] bfloat16 (row stride ldx; hidden even: rows are read in pairs), routing ids [tokens, top_k]
 * int64 and weights [tokens, top_k] float32; the stacked panels above for num_experts experts of size
 * intermediate features, biases [E, 2 * size] (gate's then up's) and [E, hidden] bfloat16 or NULL; activation 0
 * SiLU, 1 clamped SwiGLU (alpha, limit); out [tokens, hidden] bfloat16 (row stride ldo), zeros on entry: each
 * token's experts' weighted outputs are added to it. Returns 0, -1 for an expert id out of range (nothing
 * computed), -2 without memory for the scratch. */
int moe_experts_bf16(const uint16_t *x, int64_t ldx, int64_t tokens, int64_t hidden, const int64_t *ids,
                     const float *weights, int64_t top_k, int64_t num_experts, int64_t size,
                     const uint16_t *gate_up, const uint16_t *down, const uint16_t *gate_up_bias,
                     const uint16_t *down_bias, int activation, float alpha, float limit, uint16_t *out,
                     int64_t ldo) {
    const int64_t pairs = tokens * top_k, i16 = (size + 15) / 16, h16 = (hidden + 15) / 16;
    const int64_t hp = (hidden + 1) / 2, ip = 8 * i16, ldh = 16 * i16;
    const int64_t gate_up_stride = i16 * 2 * hp * 32, down_stride = h16 * ip * 32;
    for (int64_t p = 0; p < pairs; p++)
        if (ids[p] < 0 || ids[p] >= num_experts) return -1;
    int64_t *start = calloc((size_t)num_experts + 1, sizeof *start), *row_pair = malloc(sizeof(int64_t) * pairs);
    int64_t *active = malloc(sizeof(int64_t) * (size_t)(num_experts < pairs ? num_experts : pairs));
    uint16_t *hidden_rows = malloc(sizeof(uint16_t) * (size_t)(pairs * ldh));
    if (!start || !row_pair || !active || !hidden_rows) {
        free(start); free(row_pair); free(active); free(hidden_rows);
        return -2;
    }
    /* a counting sort of the pairs by expert, token-major within one */
    for (int64_t p = 0; p < pairs; p++) start[ids[p] + 1]++;
    int64_t n_active = 0;
    for (int64_t e = 0; e < num_experts; e++) {
        if (start[e + 1]) active[n_active++] = e;
        start[e + 1] += start[e];
    }
    {
        int64_t *fill = malloc(sizeof(int64_t) * (size_t)num_experts);
        if (!fill) {
            free(start); free(row_pair); free(active); free(hidden_rows);
            return -2;
        }
        memcpy(fill, start, sizeof(int64_t) * (size_t)num_experts);
        for (int64_t p = 0; p < pairs; p++) row_pair[fill[ids[p]]++] = p;
        free(fill);
    }
    const int64_t bytes = n_active * (gate_up_stride + down_stride) * 2;
#pragma omp parallel if (bytes >= PARALLEL_MIN_BYTES)
    {
        int me = 0, threads = 1;
#if defined(_OPENMP)
        me = omp_get_thread_num();
        threads = omp_get_num_threads();
#endif
        const uint16_t *rows[ROW_CHUNK];
        float sa[ROW_CHUNK * 16], sb[ROW_CHUNK * 16];
        /* 1. gate_up and the activation: this thread's share of each active expert's blocks */
        for (int64_t a = 0; a < n_active; a++) {
            const int64_t e = active[a], first = start[e], count = start[e + 1] - first;
            const uint16_t *w = gate_up + e * gate_up_stride;
            const uint16_t *bias = gate_up_bias ? gate_up_bias + e * 2 * size : NULL;
            for (int64_t b = share(i16, me, threads); b < share(i16, me + 1, threads); b++) {
                const uint16_t *g = w + b * 2 * hp * 32, *u = g + hp * 32;
                const int cols = (int)(size - 16 * b < 16 ? size - 16 * b : 16);
                for (int64_t r = 0; r < count; r += ROW_CHUNK) {
                    const int m = (int)(count - r < ROW_CHUNK ? count - r : ROW_CHUNK);
                    for (int i = 0; i < m; i++) rows[i] = x + (row_pair[first + r + i] / top_k) * ldx;
                    GATE_UP[m](rows, g, u, hp, sa, sb);
                    for (int i = 0; i < m; i++)
                        activate(sa + 16 * i, sb + 16 * i, bias ? bias + 16 * b : NULL,
                                 bias ? bias + size + 16 * b : NULL, cols, activation, alpha, limit,
                                 hidden_rows + (first + r + i) * ldh + 16 * b);
                }
            }
        }
#pragma omp barrier
        /* 2. down, weighted, into each token's row: this thread's columns, the experts in ascending order */
        const int64_t b0 = share(h16, me, threads), b1 = share(h16, me + 1, threads);
        for (int64_t a = 0; a < n_active; a++) {
            const int64_t e = active[a], first = start[e], count = start[e + 1] - first;
            const uint16_t *bias = down_bias ? down_bias + e * hidden : NULL;
            for (int64_t b = b0; b < b1; b++) {
                const uint16_t *d = down + e * down_stride + b * ip * 32;
                const int cols = (int)(hidden - 16 * b < 16 ? hidden - 16 * b : 16);
                for (int64_t r = 0; r < count; r += ROW_CHUNK) {
                    const int m = (int)(count - r < ROW_CHUNK ? count - r : ROW_CHUNK);
                    for (int i = 0; i < m; i++) rows[i] = hidden_rows + (first + r + i) * ldh;
                    DOWN[m](rows, d, ip, sa);
                    for (int i = 0; i < m; i++) {
                        const int64_t pair = row_pair[first + r + i];
                        const float weight = weights[pair];
                        uint16_t *o = out + (pair / top_k) * ldo + 16 * b;
                        for (int c = 0; c < cols; c++) {
                            const float h = biased(sa[16 * i + c], bias ? bias + 16 * b + c : NULL);
                            o[c] = f32_to_bf16(bf16_to_f32(o[c]) + round_bf16(h * weight));
                        }
                    }
                }
            }
        }
    }
    free(start); free(row_pair); free(active); free(hidden_rows);
    return 0;
}

/* What the native attention kernels share: their softmax, the decode kernels' sum of eight
 * keys' scores, their prefetch of the next block and their thread count; and the SiLU gates' silu (scalar, and
 * on 16 AVX-512 lanes).
 *
 * exp(x) for -87 <= x <= 88 (a normal result): 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2, and a
 * degree-6 polynomial (error < 2 ulp). Written so the compiler vectorizes the loops that call it. */
#ifndef PAGEDSERVE_CPU_SOFTMAX_EXP_H
#define PAGEDSERVE_CPU_SOFTMAX_EXP_H
#include <stdint.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

/* The threads a parallel region would get (1 without OpenMP): the decode kernels split one stream by KV head. */
static inline int64_t omp_threads(void) {
#if defined(_OPENMP)
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static inline float exp_normal(float x) {
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { float f; int32_t i; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* silu(g) = g / (1 + exp(-g)) in float32 for the SiLU gates (cpu_linear.c, cpu_silu_mul_half.c). exp_normal takes
 * -87..88: below, 1 + exp(-g) is 1 in float32; above, 2 exp(-g - ln 2) up to where float32's exp overflows, and past
 * that g / inf, a signed zero, as torch's. Branch-free, so a loop over it vectorizes. */
static inline float silu(float g) {
    const float e = -g < -87.0f ? -87.0f : -g;
    const int over = e > 88.72283f, high = e > 88.0f;
    const float d = 1.0f + exp_normal(high ? (over ? 88.0f : e) - 0.69314718f : e) * (high ? 2.0f : 1.0f);
    return over ? g * 0.0f : g / d;
}

#if defined(__AVX512F__)
/* exp_normal and silu on 16 lanes (cpu_gemm_w8a8.c's SiLU gate), the same operations in the same order, so each
 * lane's bits are the scalar function's where the caller is compiled with -ffp-contract=off (no fused
 * multiply-adds; cpu_native.py's SOURCES). */
static inline __m512 exp16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693145751953125f))),
                                   _mm512_mul_ps(n, _mm512_set1_ps(1.428606765330187e-06f)));
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(0.5f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
    const __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(scale));
}

static inline __m512 silu16(__m512 g) {
    const __m512 e = _mm512_max_ps(_mm512_set1_ps(-87.0f), _mm512_sub_ps(_mm512_setzero_ps(), g));  /* NaN: -g */
    const __mmask16 over = _mm512_cmp_ps_mask(e, _mm512_set1_ps(88.72283f), _CMP_GT_OQ),
                    high = _mm512_cmp_ps_mask(e, _mm512_set1_ps(88.0f), _CMP_GT_OQ);
    const __m512 top =
        _mm512_sub_ps(_mm512_mask_mov_ps(e, over, _mm512_set1_ps(88.0f)), _mm512_set1_ps(0.69314718f));
    const __m512 twice = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), high, _mm512_set1_ps(2.0f));
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f),
                                   _mm512_mul_ps(exp16(_mm512_mask_mov_ps(e, high, top)), twice));
    return _mm512_mask_mov_ps(_mm512_div_ps(g, d), over, _mm512_mul_ps(g, _mm512_setzero_ps()));
}

#endif

/* exp(x) for the x <= 0 of a softmax: 0 below -87. */
static inline float softmax_exp(float x) { return x < -87.0f ? 0.0f : exp_normal(x); }

/* One decode query's n scores (n >= 1) become exp(s - max); returns 1 / their sum. Max and sum
 * run in SOFTMAX_LANES independent lanes (vectorized, a fixed order), then combine: the same
 * bits on every thread count, for the float32 and the half precision kernels alike. ``sink``
 * (gpt-oss's attention sink, a logit with no value) joins the max and the sum; -INFINITY where the
 * layer has none: it then changes no bit (max unchanged, exp 0 added to a positive sum). */
#define SOFTMAX_LANES 16
static inline float decode_softmax(float *s, int64_t n, float sink) {
    float m = s[0], lane[SOFTMAX_LANES], sum = 0.0f;
    int64_t j = 0;
    for (int l = 0; l < SOFTMAX_LANES; l++) lane[l] = s[0];
    for (; j + SOFTMAX_LANES <= n; j += SOFTMAX_LANES)
        for (int l = 0; l < SOFTMAX_LANES; l++) lane[l] = s[j + l] > lane[l] ? s[j + l] : lane[l];
    for (int l = 0; l < SOFTMAX_LANES; l++) m = lane[l] > m ? lane[l] : m;
    for (; j < n; j++) m = s[j] > m ? s[j] : m;
    m = sink > m ? sink : m;
    for (j = 0; j < n; j++) s[j] = softmax_exp(s[j] - m);
    for (int l = 0; l < SOFTMAX_LANES; l++) lane[l] = 0.0f;
    for (j = 0; j + SOFTMAX_LANES <= n; j += SOFTMAX_LANES)
        for (int l = 0; l < SOFTMAX_LANES; l++) lane[l] += s[j + l];
    for (; j < n; j++) sum += s[j];
    for (int w = SOFTMAX_LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) lane[l] += lane[l + w];
    return 1.0f / (sum + lane[0] + softmax_exp(sink - m));
}

/* Blocks sit anywhere in the cache, so the hardware's stream prefetcher loses the thread at
 * every block boundary and a step's keys and values (larger than the caches) come from DRAM at
 * a fraction of its bandwidth. The decode kernels request the next block's keys and values
 * (elem bytes each) while they score this one; the values are weighed after all the keys, from
 * the caches by then (bench/log/2026-11-26.md: 1.5x on float32, 1.7x on bfloat16). */
static inline void prefetch_next_block(const void *k, const void *v, const int32_t *table, int64_t pos, int64_t hi,
                                       int64_t bs, int64_t row, int64_t elem) {
    const int64_t next = (pos / bs + 1) * bs;
    if (next >= hi) return;
    const int64_t bytes = (hi - next < bs ? hi - next : bs) * row * elem;
    const char *kb = (const char *)k + (int64_t)table[next / bs] * bs * row * elem;
    const char *vb = (const char *)v + (int64_t)table[next / bs] * bs * row * elem;
    for (int64_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch(kb + off, 0, 3);
        __builtin_prefetch(vb + off, 0, 3);
    }
}

#if defined(__AVX__)
/* out[j] = scale * (the sum of a[j]'s lanes), j < 8: the decode kernels' scores of eight keys,
 * reduced together (hadd tree + one cross-lane add) rather than as eight horizontal sums, which
 * cost more than the products for heads of 32-64. */
static inline void sum_eight_keys(const __m256 a[8], float scale, float *out) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    _mm256_storeu_ps(out, _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
}
#endif

#endif

/* Half precision (bfloat16, float16) for the native CPU kernels: values are widened to float32
 * in registers, all arithmetic is float32, and a result is rounded to nearest even, the way
 * torch's own conversions round (NaN becomes torch's canonical NaN), so a kernel that rounds
 * where torch's ops round gives torch's bits.
 *
 * The instructions are picked at compile time: the library is built on the machine that runs it
 * with -march=native (kernels/cpu_native.py), so the flags the compiler defines are this CPU's.
 *   AVX-512:          16 lanes; bfloat16 widened by a 16-bit shift, float16 by vcvtph2ps; with
 *                     AVX512-BF16 the decode kernel's q.k products use vdpbf16ps
 *   AVX2, FMA, F16C:  8 lanes, the same conversions on 256-bit vectors
 *   otherwise:        GCC's generic vectors with scalar conversions (any target it builds for)
 * cpu_kernel_variant() (cpu_decode_attention_half.c) names the choice for the worker's log.
 */
#ifndef PAGEDSERVE_CPU_HALF_H
#define PAGEDSERVE_CPU_HALF_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define HALF_VW 16
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HALF_VW 8
#else
#define HALF_VW 4
#endif

typedef float hvec __attribute__((vector_size(HALF_VW * sizeof(float))));
typedef uint32_t huvec __attribute__((vector_size(HALF_VW * sizeof(float))));
typedef int32_t hivec __attribute__((vector_size(HALF_VW * sizeof(float))));
typedef float hvec_unaligned __attribute__((vector_size(HALF_VW * sizeof(float)), aligned(sizeof(float))));

static inline hvec hbroadcast(float x) { return (hvec){0} + x; }

static inline float bits_to_f32(uint32_t u) { float f; memcpy(&f, &u, sizeof f); return f; }
static inline uint32_t f32_to_bits(float f) { uint32_t u; memcpy(&u, &f, sizeof u); return u; }

static inline float bf16_to_f32(uint16_t h) { return bits_to_f32((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) {
    const uint32_t u = f32_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    if (exponent == 0x1f) return bits_to_f32(sign | 0x7f800000u | mantissa << 13);
    if (exponent) return bits_to_f32(sign | (exponent + 112) << 23 | mantissa << 13);
    return bits_to_f32(sign | f32_to_bits((float)mantissa * 0x1p-24f));  /* zero or subnormal: exact */
#endif
}

static inline uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    uint32_t u = f32_to_bits(f);
    const uint16_t sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return sign | 0x7e00u;
    if (u >= 0x477ff000u) return sign | 0x7c00u;  /* 65520 and up round to infinity */
    if (u < 0x38800000u)  /* below 2^-14: a subnormal result, scaled exactly, rounded by rint */
        return sign | (uint16_t)__builtin_rintf(bits_to_f32(u) * 0x1p24f);
    u -= 112u << 23;  /* rebias the exponent, then round 13 mantissa bits to nearest even */
    return sign | (uint16_t)((u + 0xfffu + ((u >> 13) & 1u)) >> 13);
#endif
}

/* A float8_e4m3fn byte as 2^-120 times its value, exactly (its subnormals become float32's): its exponent and
 * mantissa moved into float32's bits, the sign to bit 31. The int8 GEMV and the dequantize pass read FP8 weights so,
 * their scales carrying the 2^120 (cpu_quantized.fp8_block_scales). */
static inline float fp8_e4m3_scaled(uint8_t b) {
    return bits_to_f32((uint32_t)(b & 0x7fu) << 20 | (uint32_t)(b & 0x80u) << 24);
}

static inline float half_to_f32(uint16_t h, int bf16) { return bf16 ? bf16_to_f32(h) : f16_to_f32(h); }
static inline uint16_t f32_to_half(float f, int bf16) { return bf16 ? f32_to_bf16(f) : f32_to_f16(f); }

/* HALF_VW halves from p, widened. */
static inline hvec load_bf16(const uint16_t *p) {
#if HALF_VW == 16
    return (hvec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif HALF_VW == 8
    return (hvec)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    hvec x;
    for (int i = 0; i < HALF_VW; i++) x[i] = bf16_to_f32(p[i]);
    return x;
#endif
}

static inline hvec load_f16(const uint16_t *p) {
#if HALF_VW == 16
    return (hvec)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif HALF_VW == 8
    return (hvec)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    hvec x;
    for (int i = 0; i < HALF_VW; i++) x[i] = f16_to_f32(p[i]);
    return x;
#endif
}

static inline hvec load_half(const uint16_t *p, int bf16) { return bf16 ? load_bf16(p) : load_f16(p); }
static inline hvec load_f32(const float *p) { return *(const hvec_unaligned *)p; }

/* x rounded to the nearest bfloat16, as a float32 (NaN: torch's 0x7fc0). */
static inline huvec bf16_rounded_bits(hvec x) {
    const huvec u = (huvec)x;
    const huvec rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const huvec nan = (huvec)((u & 0x7fffffffu) > 0x7f800000u);
    return (rounded & ~nan) | (0x7fc00000u & nan);
}

static inline void store_bf16(uint16_t *p, hvec x) {
    const huvec top = bf16_rounded_bits(x) >> 16;
#if HALF_VW == 16
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16((__m512i)top));
#elif HALF_VW == 8
    const __m256i packed = _mm256_packus_epi32((__m256i)top, (__m256i)top);  /* values < 2^16 */
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
#else
    for (int i = 0; i < HALF_VW; i++) p[i] = (uint16_t)top[i];
#endif
}

static inline void store_f16(uint16_t *p, hvec x) {
#if HALF_VW == 16
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif HALF_VW == 8
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph((__m256)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    for (int i = 0; i < HALF_VW; i++) p[i] = f32_to_f16(x[i]);
#endif
}

static inline void store_half(uint16_t *p, hvec x, int bf16) { if (bf16) store_bf16(p, x); else store_f16(p, x); }

/* x rounded to the dtype and widened back: where torch rounds an intermediate result. */
static inline hvec round_half(hvec x, int bf16) {
    if (bf16) return (hvec)bf16_rounded_bits(x);
#if HALF_VW == 16
    return (hvec)_mm512_cvtph_ps(_mm512_cvtps_ph((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif HALF_VW == 8
    return (hvec)_mm256_cvtph_ps(_mm256_cvtps_ph((__m256)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    for (int i = 0; i < HALF_VW; i++) x[i] = f16_to_f32(f32_to_f16(x[i]));
    return x;
#endif
}

static inline float hsum(hvec x) {
#if HALF_VW == 16
    return _mm512_reduce_add_ps((__m512)x);
#else
    float s = 0.0f;
    for (int i = 0; i < HALF_VW; i++) s += x[i];
    return s;
#endif
}

#endif

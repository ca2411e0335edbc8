// Shared helpers of pdserve's CPU kernels: bfloat16 conversion, AVX-512 and AVX2 loads/stores
// of float32 and bfloat16 rows, horizontal reductions and a fast exp. Every kernel has a scalar
// path, so the library builds and runs on any x86-64 or ARM CPU; the AVX-512 (AVX2) paths are
// compiled in where the build machine (-march=native) has AVX-512 (AVX2 and FMA).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define PD_AVX512 1
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define PD_AVX2 1   // 256-bit FMA: the bf16-weight linear's path on CPUs without AVX-512
#include <immintrin.h>
#endif

namespace pd {

using bf16 = uint16_t;   // bfloat16 bits

// dtype codes shared with the Python side (engine/layers/cpu_kernels.py)
enum DType : int { F32 = 0, BF16 = 1 };

static inline float to_f32(float x) { return x; }
static inline float to_f32(bf16 x) {
    uint32_t u = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// float32 -> bfloat16, round to nearest even (as torch's .to(torch.bfloat16)); NaN stays NaN.
static inline bf16 f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return bf16((u >> 16) | 0x40);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return bf16(u >> 16);
}

template <typename T> static inline T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }
template <> inline bf16 from_f32<bf16>(float x) { return f32_to_bf16(x); }

// x rounded to T and back: what a value computed in float32 becomes once stored as T.
template <typename T> static inline float round_as(float x) { return to_f32(from_f32<T>(x)); }

#ifdef PD_AVX512
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const bf16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 load16(const bf16* p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// 16 float32 -> 16 bfloat16 (round to nearest even, NaN kept) in a 256-bit register.
static inline __m256i cvt_bf16(__m512 v) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}

static inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline void store16(bf16* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, cvt_bf16(v)); }
static inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
static inline void store16(bf16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, cvt_bf16(v)); }

// v rounded to T and widened back to float32.
template <typename T> static inline __m512 round_as16(__m512 v);
template <> inline __m512 round_as16<float>(__m512 v) { return v; }
template <> inline __m512 round_as16<bf16>(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(cvt_bf16(v)), 16));
}

static inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// exp(x): x*log2(e) = k + f, f in [-0.5, 0.5], 2^f by a degree-6 polynomial; relative error ~2e-7.
// Inputs below ~-87 give 0 (as expf), above ~88 give inf.
static inline __m512 exp16(__m512 x) {
    const __m512 log2e = _mm512_set1_ps(1.4426950408889634f);
    const __m512 c1 = _mm512_set1_ps(0.6931471805599453f), c2 = _mm512_set1_ps(0.2402265069591007f),
                 c3 = _mm512_set1_ps(0.05550410866482158f), c4 = _mm512_set1_ps(0.009618129107628477f),
                 c5 = _mm512_set1_ps(0.0013333558146428443f), c6 = _mm512_set1_ps(0.00015403530393381606f),
                 one = _mm512_set1_ps(1.f);
    __m512 t = _mm512_mul_ps(x, log2e);
    t = _mm512_max_ps(t, _mm512_set1_ps(-150.f));
    t = _mm512_min_ps(t, _mm512_set1_ps(150.f));
    const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, k);
    __m512 p = _mm512_fmadd_ps(c6, f, c5);
    p = _mm512_fmadd_ps(p, f, c4);
    p = _mm512_fmadd_ps(p, f, c3);
    p = _mm512_fmadd_ps(p, f, c2);
    p = _mm512_fmadd_ps(p, f, c1);
    p = _mm512_fmadd_ps(p, f, one);
    return _mm512_scalef_ps(p, k);
}
#endif

#ifdef PD_AVX2
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const bf16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// [sum of a[0]'s lanes, ..., sum of a[7]'s lanes].
static inline __m256 reduce8(const __m256* a) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 lo = _mm256_hadd_ps(s01, s23), hi = _mm256_hadd_ps(s45, s67);   // [a0..a3 low | a0..a3 high]
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

static inline float hmax8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

// exp(x) over 8 lanes, as exp16: x*log2(e) = k + f, 2^f by the same degree-6 polynomial, 2^k
// built in the exponent bits (k clamped to [-126, 127]: results below 2^-126 flush to 0, as the
// softmax and SiLU uses here need no denormals). Relative error ~2e-7.
static inline __m256 exp8(__m256 x) {
    const __m256 log2e = _mm256_set1_ps(1.4426950408889634f);
    const __m256 c1 = _mm256_set1_ps(0.6931471805599453f), c2 = _mm256_set1_ps(0.2402265069591007f),
                 c3 = _mm256_set1_ps(0.05550410866482158f), c4 = _mm256_set1_ps(0.009618129107628477f),
                 c5 = _mm256_set1_ps(0.0013333558146428443f), c6 = _mm256_set1_ps(0.00015403530393381606f),
                 one = _mm256_set1_ps(1.f);
    __m256 t = _mm256_mul_ps(x, log2e);
    t = _mm256_max_ps(t, _mm256_set1_ps(-127.f));
    t = _mm256_min_ps(t, _mm256_set1_ps(127.f));
    const __m256 k = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, k);
    __m256 p = _mm256_fmadd_ps(c6, f, c5);
    p = _mm256_fmadd_ps(p, f, c4);
    p = _mm256_fmadd_ps(p, f, c3);
    p = _mm256_fmadd_ps(p, f, c2);
    p = _mm256_fmadd_ps(p, f, c1);
    p = _mm256_fmadd_ps(p, f, one);
    const __m256i ki = _mm256_cvtps_epi32(k);
    const __m256i lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(-126), ki);   // 2^k below the normal range
    const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(ki, _mm256_set1_epi32(127)), 23));
    return _mm256_andnot_ps(_mm256_castsi256_ps(lo), _mm256_mul_ps(p, scale));
}
#endif

}  // namespace pd

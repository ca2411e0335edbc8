// Fused elementwise kernels of the decoder layer, float32 or bfloat16 activations, float32 math.
//
// Each rounds where the torch reference path (engine/layers/norm.py, rotary.py, llama.py) rounds,
// so results equal torch's up to float32 summation order:
//   rms_norm:        out = T(T(x * rsqrt(mean(x^2) + eps)) * w)
//   add_rms_norm:    residual = T(residual + x); out = rms_norm(residual)
//   silu_mul:        out = T(T(silu(gate)) * up)
//   qkv_rope_store:  per q/k head: optional rms_norm, then T(T(x * cos) + T(rotate_half(x) * sin));
//                    q and k rotated in place inside the fused qkv rows; k and v stored to the
//                    KV cache slots (rounded to the cache dtype).
#include <type_traits>
#include "pd_common.h"

using namespace pd;

namespace {

template <typename T>
void rms_row(const T* x, const T* w, T* out, int64_t n, float eps) {
#ifdef PD_AVX512
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 v = load16(x + i, m);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    const float r = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / float(n) + eps);
    const __m512 vr = _mm512_set1_ps(r);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 v = round_as16<T>(_mm512_mul_ps(load16(x + i, m), vr));
        store16(out + i, _mm512_mul_ps(v, load16(w + i, m)), m);
    }
#else
    float ss = 0.f;
    for (int64_t i = 0; i < n; i++) { const float v = to_f32(x[i]); ss += v * v; }
    const float r = 1.f / std::sqrt(ss / float(n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = from_f32<T>(round_as<T>(to_f32(x[i]) * r) * to_f32(w[i]));
#endif
}

template <typename T>
void add_rows(const T* x, T* res, int64_t n) {
#ifdef PD_AVX512
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        store16(res + i, _mm512_add_ps(load16(res + i, m), load16(x + i, m)), m);
    }
#else
    for (int64_t i = 0; i < n; i++) res[i] = from_f32<T>(to_f32(res[i]) + to_f32(x[i]));
#endif
}

template <typename T>
void silu_mul_row(const T* g, const T* u, T* out, int64_t n) {
#ifdef PD_AVX512
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 x = load16(g + i, m);
        const __m512 s = round_as16<T>(_mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
        store16(out + i, _mm512_mul_ps(s, load16(u + i, m)), m);
    }
#else
    int64_t i = 0;
#ifdef PD_AVX2
    if constexpr (std::is_same_v<T, float>) {
        const __m256 one = _mm256_set1_ps(1.f);
        for (; i + 8 <= n; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
            _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
    }
#endif
    for (; i < n; i++) {
        const float x = to_f32(g[i]);
        out[i] = from_f32<T>(round_as<T>(x / (1.f + std::exp(-x))) * to_f32(u[i]));
    }
#endif
}

// One head of D values in place: optional rms_norm by w, then rotary with this position's tables.
template <typename T>
void rope_head(T* x, int64_t D, const T* cos, const T* sin, const T* w, float eps) {
    if (w != nullptr) rms_row<T>(x, w, x, D, eps);
    const int64_t half = D / 2;
#ifdef PD_AVX512
    if (half % 16 == 0) {
        const __m512 sign = _mm512_set1_ps(-0.f);
        for (int64_t j = 0; j < half; j += 16) {
            const __m512 x1 = load16(x + j), x2 = load16(x + j + half);
            const __m512 o1 = _mm512_add_ps(round_as16<T>(_mm512_mul_ps(x1, load16(cos + j))),
                                            round_as16<T>(_mm512_mul_ps(_mm512_xor_ps(x2, sign), load16(sin + j))));
            const __m512 o2 = _mm512_add_ps(round_as16<T>(_mm512_mul_ps(x2, load16(cos + j + half))),
                                            round_as16<T>(_mm512_mul_ps(x1, load16(sin + j + half))));
            store16(x + j, o1);
            store16(x + j + half, o2);
        }
        return;
    }
#endif
    float buf[512];
    for (int64_t j = 0; j < D; j++) buf[j] = to_f32(x[j]);
    for (int64_t j = 0; j < D; j++) {
        const float rot = j < half ? -buf[j + half] : buf[j - half];   // rotate_half(x)[j]
        const float a = round_as<T>(buf[j] * to_f32(cos[j]));
        const float b = round_as<T>(rot * to_f32(sin[j]));
        x[j] = from_f32<T>(a + b);
    }
}

template <typename C, typename T>
void store_row(C* dst, const T* src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = from_f32<C>(to_f32(src[i]));
}

template <typename T, typename C>
void qkv_rope_store(T* qkv, int64_t r0, int64_t r1, int64_t nq, int64_t nkv, int64_t D, const int64_t* positions,
                    const T* cos, const T* sin, const T* qw, const T* kw, float eps, C* kc, C* vc,
                    const int64_t* slots) {
    const int64_t width = (nq + 2 * nkv) * D;
    for (int64_t r = r0; r < r1; r++) {
        T* row = qkv + r * width;
        const T* c = cos + positions[r] * D;
        const T* s = sin + positions[r] * D;
        for (int64_t h = 0; h < nq; h++) rope_head<T>(row + h * D, D, c, s, qw, eps);
        for (int64_t h = 0; h < nkv; h++) rope_head<T>(row + (nq + h) * D, D, c, s, kw, eps);
        if (kc != nullptr && slots[r] >= 0) {
            store_row<C, T>(kc + slots[r] * nkv * D, row + nq * D, nkv * D);
            store_row<C, T>(vc + slots[r] * nkv * D, row + (nq + nkv) * D, nkv * D);
        }
    }
}

}  // namespace

extern "C" {

int pd_rms_norm(const void* x, int64_t x_stride, const void* w, void* out, int64_t out_stride, int64_t r0,
                int64_t r1, int64_t dim, float eps, int dtype) {
    for (int64_t r = r0; r < r1; r++) {
        if (dtype == BF16)
            rms_row<bf16>((const bf16*)x + r * x_stride, (const bf16*)w, (bf16*)out + r * out_stride, dim, eps);
        else
            rms_row<float>((const float*)x + r * x_stride, (const float*)w, (float*)out + r * out_stride, dim, eps);
    }
    return 0;
}

int pd_add_rms_norm(const void* x, int64_t x_stride, void* residual, const void* w, void* out, int64_t r0,
                    int64_t r1, int64_t dim, float eps, int dtype) {
    for (int64_t r = r0; r < r1; r++) {
        if (dtype == BF16) {
            bf16* res = (bf16*)residual + r * dim;
            add_rows<bf16>((const bf16*)x + r * x_stride, res, dim);
            rms_row<bf16>(res, (const bf16*)w, (bf16*)out + r * dim, dim, eps);
        } else {
            float* res = (float*)residual + r * dim;
            add_rows<float>((const float*)x + r * x_stride, res, dim);
            rms_row<float>(res, (const float*)w, (float*)out + r * dim, dim, eps);
        }
    }
    return 0;
}

int pd_silu_mul(const void* gate_up, void* out, int64_t r0, int64_t r1, int64_t inter, int dtype) {
    for (int64_t r = r0; r < r1; r++) {
        if (dtype == BF16) {
            const bf16* g = (const bf16*)gate_up + r * 2 * inter;
            silu_mul_row<bf16>(g, g + inter, (bf16*)out + r * inter, inter);
        } else {
            const float* g = (const float*)gate_up + r * 2 * inter;
            silu_mul_row<float>(g, g + inter, (float*)out + r * inter, inter);
        }
    }
    return 0;
}

// qkv: [rows, (nq + 2 nkv) * D] contiguous, rotated in place; cos/sin: [max_pos, D] in the
// activation dtype; qw/kw: [D] q/k norm weights or null; kc/vc: [slots, nkv, D] or null;
// slots[r] < 0 skips the store of row r.
int pd_qkv_rope_store(void* qkv, int64_t r0, int64_t r1, int64_t nq, int64_t nkv, int64_t D,
                      const int64_t* positions, const void* cos, const void* sin, const void* qw, const void* kw,
                      float eps, void* kc, void* vc, const int64_t* slots, int dtype, int cache_dtype) {
    if (D > 512 || D % 2) return 1;
    if (dtype == BF16) {
        if (cache_dtype == BF16)
            qkv_rope_store<bf16, bf16>((bf16*)qkv, r0, r1, nq, nkv, D, positions, (const bf16*)cos, (const bf16*)sin,
                                       (const bf16*)qw, (const bf16*)kw, eps, (bf16*)kc, (bf16*)vc, slots);
        else
            qkv_rope_store<bf16, float>((bf16*)qkv, r0, r1, nq, nkv, D, positions, (const bf16*)cos, (const bf16*)sin,
                                        (const bf16*)qw, (const bf16*)kw, eps, (float*)kc, (float*)vc, slots);
    } else {
        if (cache_dtype == BF16)
            qkv_rope_store<float, bf16>((float*)qkv, r0, r1, nq, nkv, D, positions, (const float*)cos,
                                        (const float*)sin, (const float*)qw, (const float*)kw, eps, (bf16*)kc,
                                        (bf16*)vc, slots);
        else
            qkv_rope_store<float, float>((float*)qkv, r0, r1, nq, nkv, D, positions, (const float*)cos,
                                         (const float*)sin, (const float*)qw, (const float*)kw, eps, (float*)kc,
                                         (float*)vc, slots);
    }
    return 0;
}

}  // extern "C"

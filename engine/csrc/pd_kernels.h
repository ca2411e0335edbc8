// The library's C entry points, for kernels that call other kernels (decode_forward.cpp).
#pragma once

#include <cstdint>

extern "C" {
int pd_rms_norm(const void* x, int64_t x_stride, const void* w, void* out, int64_t out_stride, int64_t r0,
                int64_t r1, int64_t dim, float eps, int dtype);
int pd_add_rms_norm(const void* x, int64_t x_stride, void* residual, const void* w, void* out, int64_t r0,
                    int64_t r1, int64_t dim, float eps, int dtype);
int pd_silu_mul(const void* gate_up, void* out, int64_t r0, int64_t r1, int64_t inter, int dtype);
int pd_qkv_rope_store(void* qkv, int64_t r0, int64_t r1, int64_t nq, int64_t nkv, int64_t D,
                      const int64_t* positions, const void* cos, const void* sin, const void* qw, const void* kw,
                      float eps, void* kc, void* vc, const int64_t* slots, int dtype, int cache_dtype);
int pd_decode_attention(const void* q, int64_t q_stride, const void* kc, const void* vc, const int64_t* tables,
                        const int32_t* lens, void* out, int64_t H, int64_t HKV, int64_t D, int64_t bs,
                        int64_t max_blocks, float scale, int64_t r0, int64_t r1, int q_dtype, int cache_dtype);
int pd_amx_linear_q(const void* x, int64_t M, int64_t K, const void* packed, int64_t N, const void* scale,
                    const void* bias, void* y, int64_t g0, int64_t g1);
int pd_linear_bf16dot(const uint16_t* x, int64_t M, int64_t K, const uint16_t* p, int64_t N, void* y, int64_t nt0,
                      int64_t nt1, int32_t y_dtype);
}

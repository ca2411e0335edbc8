// Decode attention entry point: dispatches on the cache dtype to decode_attention_{bf16,f32}.cpp.
#include "pd_common.h"

using namespace pd;

void pd_decode_attention_bf16_cache(const void* q, int64_t q_stride, const void* kc, const void* vc, const int64_t* tables,
                              const int32_t* lens, void* out, int64_t H, int64_t HKV, int64_t D, int64_t bs,
                              int64_t max_blocks, float scale, int64_t r0, int64_t r1, int q_dtype);
void pd_decode_attention_f32_cache(const void* q, int64_t q_stride, const void* kc, const void* vc, const int64_t* tables,
                              const int32_t* lens, void* out, int64_t H, int64_t HKV, int64_t D, int64_t bs,
                              int64_t max_blocks, float scale, int64_t r0, int64_t r1, int q_dtype);

// q: [B, H, D] rows q_stride elements apart, dtype q_dtype; out: [B, H, D] contiguous, q_dtype;
// caches [num_blocks, bs, HKV, D] of cache_dtype; tables [B, max_blocks]; lens [B]; rows [r0, r1).
extern "C" int pd_decode_attention(const void* q, int64_t q_stride, const void* kc, const void* vc,
                                   const int64_t* tables, const int32_t* lens, void* out, int64_t H, int64_t HKV,
                                   int64_t D, int64_t bs, int64_t max_blocks, float scale, int64_t r0, int64_t r1,
                                   int q_dtype, int cache_dtype) {
    if (cache_dtype == BF16)
        pd_decode_attention_bf16_cache(q, q_stride, kc, vc, tables, lens, out, H, HKV, D, bs, max_blocks, scale, r0,
                                       r1, q_dtype);
    else
        pd_decode_attention_f32_cache(q, q_stride, kc, vc, tables, lens, out, H, HKV, D, bs, max_blocks, scale, r0,
                                      r1, q_dtype);
    return 0;
}

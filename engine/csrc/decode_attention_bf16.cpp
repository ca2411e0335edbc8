// Decode attention over a bf16 KV cache (see decode_attention_impl.h).
#include "decode_attention_impl.h"

void pd_decode_attention_bf16_cache(const void* q, int64_t q_stride, const void* kc, const void* vc, const int64_t* tables,
                              const int32_t* lens, void* out, int64_t H, int64_t HKV, int64_t D, int64_t bs,
                              int64_t max_blocks, float scale, int64_t r0, int64_t r1, int q_dtype) {
    if (q_dtype == BF16)
        dispatch<bf16, bf16>((const bf16*)q, q_stride, (const bf16*)kc, (const bf16*)vc, tables, lens, (bf16*)out, H,
                             HKV, D, bs, max_blocks, scale, r0, r1);
    else
        dispatch<float, bf16>((const float*)q, q_stride, (const bf16*)kc, (const bf16*)vc, tables, lens, (float*)out,
                              H, HKV, D, bs, max_blocks, scale, r0, r1);
}

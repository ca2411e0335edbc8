// Decode attention over a float32 KV cache (see decode_attention_impl.h).
#include "decode_attention_impl.h"

void pd_decode_attention_f32_cache(const void* q, int64_t q_stride, const void* kc, const void* vc, const int64_t* tables,
                              const int32_t* lens, void* out, int64_t H, int64_t HKV, int64_t D, int64_t bs,
                              int64_t max_blocks, float scale, int64_t r0, int64_t r1, int q_dtype) {
    if (q_dtype == BF16)   // rare (bf16 math over a float32 cache): the generic kernel, to keep build time down
        decode_attn_generic<bf16, float>((const bf16*)q, q_stride, (const float*)kc, (const float*)vc, tables, lens,
                                         (bf16*)out, H, HKV, D, bs, max_blocks, scale, r0, r1);
    else
        dispatch<float, float>((const float*)q, q_stride, (const float*)kc, (const float*)vc, tables, lens,
                               (float*)out, H, HKV, D, bs, max_blocks, scale, r0, r1);
}

// A whole decode step of a Llama-family model (bf16; AMX or AVX512-BF16 GEMMs) in one call: every layer's norms,
// GEMMs, rotary + KV store, attention and MLP, then the final norm. The same kernels, in the same
// order and with the same rounding as the per-op native backend, without returning to Python
// between them (each return costs tens of microseconds once the weight stream has evicted the
// interpreter's working set from the caches).
#include "pd_common.h"
#include "pd_kernels.h"

using namespace pd;

namespace {
// Per-layer pointers, in this order (see engine/layers/backend.py, FusedDecode).
enum LayerPtr {
    IN_NORM, POST_NORM, QKV_W, QKV_B, O_W, O_B, GU_W, GU_B, DOWN_W, DOWN_B, Q_NORM, K_NORM, K_CACHE, V_CACHE,
    QKV_S, O_S, GU_S, DOWN_S,   // per-column scales of int8 (w8a16) weights; null: bf16 weights
    NUM_PTRS
};

// Which GEMM every linear runs: the AMX kernel (its per-column scales and bias applied inside), or
// batch-invariant mode's AVX512-BF16 kernel (bf16 weights, no bias, no scales).
enum LinearKind : int64_t { AMX = 0, BF16DOT = 1 };

int linear(int64_t kind, const bf16* x, int64_t M, int64_t K, const void* w, int64_t N, const void* scale,
           const void* bias, bf16* y) {
    if (kind == BF16DOT) {
        if (scale || bias || N % 32) return 3;
        return pd_linear_bf16dot(reinterpret_cast<const uint16_t*>(x), M, K, static_cast<const uint16_t*>(w), N, y,
                                 0, N / 32, BF16);
    }
    return pd_amx_linear_q(x, M, K, w, N, scale, bias, y, 0, N / 64);
}
}  // namespace

extern "C" int pd_decode_forward(int64_t M, int64_t n_layers, int64_t hidden, int64_t nq, int64_t nkv, int64_t D,
                                 int64_t inter, const int64_t* layers, float eps, float qk_eps, const void* cos,
                                 const void* sin, const int64_t* positions, const int64_t* slots,
                                 const int64_t* tables, const int32_t* lens, int64_t max_blocks, int64_t bs,
                                 float scale, void* residual, const void* final_norm, void* out, void* scratch,
                                 int64_t linear_kind) {
    const int64_t qkv_w = (nq + 2 * nkv) * D;
    bf16* h = static_cast<bf16*>(scratch);          // [M, hidden]  normed input of a GEMM
    bf16* qkv = h + M * hidden;                     // [M, qkv_w]
    bf16* attn = qkv + M * qkv_w;                   // [M, nq D]
    bf16* gu = attn + M * nq * D;                   // [M, 2 inter]
    bf16* act = gu + M * 2 * inter;                 // [M, inter]
    bf16* y = act + M * inter;                      // [M, hidden]  o_proj / down_proj output
    int rc = 0;
    for (int64_t l = 0; l < n_layers; l++) {
        const void* const* p = reinterpret_cast<const void* const*>(layers + l * NUM_PTRS);
        if (l == 0) rc |= pd_rms_norm(residual, hidden, p[IN_NORM], h, hidden, 0, M, hidden, eps, BF16);
        else rc |= pd_add_rms_norm(y, hidden, residual, p[IN_NORM], h, 0, M, hidden, eps, BF16);
        rc |= linear(linear_kind, h, M, hidden, p[QKV_W], qkv_w, p[QKV_S], p[QKV_B], qkv);
        rc |= pd_qkv_rope_store(qkv, 0, M, nq, nkv, D, positions, cos, sin, p[Q_NORM], p[K_NORM], qk_eps,
                                const_cast<void*>(p[K_CACHE]), const_cast<void*>(p[V_CACHE]), slots, BF16, BF16);
        rc |= pd_decode_attention(qkv, qkv_w, p[K_CACHE], p[V_CACHE], tables, lens, attn, nq, nkv, D, bs, max_blocks,
                                  scale, 0, M, BF16, BF16);
        rc |= linear(linear_kind, attn, M, nq * D, p[O_W], hidden, p[O_S], p[O_B], y);
        rc |= pd_add_rms_norm(y, hidden, residual, p[POST_NORM], h, 0, M, hidden, eps, BF16);
        rc |= linear(linear_kind, h, M, hidden, p[GU_W], 2 * inter, p[GU_S], p[GU_B], gu);
        rc |= pd_silu_mul(gu, act, 0, M, inter, BF16);
        rc |= linear(linear_kind, act, M, inter, p[DOWN_W], hidden, p[DOWN_S], p[DOWN_B], y);
        if (rc) return rc;
    }
    return pd_add_rms_norm(y, hidden, residual, final_norm, out, 0, M, hidden, eps, BF16);
}

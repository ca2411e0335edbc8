// Causal prefill attention of one sequence over its paged KV cache (float32 or bf16), float32 q
// and out, in 256-bit AVX2 + FMA registers: the path of CPUs without AMX (prefill_attention.cpp).
//
// Same contract as pd_prefill_attention: queries at positions [start, start + n) attend keys
// [0, start + i], the new K/V already stored in the cache. Per KV head, K is first gathered into
// float32 K^T panels of KB keys ([D][KB] each) and V into float32 rows, zero-padded to a multiple
// of KB keys (memory linear in the context). Flash attention then walks tiles of MR queries: for
// each block of KB keys up to the tile's diagonal (blocks above it are skipped), every query head
// of the KV head takes its scores (MR x KB in 12 accumulators), an online softmax in float32 and
// O = O * alpha + P V, so a K/V block is read into L1 once for the whole group.
#include <algorithm>
#include <vector>
#include "pd_common.h"

using namespace pd;

#ifdef PD_AVX2
namespace {

constexpr int MR = 6;    // queries per tile: 12 accumulators + 2 loads + 1 broadcast = 15 registers
constexpr int KB = 16;   // keys per block (two registers per query row)

template <typename T>
void gather_head(const T* kc, const T* vc, const int64_t* table, int64_t ctx, int64_t ctx_pad, int64_t h,
                 int64_t HKV, int64_t D, int64_t bs, float* kt, float* v) {
    const int64_t tok_stride = HKV * D;
    for (int64_t t = 0; t < ctx; t++) {
        const int64_t off = (table[t / bs] * bs + t % bs) * tok_stride + h * D;
        float* kp = kt + (t / KB) * D * KB + t % KB;
        for (int64_t d = 0; d < D; d++) kp[d * KB] = to_f32(kc[off + d]);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(v + t * D + d, load8(vc + off + d));
    }
    for (int64_t t = ctx; t < ctx_pad; t++) {   // padded keys: masked scores, zero values
        float* kp = kt + (t / KB) * D * KB + t % KB;
        for (int64_t d = 0; d < D; d++) kp[d * KB] = 0.f;
        std::memset(v + t * D, 0, sizeof(float) * D);
    }
}

// One query head's tile: its scaled queries, running max and sum, and unnormalized output.
template <int D>
struct QueryTile {
    float q[MR][D];
    float o[MR][D];
    float m[MR], l[MR];
};

// Keys [k0, k0 + KB) for the tile's rows; limit[r]: the last key row r sees; masked: some key of
// the block lies past some row's limit. kt: the block's K^T panel, v: its first V row.
template <int D>
inline void attend_block(QueryTile<D>& t, const float* kt, const float* v, int64_t k0, const int64_t* limit,
                         bool masked) {
    __m256 s[MR][2];
    for (int r = 0; r < MR; r++) s[r][0] = s[r][1] = _mm256_setzero_ps();
    for (int d = 0; d < D; d++) {
        const __m256 ka = _mm256_loadu_ps(kt + d * KB), kb = _mm256_loadu_ps(kt + d * KB + 8);
        for (int r = 0; r < MR; r++) {
            const __m256 qb = _mm256_broadcast_ss(&t.q[r][d]);
            s[r][0] = _mm256_fmadd_ps(qb, ka, s[r][0]);
            s[r][1] = _mm256_fmadd_ps(qb, kb, s[r][1]);
        }
    }
    alignas(32) float p[MR][KB];
    float alpha[MR];
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    const __m256 lo = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), hi = _mm256_add_ps(lo, _mm256_set1_ps(8.f));
    for (int r = 0; r < MR; r++) {
        __m256 a = s[r][0], b = s[r][1];
        if (masked) {
            const __m256 last = _mm256_set1_ps(float(limit[r] - k0));
            a = _mm256_blendv_ps(ninf, a, _mm256_cmp_ps(lo, last, _CMP_LE_OQ));
            b = _mm256_blendv_ps(ninf, b, _mm256_cmp_ps(hi, last, _CMP_LE_OQ));
        }
        // Block 0 holds key 0, seen by every row, so m is finite from the first block on.
        const float m_new = std::max(t.m[r], hmax8(_mm256_max_ps(a, b)));
        const __m256 vm = _mm256_set1_ps(m_new);
        const __m256 ea = exp8(_mm256_sub_ps(a, vm)), eb = exp8(_mm256_sub_ps(b, vm));
        _mm256_store_ps(p[r], ea);
        _mm256_store_ps(p[r] + 8, eb);
        alpha[r] = std::exp(t.m[r] - m_new);
        t.l[r] = t.l[r] * alpha[r] + hsum8(_mm256_add_ps(ea, eb));
        t.m[r] = m_new;
    }
    for (int c = 0; c < D; c += 16) {
        __m256 o[MR][2];
        for (int r = 0; r < MR; r++) {
            const __m256 va = _mm256_set1_ps(alpha[r]);
            o[r][0] = _mm256_mul_ps(_mm256_loadu_ps(t.o[r] + c), va);
            o[r][1] = _mm256_mul_ps(_mm256_loadu_ps(t.o[r] + c + 8), va);
        }
        for (int j = 0; j < KB; j++) {
            const __m256 va = _mm256_loadu_ps(v + j * D + c), vb = _mm256_loadu_ps(v + j * D + c + 8);
            for (int r = 0; r < MR; r++) {
                const __m256 pb = _mm256_broadcast_ss(&p[r][j]);
                o[r][0] = _mm256_fmadd_ps(pb, va, o[r][0]);
                o[r][1] = _mm256_fmadd_ps(pb, vb, o[r][1]);
            }
        }
        for (int r = 0; r < MR; r++) {
            _mm256_storeu_ps(t.o[r] + c, o[r][0]);
            _mm256_storeu_ps(t.o[r] + c + 8, o[r][1]);
        }
    }
}

// Query heads [g0, g1) of one KV head (q, out: at the KV head's first query head) over its
// gathered K^T panels and V rows.
template <int D>
void attend_group(const float* q, int64_t q_stride, int64_t n, int64_t start, const float* kt, const float* v,
                  float scale, float* out, int64_t out_stride, int64_t g0, int64_t g1,
                  std::vector<QueryTile<D>>& tiles) {
    tiles.resize(g1 - g0);
    for (int64_t q0 = 0; q0 < n; q0 += MR) {
        const int64_t rows = std::min<int64_t>(MR, n - q0);
        int64_t limit[MR];
        for (int r = 0; r < MR; r++) limit[r] = start + q0 + std::min<int64_t>(r, rows - 1);   // padded rows: as the last
        for (int64_t g = g0; g < g1; g++) {
            QueryTile<D>& t = tiles[g - g0];
            for (int r = 0; r < MR; r++) {
                const float* qr = q + (q0 + r) * q_stride + g * D;
                for (int d = 0; d < D; d++) t.q[r][d] = r < rows ? qr[d] * scale : 0.f;
                std::fill(t.o[r], t.o[r] + D, 0.f);
                t.m[r] = -INFINITY;
                t.l[r] = 0.f;
            }
        }
        for (int64_t k0 = 0; k0 <= limit[MR - 1]; k0 += KB) {
            const bool masked = k0 + KB - 1 > limit[0];
            for (auto& t : tiles) attend_block<D>(t, kt + k0 * D, v + k0 * D, k0, limit, masked);
        }
        for (int64_t g = g0; g < g1; g++) {
            const QueryTile<D>& t = tiles[g - g0];
            for (int64_t r = 0; r < rows; r++) {
                const __m256 inv = _mm256_set1_ps(1.f / t.l[r]);
                float* o = out + (q0 + r) * out_stride + g * D;
                for (int d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(t.o[r] + d), inv));
            }
        }
    }
}

template <int D>
void attend_heads(const float* q, int64_t q_stride, const void* kc, const void* vc, const int64_t* table,
                  int64_t start, int64_t n, float* out, int64_t H, int64_t HKV, int64_t bs, float scale, int64_t h0,
                  int64_t h1, int cache_dtype) {
    const int64_t G = H / HKV, ctx = start + n;
    const int64_t ctx_pad = (ctx + KB - 1) / KB * KB;
    thread_local std::vector<float> kbuf, vbuf;
    thread_local std::vector<QueryTile<D>> tiles;
    kbuf.resize(ctx_pad * D);
    vbuf.resize(ctx_pad * D);
    for (int64_t h = h0 / G; h * G < h1; h++) {
        if (cache_dtype == BF16)
            gather_head(static_cast<const bf16*>(kc), static_cast<const bf16*>(vc), table, ctx, ctx_pad, h, HKV, D,
                        bs, kbuf.data(), vbuf.data());
        else
            gather_head(static_cast<const float*>(kc), static_cast<const float*>(vc), table, ctx, ctx_pad, h, HKV, D,
                        bs, kbuf.data(), vbuf.data());
        const int64_t g0 = std::max<int64_t>(h0 - h * G, 0), g1 = std::min<int64_t>(h1 - h * G, G);
        attend_group<D>(q + h * G * D, q_stride, n, start, kbuf.data(), vbuf.data(), scale, out + h * G * D, H * D,
                        g0, g1, tiles);
    }
}

}  // namespace
#endif

extern "C" {

// 1 where this build has the AVX2 + FMA prefill attention kernel.
int pd_prefill_attention_avx2() {
#ifdef PD_AVX2
    return 1;
#else
    return 0;
#endif
}

// q: [n, H, D] float32, rows q_stride elements apart; caches [blocks, bs, HKV, D] of cache_dtype;
// table: the sequence's block ids; out: [n, H, D] float32 contiguous. Query heads [h0, h1).
// Returns 1 where unsupported (no AVX2 + FMA, D not 64 or 128).
int pd_prefill_attention_f32(const float* q, int64_t q_stride, const void* kc, const void* vc, const int64_t* table,
                             int64_t start, int64_t n, float* out, int64_t H, int64_t HKV, int64_t D, int64_t bs,
                             float scale, int64_t h0, int64_t h1, int cache_dtype) {
#ifdef PD_AVX2
    if (H % HKV || n <= 0) return n == 0 ? 0 : 1;
    if (D == 64)
        attend_heads<64>(q, q_stride, kc, vc, table, start, n, out, H, HKV, bs, scale, h0, h1, cache_dtype);
    else if (D == 128)
        attend_heads<128>(q, q_stride, kc, vc, table, start, n, out, H, HKV, bs, scale, h0, h1, cache_dtype);
    else
        return 1;
    return 0;
#else
    return 1;
#endif
}

}  // extern "C"

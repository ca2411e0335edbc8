// Causal prefill attention of one sequence over its paged KV cache (float32 or bf16), float32 q
// and out, in 256-bit AVX2 + FMA registers: the path of CPUs without AMX (prefill_attention.cpp).
//
// Same contract as pd_prefill_attention: queries at positions [start, start + n) attend keys
// [0, start + i], the new K/V already stored in the cache. Per KV head, K is first gathered into
// float32 K^T panels of KC keys ([D][KC] each) and V into float32 rows, zero-padded to a multiple
// of KC keys (memory linear in the context). Flash attention then walks tiles of MR queries and,
// for each, blocks of up to KB keys up to the tile's diagonal (keys above it are skipped, KC at
// a time). Every query head of the KV head takes the block's scores (MR x KC at a time in 12
// accumulators), one online-softmax update per row in float32, and O = O * alpha + P V, so a
// K/V block is read into L1 once for the whole group.
#include <algorithm>
#include <vector>
#include "pd_common.h"

using namespace pd;

#ifdef PD_AVX2
namespace {

constexpr int MR = 6;    // queries per tile: 12 accumulators + 2 loads + 1 broadcast = 15 registers
constexpr int KC = 16;   // keys per score chunk (two registers per query row)
constexpr int KB = 64;   // keys per block: one online-softmax update per row and block

template <typename T>
void gather_head(const T* kc, const T* vc, const int64_t* table, int64_t ctx, int64_t ctx_pad, int64_t h,
                 int64_t HKV, int64_t D, int64_t bs, float* kt, float* v) {
    const int64_t tok_stride = HKV * D;
    for (int64_t t = 0; t < ctx; t++) {
        const int64_t off = (table[t / bs] * bs + t % bs) * tok_stride + h * D;
        float* kp = kt + (t / KC) * D * KC + t % KC;
        for (int64_t d = 0; d < D; d++) kp[d * KC] = to_f32(kc[off + d]);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(v + t * D + d, load8(vc + off + d));
    }
    for (int64_t t = ctx; t < ctx_pad; t++) {   // padded keys: masked scores, zero values
        float* kp = kt + (t / KC) * D * KC + t % KC;
        for (int64_t d = 0; d < D; d++) kp[d * KC] = 0.f;
        std::memset(v + t * D, 0, sizeof(float) * D);
    }
}

// One query head's tile: its scaled queries, running max and sum (8 lanes, MR used), and
// unnormalized output.
template <int D>
struct QueryTile {
    float q[MR][D];
    float o[MR][D];
    alignas(32) float m[8];
    alignas(32) float l[8];
};

// s[r * KB + j] = q[r] . key j of the K^T panel kt, j < KC.
template <int D>
inline void score_chunk(const QueryTile<D>& t, const float* kt, float* s) {
    __m256 acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int d = 0; d < D; d++) {
        const __m256 ka = _mm256_loadu_ps(kt + d * KC), kb = _mm256_loadu_ps(kt + d * KC + 8);
        for (int r = 0; r < MR; r++) {
            const __m256 qb = _mm256_broadcast_ss(&t.q[r][d]);
            acc[r][0] = _mm256_fmadd_ps(qb, ka, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(qb, kb, acc[r][1]);
        }
    }
    for (int r = 0; r < MR; r++) {
        _mm256_store_ps(s + r * KB, acc[r][0]);
        _mm256_store_ps(s + r * KB + 8, acc[r][1]);
    }
}

// Keys [k0, k0 + nk) (nk a multiple of KC, at most KB) for the tile's rows; limit[r]: the last key
// row r sees. kt: the block's first K^T panel, v: its first V row.
template <int D>
inline void attend_block(QueryTile<D>& t, const float* kt, const float* v, int64_t k0, int nk, const int64_t* limit) {
    alignas(32) float s[MR][KB];
    for (int c = 0; c < nk; c += KC) score_chunk<D>(t, kt + c * D, s[0] + c);
    const __m256 ninf = _mm256_set1_ps(-INFINITY), step = _mm256_set1_ps(8.f);
    alignas(32) float m_new[8] = {}, sums[8] = {};
    for (int r = 0; r < MR; r++) {
        const int64_t last = limit[r] - k0;   // keys j > last are masked
        __m256 idx = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), mx = ninf;
        for (int j = 0; j < nk; j += 8, idx = _mm256_add_ps(idx, step)) {
            __m256 x = _mm256_load_ps(s[r] + j);
            if (j + 7 > last) {
                x = _mm256_blendv_ps(ninf, x, _mm256_cmp_ps(idx, _mm256_set1_ps(float(last)), _CMP_LE_OQ));
                _mm256_store_ps(s[r] + j, x);
            }
            mx = _mm256_max_ps(mx, x);
        }
        // Block 0 holds key 0, seen by every row, so m is finite from the first block on.
        m_new[r] = std::max(t.m[r], hmax8(mx));
        const __m256 vm = _mm256_set1_ps(m_new[r]);
        __m256 sum = _mm256_setzero_ps();
        for (int j = 0; j < nk; j += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(s[r] + j), vm));
            _mm256_store_ps(s[r] + j, e);
            sum = _mm256_add_ps(sum, e);
        }
        sums[r] = hsum8(sum);
    }
    const __m256 mn = _mm256_load_ps(m_new);
    alignas(32) float alpha[8];
    _mm256_store_ps(alpha, exp8(_mm256_sub_ps(_mm256_load_ps(t.m), mn)));
    _mm256_store_ps(t.l, _mm256_fmadd_ps(_mm256_load_ps(t.l), _mm256_load_ps(alpha), _mm256_load_ps(sums)));
    _mm256_store_ps(t.m, mn);
    for (int c = 0; c < D; c += 16) {
        __m256 o[MR][2];
        for (int r = 0; r < MR; r++) {
            const __m256 va = _mm256_broadcast_ss(alpha + r);
            o[r][0] = _mm256_mul_ps(_mm256_loadu_ps(t.o[r] + c), va);
            o[r][1] = _mm256_mul_ps(_mm256_loadu_ps(t.o[r] + c + 8), va);
        }
        for (int j = 0; j < nk; j++) {
            const __m256 va = _mm256_loadu_ps(v + j * D + c), vb = _mm256_loadu_ps(v + j * D + c + 8);
            for (int r = 0; r < MR; r++) {
                const __m256 pb = _mm256_broadcast_ss(&s[r][j]);
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
                for (int d = 0; d < D; d++) t.q[r][d] = r < rows ? q[(q0 + r) * q_stride + g * D + d] * scale : 0.f;
                std::fill(t.o[r], t.o[r] + D, 0.f);
            }
            for (int i = 0; i < 8; i++) {
                t.m[i] = i < MR ? -INFINITY : 0.f;
                t.l[i] = 0.f;
            }
        }
        for (int64_t k0 = 0; k0 <= limit[MR - 1]; k0 += KB) {   // blocks above the diagonal: skipped
            const int nk = int(std::min<int64_t>(KB, (limit[MR - 1] - k0) / KC * KC + KC));
            for (auto& t : tiles) attend_block<D>(t, kt + k0 * D, v + k0 * D, k0, nk, limit);
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
    const int64_t ctx_pad = (ctx + KC - 1) / KC * KC;
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

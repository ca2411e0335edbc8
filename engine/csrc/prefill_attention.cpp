// Causal prefill attention of one sequence over its paged bf16 KV cache, on AMX tiles.
//
// Queries are the sequence's positions [start, start + n); query i attends keys [0, start + i]
// (its cached prefix and the new tokens, already stored in the cache). Per KV head, K and V are
// first gathered from the cache blocks into tile layouts (K^T and V in VNNI pairs, zero-padded
// to 64 keys). Per query head and block of 16 queries: S = Q K^T on tiles (float32), an online
// softmax in float32 (flash attention), P rounded to bf16 (as torch's CPU flash attention does)
// and O += P V on tiles; O / l rounded to bf16 at the end.
#include <vector>
#include "pd_common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__) && defined(PD_AVX512)
#define PD_AMX 1
#endif
#include "amx_tiles.h"

using namespace pd;

extern "C" int pd_amx_init();

#ifdef PD_AMX
namespace {

constexpr int KC = 64;   // keys per step (four 16-key S tiles)

// K^T tiles: for 16 keys [16 c, 16 c + 16) and dims [32 d, 32 d + 32): kt[(c * D / 32 + d) * 512 + r * 32 + 2 j + p]
// = K[16 c + j][32 d + 2 r + p]. V tiles: for 32 keys [32 c, ...) and dims [16 n, 16 n + 16):
// vt[(c * D / 16 + n) * 512 + r * 32 + 2 j + p] = V[32 c + 2 r + p][16 n + j].
void gather_head(const bf16* kc, const bf16* vc, const int64_t* table, int64_t ctx, int64_t ctx_pad, int64_t h,
                 int64_t HKV, int64_t D, int64_t bs, bf16* kt, bf16* vt) {
    const int64_t tok_stride = HKV * D;
    const int64_t dk = D / 32, dv = D / 16;
    // K^T: tile row r of (c, d) is dword 16 d + r of keys 16 c .. 16 c + 15: one gather each.
    alignas(64) int32_t offs[16];
    for (int64_t c = 0; c < ctx_pad / 16; c++) {
        for (int j = 0; j < 16; j++) {
            const int64_t t = 16 * c + j < ctx ? 16 * c + j : ctx - 1;   // padded keys: any real row (masked)
            offs[j] = int32_t(((table[t / bs] * bs + t % bs) * tok_stride + h * D) / 2);   // in dwords
        }
        const __m512i vo = _mm512_load_si512(offs);
        for (int64_t d = 0; d < dk; d++)
            for (int r = 0; r < 16; r++) {
                const __m512i x = _mm512_i32gather_epi32(_mm512_add_epi32(vo, _mm512_set1_epi32(16 * int(d) + r)), kc, 4);
                _mm512_store_si512(kt + (c * dk + d) * 512 + r * 32, x);
            }
    }
    // V: tile row r of (c, n) interleaves dims 16 n .. 16 n + 15 of keys 32 c + 2 r and 32 c + 2 r + 1.
    alignas(64) int16_t lo_idx[32], hi_idx[32];
    for (int i = 0; i < 16; i++) {
        lo_idx[2 * i] = int16_t(i);
        lo_idx[2 * i + 1] = int16_t(32 + i);
        hi_idx[2 * i] = int16_t(16 + i);
        hi_idx[2 * i + 1] = int16_t(48 + i);
    }
    const __m512i vlo = _mm512_load_si512(lo_idx), vhi = _mm512_load_si512(hi_idx);
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t t = 0; t < ctx_pad; t += 2) {
        const bf16* a = t < ctx ? vc + (table[t / bs] * bs + t % bs) * tok_stride + h * D : nullptr;
        const bf16* b = t + 1 < ctx ? vc + (table[(t + 1) / bs] * bs + (t + 1) % bs) * tok_stride + h * D : nullptr;
        const int64_t c = t / 32, r = (t % 32) / 2;
        for (int64_t d = 0; d < D; d += 32) {
            const __m512i xa = a ? _mm512_loadu_si512(a + d) : zero;   // padded keys: zero values
            const __m512i xb = b ? _mm512_loadu_si512(b + d) : zero;
            _mm512_store_si512(vt + (c * dv + d / 16) * 512 + r * 32, _mm512_permutex2var_epi16(xa, vlo, xb));
            _mm512_store_si512(vt + (c * dv + d / 16 + 1) * 512 + r * 32, _mm512_permutex2var_epi16(xa, vhi, xb));
        }
    }
}

template <int D>
void attend_head(const bf16* q, int64_t q_stride, int64_t n, int64_t start, int64_t ctx, const bf16* kt,
                 const bf16* vt, float scale, bf16* out, int64_t out_stride) {
    constexpr int DK = D / 32, DV = D / 16;
    alignas(64) bf16 qpad[16 * D];
    alignas(64) float s[16 * KC];
    alignas(64) bf16 pb[16 * KC];
    alignas(64) float pv[16 * D];
    alignas(64) float o[16 * D];
    float m[16], l[16];
    for (int64_t q0 = 0; q0 < n; q0 += 16) {
        const int64_t rows = n - q0 < 16 ? n - q0 : 16;
        for (int64_t i = 0; i < 16; i++) {
            if (i < rows) std::memcpy(qpad + i * D, q + (q0 + i) * q_stride, sizeof(bf16) * D);
            else std::memset(qpad + i * D, 0, sizeof(bf16) * D);
            m[i] = -INFINITY;
            l[i] = 0.f;
        }
        std::memset(o, 0, sizeof(o));
        const int64_t last_key = start + q0 + rows - 1;   // the block's last query sees keys <= this
        for (int64_t k0 = 0; k0 <= last_key; k0 += KC) {
            // S = Q K^T for keys [k0, k0 + 64)
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int d = 0; d < DK; d++) {
                _tile_loadd(4, qpad + 32 * d, D * 2);
                const bf16* b = kt + ((k0 / 16) * DK + d) * 512;
                _tile_loadd(6, b, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(7, b + DK * 512, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_loadd(6, b + 2 * DK * 512, 64);
                _tile_dpbf16ps(2, 4, 6);
                _tile_loadd(7, b + 3 * DK * 512, 64);
                _tile_dpbf16ps(3, 4, 7);
            }
            _tile_stored(0, s, KC * 4);
            _tile_stored(1, s + 16, KC * 4);
            _tile_stored(2, s + 32, KC * 4);
            _tile_stored(3, s + 48, KC * 4);
            // online softmax per query row
            for (int64_t i = 0; i < 16; i++) {
                float* si = s + i * KC;
                const int64_t limit = i < rows ? start + q0 + i : -1;   // last key this row sees
                __m512 v[4];
                __m512 vmax = _mm512_set1_ps(-INFINITY);
                for (int c = 0; c < 4; c++) {
                    v[c] = _mm512_mul_ps(_mm512_load_ps(si + 16 * c), _mm512_set1_ps(scale));
                    const int64_t base = k0 + 16 * c;
                    if (base + 15 > limit) {
                        const int64_t valid = limit - base + 1;
                        const __mmask16 keep = valid <= 0 ? __mmask16(0) : tail_mask(valid);
                        v[c] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep, v[c]);
                    }
                    vmax = _mm512_max_ps(vmax, v[c]);
                }
                const float mx = _mm512_reduce_max_ps(vmax);
                const float m_new = mx > m[i] ? mx : m[i];
                bf16* pi = pb + i * KC;
                if (m_new == -INFINITY) {   // a padding row, or nothing visible yet
                    std::memset(pi, 0, sizeof(bf16) * KC);
                    continue;
                }
                const float alpha = std::exp(m[i] - m_new);
                __m512 vs = _mm512_setzero_ps();
                const __m512 vm = _mm512_set1_ps(m_new);
                for (int c = 0; c < 4; c++) {
                    const __m512 e = exp16(_mm512_sub_ps(v[c], vm));
                    vs = _mm512_add_ps(vs, e);
                    _mm256_storeu_si256((__m256i*)(pi + 16 * c), cvt_bf16(e));
                }
                l[i] = l[i] * alpha + _mm512_reduce_add_ps(vs);
                m[i] = m_new;
                if (alpha != 1.f) {
                    const __m512 va = _mm512_set1_ps(alpha);
                    for (int c = 0; c < DV; c++) _mm512_store_ps(o + i * D + 16 * c, _mm512_mul_ps(_mm512_load_ps(o + i * D + 16 * c), va));
                }
            }
            // O += P V, four 16-dim output tiles at a time
            for (int n0 = 0; n0 < DV; n0 += 4) {
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int kh = 0; kh < KC / 32; kh++) {
                    _tile_loadd(4, pb + 32 * kh, KC * 2);
                    const bf16* b = vt + (((k0 / 32) + kh) * DV + n0) * 512;
                    _tile_loadd(6, b, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_loadd(7, b + 512, 64);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_loadd(6, b + 1024, 64);
                    _tile_dpbf16ps(2, 4, 6);
                    _tile_loadd(7, b + 1536, 64);
                    _tile_dpbf16ps(3, 4, 7);
                }
                _tile_stored(0, pv + 16 * n0, D * 4);
                _tile_stored(1, pv + 16 * (n0 + 1), D * 4);
                _tile_stored(2, pv + 16 * (n0 + 2), D * 4);
                _tile_stored(3, pv + 16 * (n0 + 3), D * 4);
            }
            for (int64_t i = 0; i < rows; i++)
                for (int c = 0; c < DV; c++)
                    _mm512_store_ps(o + i * D + 16 * c, _mm512_add_ps(_mm512_load_ps(o + i * D + 16 * c),
                                                                      _mm512_load_ps(pv + i * D + 16 * c)));
        }
        for (int64_t i = 0; i < rows; i++) {
            const __m512 inv = _mm512_set1_ps(1.f / l[i]);
            for (int c = 0; c < DV; c++)
                store16(out + (q0 + i) * out_stride + 16 * c, _mm512_mul_ps(_mm512_load_ps(o + i * D + 16 * c), inv));
        }
    }
}

}  // namespace
#endif

extern "C" {

// q: [n, H, D] bf16, rows q_stride elements apart; caches [blocks, bs, HKV, D] bf16; table: the
// sequence's block ids; out: [n, H, D] bf16 contiguous. Query heads [h0, h1) (whole KV-head
// groups). Returns 1 where unsupported (no AMX, D not 64 or 128).
int pd_prefill_attention(const void* q, int64_t q_stride, const void* kc, const void* vc, const int64_t* table,
                         int64_t start, int64_t n, void* out, int64_t H, int64_t HKV, int64_t D, int64_t bs,
                         float scale, int64_t h0, int64_t h1) {
#ifdef PD_AMX
    static const bool granted = pd_amx_init() == 1;
    if (!granted || (D != 64 && D != 128) || H % HKV) return 1;
    const int64_t G = H / HKV, ctx = start + n;
    const int64_t ctx_pad = (ctx + KC - 1) / KC * KC;
    thread_local std::vector<bf16> kbuf, vbuf;
    kbuf.resize(ctx_pad * D + 32);
    vbuf.resize(ctx_pad * D + 32);
    bf16* kt = kbuf.data() + (-reinterpret_cast<intptr_t>(kbuf.data()) / 2 & 31);   // 64-byte aligned
    bf16* vt = vbuf.data() + (-reinterpret_cast<intptr_t>(vbuf.data()) / 2 & 31);
    configure_tiles();
    int64_t gathered = -1;
    for (int64_t hq = h0; hq < h1; hq++) {
        const int64_t h = hq / G;
        if (h != gathered) {
            gather_head(static_cast<const bf16*>(kc), static_cast<const bf16*>(vc), table, ctx, ctx_pad, h, HKV, D, bs,
                        kt, vt);
            gathered = h;
        }
        const bf16* qh = static_cast<const bf16*>(q) + hq * D;
        bf16* oh = static_cast<bf16*>(out) + hq * D;
        if (D == 64)
            attend_head<64>(qh, q_stride, n, start, ctx, kt, vt, scale, oh, H * D);
        else
            attend_head<128>(qh, q_stride, n, start, ctx, kt, vt, scale, oh, H * D);
    }
    _tile_release();
    return 0;
#else
    return 1;
#endif
}

}  // extern "C"

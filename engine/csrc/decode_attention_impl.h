// Decode attention over the paged KV cache: one query token per row against its row's cached
// context, read in place from the cache blocks (bf16 or float32), float32 math. q and out are in
// the activation dtype (float32 or bf16); q rows may be strided (a view into the fused qkv rows).
// The kernel templates; decode_attention_{bf16,f32}.cpp instantiate them for a bf16 / float32
// cache (two translation units, so a build compiles them in parallel).
#pragma once
#include <vector>
#include <algorithm>
#include <type_traits>
#include "pd_common.h"

using namespace pd;
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif
#ifndef PD
#define PD 3   // blocks of prefetch distance (into L2: PF_HINT)
#endif
static inline float load(float x) { return x; }
static inline float load(uint16_t x) { return to_f32(x); }

// In place: s[0:n] = softmax(s[0:n]).
static void softmax(float* s, int64_t n) {
    float m = s[0];
    for (int64_t t = 1; t < n; t++) m = s[t] > m ? s[t] : m;
    float sum = 0.f;
    int64_t t = 0;
#ifdef PD_AVX512
    // exp(x) = 2^k * p(f), x*log2(e) = k + f, f in [-0.5, 0.5]; relative error ~2e-7.
    const __m512 vm = _mm512_set1_ps(m), log2e = _mm512_set1_ps(1.4426950408889634f);
    const __m512 c1 = _mm512_set1_ps(0.6931471805599453f), c2 = _mm512_set1_ps(0.2402265069591007f),
                 c3 = _mm512_set1_ps(0.05550410866482158f), c4 = _mm512_set1_ps(0.009618129107628477f),
                 c5 = _mm512_set1_ps(0.0013333558146428443f), c6 = _mm512_set1_ps(0.00015403530393381606f),
                 one = _mm512_set1_ps(1.f), lo = _mm512_set1_ps(-126.f);
    __m512 vsum = _mm512_setzero_ps();
    for (; t + 16 <= n; t += 16) {
        __m512 x = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), vm), log2e);
        x = _mm512_max_ps(x, lo);
        __m512 k = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 f = _mm512_sub_ps(x, k);
        __m512 p = _mm512_fmadd_ps(c6, f, c5);
        p = _mm512_fmadd_ps(p, f, c4); p = _mm512_fmadd_ps(p, f, c3); p = _mm512_fmadd_ps(p, f, c2);
        p = _mm512_fmadd_ps(p, f, c1); p = _mm512_fmadd_ps(p, f, one);
        __m512 e = _mm512_scalef_ps(p, k);
        _mm512_storeu_ps(s + t, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    sum = _mm512_reduce_add_ps(vsum);
#elif defined(PD_AVX2)
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
        _mm256_storeu_ps(s + t, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vsum);
    for (int i = 0; i < 8; i++) sum += lanes[i];
#endif
    for (; t < n; t++) { s[t] = std::exp(s[t] - m); sum += s[t]; }
    const float inv = 1.f / sum;
    for (t = 0; t < n; t++) s[t] *= inv;
}

#ifdef PD_AVX512
// s[t] = exp(s[t] - mx[t % 16]) for t < n (n need not be a multiple of 16; mx has period dividing 16);
// sm[i] = sum of the results in lane i (i.e. over t = i mod 16).
static void exp_inplace(float* s, int64_t n, const float* mx, float* sm) {
    const __m512 vm = _mm512_loadu_ps(mx), log2e = _mm512_set1_ps(1.4426950408889634f);
    const __m512 c1 = _mm512_set1_ps(0.6931471805599453f), c2 = _mm512_set1_ps(0.2402265069591007f),
                 c3 = _mm512_set1_ps(0.05550410866482158f), c4 = _mm512_set1_ps(0.009618129107628477f),
                 c5 = _mm512_set1_ps(0.0013333558146428443f), c6 = _mm512_set1_ps(0.00015403530393381606f),
                 one = _mm512_set1_ps(1.f), lo = _mm512_set1_ps(-126.f);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 m = t + 16 <= n ? __mmask16(0xFFFF) : __mmask16((1u << (n - t)) - 1);
        __m512 x = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), vm), log2e);
        x = _mm512_max_ps(x, lo);
        const __m512 k = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 f = _mm512_sub_ps(x, k);
        __m512 p = _mm512_fmadd_ps(c6, f, c5);
        p = _mm512_fmadd_ps(p, f, c4); p = _mm512_fmadd_ps(p, f, c3); p = _mm512_fmadd_ps(p, f, c2);
        p = _mm512_fmadd_ps(p, f, c1); p = _mm512_fmadd_ps(p, f, one);
        const __m512 e = _mm512_scalef_ps(p, k);
        _mm512_mask_storeu_ps(s + t, m, e);
        vsum = _mm512_mask_add_ps(vsum, m, vsum, e);
    }
    _mm512_storeu_ps(sm, vsum);
}
#endif

// out[r, h*G+g, :] = softmax(q[r, h*G+g] . K[r, h]^T * scale) @ V[r, h] for rows r in [r0, r1).
// q, out: [B, H, D] float32; caches: [num_blocks, bs, HKV, D]; tables: [B, max_blocks]; lens: [B].
template <typename Q, typename T>
static void decode_attn_generic(const Q* q, int64_t q_stride, const T* kc, const T* vc, const int64_t* tables,
                                const int32_t* lens, Q* out, int64_t H, int64_t HKV, int64_t D, int64_t bs,
                                int64_t max_blocks, float scale, int64_t r0, int64_t r1) {
    const int64_t G = H / HKV;
    std::vector<float> scores, acc(G * D), qf(H * D);
    for (int64_t r = r0; r < r1; r++) {
        const int64_t L = lens[r];
        const int64_t* table = tables + r * max_blocks;
        scores.resize(G * L);
        for (int64_t i = 0; i < H * D; i++) qf[i] = load(q[r * q_stride + i]);
        for (int64_t h = 0; h < HKV; h++) {
            const float* qh = qf.data() + h * G * D;
            for (int64_t t = 0; t < L; t++) {
                const T* k = kc + ((table[t / bs] * bs + t % bs) * HKV + h) * D;
                for (int64_t g = 0; g < G; g++) {
                    float s = 0.f;
                    for (int64_t d = 0; d < D; d++) s += qh[g * D + d] * load(k[d]);
                    scores[g * L + t] = s * scale;
                }
            }
            for (int64_t g = 0; g < G; g++) softmax(scores.data() + g * L, L);
            std::fill(acc.begin(), acc.end(), 0.f);
            for (int64_t t = 0; t < L; t++) {
                const T* v = vc + ((table[t / bs] * bs + t % bs) * HKV + h) * D;
                for (int64_t g = 0; g < G; g++)
                    for (int64_t d = 0; d < D; d++) acc[g * D + d] += scores[g * L + t] * load(v[d]);
            }
            for (int64_t i = 0; i < G * D; i++) out[(r * H + h * G) * D + i] = from_f32<Q>(acc[i]);
        }
    }
}

#ifdef PD_AVX512
// A head's D values of one token as D/16 float32 vectors. bf16: each 32-value load splits into its
// even-index values (low halves, shifted up) and odd-index ones (high halves, masked), with no
// shuffles; q and the output use the same order, and dot products do not care about the order.
static inline void load_row(const float* p, __m512* out, int D) {
    for (int c = 0; c < D / 16; c++) out[c] = _mm512_loadu_ps(p + 16 * c);
}
static inline void load_row(const uint16_t* p, __m512* out, int D) {
    const __m512i hi = _mm512_set1_epi32(int(0xFFFF0000u));
    for (int c = 0; c < D / 32; c++) {
        const __m512i x = _mm512_loadu_si512(p + 32 * c);
        out[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        out[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, hi));
    }
}
// Value index of lane i of vector c in load_row's order.
static inline int value_index(float*, int c, int i) { return 16 * c + i; }
static inline int value_index(uint16_t*, int c, int i) { return 32 * (c / 2) + 2 * i + (c % 2); }

// r[i] = sum of a[i]'s lanes, for 16 vectors.
static inline __m512 reduce16(const __m512* a) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u01, u23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Both passes walk the row's blocks in order and, inside a block, every KV head (a block is
// [bs, HKV, D] contiguous), prefetching the next block meanwhile. Scores are kept per KV head as
// [L][GP] (token-major), so 16 / GP tokens' scores for the query heads of a KV head come out of
// one reduce16 and one store. GP is G rounded up to a divisor of 16 (a group of 3 query heads, as
// SmolLM2's 9 over 3, computes a fourth of zeros whose scores are never read); where G divides 16
// the kernel is the one it was before GP existed.
template <int G>
constexpr int padded_group() { return G <= 1 ? 1 : G <= 2 ? 2 : G <= 4 ? 4 : G <= 8 ? 8 : 16; }

template <typename Q, typename T, int D, int G>
static void decode_attn_avx512(const Q* q, int64_t q_stride, const T* kc, const T* vc, const int64_t* tables,
                               const int32_t* lens, Q* out, int64_t HKV, int64_t bs,
                               int64_t max_blocks, float scale, int64_t r0, int64_t r1) {
    constexpr int GP = padded_group<G>();
    constexpr int V = D / 16, TC = 16 / GP;
    static_assert(G <= 8, "at most 8 query heads per KV head");
    const int64_t H = HKV * G, tok_stride = HKV * D;
    const int64_t block_bytes = bs * tok_stride * int64_t(sizeof(T));
    std::vector<float> scores;
    std::vector<__m512> qv(HKV * GP * V, _mm512_setzero_ps()), o(H * V);   // qv: padding heads stay zero
    alignas(64) float qbuf[D];
    // Every block this call reads, in reading order (per row: its K blocks, then its V blocks), so
    // prefetching runs PD blocks ahead across the K/V and row boundaries too.
    std::vector<const char*> stream;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t nb = (lens[r] + bs - 1) / bs;
        for (int64_t j = 0; j < nb; j++) stream.push_back(reinterpret_cast<const char*>(kc + tables[r * max_blocks + j] * bs * tok_stride));
        for (int64_t j = 0; j < nb; j++) stream.push_back(reinterpret_cast<const char*>(vc + tables[r * max_blocks + j] * bs * tok_stride));
    }
    const int64_t nstream = int64_t(stream.size());
    int64_t gi = 0;   // index in stream of the block being read
    for (int64_t j = 0; j < PD && j < nstream; j++)
        for (int64_t off = 0; off < block_bytes; off += 64) _mm_prefetch(stream[j] + off, PF_HINT);
    for (int64_t r = r0; r < r1; r++) {
        const int64_t L = lens[r];
        const int64_t nblocks = (L + bs - 1) / bs;
        const int64_t* table = tables + r * max_blocks;
        const int64_t stride = (L + TC) * GP;   // per KV head, with room for a tail chunk
        scores.resize(HKV * stride);
        float* sc = scores.data();
        for (int64_t hq = 0; hq < H; hq++) {
            const Q* qh = q + r * q_stride + hq * D;
            for (int c = 0; c < V; c++)
                for (int i = 0; i < 16; i++) qbuf[16 * c + i] = load(qh[value_index((T*)nullptr, c, i)]) * scale;
            const int64_t slot = hq / G * GP + hq % G;
            for (int c = 0; c < V; c++) qv[slot * V + c] = _mm512_load_ps(qbuf + 16 * c);
        }
        // Pass 1: scores. A block's tail chunk may read slots past the last valid token (inside
        // the block, so they exist); those scores are never used.
        for (int64_t j = 0; j < nblocks; j++) {
            const T* kb = kc + table[j] * bs * tok_stride;
            const char* nxt = gi + PD < nstream ? stream[gi + PD] : nullptr;
            gi++;
            int64_t pf = 0;   // bytes of the next block prefetched so far, spread over this block's work
            const int64_t pf_step = (block_bytes + HKV * ((bs + TC - 1) / TC) - 1) / (HKV * ((bs + TC - 1) / TC));
            const int64_t t0 = j * bs, n = L - t0 < bs ? L - t0 : bs;
            for (int64_t h = 0; h < HKV; h++) {
                const __m512* qh = qv.data() + h * GP * V;
                for (int64_t i = 0; i < n; i += TC) {
                    if (nxt) for (const int64_t end = pf + pf_step; pf < end && pf < block_bytes; pf += 64) _mm_prefetch(nxt + pf, PF_HINT);
                    __m512 acc[16];
                    for (int tt = 0; tt < TC; tt++) {
                        __m512 kv[V];
                        load_row(kb + (i + tt < bs ? i + tt : bs - 1) * tok_stride + h * D, kv, D);
                        for (int g = 0; g < GP; g++) {
                            __m512 a = _mm512_mul_ps(qh[g * V], kv[0]);
                            for (int c = 1; c < V; c++) a = _mm512_fmadd_ps(qh[g * V + c], kv[c], a);
                            acc[tt * GP + g] = a;
                        }
                    }
                    _mm512_storeu_ps(sc + h * stride + (t0 + i) * GP, reduce16(acc));
                }
            }
        }
        // Softmax over each query head: values g, g + GP, ... of its KV head (lane i holds head i % GP).
        alignas(64) float inv[HKV * GP];
        for (int64_t h = 0; h < HKV; h++) {
            float* sh = sc + h * stride;
            const int64_t n = L * GP, nv = n / 16 * 16;
            __m512 vmax = _mm512_set1_ps(-INFINITY);
            for (int64_t t = 0; t < nv; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(sh + t));
            alignas(64) float mx[16], sm[16];
            _mm512_store_ps(mx, vmax);
            for (int64_t t = nv; t < n; t++) mx[t % GP] = sh[t] > mx[t % GP] ? sh[t] : mx[t % GP];
            for (int i = 0; i < GP; i++)
                for (int k = i + GP; k < 16; k += GP) mx[i] = mx[k] > mx[i] ? mx[k] : mx[i];
            for (int i = GP; i < 16; i++) mx[i] = mx[i % GP];
            exp_inplace(sh, n, mx, sm);
            for (int i = GP; i < 16; i++) sm[i % GP] += sm[i];
            for (int g = 0; g < GP; g++) inv[h * GP + g] = 1.f / sm[g];
        }
        // Pass 2: out = P @ V, P unnormalized (scaled once at the end).
        for (auto& x : o) x = _mm512_setzero_ps();
        for (int64_t j = 0; j < nblocks; j++) {
            const T* vb = vc + table[j] * bs * tok_stride;
            const char* nxt = gi + PD < nstream ? stream[gi + PD] : nullptr;
            gi++;
            const int64_t t0 = j * bs, n = L - t0 < bs ? L - t0 : bs;
            for (int64_t h = 0; h < HKV; h++) {
                if (nxt) {   // a quarter (1 / HKV) of the next block per KV head
                    const int64_t lo = block_bytes * h / HKV, hi = block_bytes * (h + 1) / HKV;
                    for (int64_t off = lo / 64 * 64; off < hi; off += 64) _mm_prefetch(nxt + off, PF_HINT);
                }
                __m512 acc[G][V];
                for (int g = 0; g < G; g++)
                    for (int c = 0; c < V; c++) acc[g][c] = o[(h * G + g) * V + c];
                const float* p = sc + h * stride + t0 * GP;
                for (int64_t i = 0; i < n; i++) {
                    __m512 vv[V];
                    load_row(vb + i * tok_stride + h * D, vv, D);
                    for (int g = 0; g < G; g++) {
                        const __m512 pg = _mm512_set1_ps(p[i * GP + g]);
                        for (int c = 0; c < V; c++) acc[g][c] = _mm512_fmadd_ps(pg, vv[c], acc[g][c]);
                    }
                }
                for (int g = 0; g < G; g++)
                    for (int c = 0; c < V; c++) o[(h * G + g) * V + c] = acc[g][c];
            }
        }
        for (int64_t hq = 0; hq < H; hq++) {
            alignas(64) float tmp[D];
            const float norm = inv[hq / G * GP + hq % G];
            for (int c = 0; c < V; c++) _mm512_store_ps(tmp + 16 * c, _mm512_mul_ps(o[hq * V + c], _mm512_set1_ps(norm)));
            Q* oh = out + (r * H + hq) * D;
            for (int c = 0; c < V; c++)
                for (int i = 0; i < 16; i++) oh[value_index((T*)nullptr, c, i)] = from_f32<Q>(tmp[16 * c + i]);
        }
    }
}

template <typename Q, typename T, int D>
static bool try_avx512_g(int64_t G, const Q* q, int64_t qs, const T* kc, const T* vc, const int64_t* tables,
                         const int32_t* lens, Q* out, int64_t HKV, int64_t bs, int64_t max_blocks,
                         float scale, int64_t r0, int64_t r1) {
    switch (G) {
        case 1: decode_attn_avx512<Q, T, D, 1>(q, qs, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1); return true;
        case 2: decode_attn_avx512<Q, T, D, 2>(q, qs, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1); return true;
        case 3: decode_attn_avx512<Q, T, D, 3>(q, qs, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1); return true;
        case 4: decode_attn_avx512<Q, T, D, 4>(q, qs, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1); return true;
        case 5: decode_attn_avx512<Q, T, D, 5>(q, qs, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1); return true;
        case 6: decode_attn_avx512<Q, T, D, 6>(q, qs, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1); return true;
        case 7: decode_attn_avx512<Q, T, D, 7>(q, qs, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1); return true;
        case 8: decode_attn_avx512<Q, T, D, 8>(q, qs, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1); return true;
        default: return false;
    }
}
#endif

#if defined(PD_AVX2) && !defined(PD_AVX512)
// float32 q over a float32 or bf16 cache through 256-bit registers. Like the AVX-512 kernel, both
// passes walk the row's blocks in order and, inside a block, every KV head, prefetching the
// blocks PD ahead (the whole call's K/V block stream), so the cache is read once, in order. The
// scores pass takes 8 tokens at a time per query head: 8 independent FMA chains over D, then one
// transpose-add (reduce8) gives the 8 scores; the G query heads of a KV head re-read the same 8 K
// rows from L1. The values pass keeps a query head's output (D/8 registers per 64 values) in
// registers over the block's tokens.
template <typename T, int D, int G>
static void decode_attn_avx2(const float* q, int64_t q_stride, const T* kc, const T* vc, const int64_t* tables,
                             const int32_t* lens, float* out, int64_t HKV, int64_t bs, int64_t max_blocks,
                             float scale, int64_t r0, int64_t r1) {
    constexpr int V = D / 8;
    static_assert(V % 8 == 0, "D must be a multiple of 64");
    const int64_t H = HKV * G, tok_stride = HKV * D;
    const int64_t block_bytes = bs * tok_stride * int64_t(sizeof(T));
    std::vector<float> scores, qs(H * D);
    std::vector<__m256> o(H * V);
    std::vector<const char*> stream;   // every block this call reads, in reading order
    for (int64_t r = r0; r < r1; r++) {
        const int64_t nb = (lens[r] + bs - 1) / bs;
        for (int64_t j = 0; j < nb; j++) stream.push_back(reinterpret_cast<const char*>(kc + tables[r * max_blocks + j] * bs * tok_stride));
        for (int64_t j = 0; j < nb; j++) stream.push_back(reinterpret_cast<const char*>(vc + tables[r * max_blocks + j] * bs * tok_stride));
    }
    const int64_t nstream = int64_t(stream.size());
    int64_t gi = 0;   // index in stream of the block being read
    for (int64_t j = 0; j < PD && j < nstream; j++)
        for (int64_t off = 0; off < block_bytes; off += 64) _mm_prefetch(stream[j] + off, PF_HINT);
    // A quarter (1 / HKV) of block stream[gi + PD] per KV head of the block being read.
    auto prefetch_part = [&](const char* nxt, int64_t h) {
        if (!nxt) return;
        const int64_t lo = block_bytes * h / HKV, hi = block_bytes * (h + 1) / HKV;
        for (int64_t off = lo / 64 * 64; off < hi; off += 64) _mm_prefetch(nxt + off, PF_HINT);
    };
    // Two rows a, b of one sequence (a prefill chunk's neighbouring queries: lens[a] <= lens[b], the
    // same blocks as far as a reads): K and V rows loaded once for both. Every score and output is
    // the same operation chain as the one-row path below (a score: the FMA chain over D and
    // reduce8's lane tree, which is the same for each of its 8 outputs; an output: the FMA chain
    // over the row's tokens in order), so a row's result does not depend on being paired.
    std::vector<float> scores_b, qs_b(H * D);
    std::vector<__m256> o_b(H * V);
    auto pairable = [&](int64_t a, int64_t b) {
        if (lens[a] > lens[b]) return false;
        const int64_t na = (lens[a] + bs - 1) / bs;
        for (int64_t j = 0; j < na; j++)
            if (tables[a * max_blocks + j] != tables[b * max_blocks + j]) return false;
        return true;
    };
    auto pair_rows = [&](int64_t a, int64_t b) {
        const int64_t La = lens[a], Lb = lens[b];
        const int64_t nblocks = (Lb + bs - 1) / bs;
        const int64_t* table = tables + b * max_blocks;
        const int64_t stride = nblocks * bs + 8;
        scores.resize(H * stride);
        scores_b.resize(H * stride);
        float* sa = scores.data();
        float* sb = scores_b.data();
        for (int64_t i = 0; i < H * D; i++) qs[i] = q[a * q_stride + i] * scale;
        for (int64_t i = 0; i < H * D; i++) qs_b[i] = q[b * q_stride + i] * scale;
        for (int64_t j = 0; j < nblocks; j++) {
            const T* kb = kc + table[j] * bs * tok_stride;
            const int64_t t0 = j * bs, n = Lb - t0 < bs ? Lb - t0 : bs;
            for (int64_t h = 0; h < HKV; h++) {
                for (int64_t i = 0; i < n; i += 4) {
                    const T* rows[4];
                    for (int tt = 0; tt < 4; tt++) rows[tt] = kb + (i + tt < bs ? i + tt : bs - 1) * tok_stride + h * D;
                    for (int g = 0; g < G; g++) {
                        const float* qa = qs.data() + (h * G + g) * D;
                        const float* qb = qs_b.data() + (h * G + g) * D;
                        __m256 acc[8];
                        const __m256 qa0 = _mm256_loadu_ps(qa), qb0 = _mm256_loadu_ps(qb);
                        for (int tt = 0; tt < 4; tt++) {
                            const __m256 k = load8(rows[tt]);
                            acc[tt] = _mm256_mul_ps(qa0, k);
                            acc[4 + tt] = _mm256_mul_ps(qb0, k);
                        }
                        for (int c = 1; c < V; c++) {
                            const __m256 qac = _mm256_loadu_ps(qa + 8 * c), qbc = _mm256_loadu_ps(qb + 8 * c);
                            for (int tt = 0; tt < 4; tt++) {
                                const __m256 k = load8(rows[tt] + 8 * c);
                                acc[tt] = _mm256_fmadd_ps(qac, k, acc[tt]);
                                acc[4 + tt] = _mm256_fmadd_ps(qbc, k, acc[4 + tt]);
                            }
                        }
                        const __m256 sc8 = reduce8(acc);
                        _mm_storeu_ps(sa + (h * G + g) * stride + t0 + i, _mm256_castps256_ps128(sc8));
                        _mm_storeu_ps(sb + (h * G + g) * stride + t0 + i, _mm256_extractf128_ps(sc8, 1));
                    }
                }
            }
        }
        for (int64_t hq = 0; hq < H; hq++) softmax(sa + hq * stride, La);
        for (int64_t hq = 0; hq < H; hq++) softmax(sb + hq * stride, Lb);
        for (auto& x : o) x = _mm256_setzero_ps();
        for (auto& x : o_b) x = _mm256_setzero_ps();
        for (int64_t j = 0; j < nblocks; j++) {
            const T* vb = vc + table[j] * bs * tok_stride;
            const int64_t t0 = j * bs, nb = Lb - t0 < bs ? Lb - t0 : bs;
            const int64_t na = La <= t0 ? 0 : (La - t0 < bs ? La - t0 : bs);
            for (int64_t h = 0; h < HKV; h++) {
                const T* vh = vb + h * D;
                for (int g = 0; g < G; g++) {
                    const float* pa = sa + (h * G + g) * stride + t0;
                    const float* pb = sb + (h * G + g) * stride + t0;
                    __m256* oa = o.data() + (h * G + g) * V;
                    __m256* ob = o_b.data() + (h * G + g) * V;
                    for (int c0 = 0; c0 < V; c0 += 4) {
                        __m256 acc[8];
                        for (int k = 0; k < 4; k++) { acc[k] = oa[c0 + k]; acc[4 + k] = ob[c0 + k]; }
                        int64_t t = 0;
                        for (; t < na; t++) {
                            const __m256 pta = _mm256_set1_ps(pa[t]), ptb = _mm256_set1_ps(pb[t]);
                            const T* row = vh + t * tok_stride + 8 * c0;
                            for (int k = 0; k < 4; k++) {
                                const __m256 v = load8(row + 8 * k);
                                acc[k] = _mm256_fmadd_ps(pta, v, acc[k]);
                                acc[4 + k] = _mm256_fmadd_ps(ptb, v, acc[4 + k]);
                            }
                        }
                        for (; t < nb; t++) {
                            const __m256 ptb = _mm256_set1_ps(pb[t]);
                            const T* row = vh + t * tok_stride + 8 * c0;
                            for (int k = 0; k < 4; k++) acc[4 + k] = _mm256_fmadd_ps(ptb, load8(row + 8 * k), acc[4 + k]);
                        }
                        for (int k = 0; k < 4; k++) { oa[c0 + k] = acc[k]; ob[c0 + k] = acc[4 + k]; }
                    }
                }
            }
        }
        for (int64_t hq = 0; hq < H; hq++)
            for (int c = 0; c < V; c++) {
                _mm256_storeu_ps(out + (a * H + hq) * D + 8 * c, o[hq * V + c]);
                _mm256_storeu_ps(out + (b * H + hq) * D + 8 * c, o_b[hq * V + c]);
            }
    };
    for (int64_t r = r0; r < r1; r++) {
        if (r + 1 < r1 && pairable(r, r + 1)) {
            pair_rows(r, r + 1);
            gi += 2 * ((lens[r] + bs - 1) / bs) + 2 * ((lens[r + 1] + bs - 1) / bs);   // their blocks in stream
            r++;
            continue;
        }
        const int64_t L = lens[r];
        const int64_t nblocks = (L + bs - 1) / bs;
        const int64_t* table = tables + r * max_blocks;
        const int64_t stride = nblocks * bs + 8;   // per query head; a chunk of 8 may run past the block's end
        scores.resize(H * stride);
        float* sc = scores.data();
        for (int64_t i = 0; i < H * D; i++) qs[i] = q[r * q_stride + i] * scale;
        // Pass 1: scores. A chunk past the last valid token reads the block's last slot (it exists);
        // those scores are overwritten by the next block's or never used.
        for (int64_t j = 0; j < nblocks; j++) {
            const T* kb = kc + table[j] * bs * tok_stride;
            const char* nxt = gi + PD < nstream ? stream[gi + PD] : nullptr;
            gi++;
            const int64_t t0 = j * bs, n = L - t0 < bs ? L - t0 : bs;
            for (int64_t h = 0; h < HKV; h++) {
                prefetch_part(nxt, h);
                for (int64_t i = 0; i < n; i += 8) {
                    const T* rows[8];
                    for (int tt = 0; tt < 8; tt++) rows[tt] = kb + (i + tt < bs ? i + tt : bs - 1) * tok_stride + h * D;
                    for (int g = 0; g < G; g++) {
                        const float* qg = qs.data() + (h * G + g) * D;
                        __m256 acc[8];
                        const __m256 q0 = _mm256_loadu_ps(qg);
                        for (int tt = 0; tt < 8; tt++) acc[tt] = _mm256_mul_ps(q0, load8(rows[tt]));
                        for (int c = 1; c < V; c++) {
                            const __m256 qc = _mm256_loadu_ps(qg + 8 * c);
                            for (int tt = 0; tt < 8; tt++) acc[tt] = _mm256_fmadd_ps(qc, load8(rows[tt] + 8 * c), acc[tt]);
                        }
                        _mm256_storeu_ps(sc + (h * G + g) * stride + t0 + i, reduce8(acc));
                    }
                }
            }
        }
        for (int64_t hq = 0; hq < H; hq++) softmax(sc + hq * stride, L);
        // Pass 2: out = P @ V.
        for (auto& x : o) x = _mm256_setzero_ps();
        for (int64_t j = 0; j < nblocks; j++) {
            const T* vb = vc + table[j] * bs * tok_stride;
            const char* nxt = gi + PD < nstream ? stream[gi + PD] : nullptr;
            gi++;
            const int64_t t0 = j * bs, n = L - t0 < bs ? L - t0 : bs;
            for (int64_t h = 0; h < HKV; h++) {
                prefetch_part(nxt, h);
                const T* vh = vb + h * D;
                for (int g = 0; g < G; g++) {
                    const float* p = sc + (h * G + g) * stride + t0;
                    __m256* oh = o.data() + (h * G + g) * V;
                    for (int c0 = 0; c0 < V; c0 += 8) {
                        __m256 acc[8];
                        for (int k = 0; k < 8; k++) acc[k] = oh[c0 + k];
                        for (int64_t t = 0; t < n; t++) {
                            const __m256 pt = _mm256_set1_ps(p[t]);
                            const T* row = vh + t * tok_stride + 8 * c0;
                            for (int k = 0; k < 8; k++) acc[k] = _mm256_fmadd_ps(pt, load8(row + 8 * k), acc[k]);
                        }
                        for (int k = 0; k < 8; k++) oh[c0 + k] = acc[k];
                    }
                }
            }
        }
        for (int64_t hq = 0; hq < H; hq++)
            for (int c = 0; c < V; c++) _mm256_storeu_ps(out + (r * H + hq) * D + 8 * c, o[hq * V + c]);
    }
}

template <typename T, int D>
static bool try_avx2_g(int64_t G, const float* q, int64_t qs, const T* kc, const T* vc, const int64_t* tables,
                       const int32_t* lens, float* out, int64_t HKV, int64_t bs, int64_t max_blocks, float scale,
                       int64_t r0, int64_t r1) {
    switch (G) {
        case 1: decode_attn_avx2<T, D, 1>(q, qs, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1); return true;
        case 2: decode_attn_avx2<T, D, 2>(q, qs, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1); return true;
        case 3: decode_attn_avx2<T, D, 3>(q, qs, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1); return true;
        case 4: decode_attn_avx2<T, D, 4>(q, qs, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1); return true;
        case 5: decode_attn_avx2<T, D, 5>(q, qs, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1); return true;
        case 6: decode_attn_avx2<T, D, 6>(q, qs, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1); return true;
        case 7: decode_attn_avx2<T, D, 7>(q, qs, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1); return true;
        case 8: decode_attn_avx2<T, D, 8>(q, qs, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1); return true;
        default: return false;
    }
}
#endif

template <typename Q, typename T>
static void dispatch(const Q* q, int64_t qs, const T* kc, const T* vc, const int64_t* tables, const int32_t* lens,
                     Q* out, int64_t H, int64_t HKV, int64_t D, int64_t bs, int64_t max_blocks, float scale,
                     int64_t r0, int64_t r1) {
#ifdef PD_AVX512
    const int64_t G = H / HKV;
    if (D == 64 && try_avx512_g<Q, T, 64>(G, q, qs, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1)) return;
    if (D == 128 && try_avx512_g<Q, T, 128>(G, q, qs, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1)) return;
#elif defined(PD_AVX2)
    if constexpr (std::is_same_v<Q, float>) {
        const int64_t G = H / HKV;
        if (D == 64 && try_avx2_g<T, 64>(G, q, qs, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1)) return;
        if (D == 128 && try_avx2_g<T, 128>(G, q, qs, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1)) return;
    }
#endif
    decode_attn_generic<Q, T>(q, qs, kc, vc, tables, lens, out, H, HKV, D, bs, max_blocks, scale, r0, r1);
}


"""Native CPU kernels: decode attention over the paged KV cache, and a bf16-weight linear.

Decode attention (``decode_attention``): the pure-torch path gathers every sequence's blocks into
a dense tensor on every layer of every step, then runs SDPA over it; both passes are slow for
one query token per row. This kernel reads K/V straight from the cache blocks (bf16 or
float32), once, with the query heads of a GQA group sharing each load, no padding to the
batch's longest context, and the next block prefetched. Math in float32.

Linear (``linear_bf16w``): float32 activations times bf16 weights, in float32. For the few rows
of a decode step a GEMM is bound by reading its weights; this reads half the bytes of float32
weights, and beats oneDNN's float32 GEMM up to ~128 rows (AVX-512 only).

Both are plain C++ with no torch headers, built on first use with the system compiler into
``$PDSERVE_HOME/kernels`` (default ``~/.cache/pdserve/kernels``; a few seconds, once per source
and CPU) and called through ctypes, which releases the GIL, so work is split across torch's
intra-op thread count. If there is no compiler, the build fails, or ``PDSERVE_CPU_KERNELS=0``,
``load()`` returns None and the callers keep their torch paths.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <cstdint>
#include <cstring>
#include <cmath>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static inline float load(float x) { return x; }
static inline float load(uint16_t x) {   // bfloat16 bits -> float32
    uint32_t u = uint32_t(x) << 16; float f; std::memcpy(&f, &u, 4); return f;
}

// In place: s[0:n] = softmax(s[0:n]).
static void softmax(float* s, int64_t n) {
    float m = s[0];
    for (int64_t t = 1; t < n; t++) m = s[t] > m ? s[t] : m;
    float sum = 0.f;
    int64_t t = 0;
#ifdef __AVX512F__
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
#endif
    for (; t < n; t++) { s[t] = std::exp(s[t] - m); sum += s[t]; }
    const float inv = 1.f / sum;
    for (t = 0; t < n; t++) s[t] *= inv;
}

#ifdef __AVX512F__
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
template <typename T>
static void decode_attn_generic(const float* q, const T* kc, const T* vc, const int64_t* tables,
                                const int32_t* lens, float* out, int64_t H, int64_t HKV, int64_t D, int64_t bs,
                                int64_t max_blocks, float scale, int64_t r0, int64_t r1) {
    const int64_t G = H / HKV;
    std::vector<float> scores, acc(G * D);
    for (int64_t r = r0; r < r1; r++) {
        const int64_t L = lens[r];
        const int64_t* table = tables + r * max_blocks;
        scores.resize(G * L);
        for (int64_t h = 0; h < HKV; h++) {
            const float* qh = q + (r * H + h * G) * D;
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
            std::memcpy(out + (r * H + h * G) * D, acc.data(), sizeof(float) * G * D);
        }
    }
}

#ifdef __AVX512F__
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
// [L][G] (token-major), so 16 / G tokens' scores for the G query heads of a KV head come out of
// one reduce16 and one store.
#ifndef PD
#define PD 1   // blocks of prefetch distance
#endif
template <typename T, int D, int G>
static void decode_attn_avx512(const float* q, const T* kc, const T* vc, const int64_t* tables,
                               const int32_t* lens, float* out, int64_t HKV, int64_t bs,
                               int64_t max_blocks, float scale, int64_t r0, int64_t r1) {
    constexpr int V = D / 16, TC = 16 / G;
    const int64_t H = HKV * G, tok_stride = HKV * D;
    const int64_t block_bytes = bs * tok_stride * int64_t(sizeof(T));
    std::vector<float> scores;
    std::vector<__m512> qv(H * V), o(H * V);
    alignas(64) float qbuf[D];
    for (int64_t r = r0; r < r1; r++) {
        const int64_t L = lens[r];
        const int64_t nblocks = (L + bs - 1) / bs;
        const int64_t* table = tables + r * max_blocks;
        const int64_t stride = (L + TC) * G;   // per KV head, with room for a tail chunk
        scores.resize(HKV * stride);
        float* sc = scores.data();
        for (int64_t hq = 0; hq < H; hq++) {
            const float* qh = q + (r * H + hq) * D;
            for (int c = 0; c < V; c++)
                for (int i = 0; i < 16; i++) qbuf[16 * c + i] = qh[value_index((T*)nullptr, c, i)] * scale;
            for (int c = 0; c < V; c++) qv[hq * V + c] = _mm512_load_ps(qbuf + 16 * c);
        }
        for (int64_t j = 1; j < PD && j < nblocks; j++)
            for (int64_t off = 0; off < block_bytes; off += 64)
                _mm_prefetch(reinterpret_cast<const char*>(kc + table[j] * bs * tok_stride) + off, _MM_HINT_T0);
        // Pass 1: scores. A block's tail chunk may read slots past the last valid token (inside
        // the block, so they exist); those scores are never used.
        for (int64_t j = 0; j < nblocks; j++) {
            const T* kb = kc + table[j] * bs * tok_stride;
            const char* nxt = j + PD < nblocks ? reinterpret_cast<const char*>(kc + table[j + PD] * bs * tok_stride) : nullptr;
            int64_t pf = 0;   // bytes of the next block prefetched so far, spread over this block's work
            const int64_t pf_step = (block_bytes + HKV * ((bs + TC - 1) / TC) - 1) / (HKV * ((bs + TC - 1) / TC));
            const int64_t t0 = j * bs, n = L - t0 < bs ? L - t0 : bs;
            for (int64_t h = 0; h < HKV; h++) {
                const __m512* qh = qv.data() + h * G * V;
                for (int64_t i = 0; i < n; i += TC) {
                    if (nxt) for (const int64_t end = pf + pf_step; pf < end && pf < block_bytes; pf += 64) _mm_prefetch(nxt + pf, _MM_HINT_T0);
                    __m512 acc[16];
                    for (int tt = 0; tt < TC; tt++) {
                        __m512 kv[V];
                        load_row(kb + (i + tt < bs ? i + tt : bs - 1) * tok_stride + h * D, kv, D);
                        for (int g = 0; g < G; g++) {
                            __m512 a = _mm512_mul_ps(qh[g * V], kv[0]);
                            for (int c = 1; c < V; c++) a = _mm512_fmadd_ps(qh[g * V + c], kv[c], a);
                            acc[tt * G + g] = a;
                        }
                    }
                    _mm512_storeu_ps(sc + h * stride + (t0 + i) * G, reduce16(acc));
                }
            }
        }
        for (int64_t j = 0; j < PD && j < nblocks; j++)
            for (int64_t off = 0; off < block_bytes; off += 64)
                _mm_prefetch(reinterpret_cast<const char*>(vc + table[j] * bs * tok_stride) + off, _MM_HINT_T0);
        // Softmax over each query head: values g, g + G, ... of its KV head (lane i holds head i % G).
        alignas(64) float inv[H];
        for (int64_t h = 0; h < HKV; h++) {
            float* sh = sc + h * stride;
            const int64_t n = L * G, nv = n / 16 * 16;
            __m512 vmax = _mm512_set1_ps(-INFINITY);
            for (int64_t t = 0; t < nv; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(sh + t));
            alignas(64) float mx[16], sm[16];
            _mm512_store_ps(mx, vmax);
            for (int64_t t = nv; t < n; t++) mx[t % G] = sh[t] > mx[t % G] ? sh[t] : mx[t % G];
            for (int i = 0; i < G; i++)
                for (int k = i + G; k < 16; k += G) mx[i] = mx[k] > mx[i] ? mx[k] : mx[i];
            for (int i = G; i < 16; i++) mx[i] = mx[i % G];
            exp_inplace(sh, n, mx, sm);
            for (int i = G; i < 16; i++) sm[i % G] += sm[i];
            for (int g = 0; g < G; g++) inv[h * G + g] = 1.f / sm[g];
        }
        // Pass 2: out = P @ V, P unnormalized (scaled once at the end).
        for (auto& x : o) x = _mm512_setzero_ps();
        for (int64_t j = 0; j < nblocks; j++) {
            const T* vb = vc + table[j] * bs * tok_stride;
            const char* nxt = j + PD < nblocks ? reinterpret_cast<const char*>(vc + table[j + PD] * bs * tok_stride) : nullptr;
            const int64_t t0 = j * bs, n = L - t0 < bs ? L - t0 : bs;
            for (int64_t h = 0; h < HKV; h++) {
                if (nxt) {   // a quarter (1 / HKV) of the next block per KV head
                    const int64_t lo = block_bytes * h / HKV, hi = block_bytes * (h + 1) / HKV;
                    for (int64_t off = lo / 64 * 64; off < hi; off += 64) _mm_prefetch(nxt + off, _MM_HINT_T0);
                }
                __m512 acc[G][V];
                for (int g = 0; g < G; g++)
                    for (int c = 0; c < V; c++) acc[g][c] = o[(h * G + g) * V + c];
                const float* p = sc + h * stride + t0 * G;
                for (int64_t i = 0; i < n; i++) {
                    __m512 vv[V];
                    load_row(vb + i * tok_stride + h * D, vv, D);
                    for (int g = 0; g < G; g++) {
                        const __m512 pg = _mm512_set1_ps(p[i * G + g]);
                        for (int c = 0; c < V; c++) acc[g][c] = _mm512_fmadd_ps(pg, vv[c], acc[g][c]);
                    }
                }
                for (int g = 0; g < G; g++)
                    for (int c = 0; c < V; c++) o[(h * G + g) * V + c] = acc[g][c];
            }
        }
        for (int64_t hq = 0; hq < H; hq++) {
            alignas(64) float tmp[D];
            for (int c = 0; c < V; c++) _mm512_store_ps(tmp + 16 * c, _mm512_mul_ps(o[hq * V + c], _mm512_set1_ps(inv[hq])));
            float* oh = out + (r * H + hq) * D;
            for (int c = 0; c < V; c++)
                for (int i = 0; i < 16; i++) oh[value_index((T*)nullptr, c, i)] = tmp[16 * c + i];
        }
    }
}

template <typename T, int D>
static bool try_avx512_g(int64_t G, const float* q, const T* kc, const T* vc, const int64_t* tables,
                         const int32_t* lens, float* out, int64_t HKV, int64_t bs, int64_t max_blocks,
                         float scale, int64_t r0, int64_t r1) {
    switch (G) {
        case 1: decode_attn_avx512<T, D, 1>(q, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1); return true;
        case 2: decode_attn_avx512<T, D, 2>(q, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1); return true;
        case 4: decode_attn_avx512<T, D, 4>(q, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1); return true;
        case 8: decode_attn_avx512<T, D, 8>(q, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1); return true;
        default: return false;
    }
}
#endif

template <typename T>
static void dispatch(const float* q, const T* kc, const T* vc, const int64_t* tables, const int32_t* lens,
                     float* out, int64_t H, int64_t HKV, int64_t D, int64_t bs, int64_t max_blocks, float scale,
                     int64_t r0, int64_t r1) {
#ifdef __AVX512F__
    const int64_t G = H / HKV;
    if (D == 64 && try_avx512_g<T, 64>(G, q, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1)) return;
    if (D == 128 && try_avx512_g<T, 128>(G, q, kc, vc, tables, lens, out, HKV, bs, max_blocks, scale, r0, r1)) return;
#endif
    decode_attn_generic<T>(q, kc, vc, tables, lens, out, H, HKV, D, bs, max_blocks, scale, r0, r1);
}

extern "C" int pd_decode_attn_bf16(const float* q, const uint16_t* kc, const uint16_t* vc, const int64_t* tables,
                                   const int32_t* lens, float* out, int64_t H, int64_t HKV, int64_t D, int64_t bs,
                                   int64_t max_blocks, float scale, int64_t r0, int64_t r1) {
    dispatch<uint16_t>(q, kc, vc, tables, lens, out, H, HKV, D, bs, max_blocks, scale, r0, r1);
    return 0;
}

extern "C" int pd_decode_attn_f32(const float* q, const float* kc, const float* vc, const int64_t* tables,
                                  const int32_t* lens, float* out, int64_t H, int64_t HKV, int64_t D, int64_t bs,
                                  int64_t max_blocks, float scale, int64_t r0, int64_t r1) {
    dispatch<float>(q, kc, vc, tables, lens, out, H, HKV, D, bs, max_blocks, scale, r0, r1);
    return 0;
}

extern "C" int pd_supports_head_dim(int64_t D) { return D > 0; }

// ---- y = x @ W^T with bf16 weights, float32 math (small row counts: decode steps) ----------
// W is packed as [N / 32][K][32] bf16: column tile t holds columns 32t..32t+31, and within a
// k row, position 2i is column i and 2i + 1 is column 16 + i, so one 64-byte load splits into
// the two 16-column halves with a shift and a mask. Half the bytes of float32 weights, which is
// what bounds these GEMMs when the rows are few.
#ifdef __AVX512F__
static inline void widen_bf16x32(const uint16_t* p, __m512& w0, __m512& w1) {
    const __m512i w = _mm512_loadu_si512(p);
    w0 = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    w1 = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(int(0xFFFF0000u))));
}

// y[0:MT, 0:32] = x[0:MT, :] @ tile; the tile is bf16 [K][32] as packed, or float32 [K][32] plain.
template <int MT, bool BF16>
static inline void gemm_tile(const float* x, int64_t ldx, const void* p, int64_t K, float* y, int64_t ldy) {
    __m512 acc[MT][2];
    for (int m = 0; m < MT; m++) { acc[m][0] = _mm512_setzero_ps(); acc[m][1] = _mm512_setzero_ps(); }
    for (int64_t k = 0; k < K; k++) {
        __m512 w0, w1;
        if (BF16) {
            widen_bf16x32(static_cast<const uint16_t*>(p) + k * 32, w0, w1);
        } else {
            const float* f = static_cast<const float*>(p) + k * 32;
            w0 = _mm512_loadu_ps(f);
            w1 = _mm512_loadu_ps(f + 16);
        }
        for (int m = 0; m < MT; m++) {
            const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
            acc[m][0] = _mm512_fmadd_ps(xb, w0, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(xb, w1, acc[m][1]);
        }
    }
    for (int m = 0; m < MT; m++) {
        _mm512_storeu_ps(y + m * ldy, acc[m][0]);
        _mm512_storeu_ps(y + m * ldy + 16, acc[m][1]);
    }
}

template <bool BF16>
static void gemm_rows(int mt, const float* x, int64_t ldx, const void* p, int64_t K, float* y, int64_t ldy) {
    switch (mt) {
#define PD_TILE(n) case n: gemm_tile<n, BF16>(x, ldx, p, K, y, ldy); break;
        PD_TILE(1) PD_TILE(2) PD_TILE(3) PD_TILE(4) PD_TILE(5) PD_TILE(6)
        PD_TILE(7) PD_TILE(8) PD_TILE(9) PD_TILE(10) PD_TILE(11) PD_TILE(12)
#undef PD_TILE
        default: break;
    }
}
#endif

// Column tiles [nt0, nt1) of y[M, N] = x[M, K] @ W^T (x, y row-major, contiguous).
extern "C" int pd_linear_bf16w(const float* x, int64_t M, int64_t K, const uint16_t* p, int64_t N, float* y,
                               int64_t nt0, int64_t nt1) {
#ifdef __AVX512F__
    const int64_t chunk = 192;   // rows whose x stays in L2 while every column tile passes over it
    std::vector<float> buf;
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t mc = M - m0 < chunk ? M - m0 : chunk;
        const int64_t ntiles = (mc + 11) / 12;
        if (ntiles > 1) buf.resize(K * 32);
        for (int64_t nt = nt0; nt < nt1; nt++) {
            const uint16_t* pt = p + nt * K * 32;
            if (ntiles > 1) {   // several row tiles reuse this column tile: widen it once
                float* b = buf.data();
                for (int64_t k = 0; k < K; k++) {
                    __m512 w0, w1;
                    widen_bf16x32(pt + k * 32, w0, w1);
                    _mm512_storeu_ps(b + k * 32, w0);
                    _mm512_storeu_ps(b + k * 32 + 16, w1);
                }
            }
            for (int64_t m = m0, t = 0; t < ntiles; t++) {
                const int64_t rows = (m0 + mc - m) / (ntiles - t);   // balanced row tiles of <= 12
                if (ntiles > 1) gemm_rows<false>(int(rows), x + m * K, K, buf.data(), K, y + m * N + nt * 32, N);
                else gemm_rows<true>(int(rows), x + m * K, K, pt, K, y + m * N + nt * 32, N);
                m += rows;
            }
        }
    }
    return 0;
#else
    return 1;
#endif
}

extern "C" int pd_has_avx512() {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}
"""

_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-shared", "-fPIC", "-std=c++17"]
_ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5 + [ctypes.c_float] + [ctypes.c_int64] * 2

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_pool: ThreadPoolExecutor | None = None


def _cache_dir() -> Path:
    env = os.environ.get("PDSERVE_HOME")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve") / "kernels"


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build() -> ctypes.CDLL | None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        log.info("no C++ compiler found: the CPU kernels are off, torch paths run instead")
        return None
    key = hashlib.sha256("\0".join([_SOURCE, compiler, *_FLAGS, _cpu_id()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"pd_cpu_kernels-{key}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src, so = Path(tmp) / "k.cpp", Path(tmp) / "k.so"
            src.write_text(_SOURCE)
            proc = subprocess.run([compiler, *_FLAGS, str(src), "-o", str(so)], capture_output=True, text=True)
            if proc.returncode != 0:
                log.warning("building the CPU kernels failed; torch paths run instead:\n%s", proc.stderr[-2000:])
                return None
            os.replace(so, target)   # atomic: concurrent builders each write a complete file
    lib = ctypes.CDLL(str(target))
    for name in ("pd_decode_attn_bf16", "pd_decode_attn_f32"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    lib.pd_supports_head_dim.argtypes, lib.pd_supports_head_dim.restype = [ctypes.c_int64], ctypes.c_int
    lib.pd_linear_bf16w.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    lib.pd_linear_bf16w.restype = ctypes.c_int
    lib.pd_has_avx512.argtypes, lib.pd_has_avx512.restype = [], ctypes.c_int
    return lib


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first call; None where unavailable."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("PDSERVE_CPU_KERNELS", "1") != "0" and platform.system() in ("Linux", "Darwin"):
                try:
                    _lib = _build()
                except Exception as exc:   # any failure leaves the torch path in place
                    log.warning("CPU kernels unavailable (%s); torch paths run instead", exc)
                    _lib = None
            _tried = True
    return _lib


def supports(cache: torch.Tensor, head_dim: int) -> bool:
    lib = load()
    return (lib is not None and cache.device.type == "cpu" and cache.dtype in (torch.bfloat16, torch.float32)
            and cache.is_contiguous() and bool(lib.pd_supports_head_dim(head_dim)))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, H, D]; caches: [num_blocks, block_size, Hkv, D]; block_tables: [B, max_blocks] int64;
    context_lens: [B] int32. Returns [B, H, D] in q's dtype. Caller checks supports() first."""
    lib = load()
    b, h, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    qf = q.to(torch.float32).contiguous()
    out = torch.empty_like(qf)
    tables = block_tables.contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    fn = lib.pd_decode_attn_bf16 if k_cache.dtype == torch.bfloat16 else lib.pd_decode_attn_f32
    args = (qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            out.data_ptr(), h, hkv, d, bs, tables.shape[1], scale)
    threads = min(torch.get_num_threads(), b)
    if threads <= 1:
        fn(*args, 0, b)
    else:
        for fut in [_executor().submit(fn, *args, r0, r1) for r0, r1 in _split(lens.tolist(), threads)]:
            fut.result()
    return out if q.dtype == torch.float32 else out.to(q.dtype)


# ---- bf16-weight linear ---------------------------------------------------------------------

def bf16_linear_available() -> bool:
    lib = load()
    return lib is not None and bool(lib.pd_has_avx512())


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] (values representable in bf16) -> the kernel's [N / 32, K, 32] bf16 layout;
    None where N is not a multiple of 32."""
    n, k = weight.shape
    if n % 32:
        return None
    tiles = weight.detach().to(torch.bfloat16).reshape(n // 32, 2, 16, k)    # [tile, half, i, k]
    return tiles.permute(0, 3, 2, 1).contiguous().reshape(n // 32, k, 32)  # [tile, k, 2i + half]


def linear_bf16w(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ W^T for W packed by pack_bf16_weight: float32 math on bf16 weights."""
    lib = load()
    x = x.contiguous()
    m, k = x.shape
    tiles = packed.shape[0]
    y = torch.empty(m, tiles * 32, dtype=torch.float32)
    args = (x.data_ptr(), m, k, packed.data_ptr(), tiles * 32, y.data_ptr())
    threads = min(torch.get_num_threads(), tiles)
    if threads <= 1:
        lib.pd_linear_bf16w(*args, 0, tiles)
    else:
        bounds = [tiles * i // threads for i in range(threads + 1)]
        for fut in [_executor().submit(lib.pd_linear_bf16w, *args, a, b) for a, b in zip(bounds, bounds[1:])]:
            fut.result()
    return y


def _forget_pool() -> None:   # a forked child has none of the parent's worker threads
    global _pool, _lock
    _pool, _lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None or _pool._max_workers < torch.get_num_threads():
            _pool = ThreadPoolExecutor(max_workers=torch.get_num_threads(), thread_name_prefix="pd-cpu")
        return _pool


def _split(lens: list[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous row ranges of about equal total context."""
    total, bounds, acc, start = sum(lens), [], 0, 0
    for i, n in enumerate(lens):
        acc += n
        if acc * parts >= total * (len(bounds) + 1) and i + 1 < len(lens):
            bounds.append((start, i + 1))
            start = i + 1
    bounds.append((start, len(lens)))
    return bounds

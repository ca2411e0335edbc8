// y = x @ W^T with bf16 weights and float32 activations, float32 math (decode rows of a float32
// compute dtype over a bf16 checkpoint).
#include <vector>
#include "pd_common.h"

using namespace pd;

// ---- y = x @ W^T with bf16 weights, float32 math (small row counts: decode steps) ----------
// W is packed as [N / 32][K][32] bf16: column tile t holds columns 32t..32t+31, and within a
// k row, position 2i is column i and 2i + 1 is column 16 + i, so one 64-byte load splits into
// the two 16-column halves with a shift and a mask. Half the bytes of float32 weights, which is
// what bounds these GEMMs when the rows are few.
#ifdef PD_AVX512
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

#if !defined(PD_AVX512) && defined(PD_AVX2)
// The same packed layout through 256-bit registers. A 32-byte load of a tile's k row holds
// positions 16h..16h+15, i.e. columns 8h..8h+7 (even positions) and 16+8h..16+8h+7 (odd ones):
// "half" h of the tile. Sixteen registers hold 6 rows x 2 accumulators, the two weight vectors
// and the broadcast x.
static inline void widen_half(const uint16_t* p, __m256& lo, __m256& hi) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xFFFF0000u))));
}

// y[0:MT, half h's 16 columns] = x[0:MT, :] @ tile; the tile is bf16 [K][32] as packed, or
// float32 [K][32] in plain column order.
template <int MT, bool BF16>
static inline void gemm_half(const float* x, int64_t ldx, const void* p, int h, int64_t K, float* y, int64_t ldy) {
    __m256 acc[MT][2];
    for (int m = 0; m < MT; m++) { acc[m][0] = _mm256_setzero_ps(); acc[m][1] = _mm256_setzero_ps(); }
    for (int64_t k = 0; k < K; k++) {
        __m256 w0, w1;
        if (BF16) {
            widen_half(static_cast<const uint16_t*>(p) + k * 32 + h * 16, w0, w1);
        } else {
            const float* f = static_cast<const float*>(p) + k * 32;
            w0 = _mm256_loadu_ps(f + h * 8);
            w1 = _mm256_loadu_ps(f + 16 + h * 8);
        }
        for (int m = 0; m < MT; m++) {
            const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
            acc[m][0] = _mm256_fmadd_ps(xb, w0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(xb, w1, acc[m][1]);
        }
    }
    for (int m = 0; m < MT; m++) {
        _mm256_storeu_ps(y + m * ldy + h * 8, acc[m][0]);
        _mm256_storeu_ps(y + m * ldy + 16 + h * 8, acc[m][1]);
    }
}

template <bool BF16>
static void gemm_rows(int mt, const float* x, int64_t ldx, const void* p, int64_t K, float* y, int64_t ldy) {
    for (int h = 0; h < 2; h++) {
        switch (mt) {
#define PD_TILE(n) case n: gemm_half<n, BF16>(x, ldx, p, h, K, y, ldy); break;
            PD_TILE(1) PD_TILE(2) PD_TILE(3) PD_TILE(4) PD_TILE(5) PD_TILE(6)
#undef PD_TILE
            default: break;
        }
    }
}
#endif

// Column tiles [nt0, nt1) of y[M, N] = x[M, K] @ W^T (x, y row-major, contiguous); W packed as
// [N / 32][K][32], bf16 as described above (BF16) or float32 in plain column order.
// Every output element is one FMA chain over k = 0 .. K-1 in order, whatever the row tile it
// falls in (1 to max_rows rows), the number of rows M, the row's position and the column-tile
// split over threads: a row's result does not depend on the rows beside it (batch invariance,
// engine/layers/linear.py), with this build's ISA fixed.
template <bool BF16>
static int linear_tiles(const float* x, int64_t M, int64_t K, const void* pw, int64_t N, float* y,
                        int64_t nt0, int64_t nt1) {
#if defined(PD_AVX512) || defined(PD_AVX2)
#ifdef PD_AVX512
    const int64_t max_rows = 12;
#else
    const int64_t max_rows = 4;   // 8 accumulators: more rows spill registers (5 or 6 rows are 3x slower)
#endif
    const int64_t chunk = 192;   // rows whose x stays in L2 while every column tile passes over it
    std::vector<float> buf;
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t mc = M - m0 < chunk ? M - m0 : chunk;
        const int64_t ntiles = (mc + max_rows - 1) / max_rows;
#ifdef PD_AVX512
        const bool widen = BF16 && ntiles > 1;   // several row tiles reuse this column tile: widen it once
#else
        const bool widen = false;        // AVX2: widening in registers is cheaper than the float32 tile's loads
#endif
        if (widen) buf.resize(K * 32);
        for (int64_t nt = nt0; nt < nt1; nt++) {
            if (!BF16) {
                const float* pt = static_cast<const float*>(pw) + nt * K * 32;
                for (int64_t m = m0, t = 0; t < ntiles; t++) {
                    const int64_t rows = (m0 + mc - m) / (ntiles - t);
                    gemm_rows<false>(int(rows), x + m * K, K, pt, K, y + m * N + nt * 32, N);
                    m += rows;
                }
                continue;
            }
            const uint16_t* pt = static_cast<const uint16_t*>(pw) + nt * K * 32;
            if (widen) {
                float* b = buf.data();
                for (int64_t k = 0; k < K; k++) {
#ifdef PD_AVX512
                    __m512 w0, w1;
                    widen_bf16x32(pt + k * 32, w0, w1);
                    _mm512_storeu_ps(b + k * 32, w0);
                    _mm512_storeu_ps(b + k * 32 + 16, w1);
#else
                    for (int h = 0; h < 2; h++) {
                        __m256 lo, hi;
                        widen_half(pt + k * 32 + h * 16, lo, hi);
                        _mm256_storeu_ps(b + k * 32 + h * 8, lo);
                        _mm256_storeu_ps(b + k * 32 + 16 + h * 8, hi);
                    }
#endif
                }
            }
            for (int64_t m = m0, t = 0; t < ntiles; t++) {
                const int64_t rows = (m0 + mc - m) / (ntiles - t);   // balanced row tiles of <= max_rows
                if (widen) gemm_rows<false>(int(rows), x + m * K, K, buf.data(), K, y + m * N + nt * 32, N);
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

extern "C" int pd_linear_bf16w(const float* x, int64_t M, int64_t K, const uint16_t* p, int64_t N, float* y,
                               int64_t nt0, int64_t nt1) {
    return linear_tiles<true>(x, M, K, p, N, y, nt0, nt1);
}

// The same over float32 weights packed [N / 32][K][32] in plain column order (a float32
// checkpoint in batch-invariant mode).
extern "C" int pd_linear_f32w(const float* x, int64_t M, int64_t K, const float* p, int64_t N, float* y,
                              int64_t nt0, int64_t nt1) {
    return linear_tiles<false>(x, M, K, p, N, y, nt0, nt1);
}

// Up to how many rows pd_linear_bf16w beats oneDNN's float32 GEMM over the same weights (0: no
// vector path in this build). AVX-512: to 128 rows (half the weight bytes, 24 accumulators). AVX2:
// to 32 rows, each row tile of 4 reading the bf16 column tile straight from L1/L2 (measured on an
// AVX2-only EPYC, this model family's shapes: 2.4-9x oneDNN at 4 rows, 1.9-5x at 8, 1.1-2.2x at
// 32, 1.0-1.6x at 48; widening the tile to float32 first for several row tiles was 0.7-0.98x).
extern "C" int pd_bf16w_max_rows() {
#if defined(PD_AVX512)
    return 128;
#elif defined(PD_AVX2)
    return 32;
#else
    return 0;
#endif
}

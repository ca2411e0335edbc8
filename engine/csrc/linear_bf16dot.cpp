// y = x @ W^T with bf16 activations and bf16 weights on AVX512-BF16 (vdpbf16ps), float32
// accumulation, y float32 or rounded to bf16 as it is stored (as torch's .to(torch.bfloat16)):
// batch-invariant mode's GEMM where the compute dtype is bf16 (engine/layers/linear.py).
//
// W is packed as [N / 32][K / 2][32][2] bf16: column tile t, k pair j holds, for each of its 32
// columns, the weights of k = 2j and 2j + 1 side by side, which is vdpbf16ps's operand layout:
// one 64-byte load is 16 columns' pairs. x's pair (2j, 2j + 1) of a row is one 32-bit broadcast.
// Products of two bf16 are exact in float32; vdpbf16ps adds them to the accumulator in a fixed
// order (the pair's odd element, then its even one, each rounded to nearest, denormals flushed).
// Every output element is one chain over the k pairs in order, whatever the row tile it falls in,
// the number of rows, the row's position and the column-tile split over threads: a row's result
// does not depend on the rows beside it.
#include <vector>
#include "pd_common.h"

using namespace pd;

#if defined(PD_AVX512) && defined(__AVX512BF16__)
#define PD_BF16DOT 1

namespace {

constexpr int64_t kMaxRows = 12;                 // 24 accumulators, two weight vectors, a broadcast
// A K of more than kBlockFromPairs k pairs (Llama-3.2-1B's down projection: 4096) runs in blocks
// of kBlockPairs: a whole K's x rows would leave room in L2 for few of them per chunk, and each
// weight panel (32 columns by K, 512 KiB there) would come from memory once per 24 rows.
constexpr int64_t kBlockPairs = 1024, kBlockFromPairs = 2048;
// Bytes of x rows kept in L2 (1 MiB on a Zen 4) while every column tile passes; more for a block,
// whose weight panels (128 KiB a tile) then come from memory once per 192 rows.
constexpr int64_t kChunkBytes = int64_t(512) << 10, kChunkBytesBlocked = int64_t(768) << 10;

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// acc[m] += x[m, 0:K2 pairs] @ tile: each output one vdpbf16ps chain over the k pairs in order.
template <int MT>
inline void dot_pairs(__m512 (&acc)[MT][2], const int32_t* x, int64_t ldx, const uint16_t* w, int64_t K2) {
    for (int64_t j = 0; j < K2; j++) {
        const __m512bh w0 = as_bh(_mm512_loadu_si512(w + j * 64));
        const __m512bh w1 = as_bh(_mm512_loadu_si512(w + j * 64 + 32));
        for (int m = 0; m < MT; m++) {
            const __m512bh xb = as_bh(_mm512_set1_epi32(x[m * ldx + j]));
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xb, w0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xb, w1);
        }
    }
}

// y[0:MT, 0:32] = x[0:MT, :] @ tile; K2 = K / 2 pairs, ldx in pairs (int32 units), ldy in elements.
template <int MT, typename T>
inline void dot_tile(const int32_t* x, int64_t ldx, const uint16_t* w, int64_t K2, T* y, int64_t ldy) {
    __m512 acc[MT][2];
    for (int m = 0; m < MT; m++) { acc[m][0] = _mm512_setzero_ps(); acc[m][1] = _mm512_setzero_ps(); }
    dot_pairs<MT>(acc, x, ldx, w, K2);
    for (int m = 0; m < MT; m++) {
        store16(y + m * ldy, acc[m][0]);
        store16(y + m * ldy + 16, acc[m][1]);
    }
}

// One block of a long K: as dot_tile over the block's KB pairs (x, w at its first pair), the
// accumulators starting from a (float32, lda apart) unless first, and going back there unless
// last, when they are stored to y: every output stays one chain over the k pairs in order.
template <int MT, typename T>
inline void dot_tile_block(const int32_t* x, int64_t ldx, const uint16_t* w, int64_t KB, T* y, int64_t ldy,
                           float* a, int64_t lda, bool first, bool last) {
    __m512 acc[MT][2];
    for (int m = 0; m < MT; m++) {
        acc[m][0] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(a + m * lda);
        acc[m][1] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(a + m * lda + 16);
    }
    dot_pairs<MT>(acc, x, ldx, w, KB);
    for (int m = 0; m < MT; m++) {
        if (last) {
            store16(y + m * ldy, acc[m][0]);
            store16(y + m * ldy + 16, acc[m][1]);
        } else {
            _mm512_storeu_ps(a + m * lda, acc[m][0]);
            _mm512_storeu_ps(a + m * lda + 16, acc[m][1]);
        }
    }
}

template <typename T>
void dot_rows(int mt, const int32_t* x, int64_t ldx, const uint16_t* w, int64_t K2, T* y, int64_t ldy) {
    switch (mt) {
#define PD_TILE(n) case n: dot_tile<n, T>(x, ldx, w, K2, y, ldy); break;
        PD_TILE(1) PD_TILE(2) PD_TILE(3) PD_TILE(4) PD_TILE(5) PD_TILE(6)
        PD_TILE(7) PD_TILE(8) PD_TILE(9) PD_TILE(10) PD_TILE(11) PD_TILE(12)
#undef PD_TILE
        default: break;
    }
}

template <typename T>
void dot_rows_block(int mt, const int32_t* x, int64_t ldx, const uint16_t* w, int64_t KB, T* y, int64_t ldy,
                    float* a, int64_t lda, bool first, bool last) {
    switch (mt) {
#define PD_TILE(n) case n: dot_tile_block<n, T>(x, ldx, w, KB, y, ldy, a, lda, first, last); break;
        PD_TILE(1) PD_TILE(2) PD_TILE(3) PD_TILE(4) PD_TILE(5) PD_TILE(6)
        PD_TILE(7) PD_TILE(8) PD_TILE(9) PD_TILE(10) PD_TILE(11) PD_TILE(12)
#undef PD_TILE
        default: break;
    }
}

// Rows in chunks whose x (at one K block) stays in L2 while every column tile of [nt0, nt1)
// passes. A long K, where there is more than one row tile, runs in blocks (dot_tile_block), their
// float32 accumulators kept in a buffer between passes.
template <typename T>
void dot_tiles(const uint16_t* x, int64_t M, int64_t K, const uint16_t* p, int64_t N, T* y, int64_t nt0, int64_t nt1) {
    const int64_t K2 = K / 2;
    const int32_t* xp = reinterpret_cast<const int32_t*>(x);
    const int64_t kc = K2 > kBlockFromPairs && M > kMaxRows ? kBlockPairs : K2;
    int64_t chunk = (kc < K2 ? kChunkBytesBlocked : kChunkBytes) / (kc * 4);
    chunk = chunk < kMaxRows ? kMaxRows : chunk - chunk % kMaxRows;
    const int64_t width = (nt1 - nt0) * 32;
    static thread_local std::vector<float> acc;   // [chunk rows][width] while a chunk's blocks pass; kept for
                                                  // the thread's next call (1.5 MiB at Llama-3.2-1B's down)
    if (kc < K2 && int64_t(acc.size()) < chunk * width) acc.resize(chunk * width);
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t mc = M - m0 < chunk ? M - m0 : chunk;
        const int64_t ntiles = (mc + kMaxRows - 1) / kMaxRows;
        for (int64_t k0 = 0; k0 < K2; k0 += kc) {
            const int64_t kn = K2 - k0 < kc ? K2 - k0 : kc;
            for (int64_t nt = nt0; nt < nt1; nt++) {
                const uint16_t* pt = p + nt * K * 32 + k0 * 64;
                for (int64_t m = m0, t = 0; t < ntiles; t++) {
                    const int64_t rows = (m0 + mc - m) / (ntiles - t);   // balanced row tiles of <= kMaxRows
                    if (kc == K2)
                        dot_rows<T>(int(rows), xp + m * K2, K2, pt, K2, y + m * N + nt * 32, N);
                    else
                        dot_rows_block<T>(int(rows), xp + m * K2 + k0, K2, pt, kn, y + m * N + nt * 32, N,
                                          acc.data() + (m - m0) * width + (nt - nt0) * 32, width, k0 == 0,
                                          k0 + kn == K2);
                    m += rows;
                }
            }
        }
    }
}

}  // namespace
#endif

// Column tiles [nt0, nt1) of y[M, N] = x[M, K] @ W^T; x bf16 row-major contiguous, K even; y
// row-major, float32 (y_dtype 0) or bf16 (1).
extern "C" int pd_linear_bf16dot(const uint16_t* x, int64_t M, int64_t K, const uint16_t* p, int64_t N, void* y,
                                 int64_t nt0, int64_t nt1, int32_t y_dtype) {
#ifdef PD_BF16DOT
    if (K % 2) return 2;
    if (y_dtype == F32) dot_tiles(x, M, K, p, N, static_cast<float*>(y), nt0, nt1);
    else dot_tiles(x, M, K, p, N, static_cast<bf16*>(y), nt0, nt1);
    return 0;
#else
    return 1;
#endif
}

// Whether this build has the kernel (AVX-512 with AVX512-BF16).
extern "C" int pd_bf16dot_available() {
#ifdef PD_BF16DOT
    return 1;
#else
    return 0;
#endif
}

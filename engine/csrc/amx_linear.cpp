// y = x @ W^T (+ bias) with bf16 x, W, y and float32 accumulation on AMX tiles: tuned mode's GEMMs
// of decode steps (few rows), which are bound by streaming the weights from memory, and
// batch-invariant mode's GEMM for every row count.
//
// W is packed as [N / 64][K / 32][4][16][32] bf16: for each group of 64 output columns and each
// 32-wide slice of K, four 1 KiB B tiles (16 columns each) in VNNI order, tile[r][2c + p] =
// W[64 q + 16 j + c][32 kc + 2 r + p]. A pass over the columns therefore reads the weights
// strictly sequentially, prefetching ahead of itself.
//
// Each 16-row block of x (zero-padded) is one A tile against the B tiles of a K slice; every output
// is one tile product per K slice, in order, whatever the row count.
#include <vector>
#include "pd_common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__) && defined(PD_AVX512)
#define PD_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include "amx_tiles.h"

using namespace pd;

#ifdef PD_AMX
namespace {

inline void prefetch_range(const char* p, int64_t n) {
    for (int64_t off = 0; off < n; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
}

// cbuf [rows][ldc] float32 -> y rows [0, m) columns [n0, n0 + cols): bf16(acc) (x scale, rounded,
// for int8 weights: torch's F.linear(x, w8.to(bf16)) * scale) (+ bias, rounded).
inline void write_rows(const float* cbuf, int64_t ldc, int64_t m, int64_t cols, const bf16* scale, const bf16* bias,
                       int64_t n0, bf16* y, int64_t N) {
    for (int64_t r = 0; r < m; r++) {
        for (int64_t c = 0; c < cols; c += 16) {
            __m512 v = _mm512_loadu_ps(cbuf + r * ldc + c);
            if (scale) v = round_as16<bf16>(_mm512_mul_ps(round_as16<bf16>(v), load16(scale + n0 + c)));
            if (bias) v = _mm512_add_ps(v, load16(bias + n0 + c));
            store16(y + r * N + n0 + c, v);
        }
    }
}

// ks K slices of int8 tiles (ks * 4 tiles of 16 x 32) -> bf16 tiles (int8 values are exact in bf16).
inline void widen_group(const int8_t* src, int64_t ks, bf16* dst) {
    for (int64_t i = 0; i < ks * 4 * 512; i += 32) {
        const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(src + i)));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(w)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(w, 1)));
        _mm512_store_si512(dst + i, _mm512_inserti64x4(_mm512_castsi256_si512(cvt_bf16(lo)), cvt_bf16(hi), 1));
    }
}

// One 16-row block against a group's four B tiles per K slice (tiles 0-3 accumulate; 4 holds
// the A tile, 5-7 the B tiles): the A tile is loaded once per slice and used four times.
// Decode's few rows take this path alone; their weights stream from memory. slice(kc) runs
// before each K slice's products (see gemm).
template <typename Slice>
inline void block_1x4(const bf16* xa, int64_t lda, const bf16* wg, int64_t ks, float* cbuf, Slice& slice) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t kc = 0; kc < ks; kc++) {
        slice(kc);
        const bf16* b = wg + kc * 2048;
        _tile_loadd(4, xa + kc * 32, lda);
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, b + 512, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, b + 1024, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, b + 1536, 64);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, cbuf, 256);
    _tile_stored(1, cbuf + 16, 256);
    _tile_stored(2, cbuf + 32, 256);
    _tile_stored(3, cbuf + 48, 256);
}

// Two 16-row blocks against a group's four B tiles, two B tiles at a time: per K slice two A and
// two B tile loads feed four tile products (block_1x4 loads five tiles for four), so a prefill
// GEMM's tile unit waits less on its loads. Each output is the same products over K in the same
// order as in block_1x4: the same bits, whichever block a row falls in.
template <typename Slice>
inline void block_2x4(const bf16* xa, int64_t lda, const bf16* wg, int64_t ks, float* cbuf, Slice& slice) {
    const bf16* xb = xa + 16 * (lda / 2);
    for (int64_t jp = 0; jp < 4; jp += 2) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t kc = 0; kc < ks; kc++) {
            slice(kc);
            const bf16* b = wg + kc * 2048 + jp * 512;
            _tile_loadd(4, xa + kc * 32, lda);
            _tile_loadd(6, b, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, b + 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, xb + kc * 32, lda);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, cbuf + jp * 16, 256);
        _tile_stored(1, cbuf + jp * 16 + 16, 256);
        _tile_stored(2, cbuf + 16 * 64 + jp * 16, 256);
        _tile_stored(3, cbuf + 16 * 64 + jp * 16 + 16, 256);
    }
}

// x padded to a multiple of 16 rows (stride K): column groups [g0, g1) of 64. Per group, the first
// 16-row block runs block_1x4, then pairs of blocks block_2x4 and a last odd one block_1x4; the
// group's weights come from cache after the first pass. Int8 weights are widened slice by slice
// as the first pass reaches them. Meanwhile the next group's weights are prefetched into L2,
// spread evenly over every K slice the group's passes run.
template <typename W>
void gemm(const bf16* x, int64_t m, int64_t K, const W* w_packed, int64_t N, const bf16* scale, const bf16* bias,
          bf16* y, int64_t g0, int64_t g1) {
    alignas(64) float cbuf[32 * 64];
    const int64_t ks = K / 32, lda = K * 2;
    constexpr bool kInt8 = sizeof(W) == 1;
    thread_local std::vector<bf16> wide;   // int8 weights: the current group's tiles as bf16
    if (kInt8 && int64_t(wide.size()) < ks * 2048 + 32) wide.resize(ks * 2048 + 32);
    bf16* wide_p = kInt8 ? wide.data() + (-reinterpret_cast<intptr_t>(wide.data()) / 2 & 31) : nullptr;
    const int64_t group_bytes = ks * 2048 * int64_t(sizeof(W)), mblocks = (m + 15) / 16;
    const int64_t chunk = (2048 * int64_t(sizeof(W)) / mblocks + 63) / 64 * 64;   // next-group bytes per K slice run
    for (int64_t g = g0; g < g1; g++) {
        const W* wsrc = w_packed + g * ks * 2048;
        const char* next = g + 1 < g1 ? reinterpret_cast<const char*>(wsrc) + group_bytes : nullptr;
        const bf16* wg = kInt8 ? wide_p : reinterpret_cast<const bf16*>(wsrc);
        int64_t runs = 0, widened = 0;
        auto slice = [&](int64_t kc) {
            if constexpr (kInt8) {
                if (kc == widened) {
                    widen_group(reinterpret_cast<const int8_t*>(wsrc) + kc * 2048, 1, wide_p + kc * 2048);
                    widened++;
                }
            }
            if (next) {
                const int64_t off = runs * chunk;
                if (off < group_bytes) prefetch_range(next + off, off + chunk <= group_bytes ? chunk : group_bytes - off);
            }
            runs++;
        };
        // The first block streams the group's weights from memory in order (all four tiles of a
        // K slice at once); the passes after it find them in cache.
        for (int64_t r0 = 0; r0 < m; r0 += r0 == 0 ? 16 : 32) {
            const bf16* xa = x + r0 * K;
            if (r0 > 0 && m - r0 > 16) block_2x4(xa, lda, wg, ks, cbuf, slice);
            else block_1x4(xa, lda, wg, ks, cbuf, slice);
            const int64_t rows = r0 == 0 || m - r0 <= 16 ? (m - r0 < 16 ? m - r0 : 16) : (m - r0 < 32 ? m - r0 : 32);
            write_rows(cbuf, 64, rows, 64, scale, bias, g * 64, y + r0 * N, N);
        }
    }
}

}  // namespace
#endif

extern "C" {

// 1 where AMX bf16 kernels are compiled in and the OS lets this process use the tiles.
int pd_amx_init() {
#ifdef PD_AMX
    // Linux: ask for the AMX tile state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : 0;
#else
    return 0;
#endif
}

// x [M, K] bf16 contiguous; packed as above ([N / 64] groups) in bf16, or in int8 when scale (bf16
// [N], per output column) is given; y [M, N] bf16; bias [N] bf16 or null. Computes column groups
// [g0, g1). Requires K % 32 == 0, N % 64 == 0.
int pd_amx_linear_q(const void* x, int64_t M, int64_t K, const void* packed, int64_t N, const void* scale,
                    const void* bias, void* y, int64_t g0, int64_t g1) {
#ifdef PD_AMX
    static const bool granted = pd_amx_init() == 1;   // once per process
    if (!granted || K % 32 || N % 64) return 1;
    const bf16* xa = static_cast<const bf16*>(x);
    const int64_t mpad = (M + 15) / 16 * 16;
    thread_local std::vector<bf16> pad;
    if (mpad != M) {   // zero rows up to a whole tile, so tile loads never read past x
        pad.assign(mpad * K, 0);
        std::memcpy(pad.data(), xa, sizeof(bf16) * M * K);
        xa = pad.data();
    }
    configure_tiles();
    if (scale)
        gemm<int8_t>(xa, M, K, static_cast<const int8_t*>(packed), N, static_cast<const bf16*>(scale),
                     static_cast<const bf16*>(bias), static_cast<bf16*>(y), g0, g1);
    else
        gemm<bf16>(xa, M, K, static_cast<const bf16*>(packed), N, nullptr, static_cast<const bf16*>(bias),
                   static_cast<bf16*>(y), g0, g1);
    _tile_release();
    return 0;
#else
    return 1;
#endif
}

int pd_amx_linear(const void* x, int64_t M, int64_t K, const void* packed, int64_t N, const void* bias, void* y,
                  int64_t g0, int64_t g1) {
    return pd_amx_linear_q(x, M, K, packed, N, nullptr, bias, y, g0, g1);
}

}  // extern "C"

// Token sampling for rows without top-k / top-p filtering, with the semantics of
// engine/layers/sampler.py: greedy rows take the first maximal logit; the others invert the CDF
// of softmax(logits / T) (float32 probabilities in token-id order): the token is the first whose
// cumulative probability, summed in float64, exceeds u * total, u drawn by the caller.
#include <vector>
#include "pd_common.h"

using namespace pd;

namespace {

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
    int64_t best = 0;
    float bv = to_f32(x[0]);
    for (int64_t i = 1; i < n; i++) {
        const float v = to_f32(x[i]);
        if (v > bv || (bv != bv && v == v)) { bv = v; best = i; }
    }
    return best;
}

// p[i] = softmax(x / temp)[i] in float32 (x - max, exp, times 1 / sum, as torch's softmax).
template <typename T>
void softmax_row(const T* x, int64_t n, float temp, float* p) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        p[i] = to_f32(x[i]) / temp;
        m = p[i] > m ? p[i] : m;
    }
    float sum = 0.f;
    int64_t i = 0;
#ifdef PD_AVX512
    __m512 vs = _mm512_setzero_ps();
    const __m512 vm = _mm512_set1_ps(m);
    for (; i + 16 <= n; i += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + i), vm));
        _mm512_storeu_ps(p + i, e);
        vs = _mm512_add_ps(vs, e);
    }
    sum = _mm512_reduce_add_ps(vs);
#endif
    for (; i < n; i++) { p[i] = std::exp(p[i] - m); sum += p[i]; }
    const float inv = 1.f / sum;
    for (i = 0; i < n; i++) p[i] *= inv;
}

// First index whose float64 running sum of p exceeds u * total (clamped to n - 1).
int64_t invert_cdf(const float* p, int64_t n, double u) {
    constexpr int64_t C = 64;
    const int64_t nchunks = (n + C - 1) / C;
    std::vector<double> chunk(nchunks);
    double total = 0.0;
    for (int64_t c = 0; c < nchunks; c++) {
        double s = 0.0;
        const int64_t end = (c + 1) * C < n ? (c + 1) * C : n;
        for (int64_t i = c * C; i < end; i++) s += double(p[i]);
        chunk[c] = s;
        total += s;
    }
    const double target = u * total;
    double acc = 0.0;
    for (int64_t c = 0; c < nchunks; c++) {
        if (acc + chunk[c] > target) {
            const int64_t end = (c + 1) * C < n ? (c + 1) * C : n;
            for (int64_t i = c * C; i < end; i++) {
                acc += double(p[i]);
                if (acc > target) return i;
            }
            break;   // rounding: the chunk's sum crossed, its elements one by one did not
        }
        acc += chunk[c];
    }
    for (int64_t i = n - 1; i > 0; i--)   // past the end (u * total at the very top): last nonzero
        if (p[i] > 0.f) return i;
    return 0;
}

}  // namespace

extern "C" {

// logits [rows, vocab] (float32 or bf16, row stride ld elements); temps[r] == 0: greedy;
// u[r]: the row's uniform draw in [0, 1); out[r]: the token.
int pd_sample(const void* logits, int64_t ld, int64_t rows, int64_t vocab, const float* temps, const double* u,
              int64_t* out, int dtype) {
    std::vector<float> p(vocab);
    for (int64_t r = 0; r < rows; r++) {
        if (dtype == BF16) {
            const bf16* x = static_cast<const bf16*>(logits) + r * ld;
            if (temps[r] == 0.f) { out[r] = argmax_row(x, vocab); continue; }
            softmax_row(x, vocab, temps[r], p.data());
        } else {
            const float* x = static_cast<const float*>(logits) + r * ld;
            if (temps[r] == 0.f) { out[r] = argmax_row(x, vocab); continue; }
            softmax_row(x, vocab, temps[r], p.data());
        }
        out[r] = invert_cdf(p.data(), vocab, u[r]);
    }
    return 0;
}

}  // extern "C"

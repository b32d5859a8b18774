// f32_linear: a float32 linear layer; at one row (decode at batch 1) on a kernel of our own, each
// output channel's dot product summed in one fixed order; at more rows on the library the engine
// chose for float32 (oneDNN's kernel, or MKL's through at::linear).
//
// Why: at one row a matrix times a vector is a stream of weights, each used once, and the step
// waits for memory. The libraries' one-row kernels did not stream at the memory's speed: on a
// Zen 5 (2026-12-06, 2 threads, the default model's 120 layer matrices and its output layer,
// 538 MB in huge pages) oneDNN, its channels split over the threads, took 12.9 ms a pass where
// summing the same matrices took 8.0 and this kernel 7.4 (docs/performance.md, nineteenth
// session). Earlier neither library kept the second core busy at one row; this one splits the
// channels over the threads.
//
// The order of the sums, on every build (AVX-512, AVX2, or portable C++): 16 lanes, lane j
// summing the products of inputs j, j + 16, j + 32, ... one fused multiply-add at a time (inputs
// past the end count as 0 x 0); then lanes j and j + 8, then j and j + 4, j and j + 2, and the
// last two; then the bias. A channel's number depends only on its row of weights and the input:
// not on the thread count, nor on which channels run beside it (tests/test_f32_rows.py).
// At one row the numbers are therefore ours, not the library's: as before, one row and several
// differ (oneDNN's own one-row kernel also summed in another order than its matmul at 2-256 rows,
// which all agree).
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernels.h"

namespace {

constexpr int64_t LANES = 16;
constexpr int64_t CHANNELS_AT_ONCE = 4;  // rows of weights read side by side
constexpr int64_t PREFETCH_BYTES = 8192;  // ahead of the last of those rows
constexpr int64_t MIN_CHANNELS_PER_THREAD = 64;  // below this one thread costs less than two

// mkldnn::_linear_pointwise(Tensor X, Tensor W, Tensor? B, str attr, Scalar?[] scalars,
// str? algorithm): what engine/kernels/float32_linear.py `onednn_linear` calls.
using OnednnLinear = at::Tensor(const at::Tensor&, const at::Tensor&,
                                const std::optional<at::Tensor>&, c10::string_view,
                                c10::List<std::optional<at::Scalar>>,
                                std::optional<c10::string_view>);

at::Tensor library_linear(const at::Tensor& x, const at::Tensor& w,
                          const std::optional<at::Tensor>& bias, bool onednn) {
  if (!onednn) return at::linear(x, w, bias);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<OnednnLinear>();
  return op.call(x, w, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

inline float with_bias(float sum, const float* bias, int64_t c) {
  return bias != nullptr ? sum + bias[c] : sum;
}

#if defined(__AVX512F__) || defined(__AVX2__)
// Lanes 0-7 of the 16 partial sums in `lo`, 8-15 in `hi`: the fixed tree above.
inline float reduce_16(__m256 lo, __m256 hi) {
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#endif

#if defined(__AVX512F__)
inline float reduce_16(__m512 v) {
  return reduce_16(_mm512_castps512_ps256(v),
                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// Channels c .. c + R - 1, their rows of weights read side by side.
template <int R>
void channels(const float* w, int64_t k, const float* x, const float* bias, float* y, int64_t c) {
  const int64_t full = k / LANES * LANES;
  const __mmask16 tail = static_cast<__mmask16>((1u << (k - full)) - 1);
  const float* row = w + c * k;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < full; i += LANES) {
    _mm_prefetch(reinterpret_cast<const char*>(row + (R - 1) * k + i) + PREFETCH_BYTES,
                 _MM_HINT_T0);
    const __m512 xv = _mm512_loadu_ps(x + i);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(row + r * k + i), xv, acc[r]);
  }
  if (tail != 0) {
    const __m512 xv = _mm512_maskz_loadu_ps(tail, x + full);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, row + r * k + full), xv, acc[r]);
  }
  for (int r = 0; r < R; ++r) y[c + r] = with_bias(reduce_16(acc[r]), bias, c + r);
}
#elif defined(__AVX2__) && defined(__FMA__)
// As above with each channel's 16 lanes in two vectors of 8.
template <int R>
void channels(const float* w, int64_t k, const float* x, const float* bias, float* y, int64_t c) {
  const int64_t full = k / LANES * LANES;
  alignas(32) int32_t mask_bits[LANES];
  for (int64_t j = 0; j < LANES; ++j) mask_bits[j] = full + j < k ? -1 : 0;
  const __m256i mask_lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(mask_bits));
  const __m256i mask_hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(mask_bits + 8));
  const float* row = w + c * k;
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < full; i += LANES) {
    _mm_prefetch(reinterpret_cast<const char*>(row + (R - 1) * k + i) + PREFETCH_BYTES,
                 _MM_HINT_T0);
    const __m256 x_lo = _mm256_loadu_ps(x + i), x_hi = _mm256_loadu_ps(x + i + 8);
    for (int r = 0; r < R; ++r) {
      lo[r] = _mm256_fmadd_ps(_mm256_loadu_ps(row + r * k + i), x_lo, lo[r]);
      hi[r] = _mm256_fmadd_ps(_mm256_loadu_ps(row + r * k + i + 8), x_hi, hi[r]);
    }
  }
  if (full < k) {
    const __m256 x_lo = _mm256_maskload_ps(x + full, mask_lo);
    const __m256 x_hi = _mm256_maskload_ps(x + full + 8, mask_hi);
    for (int r = 0; r < R; ++r) {
      lo[r] = _mm256_fmadd_ps(_mm256_maskload_ps(row + r * k + full, mask_lo), x_lo, lo[r]);
      hi[r] = _mm256_fmadd_ps(_mm256_maskload_ps(row + r * k + full + 8, mask_hi), x_hi, hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[c + r] = with_bias(reduce_16(lo[r], hi[r]), bias, c + r);
}
#else
// Any CPU: the same sums, one lane at a time.
template <int R>
void channels(const float* w, int64_t k, const float* x, const float* bias, float* y, int64_t c) {
  for (int r = 0; r < R; ++r) {
    const float* row = w + (c + r) * k;
    float acc[LANES] = {};
    for (int64_t i = 0; i < k; i += LANES)
      for (int64_t j = 0; j < LANES; ++j)
        acc[j] = i + j < k ? std::fma(row[i + j], x[i + j], acc[j]) : std::fma(0.f, 0.f, acc[j]);
    float s8[8], s4[4];
    for (int j = 0; j < 8; ++j) s8[j] = acc[j] + acc[j + 8];
    for (int j = 0; j < 4; ++j) s4[j] = s8[j] + s8[j + 4];
    const float s2_0 = s4[0] + s4[2], s2_1 = s4[1] + s4[3];
    y[c + r] = with_bias(s2_0 + s2_1, bias, c + r);
  }
}
#endif

}  // namespace

void f32_rows_part(const float* w, int64_t k, const float* x, const float* bias, float* y,
                   int64_t c0, int64_t c1) {
  int64_t c = c0;
  for (; c + CHANNELS_AT_ONCE <= c1; c += CHANNELS_AT_ONCE)
    channels<CHANNELS_AT_ONCE>(w, k, x, bias, y, c);
  for (; c < c1; ++c) channels<1>(w, k, x, bias, y, c);
}

torch::Tensor f32_linear(const torch::Tensor& x, const torch::Tensor& w,
                         const std::optional<torch::Tensor>& bias, bool onednn) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32 &&
                  x.device().is_cpu() && w.device().is_cpu(),
              "f32_linear: float32 on the CPU only");
  TORCH_CHECK(w.dim() == 2 && x.dim() >= 1 && x.size(-1) == w.size(1),
              "f32_linear: x [..., in] and w [out, in]");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == w.size(0) &&
                        bias->scalar_type() == torch::kFloat32),
              "f32_linear: bias [out], float32");
  if (x.dim() != 2 || x.size(0) != 1 || !w.is_contiguous())
    return library_linear(x, w, bias, onednn);
  const int64_t n = w.size(0), k = w.size(1);
  const torch::Tensor row = x.contiguous();
  const torch::Tensor b = bias ? bias->contiguous() : torch::Tensor();
  auto out = at::empty({1, n}, x.options());
  const float *w_at = w.data_ptr<float>(), *x_at = row.data_ptr<float>();
  const float* bias_at = bias ? b.data_ptr<float>() : nullptr;
  float* y = out.data_ptr<float>();
  at::parallel_for(0, n, MIN_CHANNELS_PER_THREAD, [&](int64_t c0, int64_t c1) {
    f32_rows_part(w_at, k, x_at, bias_at, y, c0, c1);
  });
  return out;
}

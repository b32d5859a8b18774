// f32_linear: a float32 linear layer; at up to F32_MAX_ROWS (8) rows of activations, a decode
// step's, on a kernel of our own, each output summed in one stated order; at more rows (a
// prefill chunk) on the library the engine chose for float32 (oneDNN's kernel, or MKL's through
// at::linear).
//
// Why: at a few rows a matrix product is a stream of weights, each used a few times, and the
// step waits for memory. The libraries' kernels did not stream at the memory's speed there: on a
// Zen 5 (2026-12-06, 2 threads, the default model's 120 layer matrices and its output layer,
// 538 MB in huge pages) oneDNN took 12.9 ms at one row (its channels split over the threads)
// where summing the same matrices took 8.0 and this kernel 7.4; at 2-8 rows oneDNN's matmul was
// slower still and this kernel 1.3-2x faster than it (docs/performance.md, nineteenth session).
//
// Each thread takes a range of output channels, 4 at a time, each multiplied by up to 4 rows of
// activations at once (5-8 rows on AVX-512 in one pass of chunks: group_in_one_pass; elsewhere
// more rows go again, the weights then in L1). It reads them from a copy of the weights packed
// at load (f32_pack): for each 16 inputs, the 4 channels' 16 weights one after the other, so
// that 4 channels side by side are one stream of bytes front to back, which the hardware's
// prefetch follows. Reading 4 rows of the [out, in] matrix side by side, as this kernel
// did until 2026-12-06, is 4 streams 2.3-6 KB apart; on a Zen 4 VM that took 1.9x the time of
// summing the weights at one row, one thread (32.2 against 16.9 ms over 538 MB), and packed it
// took the sum's time (16.5); at 4 rows 24.2 ms against 44.9 (docs/performance.md, twenty-first
// session; docs/scripts/f32_layouts.cpp). The matrix itself stays for the library's rows.
// The order of the sums, on every build (AVX-512, AVX2, or portable C++): 16 lanes, lane j
// summing the products of inputs j, j + 16, j + 32, ... one fused multiply-add at a time (inputs
// past the end count as 0 x 0); then lanes j and j + 8, then j and j + 4, j and j + 2, and the
// last two; then the bias. An output depends only on its row of weights and its row of
// activations: not on the thread count, the channels beside it, or the other rows of the step
// (tests/test_f32_rows.py). So a request's numbers are the same in any step of up to 8 rows; at
// more rows they are the library's, which sums in another order (as the libraries' own one-row
// and several-row kernels did: oneDNN's differed between 1 and 2 rows, MKL's between 3 and 4).
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernels.h"

namespace {

constexpr int64_t LANES = 16;
constexpr int64_t CHANNELS_AT_ONCE = F32_PACKED_CHANNELS;  // channels packed together
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
// The vector as it is, in a register. GCC otherwise folds loads into the multiply-adds, one load
// for each product (4 channels by 4 rows of activations: 20 loads for 16 multiply-adds instead of
// 8), and the load units, not the multiply-adds, set the pace.
template <typename Vector>
inline Vector in_register(Vector v) {
  __asm__("" : "+v"(v));
  return v;
}

// Lanes 0-7 of the 16 partial sums in `lo`, 8-15 in `hi`: the fixed tree above.
inline float reduce_16(__m256 lo, __m256 hi) {
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#endif

#if defined(__AVX512F__)
constexpr int64_t ROWS_AT_ONCE = 4;  // activation rows whose sums stay in registers together
constexpr int64_t ONE_PASS_MIN = 5;  // rows; at 4 the chunks cost 0-7 % more than they gave

inline float reduce_16(__m512 v) {
  return reduce_16(_mm512_castps512_ps256(v),
                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// Channels c .. c + R - 1 for the M rows of activations at x (each k long), into y (rows n long):
// `p`, their packed weights (R 16-weight pieces for each 16 inputs), each multiplied by every row
// of x.
template <int R, int M>
void channels(const float* p, int64_t k, const float* x, const float* bias, float* y, int64_t n,
              int64_t c) {
  const int64_t full = k / LANES * LANES;
  const __mmask16 tail = static_cast<__mmask16>((1u << (k - full)) - 1);
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < M; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < full; i += LANES, p += R * LANES) {
    __m512 xv[M];
    for (int j = 0; j < M; ++j) xv[j] = in_register(_mm512_loadu_ps(x + j * k + i));
    for (int r = 0; r < R; ++r) {
      const __m512 wv = in_register(_mm512_loadu_ps(p + r * LANES));
      for (int j = 0; j < M; ++j) acc[r][j] = _mm512_fmadd_ps(wv, xv[j], acc[r][j]);
    }
  }
  if (tail != 0) {  // the packed weights past the end are zeros
    __m512 xv[M];
    for (int j = 0; j < M; ++j) xv[j] = _mm512_maskz_loadu_ps(tail, x + j * k + full);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_loadu_ps(p + r * LANES);
      for (int j = 0; j < M; ++j) acc[r][j] = _mm512_fmadd_ps(wv, xv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < M; ++j) y[j * n + c + r] = with_bias(reduce_16(acc[r][j]), bias, c + r);
}

// 5-8 rows: the sums of 4 channels by 8 rows do not fit in the registers, and two passes over a
// group of channels (the second from L1) left the memory idle during the second: at 8 rows, one
// thread, a Zen 4 VM took 50 ms over the 538 MB where one pass of 4 rows took 25 and the sum 17.
// So one pass, front to back: the group's weights a chunk of CHUNK_PIECES x 16 inputs at a time,
// rows 0-3 then rows 4-7 on the chunk (in L1), their sums kept in `sums` between chunks, and the
// first set asks for the weights PREFETCH_BYTES ahead into L2: 31 ms at 8 rows, 26 at 6 (45
// before; docs/performance.md, twenty-second session). The same multiply-adds in the same order.
constexpr int64_t CHUNK_PIECES = 8;
constexpr int64_t PREFETCH_BYTES = 16384;

// Rows x (M of them) times pieces p0 .. p1 of a group of 4 packed channels `g`, into `sums`.
template <int M>
void chunk_of_rows(const float* g, int64_t p0, int64_t p1, int64_t k, const float* x,
                   __m512 (&sums)[4][4], bool prefetch) {
  const int64_t full = k / LANES;
  const __mmask16 tail = static_cast<__mmask16>((1u << (k - full * LANES)) - 1);
  __m512 acc[4][M];
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < M; ++j) acc[r][j] = sums[r][j];
  for (int64_t piece = p0; piece < p1; ++piece) {
    const float* w = g + piece * 4 * LANES;
    if (prefetch)
      for (int r = 0; r < 4; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + r * LANES) + PREFETCH_BYTES, _MM_HINT_T1);
    const int64_t i = piece * LANES;
    __m512 xv[M];
    for (int j = 0; j < M; ++j)
      xv[j] = in_register(piece < full ? _mm512_loadu_ps(x + j * k + i)
                                       : _mm512_maskz_loadu_ps(tail, x + j * k + i));
    for (int r = 0; r < 4; ++r) {
      const __m512 wv = in_register(_mm512_loadu_ps(w + r * LANES));
      for (int j = 0; j < M; ++j) acc[r][j] = _mm512_fmadd_ps(wv, xv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < M; ++j) sums[r][j] = acc[r][j];
}

void chunk_of_last_rows(const float* g, int64_t p0, int64_t p1, int64_t k, const float* x,
                        int64_t m, __m512 (&sums)[4][4]) {
  switch (m) {
    case 4: chunk_of_rows<4>(g, p0, p1, k, x, sums, false); break;
    case 3: chunk_of_rows<3>(g, p0, p1, k, x, sums, false); break;
    case 2: chunk_of_rows<2>(g, p0, p1, k, x, sums, false); break;
    default: chunk_of_rows<1>(g, p0, p1, k, x, sums, false); break;
  }
}

// Channels c .. c + 3 (packed at g) for 5-8 rows of x, in one pass (above).
void group_in_one_pass(const float* g, int64_t k, const float* x, int64_t m, const float* bias,
                       float* y, int64_t n, int64_t c) {
  __m512 sums[2][4][4];
  for (auto& set : sums)
    for (auto& channel : set)
      for (auto& v : channel) v = _mm512_setzero_ps();
  const int64_t pieces = (k + LANES - 1) / LANES;
  for (int64_t p0 = 0; p0 < pieces; p0 += CHUNK_PIECES) {
    const int64_t p1 = std::min(pieces, p0 + CHUNK_PIECES);
    chunk_of_rows<4>(g, p0, p1, k, x, sums[0], true);
    if (m > 4) chunk_of_last_rows(g, p0, p1, k, x + 4 * k, m - 4, sums[1]);
  }
  for (int64_t j = 0; j < m; ++j)
    for (int r = 0; r < 4; ++r)
      y[j * n + c + r] = with_bias(reduce_16(sums[j / 4][r][j % 4]), bias, c + r);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t ROWS_AT_ONCE = 1;  // 16 registers: a channel's 16 lanes take two

// As above with each channel's 16 lanes in two vectors of 8, one row of activations at a time.
template <int R, int M>
void channels(const float* p, int64_t k, const float* x, const float* bias, float* y, int64_t n,
              int64_t c) {
  static_assert(M == 1, "AVX2: one row of activations at a time");
  (void)n;
  const int64_t full = k / LANES * LANES;
  alignas(32) int32_t mask_bits[LANES];
  for (int64_t j = 0; j < LANES; ++j) mask_bits[j] = full + j < k ? -1 : 0;
  const __m256i mask_lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(mask_bits));
  const __m256i mask_hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(mask_bits + 8));
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  const auto add = [&](__m256 x_lo, __m256 x_hi) {
    for (int r = 0; r < R; ++r) {
      lo[r] = _mm256_fmadd_ps(in_register(_mm256_loadu_ps(p + r * LANES)), x_lo, lo[r]);
      hi[r] = _mm256_fmadd_ps(in_register(_mm256_loadu_ps(p + r * LANES + 8)), x_hi, hi[r]);
    }
    p += R * LANES;
  };
  for (int64_t i = 0; i < full; i += LANES)
    add(in_register(_mm256_loadu_ps(x + i)), in_register(_mm256_loadu_ps(x + i + 8)));
  if (full < k)  // the packed weights past the end are zeros
    add(_mm256_maskload_ps(x + full, mask_lo), _mm256_maskload_ps(x + full + 8, mask_hi));
  for (int r = 0; r < R; ++r) y[c + r] = with_bias(reduce_16(lo[r], hi[r]), bias, c + r);
}
#else
constexpr int64_t ROWS_AT_ONCE = 1;

// Any CPU: the same sums, one lane at a time.
template <int R, int M>
void channels(const float* p, int64_t k, const float* x, const float* bias, float* y, int64_t n,
              int64_t c) {
  static_assert(M == 1, "portable: one row of activations at a time");
  (void)n;
  for (int r = 0; r < R; ++r) {
    float acc[LANES] = {};
    for (int64_t i = 0; i < k; i += LANES) {
      const float* piece = p + i * R + r * LANES;  // this channel's 16 weights for inputs i ..
      for (int64_t j = 0; j < LANES; ++j)
        acc[j] = std::fma(piece[j], i + j < k ? x[i + j] : 0.f, acc[j]);
    }
    float s8[8], s4[4];
    for (int j = 0; j < 8; ++j) s8[j] = acc[j] + acc[j + 8];
    for (int j = 0; j < 4; ++j) s4[j] = s8[j] + s8[j + 4];
    const float s2_0 = s4[0] + s4[2], s2_1 = s4[1] + s4[3];
    y[c + r] = with_bias(s2_0 + s2_1, bias, c + r);
  }
}
#endif

// Channels c .. c + R - 1 (packed at p) for every row of x: 5-8 rows of a group of 4 in one pass
// on AVX-512, else ROWS_AT_ONCE rows at a time (their packed weights, 9-25 KB for SmolLM2, stay
// in the core's L1 cache between those passes).
template <int R>
void channels_all_rows(const float* p, int64_t k, const float* x, int64_t m, const float* bias,
                       float* y, int64_t n, int64_t c) {
#if defined(__AVX512F__)
  if (R == 4 && m >= ONE_PASS_MIN) return group_in_one_pass(p, k, x, m, bias, y, n, c);
#endif
  for (int64_t r0 = 0; r0 < m; r0 += ROWS_AT_ONCE) {
    const float* xr = x + r0 * k;
    float* yr = y + r0 * n;
    switch (std::min(ROWS_AT_ONCE, m - r0)) {
#if defined(__AVX512F__)
      case 4: channels<R, 4>(p, k, xr, bias, yr, n, c); break;
      case 3: channels<R, 3>(p, k, xr, bias, yr, n, c); break;
      case 2: channels<R, 2>(p, k, xr, bias, yr, n, c); break;
#endif
      default: channels<R, 1>(p, k, xr, bias, yr, n, c); break;
    }
  }
}

// y [m, n] = x [m, k] @ W^T (+ bias) on our kernel, W packed (f32_pack) at `packed`.
torch::Tensor rows_on_our_kernel(const torch::Tensor& x, const float* packed, int64_t n, int64_t k,
                                 const std::optional<torch::Tensor>& bias) {
  const int64_t m = x.size(0);
  const torch::Tensor rows = x.contiguous();
  const torch::Tensor b = bias ? bias->contiguous() : torch::Tensor();
  auto out = at::empty({m, n}, x.options());
  const float* x_at = rows.data_ptr<float>();
  const float* bias_at = bias ? b.data_ptr<float>() : nullptr;
  float* y = out.data_ptr<float>();
  const int64_t units = (n + CHANNELS_AT_ONCE - 1) / CHANNELS_AT_ONCE;  // of packed channels
  at::parallel_for(0, units, MIN_CHANNELS_PER_THREAD / CHANNELS_AT_ONCE, [&](int64_t u0, int64_t u1) {
    f32_rows_part(packed, k, x_at, m, bias_at, y, n, u0 * CHANNELS_AT_ONCE,
                  std::min(n, u1 * CHANNELS_AT_ONCE));
  });
  return out;
}

void check_linear(const torch::Tensor& x, const torch::Tensor& w,
                  const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32 &&
                  x.device().is_cpu() && w.device().is_cpu(),
              "f32_linear: float32 on the CPU only");
  TORCH_CHECK(w.dim() == 2 && x.dim() >= 1 && x.size(-1) == w.size(1),
              "f32_linear: x [..., in] and w [out, in]");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == w.size(0) &&
                        bias->scalar_type() == torch::kFloat32 && bias->device().is_cpu()),
              "f32_linear: bias [out], float32 on the CPU");
}

// Rows of activations that go to our kernel: a decode step's few, as a matrix [rows, in]; and a
// weight in rows (one that is not, a transposed view, stays with the library).
bool on_our_kernel(const torch::Tensor& x, const torch::Tensor& w) {
  return x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= F32_MAX_ROWS && w.is_contiguous();
}

}  // namespace

int64_t f32_packed_width(int64_t k) { return (k + LANES - 1) / LANES * LANES; }

void f32_pack(const torch::Tensor& w, torch::Tensor& packed) {
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.dim() == 2 && w.is_cpu() &&
                  w.is_contiguous(),
              "f32_pack: a contiguous float32 matrix [out, in] on the CPU");
  const int64_t n = w.size(0), k = w.size(1), width = f32_packed_width(k);
  TORCH_CHECK(packed.scalar_type() == torch::kFloat32 && packed.is_cpu() &&
                  packed.is_contiguous() && packed.dim() == 2 && packed.size(0) == n &&
                  packed.size(1) == width,
              "f32_pack: packed is a contiguous float32 [out, in rounded up to 16]");
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  const int64_t grouped = n / CHANNELS_AT_ONCE * CHANNELS_AT_ONCE;
  at::parallel_for(0, n, MIN_CHANNELS_PER_THREAD, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t first = c < grouped ? c / CHANNELS_AT_ONCE * CHANNELS_AT_ONCE : c;
      const int64_t together = c < grouped ? CHANNELS_AT_ONCE : 1;
      float* out = dst + first * width + (c - first) * LANES;
      for (int64_t i = 0; i < width; ++i)
        out[i / LANES * together * LANES + i % LANES] = i < k ? src[c * k + i] : 0.f;
    }
  });
}

void f32_rows_part(const float* packed, int64_t k, const float* x, int64_t m, const float* bias,
                   float* y, int64_t n, int64_t c0, int64_t c1) {
  const int64_t width = f32_packed_width(k);
  const int64_t grouped = n / CHANNELS_AT_ONCE * CHANNELS_AT_ONCE;
  int64_t c = c0;
  for (; c + CHANNELS_AT_ONCE <= std::min(c1, grouped); c += CHANNELS_AT_ONCE)
    channels_all_rows<CHANNELS_AT_ONCE>(packed + c * width, k, x, m, bias, y, n, c);
  for (; c < c1; ++c) channels_all_rows<1>(packed + c * width, k, x, m, bias, y, n, c);
}

torch::Tensor f32_packed_linear(const torch::Tensor& x, const torch::Tensor& w,
                                const torch::Tensor& packed,
                                const std::optional<torch::Tensor>& bias, bool onednn) {
  check_linear(x, w, bias);
  if (!on_our_kernel(x, w)) return library_linear(x, w, bias, onednn);
  return rows_on_our_kernel(x, packed.data_ptr<float>(), w.size(0), w.size(1), bias);
}

torch::Tensor f32_linear(const torch::Tensor& x, const torch::Tensor& w,
                         const std::optional<torch::Tensor>& bias, bool onednn) {
  check_linear(x, w, bias);
  if (!on_our_kernel(x, w)) return library_linear(x, w, bias, onednn);
  auto packed = at::empty({w.size(0), f32_packed_width(w.size(1))}, w.options());
  f32_pack(w, packed);
  return rows_on_our_kernel(x, packed.data_ptr<float>(), w.size(0), w.size(1), bias);
}

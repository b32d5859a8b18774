// Activations rounded to int8 in blocks of 32, as llama.cpp's Q8_1 rounds them (the torch
// reference: engine/kernels/quant.py `round_activations_q8`), and the float sums that follow the
// integer dot products. Shared by the row-layout kernels (q8_rows.cpp) and the tiled ones
// (q8_tiles.cpp): both round alike and sum alike, so repacking a model into tiles changes no
// number (tests/test_kernels_tiles.py checks them bit for bit).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace q8 {

constexpr int64_t BLOCK = 32;          // activation values per int8 block
constexpr int64_t TILE_CHANNELS = 16;  // output channels per tile (q8_tiles.cpp)

// v's storage, at least n long: a thread's scratch kept from call to call only grows (resizing a
// vector down and up again would fill it with zeros each time).
template <typename T>
inline T* grow_to(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

// x (k floats, k a multiple of 32) -> xq, d[k / 32], dsum[k / 32] = d * sum(xq) of each block,
// and, where qsum is given, qsum[k / 32] = sum(xq) itself: per block d = max |x| / 127 and
// xq = round(x / d) to nearest, ties to even (0 where d is 0). The AVX-512 loop computes the
// same IEEE quotients and rounds them the same way, so both branches give identical bytes.
inline void quantize_row(const float* x, int64_t k, int8_t* xq, float* d, float* dsum,
                         int32_t* qsum = nullptr) {
  for (int64_t b = 0; b < k / BLOCK; ++b) {
    const float* v = x + b * BLOCK;
    int8_t* out = xq + b * BLOCK;
#if defined(__AVX512F__)
    const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float scale = amax / 127.f;
    int32_t total = 0;
    if (scale > 0.f) {
      const __m512 s = _mm512_set1_ps(scale), lim = _mm512_set1_ps(127.f);
      auto to_int = [&](__m512 a) {
        const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(a, s), _MM_FROUND_TO_NEAREST_INT |
                                                                       _MM_FROUND_NO_EXC);
        return _mm512_cvtps_epi32(_mm512_min_ps(lim, _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), lim), r)));
      };
      const __m512i q0 = to_int(v0), q1 = to_int(v1);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtepi32_epi8(q1));
      total = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    } else {
      std::fill(out, out + BLOCK, int8_t{0});
    }
#else
    float amax = 0.f;
    for (int64_t i = 0; i < BLOCK; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float scale = amax / 127.f;
    int32_t total = 0;
    for (int64_t i = 0; i < BLOCK; ++i) {
      const float r = scale > 0.f ? std::nearbyint(v[i] / scale) : 0.f;  // to nearest, ties even
      const int32_t q = static_cast<int32_t>(std::min(127.f, std::max(-127.f, r)));
      out[i] = static_cast<int8_t>(q);
      total += q;
    }
#endif
    d[b] = scale;
    dsum[b] = scale * static_cast<float>(total);
    if (qsum) qsum[b] = total;
  }
}

// Rounded rows as the kernels read them: m rows of k int8 values, `groups` = k / 32 block scales
// (d), d * sum(xq) (dsum) and sum(xq) (qsum) per row.
struct RoundedView {
  int64_t m, k, groups;
  const int8_t* xq;
  const float* d;
  const float* dsum;
  const int32_t* qsum;
};

// The activation rows rounded to int8 blocks, with what each kind of kernel needs of them.
struct RoundedRows {
  int64_t m, k, groups;
  std::vector<int8_t> xq;     // [m, k]
  std::vector<float> d;       // [m, groups] block scales
  std::vector<float> dsum;    // [m, groups] d * sum(xq) of each block
  std::vector<int32_t> qsum;  // [m, groups] sum(xq) of each block (the int8 tiles' offset term)

  RoundedRows(const torch::Tensor& x, int64_t groups_)
      : m(x.size(0)), k(x.size(1)), groups(groups_), xq(m * k), d(m * groups), dsum(m * groups),
        qsum(m * groups) {
    const float* xp = x.data_ptr<float>();
    at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        quantize_row(xp + r * k, k, xq.data() + r * k, d.data() + r * groups,
                     dsum.data() + r * groups, qsum.data() + r * groups);
    });
  }

  RoundedView view() const { return {m, k, groups, xq.data(), d.data(), dsum.data(), qsum.data()}; }
};

// The same rounding into buffers one thread keeps from call to call (a member of the layer
// stack's team, fused_blocks.cpp, rounds the rows it multiplies itself: no allocation, no other
// thread). The buffers only grow.
struct RoundingBuffer {
  std::vector<int8_t> xq;
  std::vector<float> d, dsum;
  std::vector<int32_t> qsum;

  RoundedView round(const float* x, int64_t m, int64_t k) {
    const int64_t groups = k / BLOCK;
    int8_t* q = grow_to(xq, m * k);
    float* scale = grow_to(d, m * groups);
    float* scale_sum = grow_to(dsum, m * groups);
    int32_t* sum = grow_to(qsum, m * groups);
    for (int64_t r = 0; r < m; ++r)
      quantize_row(x + r * k, k, q + r * k, scale + r * groups, scale_sum + r * groups,
                   sum + r * groups);
    return {m, k, groups, q, scale, scale_sum, sum};
  }
};

// One output channel's float sums, in the one order every kernel here keeps: the groups in order,
// each with one fused multiply-add into a float that starts at zero, dot_g being the exact
// integer dot product of group g (the weights' integers times xq):
//   int4 (Q4_1): acc = fma(dot_g, scale_g * d_g, acc), acc_min = fma(min_g, dsum_g, acc_min);
//                y = acc + acc_min, + bias where there is one
//   int8:        acc = fma(dot_g, d_g, acc); y = fma(acc, scale, bias or 0)
// A vector kernel keeps one channel per lane, so its lanes run exactly these operations; the
// scalar code (a remainder, a CPU without vector code) calls std::fma, one rounding whether or not
// the compiler would have fused a plain a * b + c.
struct Int4Sum {
  float acc = 0.f, acc_min = 0.f;
  void add(int32_t dot, float scale, float min, float d, float dsum) {
    acc = std::fma(static_cast<float>(dot), scale * d, acc);
    acc_min = std::fma(min, dsum, acc_min);
  }
  float value(const float* bias) const { return bias ? (acc + acc_min) + *bias : acc + acc_min; }
};

struct Int8Sum {
  float acc = 0.f;
  void add(int32_t dot, float d) { acc = std::fma(static_cast<float>(dot), d, acc); }
  float value(float scale, const float* bias) const {
    return std::fma(acc, scale, bias ? *bias : 0.f);
  }
};

inline void check_x(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), name,
              ": x must be a contiguous float32 [M, K]");
}

// An int4 weight's scales and minimums, [n, groups]: float32 (engine/kernels/quant.py
// quantize_int4) or float16 (a GGUF's Q4_1 blocks).
inline void check_int4_scales(const torch::Tensor& scales, const torch::Tensor& mins, int64_t n,
                              int64_t groups, const char* name) {
  const bool f32 = scales.dtype() == torch::kFloat32, f16 = scales.dtype() == torch::kFloat16;
  TORCH_CHECK((f32 || f16) && mins.dtype() == scales.dtype() && scales.is_contiguous() &&
                  mins.is_contiguous(),
              name, ": scales and mins must be contiguous, both float32 or both float16");
  TORCH_CHECK(scales.numel() == n * groups && mins.numel() == n * groups, name,
              ": one scale and one min per group of every output channel");
}

inline void check_bias(const c10::optional<torch::Tensor>& bias, int64_t n, const char* name) {
  TORCH_CHECK(!bias.has_value() || (bias->dtype() == torch::kFloat32 && bias->is_contiguous() &&
                                    bias->numel() == n),
              name, ": bias must be contiguous float32 [N]");
}

}  // namespace q8

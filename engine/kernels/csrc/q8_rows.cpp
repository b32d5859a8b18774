// Weights in their file's row order times activations rounded to int8 blocks (q8.h): a GGUF's
// Q4_1 matrices (int4_q8_linear: packed [n, k / 2], float16 or float32 scales and minimums
// [n, k / 32]) and the "gguf" output layer (int8_q8_linear: qweight [n, k] int8, scales [n]).
// They run where no vector kernel reads tiles (q8_tiles.cpp `q8_tile_formats`), and they give
// the tiled kernels' numbers bit for bit: the same exact integer dot product for each channel and
// group, then the same float sums in the same order (q8::Int4Sum, q8::Int8Sum). So the load-time
// repack into tiles changes no logit and no greedy token.
//
// A vector holds 8 channels, one per lane, as a tile's vector holds 16. Channel c's 32 products
// of a group are summed in integers inside its own register (8 partial sums, one instruction with
// VNNI), then eight such registers fold into one whose lane c is channel c's whole dot product
// (integer additions: exact in any order), and the float multiply-adds run on 8 channels at once,
// group after group. Folding costs about one instruction per channel and group, which a kernel
// that kept partial float sums per lane (and added them across lanes at the end) did not pay; in
// exchange its sums, and so its logits, differed from the tiles' in the last bits.
//
//   int4: y[c] = sum_g scale[c, g] * d[g] * (q_c,g . xq_g) + min[c, g] * d[g] * sum(xq_g)
//   int8: y[c] = scale[c] * sum_g d[g] * (q_c,g . xq_g)

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "q8.h"

namespace {

constexpr int64_t LANES = 8;  // output channels per vector
constexpr int64_t STACK_GROUPS = 128;  // k <= 4096: a block's scales fit on the stack

inline float to_float(float v) { return v; }
inline float to_float(at::Half v) { return static_cast<float>(v); }

// Channel c's dot product with group g of the rounded row, one weight at a time (a remainder
// channel, or a CPU without AVX2).
inline int32_t int4_dot(const uint8_t* bytes, const int8_t* x) {
  int32_t dot = 0;
  for (int e = 0; e < 16; ++e) dot += (bytes[e] & 0x0F) * x[e] + (bytes[e] >> 4) * x[e + 16];
  return dot;
}

inline int32_t int8_dot(const int8_t* w, const int8_t* x) {
  int32_t dot = 0;
  for (int e = 0; e < 32; ++e) dot += w[e] * x[e];
  return dot;
}

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool VECTOR = true;

// Lane c: the sum of v[c]'s 8 lanes. Two rounds of pairwise sums leave `first` = [v0..v3 | v0..v3]
// and `second` = [v4..v7 | v4..v7], each the sums of a register's low and high 128-bit half; the
// halves are then added.
inline __m256i fold(const __m256i* v) {
  const __m256i a = _mm256_hadd_epi32(v[0], v[1]), b = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i c = _mm256_hadd_epi32(v[4], v[5]), e = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i first = _mm256_hadd_epi32(a, b), second = _mm256_hadd_epi32(c, e);
  return _mm256_add_epi32(_mm256_permute2x128_si256(first, second, 0x20),
                          _mm256_permute2x128_si256(first, second, 0x31));
}

// 8 partial sums of one group's 32 nibble x int8 products (16 bytes: element e in the low nibble
// of byte e, element e + 16 in its high one; x the group's 32 activation bytes in order).
inline __m256i int4_partials(const uint8_t* bytes, __m256i x) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low4),
                                     _mm_and_si128(b, low4));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else  // pairs to 16 bits (2 * 15 * 127 cannot saturate), then pairs of those to 32
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

// 8 partial sums of one group's 32 int8 x int8 products, widened to 16 bits (x_lo, x_hi: the
// group's activations 0-15 and 16-31, widened once for all channels).
inline __m256i int8_partials(const int8_t* w, __m256i x_lo, __m256i x_hi) {
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i lo = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)), x_lo);
  const __m256i hi = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1)), x_hi);
  return _mm256_add_epi32(lo, hi);
}

inline __m256i widen16(const int8_t* p) {  // 16 int8 -> 16 int16
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// y[0..7] of one rounded row against channels whose rows start at w, row_bytes apart; scales and
// mins: [groups][8] floats, the block's values group by group (one load per group).
void int4_block(const uint8_t* w, int64_t row_bytes, const float* scales, const float* mins,
                const int8_t* xq, const float* d, const float* dsum, int64_t groups,
                const float* bias, float* y) {
  __m256 acc = _mm256_setzero_ps(), acc_min = _mm256_setzero_ps();
  __m256i partial[LANES];
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + g * q8::BLOCK));
#pragma GCC unroll 8
    for (int64_t c = 0; c < LANES; ++c)
      partial[c] = int4_partials(w + c * row_bytes + g * 16, x);
    const __m256 dots = _mm256_cvtepi32_ps(fold(partial));
    const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(scales + g * LANES), _mm256_set1_ps(d[g]));
    acc = _mm256_fmadd_ps(dots, scale, acc);
    acc_min = _mm256_fmadd_ps(_mm256_loadu_ps(mins + g * LANES), _mm256_set1_ps(dsum[g]), acc_min);
  }
  __m256 out = _mm256_add_ps(acc, acc_min);  // the order of q8::Int4Sum
  if (bias) out = _mm256_add_ps(out, _mm256_loadu_ps(bias));
  _mm256_storeu_ps(y, out);
}

// y[0..7] of one rounded row against int8 channels whose rows start at w, k apart.
void int8_block(const int8_t* w, int64_t k, const float* scales, const int8_t* xq, const float* d,
                int64_t groups, const float* bias, float* y) {
  __m256 acc = _mm256_setzero_ps();
  __m256i partial[LANES];
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* x = xq + g * q8::BLOCK;
    const __m256i x_lo = widen16(x), x_hi = widen16(x + 16);
#pragma GCC unroll 8
    for (int64_t c = 0; c < LANES; ++c)
      partial[c] = int8_partials(w + c * k + g * q8::BLOCK, x_lo, x_hi);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold(partial)), _mm256_set1_ps(d[g]), acc);
  }
  const __m256 b = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  _mm256_storeu_ps(y, _mm256_fmadd_ps(acc, _mm256_loadu_ps(scales), b));  // q8::Int8Sum's order
}
#else
constexpr bool VECTOR = false;
#endif

// y [m, n], the output channels in blocks of 8: a whole block in vector code where the build has
// it (block(c0, y): channels c0 .. c0 + 7 of every row), else one channel at a time with the same
// operations, lane by lane (channel(c, r)). The blocks are split among the threads in contiguous
// ranges (one row: each thread one stream of weights), and a block serves every row while its
// weights are in cache.
template <typename Block, typename Channel>
torch::Tensor for_each_block(const q8::RoundedRows& a, int64_t n, const torch::Tensor& x,
                             const Block& block, const Channel& channel) {
  auto y = torch::empty({a.m, n}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (n + LANES - 1) / LANES, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t c0 = b0 * LANES; c0 < std::min(n, b1 * LANES); c0 += LANES) {
      const int64_t c1 = std::min(n, c0 + LANES);
      if (VECTOR && c1 - c0 == LANES) {
        block(c0, yp);
        continue;
      }
      for (int64_t r = 0; r < a.m; ++r)
        for (int64_t c = c0; c < c1; ++c) yp[r * n + c] = channel(c, r);
    }
  });
  return y;
}

template <typename S>
torch::Tensor int4_q8_rows(const torch::Tensor& x, const torch::Tensor& packed,
                           const torch::Tensor& scales, const torch::Tensor& mins,
                           const c10::optional<torch::Tensor>& bias) {
  const int64_t k = x.size(1), n = packed.size(0), groups = k / q8::BLOCK, row_bytes = k / 2;
  const q8::RoundedRows a(x, groups);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const S* sp = scales.data_ptr<S>();
  const S* mp = mins.data_ptr<S>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto channel = [&](int64_t c, int64_t r) {
    q8::Int4Sum total;
    const int8_t* xq = a.xq.data() + r * k;
    for (int64_t g = 0; g < groups; ++g)
      total.add(int4_dot(wp + c * row_bytes + g * 16, xq + g * q8::BLOCK),
                to_float(sp[c * groups + g]), to_float(mp[c * groups + g]),
                a.d[r * groups + g], a.dsum[r * groups + g]);
    return total.value(bp ? bp + c : nullptr);
  };
  auto block = [&](int64_t c0, float* y) {
#if defined(__AVX2__) && defined(__FMA__)
    alignas(32) float on_stack[2 * LANES * STACK_GROUPS];
    std::vector<float> on_heap(groups > STACK_GROUPS ? 2 * LANES * groups : 0);
    float* block_scales = groups > STACK_GROUPS ? on_heap.data() : on_stack;
    float* block_mins = block_scales + LANES * groups;
    for (int64_t c = 0; c < LANES; ++c)  // [channel][group] -> [group][channel], as floats
      for (int64_t g = 0; g < groups; ++g) {
        block_scales[g * LANES + c] = to_float(sp[(c0 + c) * groups + g]);
        block_mins[g * LANES + c] = to_float(mp[(c0 + c) * groups + g]);
      }
    for (int64_t r = 0; r < a.m; ++r)
      int4_block(wp + c0 * row_bytes, row_bytes, block_scales, block_mins, a.xq.data() + r * k,
                 a.d.data() + r * groups, a.dsum.data() + r * groups, groups,
                 bp ? bp + c0 : nullptr, y + r * n + c0);
#else
    (void)c0, (void)y;
#endif
  };
  return for_each_block(a, n, x, block, channel);
}

}  // namespace

// x [m, k] float32 times Q4_1 rows: packed [n, k / 2] uint8, scales and mins [n, k / 32], both
// float16 (a GGUF's) or both float32 -> y [m, n] float32.
torch::Tensor int4_q8_linear(const torch::Tensor& x, const torch::Tensor& packed,
                             const torch::Tensor& scales, const torch::Tensor& mins,
                             int64_t group_size, const c10::optional<torch::Tensor>& bias) {
  const char* name = "int4_q8_linear";
  q8::check_x(x, name);
  const int64_t k = x.size(1), n = packed.size(0);
  TORCH_CHECK(group_size == q8::BLOCK && k % q8::BLOCK == 0, name,
              ": groups of 32 weights (a GGUF's Q4_1 blocks) only");
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(1) * 2 == k,
              name, ": packed must be contiguous uint8 [N, K / 2]");
  q8::check_int4_scales(scales, mins, n, k / q8::BLOCK, name);
  q8::check_bias(bias, n, name);
  if (scales.dtype() == torch::kFloat16)
    return int4_q8_rows<at::Half>(x, packed, scales, mins, bias);
  return int4_q8_rows<float>(x, packed, scales, mins, bias);
}

// x [m, k] float32 times int8 rows: qweight [n, k] int8, scales [n] float32 -> y [m, n] float32.
torch::Tensor int8_q8_linear(const torch::Tensor& x, const torch::Tensor& qweight,
                             const torch::Tensor& scales,
                             const c10::optional<torch::Tensor>& bias) {
  const char* name = "int8_q8_linear";
  q8::check_x(x, name);
  const int64_t k = x.size(1), n = qweight.size(0), groups = k / q8::BLOCK;
  TORCH_CHECK(k % q8::BLOCK == 0, name, ": the input size must be a multiple of 32");
  TORCH_CHECK(qweight.dtype() == torch::kInt8 && qweight.dim() == 2 && qweight.is_contiguous() &&
                  qweight.size(1) == k,
              name, ": qweight must be contiguous int8 [N, K]");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == n,
              name, ": scales must be contiguous float32 [N]");
  q8::check_bias(bias, n, name);
  const q8::RoundedRows a(x, groups);
  const int8_t* wp = qweight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto channel = [&](int64_t c, int64_t r) {
    q8::Int8Sum total;
    const int8_t* xq = a.xq.data() + r * k;
    for (int64_t g = 0; g < groups; ++g)
      total.add(int8_dot(wp + c * k + g * q8::BLOCK, xq + g * q8::BLOCK), a.d[r * groups + g]);
    return total.value(sp[c], bp ? bp + c : nullptr);
  };
  auto block = [&](int64_t c0, float* y) {
#if defined(__AVX2__) && defined(__FMA__)
    for (int64_t r = 0; r < a.m; ++r)
      int8_block(wp + c0 * k, k, sp + c0, a.xq.data() + r * k, a.d.data() + r * groups, groups,
                 bp ? bp + c0 : nullptr, y + r * n + c0);
#else
    (void)c0, (void)y;
#endif
  };
  return for_each_block(a, n, x, block, channel);
}

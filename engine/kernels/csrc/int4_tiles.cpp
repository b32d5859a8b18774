// A GGUF's Q4_1 weights repacked at load into tiles of 16 output channels, times activations
// rounded to int8 in blocks of 32 (llama.cpp's Q8_1): the layout llama.cpp's repacked CPU
// kernels read, written for our format. The torch reference and the repacking itself are in
// engine/kernels/quant.py (`Int4TiledWeight`, `tile_int4_q8`); tests/test_kernels_tiles.py
// checks both against each other.
//
// Layout: tiles[t, g] is one 320-byte record for output channels 16t .. 16t + 15 and input
// group g (32 weights):
//   bytes   0..255: four chunks of 64 bytes; chunk i holds, for each channel c in order, the 4
//                   bytes 4i .. 4i + 3 of that channel's 16-byte Q4_1 block (low nibbles: weights
//                   4i .. 4i + 3, high nibbles: weights 16 + 4i .. 16 + 4i + 3);
//   bytes 256..287: the 16 channels' float16 scales d;
//   bytes 288..319: their float16 minimums m.
// So a 512-bit load takes one chunk of all 16 channels, and each 32-bit lane of the vector is
// one channel: VNNI's vpdpbusd multiplies the lane's 4 unsigned nibbles by 4 int8 activations
// (broadcast to every lane) and adds them into that channel's sum. The lanes never need to be
// summed across, the scales of 16 channels are one vector, and a thread reads one stream of
// bytes front to back. The row layout (cpu_kernels.cpp int4_q8_linear) walks 8 separate rows,
// unpacks one channel per instruction and ends every channel with a sum across 16 lanes.
//
//   y[c] = sum_g d_w[c, g] * d_x[g] * (q_c,g . xq_g) + m[c, g] * d_x[g] * sum(xq_g)

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "q8.h"

namespace {

constexpr int64_t CHANNELS = 16;  // output channels per tile
constexpr int64_t RECORD = 320;   // bytes per (tile, group): 256 of nibbles, 32 of d, 32 of m
constexpr int64_t ROW_BLOCK = 4;  // activation rows that share one unpacked record
constexpr int64_t ROWS_PER_ITEM = 64;  // several rows: a work item is a tile x 64 rows
constexpr int64_t PREFETCH_AHEAD = 8 * RECORD;  // bytes ahead of the record being read

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
constexpr bool VECTOR_KERNEL = true;

inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// y[r * ldy + c] (c < 16) for R activation rows against one tile (its records for all groups).
// xq: R rows of k int8 values, k apart; d, dsum: R rows of `groups` floats, `groups` apart.
template <int R>
void tile_rows(const uint8_t* rec, int64_t groups, const int8_t* xq, int64_t k, const float* d,
               const float* dsum, const float* bias, float* y, int64_t ldy) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R], acc_min[R];
  for (int r = 0; r < R; ++r) acc[r] = acc_min[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, rec += RECORD) {
    for (int64_t b = 0; b < RECORD; b += 64) _mm_prefetch(reinterpret_cast<const char*>(rec + PREFETCH_AHEAD + b), _MM_HINT_T0);
    __m512i lo[4], hi[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m512i w = _mm512_loadu_si512(rec + 64 * i);
      lo[i] = _mm512_and_si512(w, low4);
      hi[i] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
    }
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 256)));
    const __m512 mins = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 288)));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq + r * k + g * q8::BLOCK;
      __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        a = _mm512_dpbusd_epi32(a, lo[i], _mm512_set1_epi32(four_bytes(x + 4 * i)));
        b = _mm512_dpbusd_epi32(b, hi[i], _mm512_set1_epi32(four_bytes(x + 16 + 4 * i)));
      }
      const __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(a, b));
      acc[r] = _mm512_fmadd_ps(dots, _mm512_mul_ps(scale, _mm512_set1_ps(d[r * groups + g])), acc[r]);
      acc_min[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(dsum[r * groups + g]), acc_min[r]);
    }
  }
  const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r)
    _mm512_storeu_ps(y + r * ldy, _mm512_add_ps(_mm512_add_ps(acc[r], acc_min[r]), b));
}
#else
constexpr bool VECTOR_KERNEL = false;

inline float half_to_float(const uint8_t* p) {
  at::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// The same sums, one channel and one product at a time (any CPU; slower, same integers).
template <int R>
void tile_rows(const uint8_t* rec, int64_t groups, const int8_t* xq, int64_t k, const float* d,
               const float* dsum, const float* bias, float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < CHANNELS; ++c) {
      float total = 0.f, min_total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* p = rec + g * RECORD;
        const int8_t* x = xq + r * k + g * q8::BLOCK;
        int32_t sum = 0;
        for (int i = 0; i < 4; ++i)
          for (int e = 0; e < 4; ++e) {
            const uint8_t byte = p[64 * i + 4 * c + e];
            sum += (byte & 0x0F) * x[4 * i + e] + (byte >> 4) * x[16 + 4 * i + e];
          }
        total += half_to_float(p + 256 + 2 * c) * d[r * groups + g] * static_cast<float>(sum);
        min_total += half_to_float(p + 288 + 2 * c) * dsum[r * groups + g];
      }
      y[r * ldy + c] = total + min_total + (bias ? bias[c] : 0.f);
    }
}
#endif

// rows r0 .. r1 of y against tile t, ROW_BLOCK rows at a time
void tile_row_range(const uint8_t* tiles, int64_t t, int64_t groups, int64_t r0, int64_t r1,
                    const int8_t* xq, int64_t k, const float* d, const float* dsum,
                    const float* bias, float* y, int64_t n) {
  const uint8_t* rec = tiles + t * groups * RECORD;
  const float* b = bias ? bias + t * CHANNELS : nullptr;
  for (int64_t r = r0; r < r1; r += ROW_BLOCK) {
    const int8_t* x = xq + r * k;
    const float* dr = d + r * groups;
    const float* sr = dsum + r * groups;
    float* out = y + r * n + t * CHANNELS;
    switch (std::min(ROW_BLOCK, r1 - r)) {
      case 4: tile_rows<4>(rec, groups, x, k, dr, sr, b, out, n); break;
      case 3: tile_rows<3>(rec, groups, x, k, dr, sr, b, out, n); break;
      case 2: tile_rows<2>(rec, groups, x, k, dr, sr, b, out, n); break;
      default: tile_rows<1>(rec, groups, x, k, dr, sr, b, out, n); break;
    }
  }
}

}  // namespace

bool int4_tiles_vectorized() { return VECTOR_KERNEL; }

// x [m, k] float32, tiles [n / 16, k / 32, 320] uint8 (the layout above) -> y [m, n] float32.
torch::Tensor int4_q8_tiled_linear(const torch::Tensor& x, const torch::Tensor& tiles,
                                   const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "int4_q8_tiled_linear: x must be a contiguous float32 [M, K]");
  TORCH_CHECK(tiles.dtype() == torch::kUInt8 && tiles.dim() == 3 && tiles.is_contiguous() &&
                  tiles.size(2) == RECORD,
              "int4_q8_tiled_linear: tiles must be contiguous uint8 [N / 16, K / 32, 320]");
  const int64_t m = x.size(0), k = x.size(1), groups = tiles.size(1);
  const int64_t n_tiles = tiles.size(0), n = n_tiles * CHANNELS;
  TORCH_CHECK(k == groups * q8::BLOCK, "int4_q8_tiled_linear: x has ", k, " columns, tiles ",
              groups, " groups of 32");
  TORCH_CHECK(!bias.has_value() || (bias->dtype() == torch::kFloat32 && bias->is_contiguous() &&
                                    bias->numel() == n),
              "int4_q8_tiled_linear: bias must be contiguous float32 [N]");
  std::vector<int8_t> xq(m * k);
  std::vector<float> d(m * groups), dsum(m * groups);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      q8::quantize_row(xp + r * k, k, xq.data() + r * k, d.data() + r * groups,
                       dsum.data() + r * groups);
  });
  auto y = torch::empty({m, n}, x.options());
  const uint8_t* tp = tiles.data_ptr<uint8_t>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // Work items: (block of up to 64 rows, tile), blocks outermost, so that the threads share one
  // block of rounded rows in cache while they walk the tiles. One row (a decode step at batch 1):
  // each thread takes one contiguous range of tiles, a single stream of records.
  const int64_t row_items = (m + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
  at::parallel_for(0, row_items * n_tiles, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r0 = (i / n_tiles) * ROWS_PER_ITEM, t = i % n_tiles;
      tile_row_range(tp, t, groups, r0, std::min(m, r0 + ROWS_PER_ITEM), xq.data(), k, d.data(),
                     dsum.data(), bp, yp, n);
    }
  });
  return y;
}

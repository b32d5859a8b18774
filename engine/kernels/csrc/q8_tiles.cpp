// Quantized weights repacked at load into tiles of 16 output channels, times activations rounded
// to int8 in blocks of 32 (llama.cpp's Q8_1), as llama.cpp's repacked CPU kernels read theirs:
// a GGUF's Q4_1 layers (int4_q8_tiled_linear) and the int8 output layer (int8_q8_tiled_linear),
// in AVX-512 VNNI or, on a CPU without it, AVX2.
// The torch reference and the repacking itself are in engine/kernels/quant.py
// (`Int4TiledWeight`, `Int8TiledWeight`); tests/test_kernels_tiles.py checks both against each
// other.
//
// Q4_1 layout: tiles[t, g] is one 320-byte record for output channels 16t .. 16t + 15 and input
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
// bytes front to back. The row layout (q8_rows.cpp) walks 8 separate rows and folds each
// channel's partial sums across lanes for every group; both then sum in q8.h's order, so the two
// layouts give the same numbers bit for bit.
//
// Software prefetch in the AVX2 code only. With AVX-512 a thread's tiles are one stream of bytes
// that the hardware's prefetch follows: asking for each record's 5 (int8: 8) cache lines 8
// records ahead added as many instructions to the load units as the loads themselves, and on a
// Zen 4 VM without it a 4-bit decode step's layers took 0.91-0.94x the time (docs/performance.md,
// twentieth session). With AVX2 and no VNNI a record takes twice the instructions, and the
// hardware's prefetch alone left the int4 tiles at 0.72-0.85 of what a plain read gets from
// memory; asked for 8 records ahead they stream at 0.86-0.98 of it (a Zen 3 VM, twenty-ninth
// session).
//
//   y[c] = sum_g d_w[c, g] * d_x[g] * (q_c,g . xq_g) + m[c, g] * d_x[g] * sum(xq_g)
//
// int8 layout (one scale per output channel): tiles[t, g] is 512 bytes, eight chunks of 64; chunk
// i holds, for each channel, its weights 4i .. 4i + 3 of group g, each stored as q + 128 (an
// unsigned byte, as vpdpbusd wants its first operand); the kernel takes 128 * sum(xq_g) off again.
//   y[c] = scale[c] * sum_g d_x[g] * ((q_c,g + 128) . xq_g - 128 * sum(xq_g))

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "q8.h"

namespace {

constexpr int64_t CHANNELS = q8::TILE_CHANNELS;
constexpr int64_t RECORD = 320;   // bytes per (tile, group): 256 of nibbles, 32 of d, 32 of m
constexpr int64_t RECORD8 = 512;  // int8 tiles: bytes per (tile, group), 16 channels x 32 bytes
constexpr int64_t ROW_BLOCK = 4;  // activation rows that share one unpacked record
constexpr int64_t ROWS_PER_ITEM = 64;  // several rows: a work item is a tile x 64 rows

inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline float half_to_float(const uint8_t* p) {
  at::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// The sums one channel and one product at a time: any CPU (slower; the same integers).
template <int R>
void tile_rows_portable(const uint8_t* rec, int64_t groups, const int8_t* xq, int64_t k, const float* d,
               const float* dsum, const float* bias, float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < CHANNELS; ++c) {
      q8::Int4Sum total;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* p = rec + g * RECORD;
        const int8_t* x = xq + r * k + g * q8::BLOCK;
        int32_t dot = 0;
        for (int i = 0; i < 4; ++i)
          for (int e = 0; e < 4; ++e) {
            const uint8_t byte = p[64 * i + 4 * c + e];
            dot += (byte & 0x0F) * x[4 * i + e] + (byte >> 4) * x[16 + 4 * i + e];
          }
        total.add(dot, half_to_float(p + 256 + 2 * c), half_to_float(p + 288 + 2 * c),
                  d[r * groups + g], dsum[r * groups + g]);
      }
      y[r * ldy + c] = total.value(bias ? bias + c : nullptr);
    }
}

template <int R>
void tile_rows_int8_portable(const uint8_t* rec, int64_t groups, const int8_t* xq, int64_t k,
                    const float* d, const int32_t* qsum, const float* scales, const float* bias,
                    float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < CHANNELS; ++c) {
      q8::Int8Sum total;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* p = rec + g * RECORD8;
        const int8_t* x = xq + r * k + g * q8::BLOCK;
        int32_t dot = -128 * qsum[r * groups + g];
        for (int i = 0; i < 8; ++i)
          for (int e = 0; e < 4; ++e) dot += p[64 * i + 4 * c + e] * x[4 * i + e];
        total.add(dot, d[r * groups + g]);
      }
      y[r * ldy + c] = total.value(scales[c], bias ? bias + c : nullptr);
    }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
constexpr bool INT4_VECTOR = true, INT8_VECTOR = true;

// y[r * ldy + c] (c < 16) for R activation rows against one tile (its records for all groups).
// xq: R rows of k int8 values, k apart; d, dsum: R rows of `groups` floats, `groups` apart.
template <int R>
void tile_rows(const uint8_t* rec, int64_t groups, const int8_t* xq, int64_t k, const float* d,
               const float* dsum, const float* bias, float* y, int64_t ldy) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R], acc_min[R];
  for (int r = 0; r < R; ++r) acc[r] = acc_min[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, rec += RECORD) {
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
  for (int r = 0; r < R; ++r) {
    __m512 out = _mm512_add_ps(acc[r], acc_min[r]);  // the order of q8::Int4Sum
    if (bias) out = _mm512_add_ps(out, _mm512_loadu_ps(bias));
    _mm512_storeu_ps(y + r * ldy, out);
  }
}

// The same for int8 tiles (the output layer): 8 chunks of 4 bytes per channel, stored as q + 128
// so that vpdpbusd can take them as unsigned; the 128 * sum(xq) it adds is taken off per block.
// scales: the 16 channels' one scale each, applied once at the end.
template <int R>
void tile_rows_int8(const uint8_t* rec, int64_t groups, const int8_t* xq, int64_t k,
                    const float* d, const int32_t* qsum, const float* scales, const float* bias,
                    float* y, int64_t ldy) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, rec += RECORD8) {
    __m512i w[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) w[i] = _mm512_loadu_si512(rec + 64 * i);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq + r * k + g * q8::BLOCK;
      __m512i a = _mm512_set1_epi32(-128 * qsum[r * groups + g]), b = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int i = 0; i < 8; i += 2) {
        a = _mm512_dpbusd_epi32(a, w[i], _mm512_set1_epi32(four_bytes(x + 4 * i)));
        b = _mm512_dpbusd_epi32(b, w[i + 1], _mm512_set1_epi32(four_bytes(x + 4 * i + 4)));
      }
      const __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(a, b));
      acc[r] = _mm512_fmadd_ps(dots, _mm512_set1_ps(d[r * groups + g]), acc[r]);
    }
  }
  const __m512 s = _mm512_loadu_ps(scales);
  const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, _mm512_fmadd_ps(acc[r], s, b));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr bool INT4_VECTOR = true, INT8_VECTOR = true;

// One record's 16 channels (two vectors of 8 lanes) against one group's 32 activations: each
// 32-bit lane sums its channel's 32 products of a 4-bit weight and an int8 activation. AVX-VNNI
// multiplies four byte pairs into a lane in one instruction. Plain AVX2 multiplies pairs into 16
// bits (vpmaddubsw: 2 * 15 * 128 cannot saturate) and adds the group's eight such vectors in 16
// bits before widening to 32 once (8 * 2 * 15 * 128 = 30,720 < 32,767): 9 multiplies a half
// instead of 16, the products the same integers. Int8 tiles take another way below.
inline void record_sums(const uint8_t* rec, const int8_t* x, __m256i a[2]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
#if defined(__AVXVNNI__)
  a[0] = a[1] = _mm256_setzero_si256();
#else
  __m256i pairs[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
#endif
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m256i xl = _mm256_set1_epi32(four_bytes(x + 4 * i));
    const __m256i xh = _mm256_set1_epi32(four_bytes(x + 16 + 4 * i));
    for (int h = 0; h < 2; ++h) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * i + 32 * h));
      const __m256i lo = _mm256_and_si256(w, low4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
#if defined(__AVXVNNI__)
      a[h] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(a[h], lo, xl), hi, xh);
#else
      pairs[h] = _mm256_add_epi16(pairs[h], _mm256_maddubs_epi16(lo, xl));
      pairs[h] = _mm256_add_epi16(pairs[h], _mm256_maddubs_epi16(hi, xh));
#endif
    }
  }
#if !defined(__AVXVNNI__)
  for (int h = 0; h < 2; ++h) a[h] = _mm256_madd_epi16(pairs[h], _mm256_set1_epi16(1));
#endif
}

// Asks for the record `AHEAD` records past `rec` (`bytes` long), as non-temporal: a step reads
// each weight once, and the lines it fetched so need not push the step's other data (the team's
// rows, the Python around the forward) out of the outer caches. Against the L2 hint, ten
// alternations of a batch-1 gguf decode on the Zen 3 VM: median step 4.35 -> 4.22 ms, the time
// outside the forward 0.43 -> 0.39 ms; a small gain in this VM's noise, but no loss (docs/
// performance.md, twenty-ninth session).
constexpr int64_t AHEAD = 8;
inline void fetch_ahead(const uint8_t* rec, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    __builtin_prefetch(rec + AHEAD * bytes + line, /*rw=*/0, /*locality: non-temporal=*/0);
}

// The int4 tile in 256-bit vectors: each chunk's 64 bytes are two halves of 8 channels. Sixteen
// registers do not hold four rows' accumulators and the unpacked chunks, so rows go one at a time
// (the tile's records, 6-15 KB, stay in L1 for the next row).
template <int R>
void tile_rows(const uint8_t* rec0, int64_t groups, const int8_t* xq, int64_t k, const float* d,
               const float* dsum, const float* bias, float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 acc_min[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const uint8_t* rec = rec0;
    for (int64_t g = 0; g < groups; ++g, rec += RECORD) {
      if (r == 0) fetch_ahead(rec, RECORD);  // the later rows find the tile in L1
      __m256i a[2];
      record_sums(rec, xq + r * k + g * q8::BLOCK, a);
      const __m256 dg = _mm256_set1_ps(d[r * groups + g]), sg = _mm256_set1_ps(dsum[r * groups + g]);
      for (int h = 0; h < 2; ++h) {
        const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 256 + 16 * h)));
        const __m256 mins = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 288 + 16 * h)));
        acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[h]), _mm256_mul_ps(scale, dg), acc[h]);
        acc_min[h] = _mm256_fmadd_ps(mins, sg, acc_min[h]);
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256 out = _mm256_add_ps(acc[h], acc_min[h]);
      if (bias) out = _mm256_add_ps(out, _mm256_loadu_ps(bias + 8 * h));
      _mm256_storeu_ps(y + r * ldy + 8 * h, out);
    }
  }
}

// The int8 tile in 256-bit vectors, two halves of 8 channels per chunk, rows one at a time as
// above. A stored byte is q + 128, and (q + 128) * x summed in pairs would saturate 16 bits
// (2 * 255 * 127), so the byte is turned back into q (xor 0x80) and multiplied as llama.cpp's
// AVX2 kernels do: |q| (unsigned) by x with q's sign, whose pairs fit (2 * 128 * 127 < 32767).
// The products are then exact, q . x itself: no 128 * sum(xq) to take off (qsum is unused).
template <int R>
void tile_rows_int8(const uint8_t* rec0, int64_t groups, const int8_t* xq, int64_t k,
                    const float* d, const int32_t*, const float* scales, const float* bias,
                    float* y, int64_t ldy) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const uint8_t* rec = rec0;
    for (int64_t g = 0; g < groups; ++g, rec += RECORD8) {
      if (r == 0) fetch_ahead(rec, RECORD8);
      const int8_t* x = xq + r * k + g * q8::BLOCK;
      __m256i a[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const __m256i xi = _mm256_set1_epi32(four_bytes(x + 4 * i));
        for (int h = 0; h < 2; ++h) {
          const __m256i q = _mm256_xor_si256(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * i + 32 * h)), flip);
          const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xi, q));
          a[h] = _mm256_add_epi32(a[h], _mm256_madd_epi16(pairs, ones));
        }
      }
      const __m256 dg = _mm256_set1_ps(d[r * groups + g]);
      for (int h = 0; h < 2; ++h) acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[h]), dg, acc[h]);
    }
    for (int h = 0; h < 2; ++h) {  // q8::Int8Sum's order: the scale last, with the bias
      const __m256 b = bias ? _mm256_loadu_ps(bias + 8 * h) : _mm256_setzero_ps();
      _mm256_storeu_ps(y + r * ldy + 8 * h,
                       _mm256_fmadd_ps(acc[h], _mm256_loadu_ps(scales + 8 * h), b));
    }
  }
}
#else
constexpr bool INT4_VECTOR = false, INT8_VECTOR = false;

template <int R>
void tile_rows(const uint8_t* rec, int64_t groups, const int8_t* xq, int64_t k, const float* d,
               const float* dsum, const float* bias, float* y, int64_t ldy) {
  tile_rows_portable<R>(rec, groups, xq, k, d, dsum, bias, y, ldy);
}

template <int R>
void tile_rows_int8(const uint8_t* rec, int64_t groups, const int8_t* xq, int64_t k,
                    const float* d, const int32_t* qsum, const float* scales, const float* bias,
                    float* y, int64_t ldy) {
  tile_rows_int8_portable<R>(rec, groups, xq, k, d, qsum, scales, bias, y, ldy);
}
#endif

// Rows r0 .. r1 of y against tile t, ROW_BLOCK rows at a time: rows<R>(rows of x from r, out)
// computes R rows of the tile's 16 outputs.
template <typename Rows>
void tile_row_range(int64_t r0, int64_t r1, const Rows& rows) {
  for (int64_t r = r0; r < r1; r += ROW_BLOCK) {
    switch (std::min(ROW_BLOCK, r1 - r)) {
      case 4: rows(std::integral_constant<int, 4>{}, r); break;
      case 3: rows(std::integral_constant<int, 3>{}, r); break;
      case 2: rows(std::integral_constant<int, 2>{}, r); break;
      default: rows(std::integral_constant<int, 1>{}, r); break;
    }
  }
}

// Work items: (block of up to 64 rows, tile), blocks outermost, so that the threads share one
// block of rounded rows in cache while they walk the tiles. One row (a decode step at batch 1):
// each thread takes one contiguous range of tiles, a single stream of records.
// item(t, r0, r1): rows r0 .. r1 of tile t.
template <typename Item>
void for_each_item(int64_t m, int64_t n_tiles, const Item& item) {
  const int64_t row_items = (m + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
  at::parallel_for(0, row_items * n_tiles, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r0 = (i / n_tiles) * ROWS_PER_ITEM, t = i % n_tiles;
      item(t, r0, std::min(m, r0 + ROWS_PER_ITEM));
    }
  });
}

// Rows r0 .. r1 of y's 16 columns of tile t: y [m, n_tiles * 16] = x [m, k] @ W^T (+ bias), x
// rounded in `a`; tiles: the int4 layout above, [n_tiles, groups, 320] bytes.
void int4_tile(const uint8_t* tiles, int64_t n_tiles, const q8::RoundedView& a, const float* bias,
               float* y, int64_t t, int64_t r0, int64_t r1) {
  const int64_t groups = a.groups, n = n_tiles * CHANNELS;
  tile_row_range(r0, r1, [&](auto R, int64_t r) {
    tile_rows<decltype(R)::value>(tiles + t * groups * RECORD, groups, a.xq + r * a.k, a.k,
                                  a.d + r * groups, a.dsum + r * groups,
                                  bias ? bias + t * CHANNELS : nullptr, y + r * n + t * CHANNELS, n);
  });
}

// The same for the int8 layout, [n_tiles, groups, 512] bytes, and its scales [n_tiles * 16].
void int8_tile(const uint8_t* tiles, const float* scales, int64_t n_tiles,
               const q8::RoundedView& a, const float* bias, float* y, int64_t t, int64_t r0,
               int64_t r1) {
  const int64_t groups = a.groups, n = n_tiles * CHANNELS;
  tile_row_range(r0, r1, [&](auto R, int64_t r) {
    tile_rows_int8<decltype(R)::value>(tiles + t * groups * RECORD8, groups, a.xq + r * a.k, a.k,
                                       a.d + r * groups, a.qsum + r * groups,
                                       scales + t * CHANNELS, bias ? bias + t * CHANNELS : nullptr,
                                       y + r * n + t * CHANNELS, n);
  });
}

// tiles [N / 16, K / 32, record] uint8 that fit x [M, K]; returns the number of groups K / 32.
int64_t check_tiles(const torch::Tensor& x, const torch::Tensor& tiles, int64_t record,
                    const char* name) {
  TORCH_CHECK(tiles.dtype() == torch::kUInt8 && tiles.dim() == 3 && tiles.is_contiguous() &&
                  tiles.size(2) == record,
              name, ": tiles must be contiguous uint8 [N / 16, K / 32, ", record, "]");
  const int64_t groups = tiles.size(1);
  TORCH_CHECK(x.size(1) == groups * q8::BLOCK, name, ": x has ", x.size(1), " columns, tiles ",
              groups, " groups of 32");
  return groups;
}

}  // namespace

// Which tiled formats run in vector code on this build ("int4", "int8"): the engine tiles only
// those (engine/kernels/quant.py arrange_for_kernels); the portable loops are for tests.
std::vector<std::string> q8_tile_formats() {
  std::vector<std::string> formats;
  if (INT4_VECTOR) formats.push_back("int4");
  if (INT8_VECTOR) formats.push_back("int8");
  return formats;
}

// x [m, k] float32, tiles [n / 16, k / 32, 320] uint8 (the layout above) -> y [m, n] float32.
torch::Tensor int4_q8_tiled_linear(const torch::Tensor& x, const torch::Tensor& tiles,
                                   const c10::optional<torch::Tensor>& bias) {
  const char* name = "int4_q8_tiled_linear";
  q8::check_x(x, name);
  const int64_t groups = check_tiles(x, tiles, RECORD, name);
  const int64_t n_tiles = tiles.size(0), n = n_tiles * CHANNELS;
  q8::check_bias(bias, n, name);
  const q8::RoundedRows rounded(x, groups);
  const q8::RoundedView a = rounded.view();
  auto y = torch::empty({a.m, n}, x.options());
  const uint8_t* tp = tiles.data_ptr<uint8_t>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  for_each_item(a.m, n_tiles, [&](int64_t t, int64_t r0, int64_t r1) {
    int4_tile(tp, n_tiles, a, bp, yp, t, r0, r1);
  });
  return y;
}

// x [m, k] float32, tiles [n / 16, k / 32, 512] uint8 (q + 128, chunks of 4 bytes of 16
// channels), scales [n] float32 -> y [m, n] float32.
torch::Tensor int8_q8_tiled_linear(const torch::Tensor& x, const torch::Tensor& tiles,
                                   const torch::Tensor& scales,
                                   const c10::optional<torch::Tensor>& bias) {
  const char* name = "int8_q8_tiled_linear";
  q8::check_x(x, name);
  const int64_t groups = check_tiles(x, tiles, RECORD8, name);
  const int64_t n_tiles = tiles.size(0), n = n_tiles * CHANNELS;
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == n,
              name, ": scales must be contiguous float32 [N]");
  q8::check_bias(bias, n, name);
  const q8::RoundedRows rounded(x, groups);
  const q8::RoundedView a = rounded.view();
  auto y = torch::empty({a.m, n}, x.options());
  const uint8_t* tp = tiles.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  for_each_item(a.m, n_tiles, [&](int64_t t, int64_t r0, int64_t r1) {
    int8_tile(tp, sp, n_tiles, a, bp, yp, t, r0, r1);
  });
  return y;
}

// Rows `ids` of an int8 tiled matrix as float32 [len, k]: (stored byte - 128) * scale, the
// numbers of Int8TiledWeight.dequantize_rows (engine/kernels/quant.py). A tied embedding looks its
// tokens up here: in torch, the same gather took ten tensor operations (~50 us a decode step).
torch::Tensor int8_tiled_rows(const torch::Tensor& tiles, const torch::Tensor& scales,
                              const torch::Tensor& ids) {
  TORCH_CHECK(tiles.dtype() == torch::kUInt8 && tiles.dim() == 3 && tiles.is_contiguous() &&
                  tiles.size(2) == RECORD8,
              "int8_tiled_rows: tiles must be contiguous uint8 [N / 16, K / 32, 512]");
  const int64_t groups = tiles.size(1), n = tiles.size(0) * CHANNELS;
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == n,
              "int8_tiled_rows: scales must be contiguous float32 [N]");
  TORCH_CHECK(ids.dtype() == torch::kInt64 && ids.dim() == 1 && ids.is_contiguous(),
              "int8_tiled_rows: ids must be contiguous int64 [len]");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < ids.numel(); ++r)
    TORCH_CHECK(id[r] >= 0 && id[r] < n, "int8_tiled_rows: id ", id[r], " out of range");
  auto out = torch::empty({ids.numel(), groups * q8::BLOCK}, scales.options());
  const uint8_t* tp = tiles.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < ids.numel(); ++r) {
    const uint8_t* first = tp + (id[r] / CHANNELS) * groups * RECORD8 + (id[r] % CHANNELS) * 4;
    const float scale = sp[id[r]];
    float* o = op + r * groups * q8::BLOCK;
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t w = 0; w < q8::BLOCK; ++w)
        o[g * q8::BLOCK + w] =
            (static_cast<float>(first[g * RECORD8 + (w / 4) * 64 + w % 4]) - 128.f) * scale;
  }
  return out;
}

void int4_tiles_part(const uint8_t* tiles, int64_t n_tiles, const q8::RoundedView& a,
                     const float* bias, float* y, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) int4_tile(tiles, n_tiles, a, bias, y, t, 0, a.m);
}

void int8_tiles_part(const uint8_t* tiles, const float* scales, int64_t n_tiles,
                     const q8::RoundedView& a, const float* bias, float* y, int64_t t0,
                     int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) int8_tile(tiles, scales, n_tiles, a, bias, y, t, 0, a.m);
}

// bfloat16 matrices multiplied by our own kernel on a CPU with bfloat16 instructions: a float32
// engine's linear layers with bfloat16 weights (linear_precision "bfloat16":
// engine/kernels/linear_precision.py), and a bfloat16 engine's. Two kernels read one layout:
// AMX tiles (Intel's Advanced Matrix Extensions, amx_bf16) where the CPU has them, else
// AVX512-BF16's dot products (avx512_bf16: AMD's Zen 4 and 5, Intel's Cooper Lake).
//
// An AMX core has eight tile registers of up to 16 rows x 64 bytes. TDPBF16PS multiplies a tile
// of 16 rows x 32 bfloat16 (A) by one of 16 rows x 16 pairs of bfloat16 (B, "VNNI" order: row r
// holds, for each output channel n, its weights 2r and 2r + 1) and adds the products into a tile
// of 16 x 16 float32 (C): 16 x 16 x 32 multiply-adds in one instruction. So the weight [N, K] is
// repacked once at load (engine/kernels/bfloat16_tiles.py `tile_bfloat16`) into records of
// one B tile each: packed[t, g] holds output channels 16t .. 16t + 15 and inputs 32g .. 32g + 31,
// packed[t, g, r, n, p] = W[16t + n, 32g + 2r + p]. A thread reads the records of its channels
// front to back, one stream of bytes, as the int4 tiles do (q8_tiles.cpp).
//
// Row r of a B tile is also what one VDPBF16PS takes: 64 bytes, the pair (2r, 2r + 1) of 16
// channels. Against the pair of inputs broadcast to all 16 lanes it adds both products into the
// 16 channels' sums. The AVX512-BF16 kernel keeps up to 4 rows x 4 tiles of channels in 16
// registers and walks the inputs pair by pair: a tile of channels is one stream of K / 2 such
// rows, read once for every 4 rows of x.
//
// Each call rounds the float32 rows of x to bfloat16 once (to nearest even, as torch's
// .to(torch.bfloat16) does) and writes float32 results: no separate cast before the matmul and
// none after, which a float32 engine otherwise pays around each oneDNN call. On AMX, four C
// tiles hold a block of 32 rows x 32 channels; per 32 inputs, two A tiles (the block's rows) and
// two B tiles (its channels) give four TDPBF16PS. With either kernel each output is a sum over
// the inputs in the same order whatever the number of rows, so a request's numbers do not
// depend on its batch (the two kernels' orders differ from each other).
//
// Linux hands a process the tile registers only when it asks (arch_prctl ARCH_REQ_XCOMP_PERM);
// `tiles_permitted` asks once, and without the grant the AVX512-BF16 kernel runs instead.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define BF16_DOT 1
#else
#define BF16_DOT 0
#endif

#if BF16_DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define BF16_TILES 1
#else
#define BF16_TILES 0
#endif

namespace {

constexpr int64_t CHANNELS = 16;     // output channels per B tile
constexpr int64_t DEPTH = 32;        // inputs per B tile (16 rows of pairs)

#if BF16_DOT

// count float32 values -> bfloat16, rounded to nearest even.
void round_values(const float* x, int64_t count, uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), reinterpret_cast<const __m256i&>(h));
  }
  if (i < count) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (count - i)) - 1);
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(tail, x + i));
    _mm256_mask_storeu_epi16(out + i, tail, reinterpret_cast<const __m256i&>(h));
  }
}

// Rows r .. r + R of y x channel tiles t .. t + C (R, C <= 4): R x C sums of 16 channels in
// registers, each over the input pairs in order. a: row r in bfloat16; b: tile t's first record;
// tile_values: the bfloat16 values of one tile of channels (its K / 2 rows of pairs).
template <int R, int C>
void dot_block(const uint16_t* a, int64_t k, const uint16_t* b, int64_t tile_values, float* y,
               int64_t n) {
  __m512 sum[R][C];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) sum[i][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k / 2; ++p) {
    __m512bh w[C];
    for (int c = 0; c < C; ++c)
      w[c] = (__m512bh)_mm512_loadu_si512(b + c * tile_values + p * 2 * CHANNELS);
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, a + i * k + 2 * p, sizeof pair);
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < C; ++c) sum[i][c] = _mm512_dpbf16_ps(sum[i][c], x, w[c]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(y + i * n + c * CHANNELS, sum[i][c]);
}

using DotBlock = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t);

template <int R>
constexpr std::array<DotBlock, 4> dot_blocks_of() {
  return {&dot_block<R, 1>, &dot_block<R, 2>, &dot_block<R, 3>, &dot_block<R, 4>};
}

// dot_blocks[R - 1][C - 1]
constexpr std::array<std::array<DotBlock, 4>, 4> dot_blocks = {
    dot_blocks_of<1>(), dot_blocks_of<2>(), dot_blocks_of<3>(), dot_blocks_of<4>()};

// Channel tiles t0 .. t1 of y. One row: a tile at a time, one stream of bytes (a thread reading
// four tiles' streams side by side was slower: batch-1 decode 141-149 -> 162-175 tokens/s with
// bfloat16 linears on a Zen 4 VM). More rows: 4 tiles at a time, all rows 4 at a time, so those 4
// tiles (4 x 16 x K bfloat16: 196 KB at K = 1536) stay in L2 across the rows and each broadcast
// pair of inputs feeds 4 tiles. Each output is its own sum over the input pairs in order, so a
// range gives the same numbers whoever runs it, in whatever blocks.
void dot_tiles(const uint16_t* a, int64_t m, int64_t k, const uint16_t* packed, int64_t n,
               float* y, int64_t t0, int64_t t1) {
  const int64_t block = m == 1 ? 1 : 4;
  const int64_t tile_values = CHANNELS * k;
  for (int64_t t = t0; t < t1; t += block) {
    const int64_t c = std::min(block, t1 - t);
    for (int64_t r = 0; r < m; r += 4) {
      const int64_t rows = std::min<int64_t>(4, m - r);
      dot_blocks[rows - 1][c - 1](a + r * k, k, packed + t * tile_values, tile_values,
                                  y + r * n + t * CHANNELS, n);
    }
  }
}

// The threads share the tiles of channels, each its own range.
void dot_matmul(const uint16_t* a, int64_t m, int64_t k, const uint16_t* packed, int64_t n,
                float* y) {
  at::parallel_for(0, n / CHANNELS, 4, [&](int64_t t0, int64_t t1) {
    dot_tiles(a, m, k, packed, n, y, t0, t1);
  });
}

#endif

#if BF16_TILES

constexpr int64_t ROWS = 16;         // rows of x per A tile
constexpr int64_t ROWS_PER_ITEM = 256;  // a work item: two tiles of channels x up to 256 rows

bool tiles_permitted() {
  static const bool permitted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return permitted;
}

// Tiles 0-3: C (rows of block half h, channel tile c at 2h + c); 4, 5: A (rows 0-15, 16-31 of
// the block); 6, 7: B (the two channel tiles). `rows0`, `rows1`: the block's rows in each half.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  TileConfig(int rows0, int rows1) {
    const int a_rows[6] = {rows0, rows0, rows1, rows1, rows0, rows1};
    for (int t = 0; t < 6; ++t) {
      rows[t] = static_cast<uint8_t>(a_rows[t]);
      colsb[t] = a_rows[t] > 0 ? 64 : 0;  // an unused tile: no rows, no columns
    }
    for (int t = 6; t < 8; ++t) rows[t] = static_cast<uint8_t>(DEPTH / 2), colsb[t] = 64;
  }
};

// One block: rows r .. r + rows0 + rows1 of y (at most 32) x channel tiles t and t + 1 (`two`
// false: t alone). a: the block's first bfloat16 row; b: tile t's first record.
void block(const uint16_t* a, int64_t k, const uint16_t* b0, const uint16_t* b1, bool two,
           bool second_half, float* y, int64_t n) {
  const int64_t groups = k / DEPTH, stride_a = k * 2, stride_y = n * 4;
  const int64_t record = CHANNELS * DEPTH;  // bfloat16 values per B tile
  _tile_zero(0);  // a tile configured with no rows must not be touched at all
  if (two) _tile_zero(1);
  if (second_half) _tile_zero(2);
  if (two && second_half) _tile_zero(3);
  for (int64_t g = 0; g < groups; ++g) {
    _tile_loadd(4, a + g * DEPTH, stride_a);
    _tile_loadd(6, b0 + g * record, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two) {
      _tile_loadd(7, b1 + g * record, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (second_half) {
      _tile_loadd(5, a + ROWS * k + g * DEPTH, stride_a);
      _tile_dpbf16ps(2, 5, 6);
      if (two) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, y, stride_y);
  if (two) _tile_stored(1, y + CHANNELS, stride_y);
  if (second_half) {
    _tile_stored(2, y + ROWS * n, stride_y);
    if (two) _tile_stored(3, y + ROWS * n + CHANNELS, stride_y);
  }
}

void tiled_matmul(const uint16_t* a, int64_t m, int64_t k, const uint16_t* packed, int64_t n,
                  float* y) {
  const int64_t n_tiles = n / CHANNELS, pairs = (n_tiles + 1) / 2;
  const int64_t row_items = (m + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
  const int64_t record = CHANNELS * DEPTH, tile_values = record * (k / DEPTH);
  at::parallel_for(0, pairs * row_items, 1, [&](int64_t i0, int64_t i1) {
    int configured = -1;  // the rows in the block the tiles are configured for
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = (i / row_items) * 2, r0 = (i % row_items) * ROWS_PER_ITEM;
      const int64_t r_end = std::min(m, r0 + ROWS_PER_ITEM);
      const bool two = t + 1 < n_tiles;
      for (int64_t r = r0; r < r_end; r += 2 * ROWS) {
        const int rows = static_cast<int>(std::min<int64_t>(2 * ROWS, r_end - r));
        if (rows != configured) {
          const TileConfig config(std::min<int>(rows, ROWS), std::max<int>(rows - ROWS, 0));
          _tile_loadconfig(&config);
          configured = rows;
        }
        block(a + r * k, k, packed + t * tile_values, packed + (t + 1) * tile_values, two,
              rows > ROWS, y + r * n + t * CHANNELS, n);
      }
    }
    if (configured >= 0) _tile_release();
  });
}

#endif

}  // namespace

// True where this build has either kernel: AVX512-BF16's (which a CPU with AMX has too).
bool bf16_tiles_available() { return BF16_DOT; }

void bf16_round(const float* x, int64_t count, uint16_t* out) {
#if BF16_DOT
  round_values(x, count, out);
#endif
}

void bf16_tiles_part(const uint16_t* a, int64_t m, int64_t k, const uint16_t* packed, int64_t n,
                     const float* bias, float* y, int64_t t0, int64_t t1) {
#if BF16_DOT
  dot_tiles(a, m, k, packed, n, y, t0, t1);
  if (bias)
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = t0 * CHANNELS; j < t1 * CHANNELS; ++j) y[r * n + j] += bias[j];
#endif
}

// The kernel that multiplies here: "AMX" where this build has it and Linux granted this process
// the tiles, else "AVX512-BF16" where this build has that, else "".
std::string bf16_tiles_kernel() {
#if BF16_TILES
  if (tiles_permitted()) return "AMX";
#endif
  return BF16_DOT ? "AVX512-BF16" : "";
}

// A team of threads shares the tiles where the AVX512-BF16 kernel multiplies them. Where AMX
// multiplies, the layers keep their parallel loops: AMX's tile registers are configured for a
// call's blocks of rows, which a team's runs of tiles would configure again and again, and no AMX
// machine was at hand to measure what that costs.
bool bf16_tiles_team() { return bf16_tiles_kernel() == "AVX512-BF16"; }

// x [m, k] float32, packed [n / 16, k / 32, 16, 32] bfloat16 (the layout above) -> y [m, n]
// float32 (+ bias [n], added unrounded). A bfloat16 x (a bfloat16 engine's) is read as it is, and
// y, summed in float32 with the bias, is rounded to bfloat16 once at the end, as torch's bfloat16
// linear rounds its result.
torch::Tensor bf16_tiled_linear(const torch::Tensor& x, const torch::Tensor& packed,
                                const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(bf16_tiles_available(),
              "bf16_tiled_linear: this CPU or build has no bfloat16 instructions");
  const bool rounded = x.dtype() == torch::kBFloat16;  // already bfloat16
  TORCH_CHECK((rounded || x.dtype() == torch::kFloat32) && x.dim() == 2 && x.is_contiguous(),
              "bf16_tiled_linear: x must be contiguous float32 or bfloat16 [rows, in]");
  TORCH_CHECK(packed.dtype() == torch::kBFloat16 && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(2) == CHANNELS && packed.size(3) == DEPTH,
              "bf16_tiled_linear: packed must be contiguous bfloat16 [N / 16, K / 32, 16, 32]");
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0) * CHANNELS;
  TORCH_CHECK(packed.size(1) * DEPTH == k, "bf16_tiled_linear: x has ", k, " columns, packed ",
              packed.size(1) * DEPTH, " inputs");
  auto y = torch::empty({m, n}, x.options().dtype(torch::kFloat32));
#if BF16_DOT
  if (m > 0) {
    std::vector<uint16_t> a(rounded ? 0 : static_cast<size_t>(m * k));
    if (!rounded) {
      const float* xp = x.data_ptr<float>();
      at::parallel_for(0, m, std::max<int64_t>(1, 32768 / k), [&](int64_t r0, int64_t r1) {
        round_values(xp + r0 * k, (r1 - r0) * k, a.data() + r0 * k);
      });
    }
    const uint16_t* ap = rounded ? reinterpret_cast<const uint16_t*>(x.data_ptr()) : a.data();
    const auto* bp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
#if BF16_TILES
    if (tiles_permitted()) tiled_matmul(ap, m, k, bp, n, y.data_ptr<float>());
    else
#endif
      dot_matmul(ap, m, k, bp, n, y.data_ptr<float>());
  }
#endif
  if (bias.has_value()) y.add_(*bias);
  return rounded ? y.to(torch::kBFloat16) : y;
}

// CPU kernels for the engine: paged attention that reads K/V blocks where they lie, and
// weight-only int8 / int4 matrix x (few) vectors. The pure-torch code in engine/attention.py and
// engine/kernels/quant.py is the reference for every function here; tests/test_kernels.py checks
// that both give the same numbers.
//
// Style: plain loops that the compiler vectorises. The file is compiled with -O3 -march=native
// (the build directory is keyed by the CPU's flags, so a binary never runs on a CPU it was not
// built for); `#pragma omp simd reduction` tells GCC it may reorder the float sums of a dot
// product, which it otherwise must not do, and is what turns them into AVX2 / AVX-512 code.
// The one exception is the register tile of the multi-row quantized linear, written with
// AVX-512 / AVX2 intrinsics (a scalar fallback beside them) because its point is which values
// stay in registers. Threads come from PyTorch's own pool (at::parallel_for), so
// torch.set_num_threads applies.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Run fn(item) for item in [0, n) on torch's threads, each thread taking the next item when it is
// done with its last (dynamic scheduling). Items differ a lot in cost (a 2000-token context next
// to a 20-token one), so a static split would leave one core idle.
template <typename F>
void parallel_items(int64_t n, const F& fn) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, std::max<int64_t>(threads, 1), 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  });
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* y, float a, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Paged attention.
//
// q:           [num_tokens, num_heads, head_dim]   float32, this step's queries (already roped)
// k_cache:     [num_blocks, block_size, kv_heads, head_dim] float32 (this step's K already written)
// v_cache:     same shape as k_cache
// block_tables:[num_requests, max_blocks] int32, each request's blocks in order
// tiles:       [num_tiles, 4] int32: (first row in q, number of rows, request, position of the
//              first row). Row i of a tile sits at position pos0 + i of its request and attends
//              to keys 0 .. pos0 + i (causal). A decode token is a tile of one row; a prefill
//              chunk is cut into tiles of a few rows, so that each key read serves several queries.
// out:         [num_tokens, num_heads, head_dim] float32, written only at the tiles' rows.
//
// One work item = one tile x one KV head. The query heads that share the KV head (grouped-query
// attention) are handled together, so every K and V row is read once per tile, straight from its
// block: no copy of the context is ever made. Keys are walked block by block (one table lookup per
// block, no division per key), the queries are copied next to each other and pre-scaled, and the
// softmax's exponentials run vectorised (exp_nonpositive below).

namespace {

// exp(x) for x <= 0, as the softmax needs it after subtracting the maximum: 2^(x log2 e) split
// into 2^n (written into the float's exponent bits) times 2^f, f in [-0.5, 0.5], by its Taylor
// polynomial of degree 6 (relative error < 2e-7, below float32's own rounding of the sum). Plain
// float arithmetic, so GCC vectorises the loop that calls it, which it cannot do with std::exp.
#pragma omp declare simd notinbranch
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float t = x * 1.44269504f;          // x in powers of two
  const float n = std::floor(t + 0.5f);     // nearest integer
  const float f = (t - n) * 0.693147181f;   // back to e: the remainder, |f| <= ln 2 / 2
  float p = 1.f / 720;
  p = p * f + 1.f / 120;
  p = p * f + 1.f / 24;
  p = p * f + 1.f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n as a float
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Scratch of one thread, reused from item to item.
struct AttentionScratch {
  std::vector<float> queries, scores, acc, inv_sum;
};

}  // namespace

void paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                     const torch::Tensor& tiles, double scale, torch::Tensor& out) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
                  v_cache.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32,
              "paged_attention: float32 only");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && tiles.dtype() == torch::kInt32,
              "paged_attention: block_tables and tiles must be int32");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  out.is_contiguous() && block_tables.is_contiguous() && tiles.is_contiguous(),
              "paged_attention: contiguous tensors only");
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % kv_heads == 0, "paged_attention: shapes");
  const int64_t group = num_heads / kv_heads;  // query heads per KV head
  const int64_t max_blocks = block_tables.size(1);
  const int64_t num_tiles = tiles.size(0);

  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* tp = tiles.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t token_stride = kv_heads * head_dim;  // floats between two slots of the cache

  parallel_items(num_tiles * kv_heads, [&](int64_t item) {
    const int64_t t = item / kv_heads, h = item % kv_heads;
    const int64_t row0 = tp[4 * t], num_rows = tp[4 * t + 1];
    const int32_t* table = tables + static_cast<int64_t>(tp[4 * t + 2]) * max_blocks;
    const int64_t pos0 = tp[4 * t + 3];
    const int64_t num_keys = pos0 + num_rows;  // the last row sees this many keys
    const int64_t rows = num_rows * group;     // query vectors of this item

    thread_local AttentionScratch scratch;
    std::vector<float>& queries = scratch.queries;  // [rows, head_dim], scaled
    std::vector<float>& scores = scratch.scores;    // [rows, num_keys]
    std::vector<float>& acc = scratch.acc;          // [rows, head_dim]
    std::vector<float>& inv_sum = scratch.inv_sum;  // [rows]
    queries.resize(rows * head_dim);
    scores.resize(rows * num_keys);
    acc.assign(rows * head_dim, 0.f);
    inv_sum.resize(rows);

    // Query vector r = (row i, head g of the group): q[row0 + i, h * group + g, :].
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = qp + ((row0 + r / group) * num_heads + h * group + r % group) * head_dim;
      float* dst = queries.data() + r * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = src[d] * fscale;
    }
    // Visit keys 0 .. num_keys - 1 where they lie: fn(j, offset of key j's row in the cache).
    auto for_each_key = [&](auto&& fn) {
      for (int64_t first = 0, b = 0; first < num_keys; first += block_size, ++b) {
        const int64_t base = static_cast<int64_t>(table[b]) * block_size * token_stride +
                             h * head_dim;
        const int64_t n = std::min<int64_t>(block_size, num_keys - first);
        for (int64_t o = 0; o < n; ++o) fn(first + o, base + o * token_stride);
      }
    };

    // 1. Scores: each key is read once and dotted with every query of the tile that may see it.
    for_each_key([&](int64_t j, int64_t at) {
      const float* key = kp + at;
      const int64_t first_row = std::max<int64_t>(j - pos0, 0);  // rows before it cannot see j
      for (int64_t r = first_row * group; r < rows; ++r)
        scores[r * num_keys + j] = dot(queries.data() + r * head_dim, key, head_dim);
    });
    // 2. Softmax of each query's scores over the keys it sees (0 .. pos0 + i).
    for (int64_t r = 0; r < rows; ++r) {
      float* s = scores.data() + r * num_keys;
      const int64_t n = pos0 + r / group + 1;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        s[j] = exp_nonpositive(s[j] - m);
        sum += s[j];
      }
      inv_sum[r] = 1.f / sum;
    }
    // 3. Weighted sum of the values, each V row read once for the whole tile.
    for_each_key([&](int64_t j, int64_t at) {
      const float* value = vp + at;
      const int64_t first_row = std::max<int64_t>(j - pos0, 0);
      for (int64_t r = first_row * group; r < rows; ++r)
        axpy(acc.data() + r * head_dim, scores[r * num_keys + j], value, head_dim);
    });
    for (int64_t r = 0; r < rows; ++r) {
      float* o = op + ((row0 + r / group) * num_heads + h * group + r % group) * head_dim;
      const float* a = acc.data() + r * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) o[d] = a[d] * inv_sum[r];
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Weight-only int8 and int4 linear layers: y = x @ W^T (+ bias) with W stored quantized.
// Activations stay float32. A work item is ITEM_CHANNELS output channels.
//
// One activation row (a decode step at batch 1) should be bound by reading the weights from
// memory: each quantized byte is read once and widened in registers inside the dot product. The
// widening (int8 -> int32 -> float, or nibble -> float) costs more instructions than the
// multiply-add itself, so the row is walked ROW_CHANNELS output channels at a time: each
// activation vector is loaded once for all of them, and their accumulators are independent chains
// of multiply-adds that the CPU overlaps (one channel at a time waits on each add's latency).
// A tile's rows are short (576 bytes of int8 here), too short for the hardware prefetcher to
// notice eight interleaved streams, so each tile asks for the bytes of the tile
// ROW_PREFETCH_TILES ahead while it computes (software prefetch: 12 -> 36 GB/s at one row on a
// 49152 x 576 int8 matrix, 2 threads), and each thread takes one contiguous range of tiles.
//
// Several rows (2..32: a batched decode step; more: a prefill chunk) are a small matrix multiply.
// The item first widens its channels into float rows (ITEM_CHANNELS x k floats, in L1 or L2;
// each quantized byte is read once per call), then walks the activation rows TILE_M at a time,
// and for each such row tile runs register tiles over the widened channels: TILE_M rows x
// TILE_N channels, TILE_M * TILE_N accumulators that stay in vector registers while the input
// dimension k runs. Each step loads TILE_M activation vectors and TILE_N weight vectors for
// TILE_M * TILE_N fused multiply-adds, so a weight vector serves TILE_M rows and an activation
// vector TILE_N channels (a plain dot product loads two vectors per multiply-add and is bound by
// loads, not arithmetic).
//
// Vector width and tile shape follow the instruction set the file is compiled for (-march=native,
// the build directory keyed by the CPU's flags): AVX-512 (16 floats, 32 registers: a 4 x 4 tile),
// AVX2 + FMA (8 floats, 16 registers: 4 x 2, so that 8 accumulators + 2 weight vectors + 1
// activation vector fit), otherwise one float (the compiler's scalar code, still correct).

namespace {
constexpr int64_t ITEM_CHANNELS = 16;  // output channels per work item
constexpr int TILE_M = 4;              // activation rows per register tile
constexpr int ROW_CHANNELS = 8;        // output channels per tile of the one-row case
constexpr int ROW_PREFETCH_TILES = 4;  // how many tiles ahead the one-row case prefetches

#if defined(__AVX512F__)
constexpr int TILE_N = 4;  // output channels per register tile
struct Vec {
  static constexpr int64_t width = 16;
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a*b + c
  static Vec set1(float f) { return {_mm512_set1_ps(f)}; }
  static Vec int8s(const int8_t* p) {  // `width` int8 weights -> floats
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))};
  }
  // `width` packed int4 bytes -> their low (SHIFT 0) or high (SHIFT 4) nibbles as floats
  template <int SHIFT>
  static Vec nibbles(const uint8_t* p) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i nibble = _mm512_and_si512(_mm512_srli_epi32(q, SHIFT), _mm512_set1_epi32(15));
    return {_mm512_cvtepi32_ps(nibble)};
  }
  float sum() const { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int TILE_N = 2;
struct Vec {
  static constexpr int64_t width = 8;
  __m256 v;
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec set1(float f) { return {_mm256_set1_ps(f)}; }
  static Vec int8s(const int8_t* p) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))};
  }
  template <int SHIFT>
  static Vec nibbles(const uint8_t* p) {
    const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i nibble = _mm256_and_si256(_mm256_srli_epi32(q, SHIFT), _mm256_set1_epi32(15));
    return {_mm256_cvtepi32_ps(nibble)};
  }
  float sum() const {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};
#else
constexpr int TILE_N = 2;
struct Vec {
  static constexpr int64_t width = 1;
  float v;
  static Vec zero() { return {0.f}; }
  static Vec load(const float* p) { return {*p}; }
  static Vec fma(Vec a, Vec b, Vec c) { return {a.v * b.v + c.v}; }
  static Vec set1(float f) { return {f}; }
  static Vec int8s(const int8_t* p) { return {static_cast<float>(*p)}; }
  template <int SHIFT>
  static Vec nibbles(const uint8_t* p) { return {static_cast<float>((*p >> SHIFT) & 15)}; }
  float sum() const { return v; }
};
#endif
static_assert(ITEM_CHANNELS % TILE_N == 0 && ITEM_CHANNELS % ROW_CHANNELS == 0,
              "a work item holds whole register tiles");

// out[r * TILE_N + c] = dot(x row r, w row c) for r < R, c < TILE_N; x rows are ldx floats
// apart, w rows k floats apart (the widened tile). R is a template argument so that the
// accumulators are a fixed set of registers; rows_tile() picks R for the last, partial row tile.
template <int R>
void register_tile(const float* x, int64_t ldx, const float* w, int64_t k, float* out) {
  // The loops over r and c have fixed trip counts and are unrolled, so acc[r][c] are registers.
  Vec acc[R][TILE_N];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < TILE_N; ++c) acc[r][c] = Vec::zero();
  int64_t i = 0;
  for (; i + Vec::width <= k; i += Vec::width) {
    Vec wv[TILE_N];
#pragma GCC unroll 8
    for (int c = 0; c < TILE_N; ++c) wv[c] = Vec::load(w + c * k + i);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const Vec xv = Vec::load(x + r * ldx + i);
#pragma GCC unroll 8
      for (int c = 0; c < TILE_N; ++c) acc[r][c] = Vec::fma(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < TILE_N; ++c) {
      float s = acc[r][c].sum();
      for (int64_t t = i; t < k; ++t) s += x[r * ldx + t] * w[c * k + t];  // k % width tail
      out[r * TILE_N + c] = s;
    }
}

void rows_tile(int64_t rows, const float* x, int64_t ldx, const float* w, int64_t k, float* out) {
  static_assert(TILE_M == 4, "rows_tile dispatches 1..4 rows");
  switch (rows) {
    case 4: register_tile<4>(x, ldx, w, k, out); break;
    case 3: register_tile<3>(x, ldx, w, k, out); break;
    case 2: register_tile<2>(x, ldx, w, k, out); break;
    default: register_tile<1>(x, ldx, w, k, out); break;
  }
}

// The loop shared by both formats: widen(j, row) writes output channel j's weights as k floats;
// row1(j0, j1, y) writes y[j] for channels j0 <= j < j1 of the one-activation-row case.
template <typename Widen, typename Row1>
torch::Tensor quantized_linear(const torch::Tensor& x, int64_t n,
                               const c10::optional<torch::Tensor>& bias, const Widen& widen,
                               const Row1& row1) {
  const int64_t m = x.size(0), k = x.size(1);
  auto y = torch::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  if (m == 1) {  // every tile costs the same: one contiguous range of tiles per thread
    const int64_t tiles = (n + ROW_CHANNELS - 1) / ROW_CHANNELS;
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      const int64_t n0 = t0 * ROW_CHANNELS, n1 = std::min(n, t1 * ROW_CHANNELS);
      row1(n0, n1, yp);
      if (bp)
        for (int64_t j = n0; j < n1; ++j) yp[j] += bp[j];
    });
    return y;
  }
  parallel_items((n + ITEM_CHANNELS - 1) / ITEM_CHANNELS, [&](int64_t item) {
    const int64_t n0 = item * ITEM_CHANNELS, n1 = std::min(n, n0 + ITEM_CHANNELS);
    thread_local std::vector<float> wide;  // this item's channels widened to floats, [ITEM, k]
    wide.resize(ITEM_CHANNELS * k);
    const int64_t channels = n1 - n0;
    for (int64_t c = 0; c < channels; ++c) widen(n0 + c, wide.data() + c * k);
    std::fill(wide.begin() + channels * k, wide.end(), 0.f);  // a partial last item: zero rows
    float s[TILE_M * TILE_N];
    for (int64_t i = 0; i < m; i += TILE_M) {  // TILE_M activation rows (they stay in L1) ...
      const int64_t rows = std::min<int64_t>(TILE_M, m - i);
      for (int64_t j0 = 0; j0 < channels; j0 += TILE_N) {  // ... against TILE_N channels a time
        const int64_t cols = std::min<int64_t>(TILE_N, channels - j0);
        rows_tile(rows, xp + i * k, k, wide.data() + j0 * k, k, s);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c)
            yp[(i + r) * n + n0 + j0 + c] = s[r * TILE_N + c] + (bp ? bp[n0 + j0 + c] : 0.f);
      }
    }
  });
  return y;
}

// y[c] = scales[c] * (x . q_c) for the NC consecutive int8 channels whose rows start at w.
template <int NC>
inline void int8_row_tile(const float* x, const int8_t* w, int64_t k, const float* scales,
                          float* y) {
  Vec acc[NC];
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) acc[c] = Vec::zero();
  // The tiles ahead start NC * k bytes apart (rows are contiguous): fetch NC * width of them
  // per step, so that one pass over this tile has asked for the whole of that one.
  const int8_t* ahead = w + ROW_PREFETCH_TILES * NC * k;
  int64_t i = 0;
  for (; i + Vec::width <= k; i += Vec::width, ahead += NC * Vec::width) {
    for (int64_t b = 0; b < NC * Vec::width; b += 64) __builtin_prefetch(ahead + b);
    const Vec xv = Vec::load(x + i);
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) acc[c] = Vec::fma(xv, Vec::int8s(w + c * k + i), acc[c]);
  }
  for (int c = 0; c < NC; ++c) {
    float s = acc[c].sum();
    for (int64_t t = i; t < k; ++t) s += x[t] * static_cast<float>(w[c * k + t]);  // k % width
    y[c] = s * scales[c];
  }
}

// y[c] = sum over groups g of scale[c, g] * (x_g . q_c,g) + min[c, g] * sum(x_g), for the NC
// consecutive int4 channels whose packed rows start at b (row_bytes apart). Needs half a group to
// be a whole number of vectors: then every loop over c is unrolled and a[c], acc[c] stay in
// registers. The min terms are one dot product per channel with the activation's group sums.
template <int NC>
inline void int4_row_tile(const float* x, const uint8_t* b, int64_t row_bytes, const float* scales,
                          const float* mins, int64_t groups, int64_t group_size,
                          const float* xsum, float* y) {
  const int64_t half = group_size / 2;
  Vec acc[NC];
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) acc[c] = Vec::zero();
  for (int64_t g = 0; g < groups; ++g) {
    const float* lo = x + g * group_size;
    const float* hi = lo + half;
    // The tile ahead's packed bytes (NC * half of them per group), scales and minimums.
    const int64_t ahead = ROW_PREFETCH_TILES * NC;
    for (int64_t b0 = 0; b0 < NC * half; b0 += 64)
      __builtin_prefetch(b + ahead * row_bytes + g * NC * half + b0);
    __builtin_prefetch(scales + ahead * groups + g * NC);
    __builtin_prefetch(mins + ahead * groups + g * NC);
    Vec a[NC];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) a[c] = Vec::zero();
    for (int64_t e = 0; e < half; e += Vec::width) {
      const Vec xl = Vec::load(lo + e), xh = Vec::load(hi + e);
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        const uint8_t* p = b + c * row_bytes + g * half + e;
        a[c] = Vec::fma(xl, Vec::nibbles<0>(p), a[c]);
        a[c] = Vec::fma(xh, Vec::nibbles<4>(p), a[c]);
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) acc[c] = Vec::fma(Vec::set1(scales[c * groups + g]), a[c], acc[c]);
  }
  for (int c = 0; c < NC; ++c) y[c] = acc[c].sum() + dot(mins + c * groups, xsum, groups);
}

void check_x(const torch::Tensor& x, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "quantized linear: x must be a contiguous float32 [M, K]");
  TORCH_CHECK(!bias.has_value() || (bias->dtype() == torch::kFloat32 && bias->is_contiguous()),
              "quantized linear: bias must be contiguous float32");
}
}  // namespace

// int8, per output channel, symmetric: w[n, k] ~ qweight[n, k] * scales[n].
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& qweight,
                          const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias) {
  check_x(x, bias);
  TORCH_CHECK(qweight.dtype() == torch::kInt8 && qweight.is_contiguous(), "int8_linear: qweight");
  TORCH_CHECK(scales.dtype() == torch::kFloat32, "int8_linear: scales must be float32");
  const int64_t k = x.size(1), n = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == k && scales.numel() == n, "int8_linear: shapes");
  const int8_t* wp = qweight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  auto widen = [&](int64_t j, float* row) {
    const int8_t* w = wp + j * k;
    const float scale = sp[j];
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) row[i] = static_cast<float>(w[i]) * scale;
  };
  const float* x0 = x.data_ptr<float>();
  auto row1 = [&](int64_t j0, int64_t j1, float* y) {
    int64_t j = j0;
    for (; j + ROW_CHANNELS <= j1; j += ROW_CHANNELS)
      int8_row_tile<ROW_CHANNELS>(x0, wp + j * k, k, sp + j, y + j);
    for (; j < j1; ++j) int8_row_tile<1>(x0, wp + j * k, k, sp + j, y + j);
  };
  return quantized_linear(x, n, bias, widen, row1);
}

// int4, group-wise with a scale and a minimum (GGUF's Q4_1 idea): in each group of G consecutive
// input channels, w ~ q * scale + min with q in 0..15. Packing (engine/kernels/quant.py): in each
// group, byte e holds element e in its low nibble and element e + G/2 in its high nibble, so a
// group unpacks with one mask and one shift, no shuffle.
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scales, const torch::Tensor& mins,
                          int64_t group_size, const c10::optional<torch::Tensor>& bias) {
  check_x(x, bias);
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous(), "int4_linear: packed");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && mins.dtype() == torch::kFloat32 &&
                  scales.is_contiguous() && mins.is_contiguous(),
              "int4_linear: scales and mins must be contiguous float32");
  const int64_t k = x.size(1), n = packed.size(0);
  TORCH_CHECK(group_size % 2 == 0 && k % group_size == 0 && packed.size(1) * 2 == k,
              "int4_linear: shapes");
  const int64_t groups = k / group_size, half = group_size / 2;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* scp = scales.data_ptr<float>();
  const float* mnp = mins.data_ptr<float>();
  auto widen = [&](int64_t j, float* row) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* b = wp + j * (k / 2) + g * half;
      const float scale = scp[j * groups + g], mn = mnp[j * groups + g];
      float* out = row + g * group_size;
#pragma omp simd
      for (int64_t e = 0; e < half; ++e) {
        out[e] = static_cast<float>(b[e] & 0x0F) * scale + mn;
        out[e + half] = static_cast<float>(b[e] >> 4) * scale + mn;
      }
    }
  };
  // Batch 1, fused: sum_e x*(q*scale + min) = scale * sum_e x*q + min * sum_e x. The second
  // sum depends only on the activation, so it is computed once per group for all N channels;
  // each channel then reads its packed bytes once, widening the nibbles in registers.
  std::vector<float> xsum;
  const float* x0 = x.data_ptr<float>();
  if (x.size(0) == 1) {
    xsum.resize(groups);
    for (int64_t g = 0; g < groups; ++g) {
      float t = 0.f;
#pragma omp simd reduction(+ : t)
      for (int64_t e = 0; e < group_size; ++e) t += x0[g * group_size + e];
      xsum[g] = t;
    }
  }
  // A group whose half is a whole number of vectors (group 32 on AVX-512 and AVX2) runs in tiles
  // of ROW_CHANNELS channels; any other group size one channel at a time, ending in scalars.
  auto one_channel = [&](int64_t j) {
    const uint8_t* b = wp + j * (k / 2);
    const float* sc = scp + j * groups;
    const float* mn = mnp + j * groups;
    Vec acc = Vec::zero();  // scale * (x . q) of all groups, lane by lane: one sum across lanes
    float total = 0.f;
    for (int64_t g = 0; g < groups; ++g, b += half) {
      const float* lo = x0 + g * group_size;
      const float* hi = lo + half;
      Vec a = Vec::zero();
      int64_t e = 0;
      for (; e + Vec::width <= half; e += Vec::width) {
        a = Vec::fma(Vec::load(lo + e), Vec::nibbles<0>(b + e), a);
        a = Vec::fma(Vec::load(hi + e), Vec::nibbles<4>(b + e), a);
      }
      float tail = 0.f;
      for (; e < half; ++e)
        tail += lo[e] * static_cast<float>(b[e] & 0x0F) + hi[e] * static_cast<float>(b[e] >> 4);
      acc = Vec::fma(Vec::set1(sc[g]), a, acc);
      total += sc[g] * tail + mn[g] * xsum[g];
    }
    return total + acc.sum();
  };
  const bool whole_vectors = half % Vec::width == 0;
  auto row1 = [&](int64_t j0, int64_t j1, float* y) {
    int64_t j = j0;
    if (whole_vectors)
      for (; j + ROW_CHANNELS <= j1; j += ROW_CHANNELS)
        int4_row_tile<ROW_CHANNELS>(x0, wp + j * (k / 2), k / 2, scp + j * groups,
                                    mnp + j * groups, groups, group_size, xsum.data(), y + j);
    for (; j < j1; ++j) y[j] = one_channel(j);
  };
  return quantized_linear(x, n, bias, widen, row1);
}

// ---------------------------------------------------------------------------------------------
// RMSNorm, y = x * rsqrt(mean(x^2) + eps) * weight, row by row (float32). A decode step at batch 1
// runs 61 of them on 576 floats each; torch's CPU rms_norm spends ~10-30 us per call in the
// operations it is made of (power, mean, add, rsqrt, two products), ours under 1 us.

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && weight.dtype() == torch::kFloat32 &&
                  x.is_contiguous() && weight.is_contiguous(),
              "rms_norm: contiguous float32 only");
  const int64_t d = weight.numel();
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == d, "rms_norm: last dimension must match weight");
  const int64_t rows = x.numel() / d;
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  // A few rows are not worth waking other threads for; a prefill chunk is.
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * d;
      float* out = yp + r * d;
      const float inv_rms = 1.f / std::sqrt(dot(row, row, d) / static_cast<float>(d) + feps);
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) out[i] = row[i] * inv_rms * wp[i];
    }
  });
  return y;
}

// ---------------------------------------------------------------------------------------------
// Rotary position embedding: one call instead of the six torch operations apply_rope is spelled
// with in engine/models/llama.py (at batch 1 the arithmetic is ~1 us, each operation ~2 us).

// x: [tokens, heads, d] (any row stride, heads contiguous), cos/sin: [tokens, d] whose two halves
// are equal (rope_cos_sin duplicates the angles). out = x * cos + rotate_half(x) * sin.
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && cos.dtype() == torch::kFloat32 &&
                  sin.dtype() == torch::kFloat32 && x.dim() == 3 && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2) && cos.is_contiguous() && sin.is_contiguous(),
              "rope: float32 [tokens, heads, d] with contiguous heads");
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0 && cos.numel() == tokens * d && sin.numel() == tokens * d, "rope: shapes");
  auto out = torch::empty({tokens, heads, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row_stride = x.stride(0);
  at::parallel_for(0, tokens, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cp + t * d;
      const float* s = sp + t * d;
      for (int64_t h = 0; h < heads; ++h) {
        const float* in = xp + t * row_stride + h * d;
        float* o = op + (t * heads + h) * d;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          o[i] = in[i] * c[i] - in[i + half] * s[i];
          o[i + half] = in[i + half] * c[i + half] + in[i] * s[i + half];
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "llm-inference-lab CPU kernels: paged attention, weight-only int8/int4 linear, RMSNorm";
  m.def("paged_attention", &paged_attention, "paged attention over a block table, in place");
  m.def("int8_linear", &int8_linear, "y = x @ (q * scale).T (+ bias), int8 weights");
  m.def("int4_linear", &int4_linear, "y = x @ (q * scale + min).T (+ bias), int4 groups");
  m.def("rms_norm", &rms_norm, "y = x * rsqrt(mean(x^2) + eps) * weight, row by row");
  m.def("rope", &rope, "x * cos + rotate_half(x) * sin, heads of [tokens, heads, d]");
}

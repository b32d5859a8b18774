// CPU kernels for the engine: paged attention that reads K/V blocks where they lie, weight-only
// int8 / int4 matrix x (few) vectors, and the two small steps of a layer that torch spells with
// several operations (RMSNorm, RoPE). The pure-torch code in engine/attention.py,
// engine/kernels/quant.py and engine/models/llama.py is the reference for every function here;
// tests/test_kernels.py checks that both give the same numbers.
//
// Style: plain loops that the compiler vectorises where that is enough. The file is compiled
// with -O3 -march=native (the build directory is keyed by the CPU's flags, so a binary never runs
// on a CPU it was not built for); `#pragma omp simd reduction` tells GCC it may reorder the float
// sums of a dot product, which it otherwise must not do, and is what turns them into AVX2 /
// AVX-512 code. Where the point is which values stay in registers (the attention's chunk of keys
// scored at once, the quantized linears' register tiles), the code uses AVX-512 / AVX2
// intrinsics, with a portable fallback beside them. Threads come from PyTorch's own pool
// (at::parallel_for), so torch.set_num_threads applies.

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
// A decode step is bound by reading K and V from memory (every key is used once per step), so
// the kernel's job is to stream them at the memory's speed, with as little work per key as it
// can, and to read each byte once:
// - No copy of the context is made: keys are read where they lie, through the block table.
// - One work item = one tile x a range of KV heads. With many tiles (a batched decode step, a
//   long prefill chunk) the range is all the heads: a key's row of the cache, kv_heads x head_dim
//   contiguous floats, is read in one stretch, and a block of keys is one contiguous stretch too.
//   With few tiles (batch 1) each KV head is its own item, so that the threads have work to share.
//   The query heads that share a KV head (grouped-query attention) use each K and V row together.
// - Online softmax (as in FlashAttention): each query keeps a running maximum, a running sum of
//   exponentials and a running weighted sum of values, rescaled when the maximum grows. K and V
//   are then read in a single pass, KEYS keys at a time, and the scores of those keys never leave
//   registers and L1.
// - KEYS dot products at once (score_chunk): KEYS independent vector accumulators, summed across
//   their lanes by one transpose-and-add tree at the end. Summing each dot product's lanes on its
//   own costs about as much as the dot product itself at head_dim 64.
// - The next chunk's K and V rows are prefetched while this one is computed: blocks lie anywhere
//   in the cache, so the hardware prefetcher cannot guess where the next one starts.

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

// score_chunk(q, keys, d, s):           s[j] = q . keys[j]                  for j < KEYS
// accumulate_chunk(acc, c, p, values, d): acc = c * acc + sum_j p[j] * values[j]  (d floats)
// Written with AVX-512 (KEYS = 16: one vector of scores) or AVX2 + FMA (KEYS = 8), else plain
// loops. Any head_dim d: the last partial vector is read and written with a lane mask.
#if defined(__AVX512F__)
constexpr int64_t KEYS = 16;

// out[j] = the sum of v[j]'s 16 lanes, j < 16. Each level adds pairs of vectors after shuffling
// them so that each sum keeps half of each input's partial sums: 16 vectors -> 8 -> 4 -> 2 -> 1,
// 15 vector additions in all instead of 16 separate horizontal sums (4 additions each).
inline __m512 sum_lanes(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)  // w[i]: v[2i]'s 8 partial sums, then v[2i+1]'s
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // x[i], 128-bit lane k: 4 partial sums of v[4i + k]
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  // lane k of y0: 2 partial sums of v[k] and of v[4 + k] (y1: v[8 + k], v[12 + k])
  const __m512 y0 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
  const __m512 y1 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
  // element 4k + m: the whole sum of v[4m + k]; one permutation puts v[j]'s sum at element j
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y0, y1, 0x44), _mm512_shuffle_ps(y0, y1, 0xEE));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, z);
}

inline void score_chunk(const float* q, const float* const* keys, int64_t d, float* s) {
  __m512 acc[KEYS];
  for (int j = 0; j < KEYS; ++j) acc[j] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= d; c += 16) {
    const __m512 qv = _mm512_loadu_ps(q + c);
#pragma GCC unroll 16
    for (int j = 0; j < KEYS; ++j)
      acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys[j] + c), acc[j]);
  }
  if (c < d) {  // the last d - c < 16 floats
    const __mmask16 m = static_cast<__mmask16>((1u << (d - c)) - 1);
    const __m512 qv = _mm512_maskz_loadu_ps(m, q + c);
#pragma GCC unroll 16
    for (int j = 0; j < KEYS; ++j)
      acc[j] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, keys[j] + c), acc[j]);
  }
  _mm512_storeu_ps(s, sum_lanes(acc));
}

inline void accumulate_chunk(float* acc, float corr, const float* p, const float* const* values,
                             int64_t d) {
  int64_t c = 0;
  for (; c + 16 <= d; c += 16) {
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + c), _mm512_set1_ps(corr));
#pragma GCC unroll 16
    for (int j = 0; j < KEYS; ++j)
      a = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_loadu_ps(values[j] + c), a);
    _mm512_storeu_ps(acc + c, a);
  }
  if (c < d) {
    const __mmask16 m = static_cast<__mmask16>((1u << (d - c)) - 1);
    __m512 a = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, acc + c), _mm512_set1_ps(corr));
#pragma GCC unroll 16
    for (int j = 0; j < KEYS; ++j)
      a = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_maskz_loadu_ps(m, values[j] + c), a);
    _mm512_mask_storeu_ps(acc + c, m, a);
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t KEYS = 8;

// out[j] = the sum of v[j]'s 8 lanes, j < 8: pairwise horizontal adds (8 -> 4 -> 2 vectors, each
// 128-bit half holding 4 partial sums of 4 inputs), then the two halves added.
inline __m256 sum_lanes(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

inline __m256i tail_mask(int64_t n) {  // lanes < n set
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline void score_chunk(const float* q, const float* const* keys, int64_t d, float* s) {
  __m256 acc[KEYS];
  for (int j = 0; j < KEYS; ++j) acc[j] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= d; c += 8) {
    const __m256 qv = _mm256_loadu_ps(q + c);
#pragma GCC unroll 8
    for (int j = 0; j < KEYS; ++j)
      acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[j] + c), acc[j]);
  }
  if (c < d) {
    const __m256i m = tail_mask(d - c);
    const __m256 qv = _mm256_maskload_ps(q + c, m);
#pragma GCC unroll 8
    for (int j = 0; j < KEYS; ++j)
      acc[j] = _mm256_fmadd_ps(qv, _mm256_maskload_ps(keys[j] + c, m), acc[j]);
  }
  _mm256_storeu_ps(s, sum_lanes(acc));
}

inline void accumulate_chunk(float* acc, float corr, const float* p, const float* const* values,
                             int64_t d) {
  int64_t c = 0;
  for (; c + 8 <= d; c += 8) {
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc + c), _mm256_set1_ps(corr));
#pragma GCC unroll 8
    for (int j = 0; j < KEYS; ++j)
      a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(values[j] + c), a);
    _mm256_storeu_ps(acc + c, a);
  }
  if (c < d) {
    const __m256i m = tail_mask(d - c);
    __m256 a = _mm256_mul_ps(_mm256_maskload_ps(acc + c, m), _mm256_set1_ps(corr));
#pragma GCC unroll 8
    for (int j = 0; j < KEYS; ++j)
      a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_maskload_ps(values[j] + c, m), a);
    _mm256_maskstore_ps(acc + c, m, a);
  }
}

#else  // portable: one dot product / axpy per key, vectorised by the compiler where it can
constexpr int64_t KEYS = 8;

inline void score_chunk(const float* q, const float* const* keys, int64_t d, float* s) {
  for (int64_t j = 0; j < KEYS; ++j) s[j] = dot(q, keys[j], d);
}

inline void accumulate_chunk(float* acc, float corr, const float* p, const float* const* values,
                             int64_t d) {
  for (int64_t i = 0; i < d; ++i) acc[i] *= corr;
  for (int64_t j = 0; j < KEYS; ++j) axpy(acc, p[j], values[j], d);
}
#endif

// Scratch of one thread, reused from item to item. Buffers only grow (grow_to): resizing a vector
// down and up again would fill it with zeros each time.
struct AttentionScratch {
  std::vector<float> queries, acc, max, sum;
};

inline float* grow_to(std::vector<float>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

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

  // All KV heads per item when there are several tiles per thread, else one head per item.
  const int64_t item_heads = num_tiles >= 4 * at::get_num_threads() ? kv_heads : 1;
  const int64_t items_per_tile = kv_heads / item_heads;

  parallel_items(num_tiles * items_per_tile, [&](int64_t item) {
    const int64_t t = item / items_per_tile, h0 = (item % items_per_tile) * item_heads;
    const int64_t row0 = tp[4 * t], num_rows = tp[4 * t + 1];
    const int32_t* table = tables + static_cast<int64_t>(tp[4 * t + 2]) * max_blocks;
    const int64_t pos0 = tp[4 * t + 3];
    const int64_t num_keys = pos0 + num_rows;  // the last row sees this many keys
    const int64_t per_head = num_rows * group;  // query vectors of one KV head
    const int64_t rows = item_heads * per_head;

    // Query vector r = (KV head h0 + r / per_head, tile row i, head g of its group), with
    // i * group + g = r % per_head: q[row0 + i, (h0 + r / per_head) * group + g, :].
    thread_local AttentionScratch scratch;
    float* queries = grow_to(scratch.queries, rows * head_dim);  // scaled
    float* acc = grow_to(scratch.acc, rows * head_dim);  // running sum of p * V, not normalised
    float* run_max = grow_to(scratch.max, rows);         // running maximum of the scores
    float* run_sum = grow_to(scratch.sum, rows);         // running sum of exp(score - max)
    auto q_offset = [&](int64_t r) {
      const int64_t h = h0 + r / per_head, i = (r % per_head) / group, g = r % group;
      return ((row0 + i) * num_heads + h * group + g) * head_dim;
    };
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = qp + q_offset(r);
      for (int64_t d = 0; d < head_dim; ++d) queries[r * head_dim + d] = src[d] * fscale;
      std::fill(acc + r * head_dim, acc + (r + 1) * head_dim, 0.f);
      run_max[r] = -std::numeric_limits<float>::infinity();
      run_sum[r] = 0.f;
    }

    // Offsets in the cache of the rows of keys j0 .. j0 + KEYS - 1 (head 0); past the last key
    // they repeat it, so that a short chunk is computed like a full one (its extra keys get
    // weight 0). Walks the block table without a division per key.
    auto chunk_rows = [&](int64_t j0, int64_t* offset) {
      int64_t b = j0 / block_size, o = j0 % block_size;
      const int64_t n = std::min<int64_t>(KEYS, num_keys - j0);
      for (int64_t j = 0; j < KEYS; ++j) {
        if (j < n) {
          offset[j] = (static_cast<int64_t>(table[b]) * block_size + o) * token_stride;
          if (++o == block_size) o = 0, ++b;
        } else {
          offset[j] = offset[n - 1];
        }
      }
    };
    // Ask for the item's heads of these rows of K and V (one cache line at a time).
    auto prefetch = [&](const int64_t* offset, int64_t n) {
      const int64_t first = h0 * head_dim * static_cast<int64_t>(sizeof(float));
      const int64_t bytes = item_heads * head_dim * static_cast<int64_t>(sizeof(float));
      for (int64_t j = 0; j < n; ++j) {
        const char* k = reinterpret_cast<const char*>(kp + offset[j]) + first;
        const char* v = reinterpret_cast<const char*>(vp + offset[j]) + first;
        for (int64_t at = 0; at < bytes; at += 64) {
          __builtin_prefetch(k + at);
          __builtin_prefetch(v + at);
        }
      }
    };

    int64_t offset[KEYS], next[KEYS];
    chunk_rows(0, offset);
    for (int64_t j0 = 0; j0 < num_keys; j0 += KEYS) {
      const int64_t n = std::min<int64_t>(KEYS, num_keys - j0);
      const bool more = j0 + KEYS < num_keys;
      if (more) {
        chunk_rows(j0 + KEYS, next);
        prefetch(next, std::min<int64_t>(KEYS, num_keys - j0 - KEYS));
      }
      const int64_t first_row = std::max<int64_t>(j0 - pos0, 0);  // rows before it see no key here
      for (int64_t hh = 0; hh < item_heads; ++hh) {
        const float* keys[KEYS];
        const float* values[KEYS];
        for (int64_t j = 0; j < KEYS; ++j) {
          keys[j] = kp + offset[j] + (h0 + hh) * head_dim;
          values[j] = vp + offset[j] + (h0 + hh) * head_dim;
        }
        for (int64_t r = hh * per_head + first_row * group; r < (hh + 1) * per_head; ++r) {
          const int64_t i = (r % per_head) / group;
          const int64_t visible = std::min<int64_t>(n, pos0 + i + 1 - j0);  // keys row i sees
          alignas(64) float s[KEYS], p[KEYS];
          score_chunk(queries + r * head_dim, keys, head_dim, s);
          float m = run_max[r];
#pragma omp simd reduction(max : m)
          for (int64_t j = 0; j < KEYS; ++j) m = std::max(m, j < visible ? s[j] : -INFINITY);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < KEYS; ++j) {
            p[j] = j < visible ? exp_nonpositive(s[j] - m) : 0.f;
            sum += p[j];
          }
          const float corr = exp_nonpositive(run_max[r] - m);  // rescales what came before
          run_max[r] = m;
          run_sum[r] = run_sum[r] * corr + sum;
          accumulate_chunk(acc + r * head_dim, corr, p, values, head_dim);
        }
      }
      if (more) std::copy(next, next + KEYS, offset);
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* o = op + q_offset(r);
      const float inv = 1.f / run_sum[r];
      for (int64_t d = 0; d < head_dim; ++d) o[d] = acc[r * head_dim + d] * inv;
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
  const int64_t ahead = ROW_PREFETCH_TILES * NC;  // channels between this tile and the one fetched
  Vec acc[NC];
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) acc[c] = Vec::zero();
  for (int64_t g = 0; g < groups; ++g) {
    const float* lo = x + g * group_size;
    const float* hi = lo + half;
    // The tile ahead's packed bytes (NC * half of them per group), scales and minimums.
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
  m.doc() = "llm-inference-lab CPU kernels: paged attention, int8/int4 linear, RMSNorm, RoPE";
  m.def("paged_attention", &paged_attention, "paged attention over a block table, in place");
  m.def("int8_linear", &int8_linear, "y = x @ (q * scale).T (+ bias), int8 weights");
  m.def("int4_linear", &int4_linear, "y = x @ (q * scale + min).T (+ bias), int4 groups");
  m.def("rms_norm", &rms_norm, "y = x * rsqrt(mean(x^2) + eps) * weight, row by row");
  m.def("rope", &rope, "x * cos + rotate_half(x) * sin, heads of [tokens, heads, d]");
}

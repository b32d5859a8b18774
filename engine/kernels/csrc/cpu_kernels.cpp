// CPU kernels for the engine: paged attention that reads K/V blocks where they lie, weight-only
// int8 / int4 matrix x (few) vectors, and the small steps of a layer that torch spells with
// several operations (RMSNorm, the residual add fused with the norm after it, RoPE, SwiGLU's
// silu(gate) * up). The pure-torch code in engine/attention.py,
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

#include "kernels.h"
#include "q8.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
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

}  // namespace

// ---------------------------------------------------------------------------------------------
// Paged attention, with this step's K/V written into the cache first.
//
// q:           [num_tokens, num_heads, head_dim]   this step's queries (already roped)
// k, v:        [num_tokens, kv_heads, head_dim]    this step's keys (roped) and values
//              (q, k, v: any stride between tokens, heads and head_dim contiguous: the views of
//              the fused qkv projection are used as they are, without a copy)
// k_cache:     [num_blocks, block_size, kv_heads, head_dim]
// v_cache:     same shape as k_cache
// slots:       [num_tokens] int64, the cache slot (block * block_size + offset) of each new token
// block_tables:[num_requests, max_blocks] int32, each request's blocks in order
// tiles:       [num_tiles, 4] int32: (first row in q, number of rows, request, position of the
//              first row). Row i of a tile sits at position pos0 + i of its request and attends
//              to keys 0 .. pos0 + i (causal). A decode token is a tile of one row; a prefill
//              chunk is cut into tiles of a few rows, so that each key read serves several queries.
// out:         [num_tokens, num_heads, head_dim] contiguous, written only at the tiles' rows.
// All float tensors are float32, or all bfloat16 (computed in float32, output rounded to nearest
// even as torch rounds); or q, k, v and out float32 over bfloat16 caches (kv_cache_dtype: the new
// K/V rounded to nearest even as they are written). Zero tiles is allowed: the call then only
// writes the cache.
//
// A decode step is bound by reading K and V from memory (every key is used once per step), so
// the kernel's job is to stream them at the memory's speed, with as little work per key as it
// can, and to read each byte once:
// - No copy of the context is made: keys are read where they lie, through the block table. The
//   new tokens' K/V are written into their slots by the same call (one pass over the tokens).
// - One work item = one tile x a range of KV heads x a range of keys. With many tiles (a batched
//   decode step, a long prefill chunk) and for decode tiles, the range is all the heads: a key's
//   row of the cache, kv_heads x head_dim contiguous values, is read in one stretch. With a few
//   prefill tiles each KV head is its own item. Tiles too few for the threads (batch 1) are cut
//   into key ranges ("partitions", as in vLLM's paged_attention_v2 and FlashDecoding), so that
//   both cores have work: each range leaves its partial softmax state, and the last to finish
//   merges them.
//   The query heads that share a KV head (grouped-query attention) use each K and V row together.
// - Online softmax (as in FlashAttention): each query keeps a running maximum, a running sum of
//   exponentials and a running weighted sum of values, rescaled when the maximum grows. K and V
//   are then read in a single pass, CHUNK keys at a time: per KV head, every query row's scores
//   for the chunk (in L1), one rescale per row, then the values.
// - KEYS dot products at once (score_chunk): KEYS independent vector accumulators, summed across
//   their lanes by one transpose-and-add tree at the end. Summing each dot product's lanes on its
//   own costs about as much as the dot product itself at head_dim 64.
// - The values are added for ROW_SET query rows at once (the heads of a group, a tile's rows):
//   each value vector is loaded once for all of them (accumulate_rows).
// - Each head's values are prefetched while its scores are computed, and the next head's keys
//   while its values are added: blocks lie anywhere in the cache, so the hardware prefetcher
//   cannot guess where the next rows start. (Batch 32, contexts 300-500, 30 layers, 2 threads:
//   38.6 ms a step with 16 keys at a time per row and a whole chunk prefetched ahead, 28.9 ms
//   now in float32; 24.7 -> 16.2 ms in bfloat16: docs/performance.md.)
// - bfloat16 K/V are half the bytes to stream; widening one to float32 is a 16-bit shift.

namespace {

using bf16 = c10::BFloat16;

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

// The vector type of the instruction set the file is compiled for, W floats wide, and the
// few operations the attention needs. v_load widens bfloat16 (the upper half of a float32).
#if defined(__AVX512F__)
constexpr int64_t W = 16, KEYS = 16;
using V = __m512;
inline V v_zero() { return _mm512_setzero_ps(); }
inline V v_set1(float f) { return _mm512_set1_ps(f); }
inline V v_load(const float* p) { return _mm512_loadu_ps(p); }
inline V v_load(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline V v_fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V v_mul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V v_add(V a, V b) { return _mm512_add_ps(a, b); }
inline V v_floor(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline V v_pow2(V n) {  // 2^n for whole numbers n in [-87, 0], written into the exponent bits
  const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
  return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}
inline V v_sub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V v_max(V a, V b) { return _mm512_max_ps(a, b); }
inline V v_min(V a, V b) { return _mm512_min_ps(a, b); }
inline V v_div(V a, V b) { return _mm512_div_ps(a, b); }
using Mask = __mmask16;  // lanes j < n: the keys of a chunk that a query row sees
inline Mask first_lanes(int64_t n) { return static_cast<Mask>((1u << n) - 1u); }
inline V v_select(Mask m, V a, V b) { return _mm512_mask_blend_ps(m, b, a); }  // a where m
inline Mask v_nonnegative(V a) { return _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GE_OQ); }
inline float v_max_lanes(V a) { return _mm512_reduce_max_ps(a); }
inline float v_sum_lanes(V a) { return _mm512_reduce_add_ps(a); }
inline void v_store(float* p, V a) { _mm512_storeu_ps(p, a); }

// out[j] = the sum of v[j]'s 16 lanes, j < 16. Each level adds pairs of vectors after shuffling
// them so that each sum keeps half of each input's partial sums: 16 vectors -> 8 -> 4 -> 2 -> 1,
// 15 vector additions in all instead of 16 separate horizontal sums (4 additions each).
inline V sum_lanes(const V* v) {
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
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t W = 8, KEYS = 8;
using V = __m256;
inline V v_zero() { return _mm256_setzero_ps(); }
inline V v_set1(float f) { return _mm256_set1_ps(f); }
inline V v_load(const float* p) { return _mm256_loadu_ps(p); }
inline V v_load(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline V v_fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V v_mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V v_add(V a, V b) { return _mm256_add_ps(a, b); }
inline V v_floor(V a) { return _mm256_floor_ps(a); }
inline V v_pow2(V n) {  // 2^n for whole numbers n in [-87, 0], written into the exponent bits
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
inline V v_sub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V v_max(V a, V b) { return _mm256_max_ps(a, b); }
inline V v_min(V a, V b) { return _mm256_min_ps(a, b); }
inline V v_div(V a, V b) { return _mm256_div_ps(a, b); }
using Mask = __m256;  // lanes j < n (all bits set): the keys of a chunk that a query row sees
inline Mask first_lanes(int64_t n) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
inline V v_select(Mask m, V a, V b) { return _mm256_blendv_ps(b, a, m); }  // a where m
inline Mask v_nonnegative(V a) { return _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_GE_OQ); }
inline float v_max_lanes(V a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float v_sum_lanes(V a) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}
inline void v_store(float* p, V a) { _mm256_storeu_ps(p, a); }

// out[j] = the sum of v[j]'s 8 lanes, j < 8: pairwise horizontal adds (8 -> 4 -> 2 vectors, each
// 128-bit half holding 4 partial sums of 4 inputs), then the two halves added.
inline V sum_lanes(const V* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#else
constexpr int64_t W = 1, KEYS = 8;  // portable: plain loops, vectorised by the compiler if it can
#endif

// Keys per chunk of the online softmax: each query row's scores for CHUNK keys are computed
// (KEYS at a time), then the row is rescaled once, then the value rows are added, each vector of
// V loaded once for ROW_SET query rows (the heads of a group, or a prefill tile's rows). One
// rescale per 64 keys instead of per 16; 2 x KEYS measured the same, 8 x KEYS slower.
constexpr int64_t CHUNK = 4 * KEYS;

// score_chunk(q, keys, d, s):        s[j] = q . keys[j]                                j < KEYS
// softmax_row(s, n, visible, m, l):  s[j] = exp(s[j] - m') for j < visible, 0 up to n; m, l the
//                                    row's running maximum and sum, updated; returns exp(m - m'),
//                                    the factor that rescales the row's values so far
// accumulate_rows(R, ...):           acc_r = corr_r * acc_r + sum_j p_r[j] * values[j]  r < R
// q and acc are this kernel's own float rows, padded with zeros to a multiple of W; K/V rows are
// the cache's, so their last partial vector (head_dim not a multiple of W) is copied out first:
// a full vector load there could read past the end of the cache.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
constexpr int ROW_SET = W == 16 ? 4 : 2;  // R x 4 accumulators + 4 value vectors in registers

// exp_nonpositive above, W lanes at once (the same operations, so the same numbers).
inline V v_exp_nonpositive(V x) {
  x = v_max(x, v_set1(-87.f));
  const V t = v_mul(x, v_set1(1.44269504f));
  const V n = v_floor(v_add(t, v_set1(0.5f)));
  const V f = v_mul(v_sub(t, n), v_set1(0.693147181f));
  V p = v_set1(1.f / 720);
  p = v_fma(p, f, v_set1(1.f / 120));
  p = v_fma(p, f, v_set1(1.f / 24));
  p = v_fma(p, f, v_set1(1.f / 6));
  p = v_fma(p, f, v_set1(0.5f));
  p = v_fma(p, f, v_set1(1.f));
  p = v_fma(p, f, v_set1(1.f));
  return v_mul(p, v_pow2(n));
}

inline Mask lanes_below(int64_t n) { return first_lanes(std::clamp<int64_t>(n, 0, W)); }

inline float softmax_row(float* s, int64_t n, int64_t visible, float* run_max, float* run_sum) {
  V mx = v_set1(-INFINITY);
  for (int64_t c = 0; c < visible; c += W)
    mx = v_max(mx, v_select(lanes_below(visible - c), v_load(s + c), v_set1(-INFINITY)));
  const float m = std::max(*run_max, v_max_lanes(mx));
  V sum = v_zero();
  for (int64_t c = 0; c < n; c += W) {
    const V e = v_exp_nonpositive(v_sub(v_load(s + c), v_set1(m)));
    const V p = v_select(lanes_below(visible - c), e, v_zero());
    v_store(s + c, p);
    sum = v_add(sum, p);
  }
  const float corr = exp_nonpositive(*run_max - m);
  *run_max = m;
  *run_sum = *run_sum * corr + v_sum_lanes(sum);
  return corr;
}

template <typename T>
inline V v_load_part(const T* p, int64_t n) {
  alignas(64) T part[W] = {};
  std::copy(p, p + n, part);
  return v_load(part);
}

template <typename T>
inline void score_chunk(const float* q, const T* const* keys, int64_t d, float* s) {
  V acc[KEYS];
  for (int j = 0; j < KEYS; ++j) acc[j] = v_zero();
  int64_t c = 0;
  for (; c + W <= d; c += W) {
    const V qv = v_load(q + c);
#pragma GCC unroll 16
    for (int j = 0; j < KEYS; ++j) acc[j] = v_fma(qv, v_load(keys[j] + c), acc[j]);
  }
  if (c < d) {
    const V qv = v_load(q + c);
#pragma GCC unroll 16
    for (int j = 0; j < KEYS; ++j) acc[j] = v_fma(qv, v_load_part(keys[j] + c, d - c), acc[j]);
  }
  v_store(s, sum_lanes(acc));
}

// R rows x NV vectors from float c on (acc and p: one row every acc_stride / p_stride floats).
// Each key's NV value vectors are loaded once for the R rows: R * NV independent chains of
// multiply-adds, enough to keep both FMA units busy at R = 4, NV = 4.
template <int R, int NV, typename T>
inline void accumulate_vectors(float* acc, int64_t acc_stride, const float* corr, const float* p,
                               int64_t p_stride, const T* const* values, int64_t n, int64_t c) {
  V a[R][NV];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i)
      a[r][i] = v_mul(v_load(acc + r * acc_stride + c + i * W), v_set1(corr[r]));
  for (int64_t j = 0; j < n; ++j) {
    V x[NV];
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i) x[i] = v_load(values[j] + c + i * W);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const V pr = v_set1(p[r * p_stride + j]);
#pragma GCC unroll 4
      for (int i = 0; i < NV; ++i) a[r][i] = v_fma(pr, x[i], a[r][i]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i) v_store(acc + r * acc_stride + c + i * W, a[r][i]);
}

template <int R, typename T>
inline void accumulate_set(float* acc, int64_t acc_stride, const float* corr, const float* p,
                           int64_t p_stride, const T* const* values, int64_t n, int64_t d) {
  int64_t c = 0;
  for (; c + 4 * W <= d; c += 4 * W)
    accumulate_vectors<R, 4>(acc, acc_stride, corr, p, p_stride, values, n, c);
  for (; c + W <= d; c += W)
    accumulate_vectors<R, 1>(acc, acc_stride, corr, p, p_stride, values, n, c);
  for (; c < d; ++c)  // head_dim not a multiple of W: the last few values one by one
    for (int r = 0; r < R; ++r) {
      float a = acc[r * acc_stride + c] * corr[r];
      for (int64_t j = 0; j < n; ++j) a += p[r * p_stride + j] * static_cast<float>(values[j][c]);
      acc[r * acc_stride + c] = a;
    }
}

template <typename T>
inline void accumulate_rows(int64_t rows, float* acc, int64_t acc_stride, const float* corr,
                            const float* p, int64_t p_stride, const T* const* values, int64_t n,
                            int64_t d) {
  switch (rows) {
    case 1: return accumulate_set<1>(acc, acc_stride, corr, p, p_stride, values, n, d);
    case 2: return accumulate_set<2>(acc, acc_stride, corr, p, p_stride, values, n, d);
    case 3: return accumulate_set<3>(acc, acc_stride, corr, p, p_stride, values, n, d);
    default: return accumulate_set<4>(acc, acc_stride, corr, p, p_stride, values, n, d);
  }
}
#else
constexpr int ROW_SET = 4;

template <typename T>
inline void score_chunk(const float* q, const T* const* keys, int64_t d, float* s) {
  for (int64_t j = 0; j < KEYS; ++j) {
    float sum = 0.f;
    for (int64_t i = 0; i < d; ++i) sum += q[i] * static_cast<float>(keys[j][i]);
    s[j] = sum;
  }
}

inline float softmax_row(float* s, int64_t n, int64_t visible, float* run_max, float* run_sum) {
  float m = *run_max, sum = 0.f;
  for (int64_t j = 0; j < visible; ++j) m = std::max(m, s[j]);
  for (int64_t j = 0; j < n; ++j) {
    s[j] = j < visible ? exp_nonpositive(s[j] - m) : 0.f;
    sum += s[j];
  }
  const float corr = exp_nonpositive(*run_max - m);
  *run_max = m;
  *run_sum = *run_sum * corr + sum;
  return corr;
}

template <typename T>
inline void accumulate_rows(int64_t rows, float* acc, int64_t acc_stride, const float* corr,
                            const float* p, int64_t p_stride, const T* const* values, int64_t n,
                            int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    float* a = acc + r * acc_stride;
    for (int64_t i = 0; i < d; ++i) a[i] *= corr[r];
    for (int64_t j = 0; j < n; ++j) {
      const float pj = p[r * p_stride + j];
      for (int64_t i = 0; i < d; ++i) a[i] += pj * static_cast<float>(values[j][i]);
    }
  }
}
#endif

// Scratch of one thread, reused from item to item. Buffers only grow (q8.h grow_to).
struct AttentionScratch {
  std::vector<float> queries, acc, max, sum, scores, corr;
};

using q8::grow_to;

}  // namespace

// One work item: tile `tile`, KV heads head0 .. head0 + item_heads - 1, keys key_begin .. key_end
// - 1. merge < 0: the item covers all the tile's keys and writes `out`; else it leaves its
// running (maximum, sum, weighted values) at offset `partial` of the partial buffer, for merge
// job `merge`.
struct AttentionItem {
  int64_t tile, head0, key_begin, key_end, merge, partial;
};

// A tile's heads whose keys were cut into `parts` items, their states at partial, partial +
// stride, ...: merged into `out` by whichever thread finishes the last of them (no second pass
// over the threads, whose start costs about as much as a short merge).
struct MergeJob {
  int64_t tile, head0, parts, partial, stride;
};

// Shorter ranges cost more to merge than they save (key x KV head pairs per range).
constexpr int64_t MIN_PARTITION_KEYS = 128;

// The work of one call, and the partial states of the ranges that are merged. Each calling
// thread keeps its own and reuses it: a batch-1 decode step calls the kernel once per layer, in
// about 10 us, and needs no allocation per call.
struct AttentionPlan {
  int64_t item_heads = 1;
  std::vector<AttentionItem> items;
  std::vector<MergeJob> merges;
  std::vector<float> partials;
  std::vector<std::atomic<int64_t>> parts_done;
};

namespace {

// Cut the tiles into work items. One KV head per item when there are few tiles of several rows
// (a short prefill: more items for the threads, and a tile's rows fill the item's work). All KV
// heads per item for decode tiles (one row each) and for many tiles: a key's row of the cache,
// kv_heads x head_dim values, is then read in one stretch instead of one head's slice of every
// row, and each row's block-table lookup serves all heads (batch 1, 207 keys, SmolLM2's 3 KV
// heads: 12.4 -> 11.7 us with 1 thread and 9.0 -> 7.7 us with 2, cache hot). Tiles still too few
// for the threads are cut into key ranges: for decode tiles, ranges of one thread's share of all
// the tiles' keys (batch 1: one range per thread, each streaming its own part of the context; a
// long context beside short ones is cut so that it does not keep one thread busy alone), for
// prefill tiles, four ranges per thread.
void plan_attention(const int32_t* tp, int64_t num_tiles, int64_t kv_heads, int64_t group,
                    int64_t padded_dim, int64_t threads, AttentionPlan& plan) {
  int64_t longest = 0, most_rows = 0, all_keys = 0;
  for (int64_t t = 0; t < num_tiles; ++t) {
    longest = std::max<int64_t>(longest, tp[4 * t + 1] + tp[4 * t + 3]);
    most_rows = std::max<int64_t>(most_rows, tp[4 * t + 1]);
    all_keys += tp[4 * t + 1] + tp[4 * t + 3];
  }
  const bool many_tiles = num_tiles >= 4 * threads;
  const bool whole_rows = most_rows == 1 || many_tiles;
  const int64_t item_heads = whole_rows ? kv_heads : 1;
  const int64_t items_per_tile = kv_heads / item_heads;
  const int64_t base_items = num_tiles * items_per_tile;
  int64_t partition_keys = longest;
  if (threads > 1 && !many_tiles && (whole_rows || base_items < 4 * threads)) {
    // Decode tiles: ranges of about one thread's share of all the keys, so that a long context
    // next to short ones is cut too. Prefill tiles: each cut into enough ranges for 4 per thread.
    const int64_t want = (4 * threads + base_items - 1) / base_items;  // ranges per tile
    const int64_t share =
        whole_rows ? (all_keys + threads - 1) / threads : (longest + want - 1) / want;
    const int64_t min_keys = (MIN_PARTITION_KEYS + item_heads - 1) / item_heads;
    partition_keys = std::max<int64_t>(min_keys, share);
    partition_keys = (partition_keys + KEYS - 1) / KEYS * KEYS;  // whole chunks of keys
  }
  plan.item_heads = item_heads;
  plan.items.clear();
  plan.merges.clear();
  int64_t partial_floats = 0;
  for (int64_t t = 0; t < num_tiles; ++t) {
    const int64_t num_keys = tp[4 * t + 1] + tp[4 * t + 3];
    const int64_t rows = item_heads * tp[4 * t + 1] * group;  // query vectors of one item
    const int64_t parts = (num_keys + partition_keys - 1) / partition_keys;
    for (int64_t h = 0; h < items_per_tile; ++h) {
      const int64_t head0 = h * item_heads, stride = rows * (padded_dim + 2);
      if (parts == 1) {
        plan.items.push_back({t, head0, 0, num_keys, -1, 0});
        continue;
      }
      const int64_t merge = static_cast<int64_t>(plan.merges.size());
      plan.merges.push_back({t, head0, parts, partial_floats, stride});
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t begin = p * partition_keys;
        const int64_t end = std::min(num_keys, begin + partition_keys);
        plan.items.push_back({t, head0, begin, end, merge, partial_floats});
        partial_floats += stride;
      }
    }
  }
  if (static_cast<int64_t>(plan.partials.size()) < partial_floats)
    plan.partials.resize(partial_floats);
  if (plan.parts_done.size() < plan.merges.size())
    plan.parts_done = std::vector<std::atomic<int64_t>>(plan.merges.size());
  for (size_t m = 0; m < plan.merges.size(); ++m) plan.parts_done[m].store(0);
}

// Copy this step's K or V rows ([tokens, kv_heads, head_dim], heads contiguous) to their slots,
// rounded to the cache's dtype when it is narrower (bfloat16 KV cache of a float32 model: round
// to nearest even, as torch's .to(torch.bfloat16) does). The tensors are read when it is made,
// the rows copied when it is called (a team reads every layer's tensors once a step, before its
// threads start: fused_blocks.cpp's LayerStack).
template <typename T, typename C>
struct NewRows {
  const T* sp;
  int64_t tokens, row, stride;
  C* cp;
  const int64_t* slot;  // in range: check_paged_attention

  NewRows(const torch::Tensor& src, torch::Tensor& cache, const torch::Tensor& slots)
      : sp(src.data_ptr<T>()), tokens(src.size(0)), row(src.size(1) * src.size(2)),
        stride(src.stride(0)), cp(cache.data_ptr<C>()), slot(slots.data_ptr<int64_t>()) {}

  void operator()() const {
    for (int64_t t = 0; t < tokens; ++t) {
      if constexpr (std::is_same_v<T, C>) {
        std::memcpy(cp + slot[t] * row, sp + t * stride, row * sizeof(T));
      } else {
        for (int64_t i = 0; i < row; ++i)
          cp[slot[t] * row + i] = static_cast<C>(static_cast<float>(sp[t * stride + i]));
      }
    }
  }
};

template <typename T, typename C>
void write_new_rows(const torch::Tensor& src, torch::Tensor& cache, const torch::Tensor& slots) {
  NewRows<T, C>(src, cache, slots)();
}

bool heads_contiguous(const torch::Tensor& x) {
  return x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2);
}

// The work of one paged_attention call after this step's K/V are in the cache: `make_plan` cuts it
// into items, and `item(i)` runs item i (any thread, any order). T: the queries' and the output's
// dtype; C: the cache's (T, or bfloat16 under a float32 model).
template <typename T, typename C>
struct AttentionRun {
  int64_t num_heads, head_dim, block_size, kv_heads, group, max_blocks, padded_dim, q_stride;
  const T* qp;
  const C* kp;
  const C* vp;
  const int32_t* tables;
  const int32_t* tp;
  T* op;
  float fscale;
  int64_t token_stride;  // values between two slots of the cache
  AttentionPlan* plan;

  AttentionRun(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
               const torch::Tensor& block_tables, const torch::Tensor& tiles, double scale,
               torch::Tensor& out, AttentionPlan& plan_)
      : num_heads(q.size(1)), head_dim(q.size(2)), block_size(k_cache.size(1)),
        kv_heads(k_cache.size(2)), group(num_heads / kv_heads),  // query heads per KV head
        max_blocks(block_tables.size(1)),
        padded_dim((head_dim + W - 1) / W * W),  // scratch rows: whole vectors
        q_stride(q.stride(0)), qp(q.data_ptr<T>()), kp(k_cache.data_ptr<C>()),
        vp(v_cache.data_ptr<C>()), tables(block_tables.data_ptr<int32_t>()),
        tp(tiles.data_ptr<int32_t>()), op(out.data_ptr<T>()), fscale(static_cast<float>(scale)),
        token_stride(kv_heads * head_dim), plan(&plan_) {}

  void make_plan(int64_t num_tiles, int64_t threads) const {
    plan_attention(tp, num_tiles, kv_heads, group, padded_dim, threads, *plan);
  }

  // For another layer under the same plan: no range merged yet.
  void reset_merges() const {
    for (size_t m = 0; m < plan->merges.size(); ++m) plan->parts_done[m].store(0);
  }

  int64_t num_items() const { return static_cast<int64_t>(plan->items.size()); }

  // Query vector r of an item = (KV head head0 + r / per_head, tile row i, head g of its group),
  // with i * group + g = r % per_head: q[row0 + i, (head0 + r / per_head) * group + g, :].
  int64_t q_row(int64_t tile, int64_t head0, int64_t r) const {
    const int64_t per_head = tp[4 * tile + 1] * group;
    const int64_t h = head0 + r / per_head, i = (r % per_head) / group, g = r % group;
    return (tp[4 * tile] + i) * q_stride + (h * group + g) * head_dim;  // in q
  }
  int64_t out_row(int64_t tile, int64_t head0, int64_t r) const {
    const int64_t per_head = tp[4 * tile + 1] * group;
    const int64_t h = head0 + r / per_head, i = (r % per_head) / group, g = r % group;
    return ((tp[4 * tile] + i) * num_heads + h * group + g) * head_dim;  // in out
  }

  void item(int64_t index) const;
};

template <typename T, typename C>
void AttentionRun<T, C>::item(int64_t index) const {
  const int64_t item_heads = plan->item_heads;
  const std::vector<MergeJob>& merges = plan->merges;
  std::vector<float>& partials = plan->partials;
  std::vector<std::atomic<int64_t>>& parts_done = plan->parts_done;
  const AttentionItem& item = plan->items[index];
  const int64_t t = item.tile, h0 = item.head0;
  const int64_t num_rows = tp[4 * t + 1];
  const int32_t* table = tables + static_cast<int64_t>(tp[4 * t + 2]) * max_blocks;
  const int64_t pos0 = tp[4 * t + 3];
  const int64_t per_head = num_rows * group;  // query vectors of one KV head
  const int64_t rows = item_heads * per_head;

  thread_local AttentionScratch scratch;
  float* queries = grow_to(scratch.queries, rows * padded_dim);  // scaled
  float* acc = grow_to(scratch.acc, rows * padded_dim);  // running sum of p * V, not normalised
  float* run_max = grow_to(scratch.max, rows);           // running maximum of the scores
  float* run_sum = grow_to(scratch.sum, rows);           // running sum of exp(score - max)
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = qp + q_row(t, h0, r);
    float* dst = queries + r * padded_dim;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]) * fscale;
    std::fill(dst + head_dim, dst + padded_dim, 0.f);
    std::fill(acc + r * padded_dim, acc + (r + 1) * padded_dim, 0.f);
    run_max[r] = -std::numeric_limits<float>::infinity();
    run_sum[r] = 0.f;
  }

  // Offsets in the cache of the rows of keys j0 .. j0 + n - 1 (head 0), then up to a whole
  // number of KEYS repeating the last one, so that a short chunk is scored like a full one (its
  // extra keys get weight 0). Walks the block table without a division per key.
  const int64_t key_end = item.key_end;
  auto chunk_rows = [&](int64_t j0, int64_t n, int64_t* offset) {
    int64_t b = j0 / block_size, o = j0 % block_size;
    for (int64_t j = 0; j < n; ++j) {
      offset[j] = (static_cast<int64_t>(table[b]) * block_size + o) * token_stride;
      if (++o == block_size) o = 0, ++b;
    }
    std::fill(offset + n, offset + (n + KEYS - 1) / KEYS * KEYS, offset[n - 1]);
  };
  // Ask for one head's slice of these rows of the cache (one line at a time, into L1) a phase
  // before it is read: the values while the head's scores are computed, the next head's (or
  // the next chunk's first head's) keys while the values are added. Blocks lie anywhere in the
  // cache, so the hardware prefetcher cannot guess where the next rows start; and asked for a
  // whole chunk ahead, the lines did not arrive any sooner (measured).
  auto prefetch = [&](const C* cache, const int64_t* offset, int64_t n, int64_t head) {
    const int64_t bytes = head_dim * static_cast<int64_t>(sizeof(C));
    for (int64_t j = 0; j < n; ++j) {
      const char* row = reinterpret_cast<const char*>(cache + offset[j] + head * head_dim);
      for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(row + at, 0, 3);
    }
  };
  // Keys of this chunk that tile row i sees (causal: up to its own position).
  auto visible_keys = [&](int64_t r, int64_t j0, int64_t n) {
    const int64_t i = (r % per_head) / group;
    return std::min<int64_t>(n, pos0 + i + 1 - j0);
  };

  float* scores = grow_to(scratch.scores, rows * CHUNK);  // then the weights p
  float* corr = grow_to(scratch.corr, rows);
  int64_t offset[CHUNK], next[CHUNK];
  const C* keys[CHUNK];
  const C* values[CHUNK];
  chunk_rows(item.key_begin, std::min<int64_t>(CHUNK, key_end - item.key_begin), offset);
  for (int64_t j0 = item.key_begin; j0 < key_end; j0 += CHUNK) {
    const int64_t n = std::min<int64_t>(CHUNK, key_end - j0);
    const int64_t padded = (n + KEYS - 1) / KEYS * KEYS;
    const int64_t next_n = std::min<int64_t>(CHUNK, key_end - j0 - CHUNK);
    if (next_n > 0) chunk_rows(j0 + CHUNK, next_n, next);
    const int64_t first_row = std::max<int64_t>(j0 - pos0, 0);  // rows before it see no key here
    for (int64_t hh = 0; hh < item_heads; ++hh) {
      for (int64_t j = 0; j < padded; ++j) {
        keys[j] = kp + offset[j] + (h0 + hh) * head_dim;
        values[j] = vp + offset[j] + (h0 + hh) * head_dim;
      }
      const int64_t r0 = hh * per_head + first_row * group, r_end = (hh + 1) * per_head;
      prefetch(vp, offset, n, h0 + hh);
      for (int64_t r = r0; r < r_end; ++r) {
        const int64_t visible = visible_keys(r, j0, n);
        float* s = scores + r * CHUNK;
        for (int64_t j = 0; j < visible; j += KEYS)
          score_chunk(queries + r * padded_dim, keys + j, head_dim, s + j);
        corr[r] = softmax_row(s, padded, visible, run_max + r, run_sum + r);
      }
      if (hh + 1 < item_heads)
        prefetch(kp, offset, n, h0 + hh + 1);
      else if (next_n > 0)
        prefetch(kp, next, next_n, h0);
      for (int64_t r = r0; r < r_end; r += ROW_SET) {
        const int64_t set = std::min<int64_t>(ROW_SET, r_end - r);
        const int64_t seen = visible_keys(r + set - 1, j0, n);  // the set's last row sees most
        accumulate_rows(set, acc + r * padded_dim, padded_dim, corr + r, scores + r * CHUNK,
                        CHUNK, values, seen, head_dim);
      }
    }
    if (next_n > 0) std::copy(next, next + CHUNK, offset);
  }
  if (item.merge < 0) {  // the whole range: normalise and write out
    for (int64_t r = 0; r < rows; ++r) {
      T* o = op + out_row(t, h0, r);
      const float inv = 1.f / run_sum[r];
      const float* a = acc + r * padded_dim;
      for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(a[d] * inv);
    }
    return;
  }
  // A partial state per row: maximum, sum, then the weighted values (a row that saw no key of
  // this range keeps maximum -inf, sum 0 and weighs nothing in the merge).
  for (int64_t r = 0; r < rows; ++r) {
    float* state = partials.data() + item.partial + r * (padded_dim + 2);
    state[0] = run_max[r];
    state[1] = run_sum[r];
    std::copy(acc + r * padded_dim, acc + r * padded_dim + head_dim, state + 2);
  }
  // The last range to finish merges them all (acquire-release: it sees the others' states).
  const MergeJob& job = merges[item.merge];
  if (parts_done[item.merge].fetch_add(1, std::memory_order_acq_rel) != job.parts - 1) return;
  // Rescale every range's state to the largest maximum, add, normalise.
  float* total = acc;  // this item's own sums are saved: the scratch is free
  for (int64_t r = 0; r < rows; ++r) {
    auto state = [&](int64_t p) {
      return partials.data() + job.partial + p * job.stride + r * (padded_dim + 2);
    };
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < job.parts; ++p) m = std::max(m, state(p)[0]);
    float sum = 0.f;
    std::fill(total, total + head_dim, 0.f);
    for (int64_t p = 0; p < job.parts; ++p) {
      const float* s = state(p);
      if (s[1] == 0.f) continue;  // saw no key of this range
      const float weight = exp_nonpositive(s[0] - m);
      sum += s[1] * weight;
      for (int64_t d = 0; d < head_dim; ++d) total[d] += s[2 + d] * weight;
    }
    T* o = op + out_row(t, h0, r);
    const float inv = 1.f / sum;
    for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(total[d] * inv);
  }
}

// T: the queries', new keys' and values' and the output's dtype; C: the cache's (T, or bfloat16
// under a float32 model).
template <typename T, typename C>
void paged_attention_impl(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          torch::Tensor& k_cache, torch::Tensor& v_cache,
                          const torch::Tensor& slots, const torch::Tensor& block_tables,
                          const torch::Tensor& tiles, double scale, torch::Tensor& out) {
  write_new_rows<T, C>(k, k_cache, slots);
  write_new_rows<T, C>(v, v_cache, slots);
  if (tiles.size(0) == 0) return;
  thread_local AttentionPlan plan;
  const AttentionRun<T, C> run(q, k_cache, v_cache, block_tables, tiles, scale, out, plan);
  run.make_plan(tiles.size(0), at::get_num_threads());
  parallel_items(run.num_items(), [&](int64_t index) { run.item(index); });
}


}  // namespace

void check_paged_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& slots, const torch::Tensor& block_tables,
                           const torch::Tensor& tiles, const torch::Tensor& out) {
  const auto dtype = q.scalar_type(), cache_dtype = k_cache.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16,
              "paged_attention: float32 or bfloat16 only");
  for (const auto t : {k.scalar_type(), v.scalar_type(), out.scalar_type()})
    TORCH_CHECK(t == dtype, "paged_attention: q, k, v and out need one dtype");
  TORCH_CHECK(v_cache.scalar_type() == cache_dtype &&
                  (cache_dtype == dtype || cache_dtype == torch::kBFloat16),
              "paged_attention: the caches hold q's dtype, or bfloat16");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && tiles.dtype() == torch::kInt32 &&
                  slots.dtype() == torch::kInt64,
              "paged_attention: block_tables and tiles int32, slots int64");
  TORCH_CHECK(heads_contiguous(q) && heads_contiguous(k) && heads_contiguous(v),
              "paged_attention: q, k, v need contiguous heads ([tokens, heads, head_dim])");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous() &&
                  block_tables.is_contiguous() && tiles.is_contiguous() && slots.is_contiguous(),
              "paged_attention: contiguous caches, out, tables, tiles and slots only");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.size(3) == q.size(2) && k.size(1) == k_cache.size(2) &&
                  k.sizes() == v.sizes() && k.size(2) == q.size(2) &&
                  q.size(1) % k_cache.size(2) == 0 && slots.numel() == k.size(0) &&
                  out.sizes() == q.sizes(),
              "paged_attention: shapes");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "paged_attention: slot out of range");
}

void paged_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots,
                     const torch::Tensor& block_tables, const torch::Tensor& tiles, double scale,
                     torch::Tensor& out) {
  check_paged_attention(q, k, v, k_cache, v_cache, slots, block_tables, tiles, out);
  if (q.scalar_type() == torch::kBFloat16)
    paged_attention_impl<bf16, bf16>(q, k, v, k_cache, v_cache, slots, block_tables, tiles, scale,
                                     out);
  else if (k_cache.scalar_type() == torch::kBFloat16)
    paged_attention_impl<float, bf16>(q, k, v, k_cache, v_cache, slots, block_tables, tiles, scale,
                                      out);
  else
    paged_attention_impl<float, float>(q, k, v, k_cache, v_cache, slots, block_tables, tiles,
                                       scale, out);
}

TeamAttention::TeamAttention() : plan_(std::make_unique<AttentionPlan>()) {}
TeamAttention::~TeamAttention() = default;

// Calls fn(AttentionRun<float, C>) for the cache's dtype C.
template <typename F>
void with_float_run(const torch::Tensor& q, const torch::Tensor& k_cache,
                    const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                    const torch::Tensor& tiles, double scale, torch::Tensor& out,
                    AttentionPlan& plan, const F& fn) {
  if (k_cache.scalar_type() == torch::kBFloat16)
    fn(AttentionRun<float, bf16>(q, k_cache, v_cache, block_tables, tiles, scale, out, plan));
  else
    fn(AttentionRun<float, float>(q, k_cache, v_cache, block_tables, tiles, scale, out, plan));
}

void TeamAttention::plan(const torch::Tensor& q, const torch::Tensor& k_cache,
                         const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                         const torch::Tensor& tiles, torch::Tensor& out, int64_t threads) {
  with_float_run(q, k_cache, v_cache, block_tables, tiles, 1.0, out, *plan_,
                 [&](const auto& run) { run.make_plan(tiles.size(0), threads); });
}

void TeamAttention::prepare(const torch::Tensor& q, const torch::Tensor& k,
                            const torch::Tensor& v, std::vector<torch::Tensor>& k_caches,
                            std::vector<torch::Tensor>& v_caches, const torch::Tensor& slots,
                            const torch::Tensor& block_tables, const torch::Tensor& tiles,
                            const std::vector<double>& scales, torch::Tensor& out) {
  layers_.clear();
  for (size_t i = 0; i < k_caches.size(); ++i)
    with_float_run(q, k_caches[i], v_caches[i], block_tables, tiles, scales[i], out, *plan_,
                   [&](const auto& run) {
                     using Cache = std::remove_cv_t<std::remove_pointer_t<decltype(run.kp)>>;
                     const NewRows<float, Cache> new_k(k, k_caches[i], slots);
                     const NewRows<float, Cache> new_v(v, v_caches[i], slots);
                     layers_.push_back({[run, new_k, new_v] {
                                          new_k(), new_v();
                                          run.reset_merges();
                                        },
                                        [run](int64_t index) { run.item(index); }});
                   });
  items_ = static_cast<int64_t>(plan_->items.size());
}

void TeamAttention::start_layer(size_t layer) const { layers_[layer].start(); }

void TeamAttention::run_items(size_t layer, std::atomic<int64_t>& next) const {
  const auto& item = layers_[layer].item;
  for (int64_t i = next.fetch_add(1); i < items_; i = next.fetch_add(1)) item(i);
}

// ---------------------------------------------------------------------------------------------
// Weight-only int8 and int4 linear layers: y = x @ W^T (+ bias) with W stored quantized.
// Activations stay float32. A work item is ITEM_CHANNELS output channels.
//
// One activation row (a decode step at batch 1) should be bound by reading the weights from
// memory: each quantized byte is read once and widened in registers inside the dot product. The
// widening (int8 -> int32 -> float, or nibble -> float) costs more instructions than the
// multiply-add itself, so the row is walked a few output channels at a time (ROW_CHANNELS for
// int4, INT8_ROW_CHANNELS for int8): each activation vector is loaded once for all of them, and
// their accumulators are independent chains of multiply-adds that the CPU overlaps (one channel at
// a time waits on each add's latency). A tile's rows are short (576 bytes of int8 here), too
// short for the hardware prefetcher to notice several interleaved streams, so each tile asks for
// the bytes of the tile ROW_PREFETCH_TILES ahead while it computes (software prefetch: 12 -> 36
// GB/s at one row on a 49152 x 576 int8 matrix, 2 threads, when int8 tiles were 8 channels), and
// each thread takes one contiguous range of tiles.
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
// An int4 weight's scales and minimums are float32 (engine/kernels/quant.py quantize_int4) or
// float16 (a GGUF's Q4_1 blocks store them so: 20 bytes per 32 weights instead of 24, and where
// the weights stream from memory the one-row kernels are limited by the bytes they read).
// int4_linear is a template over that type.
inline float to_float(float v) { return v; }
inline float to_float(at::Half v) {
#if defined(__F16C__)
  return _cvtsh_ss(v.x);
#else
  return static_cast<float>(v);
#endif
}

constexpr int64_t ITEM_CHANNELS = QUANT_ROWS_ITEM;  // output channels per work item
constexpr int TILE_M = 4;              // activation rows per register tile
constexpr int ROW_CHANNELS = 8;        // output channels per tile of the one-row case (int4)
// int8's: each channel's row is one stream of bytes, and two streams a thread read faster than
// eight (batch-1 int8 decode 153-163 -> 196-233 tokens/s on a Zen 4 VM; one: 199-214).
constexpr int INT8_ROW_CHANNELS = 2;
constexpr int ROW_PREFETCH_TILES = 4;  // how many tiles ahead the one-row case prefetches

#if defined(__AVX512F__)
constexpr int TILE_N = 4;  // output channels per register tile
struct Vec {
  static constexpr int64_t width = 16;
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const at::Half* p) {  // `width` float16 values -> floats
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a*b + c
  static Vec add(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
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
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  float sum() const { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int TILE_N = 2;
struct Vec {
  static constexpr int64_t width = 8;
  __m256 v;
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const at::Half* p) {
#if defined(__F16C__)
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
#else
    alignas(32) float f[8];
    for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
    return {_mm256_load_ps(f)};
#endif
  }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
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
  void store(float* p) const { _mm256_storeu_ps(p, v); }
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
  static Vec load(const at::Half* p) { return {static_cast<float>(*p)}; }
  static Vec fma(Vec a, Vec b, Vec c) { return {a.v * b.v + c.v}; }
  static Vec add(Vec a, Vec b) { return {a.v + b.v}; }
  static Vec set1(float f) { return {f}; }
  static Vec int8s(const int8_t* p) { return {static_cast<float>(*p)}; }
  template <int SHIFT>
  static Vec nibbles(const uint8_t* p) { return {static_cast<float>((*p >> SHIFT) & 15)}; }
  void store(float* p) const { *p = v; }
  float sum() const { return v; }
};
#endif
// a . b over n floats: whole vectors, then the rest one by one. (An `omp simd reduction` loop
// ends with GCC adding its lanes one after another: at a 576-wide row's 18 groups that serial end
// cost as much as the int4 tile's dot products themselves.)
// `a` may be float16 (an int4 weight's minimums, see to_float above).
template <typename S>
inline float dot(const S* a, const float* b, int64_t n) {
  Vec acc = Vec::zero();
  int64_t i = 0;
  for (; i + Vec::width <= n; i += Vec::width)
    acc = Vec::fma(Vec::load(a + i), Vec::load(b + i), acc);
  float s = acc.sum();
  for (; i < n; ++i) s += to_float(a[i]) * b[i];
  return s;
}

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

// Output channels c0 .. c1 of y [m, n] for m > 1 rows, an item of ITEM_CHANNELS channels at a
// time from c0 (a multiple of ITEM_CHANNELS): widen(j, row) writes channel j's weights as k
// floats. The item's channels are first widened into float rows (in L1 or L2; each quantized byte
// is read once per call), then the activation rows run TILE_M at a time against register tiles of
// TILE_N channels.
template <typename Widen>
void widened_rows(const float* xp, int64_t m, int64_t k, int64_t n, const float* bp, float* yp,
                  int64_t c0, int64_t c1, const Widen& widen) {
  thread_local std::vector<float> wide;  // an item's channels widened to floats, [ITEM, k]
  wide.resize(ITEM_CHANNELS * k);
  for (int64_t n0 = c0; n0 < c1; n0 += ITEM_CHANNELS) {
    const int64_t channels = std::min(c1, n0 + ITEM_CHANNELS) - n0;
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
  }
}

void add_bias(const float* bias, float* y, int64_t c0, int64_t c1) {
  if (bias)
    for (int64_t j = c0; j < c1; ++j) y[j] += bias[j];
}

// y[c] = scales[c] * (x . q_c) for the NC consecutive int8 channels whose rows start at w. Each
// channel keeps two accumulators, for even and odd vectors: with one, a pair of channels is two
// chains of multiply-adds, each waiting on the last one's latency (4 cycles), and on AVX2 that is
// 16 weights a chain per 4 cycles, about 14 GB/s a core where the memory gives 17-20.
template <int NC>
inline void int8_row_tile(const float* x, const int8_t* w, int64_t k, const float* scales,
                          float* y) {
  Vec acc[NC], odd[NC];
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) acc[c] = odd[c] = Vec::zero();
  // The tiles ahead start NC * k bytes apart (rows are contiguous): fetch NC * width of them
  // per step, so that one pass over this tile has asked for the whole of that one.
  const int8_t* ahead = w + ROW_PREFETCH_TILES * NC * k;
  int64_t i = 0;
  for (; i + 2 * Vec::width <= k; i += 2 * Vec::width, ahead += 2 * NC * Vec::width) {
    for (int64_t b = 0; b < 2 * NC * Vec::width; b += 64) __builtin_prefetch(ahead + b);
    const Vec xv = Vec::load(x + i), xw = Vec::load(x + i + Vec::width);
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      acc[c] = Vec::fma(xv, Vec::int8s(w + c * k + i), acc[c]);
      odd[c] = Vec::fma(xw, Vec::int8s(w + c * k + i + Vec::width), odd[c]);
    }
  }
  for (; i + Vec::width <= k; i += Vec::width) {
    const Vec xv = Vec::load(x + i);
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) acc[c] = Vec::fma(xv, Vec::int8s(w + c * k + i), acc[c]);
  }
  for (int c = 0; c < NC; ++c) {
    float s = Vec::add(acc[c], odd[c]).sum();
    for (int64_t t = i; t < k; ++t) s += x[t] * static_cast<float>(w[c * k + t]);  // k % width
    y[c] = s * scales[c];
  }
}

// y[c] = sum over groups g of scale[c, g] * (x_g . q_c,g) + min[c, g] * sum(x_g), for the NC
// consecutive int4 channels whose packed rows start at b (row_bytes apart). Needs half a group to
// be a whole number of vectors: then every loop over c is unrolled and a[c], acc[c] stay in
// registers. The min terms are one dot product per channel with the activation's group sums.
template <int NC, typename S>
inline void int4_row_tile(const float* x, const uint8_t* b, int64_t row_bytes, const S* scales,
                          const S* mins, int64_t groups, int64_t group_size, const float* xsum,
                          float* y) {
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
    for (int c = 0; c < NC; ++c)
      acc[c] = Vec::fma(Vec::set1(to_float(scales[c * groups + g])), a[c], acc[c]);
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
// int4, group-wise with a scale and a minimum (GGUF's Q4_1 idea): in each group of G consecutive
// input channels, w ~ q * scale + min with q in 0..15. Packing (engine/kernels/quant.py): in each
// group, byte e holds element e in its low nibble and element e + G/2 in its high nibble, so a
// group unpacks with one mask and one shift, no shuffle.
//
// Both run quant_rows_part on a range of output channels: int8_linear and int4_linear split the
// channels over their threads (ROW_CHANNELS at a time for one row, ITEM_CHANNELS for more), and a
// member of the layer stack's team takes its share of 16 at a time (fused_blocks.cpp); a channel's
// arithmetic is the same whoever runs it, so the outputs are the same bit for bit.
namespace {
void int8_rows_part(const QuantRows& w, const float* x, int64_t m, const float* bias, float* y,
                    int64_t c0, int64_t c1) {
  const int8_t* wp = static_cast<const int8_t*>(w.weights);
  const float* sp = static_cast<const float*>(w.scales);
  const int64_t k = w.k;
  if (m > 1) {
    widened_rows(x, m, k, w.n, bias, y, c0, c1, [&](int64_t j, float* row) {
      const int8_t* q = wp + j * k;
      const float scale = sp[j];
#pragma omp simd
      for (int64_t i = 0; i < k; ++i) row[i] = static_cast<float>(q[i]) * scale;
    });
    return;
  }
  int64_t j = c0;
  for (; j + INT8_ROW_CHANNELS <= c1; j += INT8_ROW_CHANNELS)
    int8_row_tile<INT8_ROW_CHANNELS>(x, wp + j * k, k, sp + j, y + j);
  for (; j < c1; ++j) int8_row_tile<1>(x, wp + j * k, k, sp + j, y + j);
  add_bias(bias, y, c0, c1);
}

// scales and mins: both float32 or both float16 (S), one per group. xsum: x's group sums (one row).
template <typename S>
void int4_rows_part(const QuantRows& w, const float* x0, const float* xsum, int64_t m,
                    const float* bias, float* y, int64_t c0, int64_t c1) {
  const int64_t k = w.k, group_size = w.group_size;
  const int64_t groups = k / group_size, half = group_size / 2;
  const uint8_t* wp = static_cast<const uint8_t*>(w.weights);
  const S* scp = static_cast<const S*>(w.scales);
  const S* mnp = static_cast<const S*>(w.mins);
  if (m > 1) {
    widened_rows(x0, m, k, w.n, bias, y, c0, c1, [&](int64_t j, float* row) {
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* b = wp + j * (k / 2) + g * half;
        const float scale = to_float(scp[j * groups + g]), mn = to_float(mnp[j * groups + g]);
        float* out = row + g * group_size;
#pragma omp simd
        for (int64_t e = 0; e < half; ++e) {
          out[e] = static_cast<float>(b[e] & 0x0F) * scale + mn;
          out[e + half] = static_cast<float>(b[e] >> 4) * scale + mn;
        }
      }
    });
    return;
  }
  // One row: each channel reads its packed bytes once, widening the nibbles in registers.
  auto one_channel = [&](int64_t j) {
    const uint8_t* b = wp + j * (k / 2);
    const S* sc = scp + j * groups;
    const S* mn = mnp + j * groups;
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
      const float scale = to_float(sc[g]);
      acc = Vec::fma(Vec::set1(scale), a, acc);
      total += scale * tail + to_float(mn[g]) * xsum[g];
    }
    return total + acc.sum();
  };
  // A group whose half is a whole number of vectors (group 32 on AVX-512 and AVX2) runs in tiles
  // of ROW_CHANNELS channels; any other group size one channel at a time, ending in scalars.
  int64_t j = c0;
  if (half % Vec::width == 0)
    for (; j + ROW_CHANNELS <= c1; j += ROW_CHANNELS)
      int4_row_tile<ROW_CHANNELS, S>(x0, wp + j * (k / 2), k / 2, scp + j * groups,
                                     mnp + j * groups, groups, group_size, xsum, y + j);
  for (; j < c1; ++j) y[j] = one_channel(j);
  add_bias(bias, y, c0, c1);
}
}  // namespace

QuantRows int8_rows(const torch::Tensor& qweight, const torch::Tensor& scales) {
  TORCH_CHECK(qweight.dtype() == torch::kInt8 && qweight.is_contiguous() && qweight.dim() == 2,
              "int8_linear: qweight must be contiguous int8 [N, K]");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() &&
                  scales.numel() == qweight.size(0),
              "int8_linear: scales must be contiguous float32 [N]");
  return {qweight.data_ptr<int8_t>(), scales.data_ptr<float>(), nullptr, false, false,
          qweight.size(0), qweight.size(1), 0};
}

QuantRows int4_rows(const torch::Tensor& packed, const torch::Tensor& scales,
                    const torch::Tensor& mins, int64_t group_size) {
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 2,
              "int4_linear: packed must be contiguous uint8 [N, K / 2]");
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK(group_size > 0 && group_size % 2 == 0 && k % group_size == 0,
              "int4_linear: shapes");
  q8::check_int4_scales(scales, mins, n, k / group_size, "int4_linear");
  return {packed.data_ptr<uint8_t>(), scales.data_ptr(), mins.data_ptr(), true,
          scales.dtype() == torch::kFloat16, n, k, group_size};
}

// The minimums' term of int4: sum_e x*(q*scale + min) = scale * sum_e x*q + min * sum_e x.
void row_group_sums(const QuantRows& w, const float* x, float* out) {
  const int64_t group_size = w.group_size;
  for (int64_t g = 0; g < w.num_groups(); ++g) {
    float t = 0.f;
#pragma omp simd reduction(+ : t)
    for (int64_t e = 0; e < group_size; ++e) t += x[g * group_size + e];
    out[g] = t;
  }
}

void quant_rows_part(const QuantRows& w, const float* x, const float* x_sums, int64_t m,
                     const float* bias, float* y, int64_t c0, int64_t c1) {
  if (m < 1) return;  // no rows (an output layer in a step where no request samples)
  if (!w.int4)
    int8_rows_part(w, x, m, bias, y, c0, c1);
  else if (w.half)
    int4_rows_part<at::Half>(w, x, x_sums, m, bias, y, c0, c1);
  else
    int4_rows_part<float>(w, x, x_sums, m, bias, y, c0, c1);
}

// One row: every tile of ROW_CHANNELS channels costs the same, so each thread takes one contiguous
// range of tiles. (Chunks handed out dynamically were 20 % slower on a Xeon whose 480 MB L3 holds
// the weights: a thread no longer reads the same rows step after step.) More rows: items of
// ITEM_CHANNELS channels, handed out one at a time.
torch::Tensor quant_rows_linear(const torch::Tensor& x, const QuantRows& w,
                                const c10::optional<torch::Tensor>& bias) {
  check_x(x, bias);
  const int64_t m = x.size(0), n = w.n;
  TORCH_CHECK(x.size(1) == w.k && (!bias.has_value() || bias->numel() == n),
              "quantized linear: x must be [M, ", w.k, "] and a bias [", n, "]");
  auto y = torch::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  if (m == 1) {
    std::vector<float> sums(w.num_groups());
    row_group_sums(w, xp, sums.data());
    at::parallel_for(0, (n + ROW_CHANNELS - 1) / ROW_CHANNELS, 1, [&](int64_t t0, int64_t t1) {
      quant_rows_part(w, xp, sums.data(), 1, bp, yp, t0 * ROW_CHANNELS,
                      std::min(n, t1 * ROW_CHANNELS));
    });
  } else {
    parallel_items((n + ITEM_CHANNELS - 1) / ITEM_CHANNELS, [&](int64_t item) {
      const int64_t c0 = item * ITEM_CHANNELS;
      quant_rows_part(w, xp, nullptr, m, bp, yp, c0, std::min(n, c0 + ITEM_CHANNELS));
    });
  }
  return y;
}

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& qweight,
                          const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias) {
  return quant_rows_linear(x, int8_rows(qweight, scales), bias);
}

torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scales, const torch::Tensor& mins,
                          int64_t group_size, const c10::optional<torch::Tensor>& bias) {
  return quant_rows_linear(x, int4_rows(packed, scales, mins, group_size), bias);
}

// ---------------------------------------------------------------------------------------------
// RMSNorm, y = x * rsqrt(mean(x^2) + eps) * weight, row by row (float32). A decode step at batch 1
// runs 61 of them on 576 floats each; torch's CPU rms_norm spends ~10-30 us per call in the
// operations it is made of (power, mean, add, rsqrt, two products), ours under 1 us.

// The row functions here and below are what the tensor functions run on each row, and what the
// layer stack's team of threads runs (fused_blocks.cpp): one copy of the machine code (noinline),
// so both give the same numbers bit for bit.
__attribute__((noinline)) void rms_norm_row(const float* x, const float* weight, int64_t d,
                                            float eps, float* out) {
  const float inv_rms = 1.f / std::sqrt(dot(x, x, d) / static_cast<float>(d) + eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = x[i] * inv_rms * weight[i];
}

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
    for (int64_t r = r0; r < r1; ++r) rms_norm_row(xp + r * d, wp, d, feps, yp + r * d);
  });
  return y;
}

// The residual connection and the norm after it in one pass over the row (vLLM's
// fused_add_rms_norm): sum = h + delta, normed = rms_norm(sum) * weight. Each layer does this
// twice; separately they are an addition and a norm, each reading and writing the row.
// sum may be h itself.
__attribute__((noinline)) void add_rms_norm_row(const float* h, const float* delta,
                                                const float* weight, int64_t d, float eps,
                                                float* sum, float* out) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) sum[i] = h[i] + delta[i];
  const float inv_rms = 1.f / std::sqrt(dot(sum, sum, d) / static_cast<float>(d) + eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = sum[i] * inv_rms * weight[i];
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& h,
                                                      const torch::Tensor& delta,
                                                      const torch::Tensor& weight, double eps) {
  TORCH_CHECK(h.dtype() == torch::kFloat32 && delta.dtype() == torch::kFloat32 &&
                  weight.dtype() == torch::kFloat32 && h.is_contiguous() &&
                  delta.is_contiguous() && weight.is_contiguous() && h.sizes() == delta.sizes(),
              "add_rms_norm: contiguous float32 h and delta of one shape");
  const int64_t d = weight.numel();
  TORCH_CHECK(h.dim() >= 1 && h.size(-1) == d, "add_rms_norm: last dimension must match weight");
  const int64_t rows = h.numel() / d;
  auto sum = torch::empty_like(h);
  auto normed = torch::empty_like(h);
  const float* hp = h.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* np = normed.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      add_rms_norm_row(hp + r * d, dp + r * d, wp, d, feps, sp + r * d, np + r * d);
  });
  return {sum, normed};
}

// ---------------------------------------------------------------------------------------------
// SwiGLU's middle step (vLLM's silu_and_mul): out = silu(gate) * up, where gate and up are the two
// halves of each row of the fused gate_up projection. silu(g) = g * sigmoid(g), with sigmoid
// from exp(-|g|) (exp_nonpositive, so that the loop vectorises): 1 / (1 + e) for g >= 0, else
// e / (1 + e).

// One row: gate_up holds gate then up, n each.
__attribute__((noinline)) void silu_and_mul_row(const float* gate_up, int64_t n, float* o) {
  const float* gate = gate_up;
  const float* up = gate + n;
  int64_t i = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  // GCC leaves the loop below scalar: 5.8 us for a 1536-wide row, 30 rows a decode step (on an
  // AVX2 Zen 3, 6 % of a 4-bit decode step's samples until 2026-12-07)
  for (; i + W <= n; i += W) {
    const V g = v_load(gate + i);
    const V e = v_exp_nonpositive(v_min(g, v_sub(v_zero(), g)));
    const V sigmoid = v_div(v_select(v_nonnegative(g), v_set1(1.f), e), v_add(v_set1(1.f), e));
    v_store(o + i, v_mul(v_mul(g, sigmoid), v_load(up + i)));
  }
#endif
  const int64_t done = i;
#pragma omp simd
  for (int64_t j = done; j < n; ++j) {
    const float g = gate[j];
    const float e = exp_nonpositive(-std::fabs(g));
    const float sigmoid = (g >= 0.f ? 1.f : e) / (1.f + e);
    o[j] = g * sigmoid * up[j];
  }
}

torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dtype() == torch::kFloat32 && gate_up.is_contiguous() &&
                  gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "silu_and_mul: contiguous float32 with an even last dimension");
  const int64_t n = gate_up.size(-1) / 2, rows = gate_up.numel() / (2 * n);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = n;
  auto out = torch::empty(sizes, gate_up.options());
  const float* xp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_and_mul_row(xp + r * 2 * n, n, op + r * n);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Rotary position embedding: one call instead of the six torch operations apply_rope is spelled
// with in engine/models/llama.py (at batch 1 the arithmetic is ~1 us, each operation ~2 us).

// One token: its heads' rows, contiguous in x and in out; cos and sin [d].
__attribute__((noinline)) void rope_row(const float* x, int64_t heads, int64_t d,
                                        const float* c, const float* s, float* out) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float* in = x + h * d;
    float* o = out + h * d;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      o[i] = in[i] * c[i] - in[i + half] * s[i];
      o[i + half] = in[i + half] * c[i + half] + in[i] * s[i + half];
    }
  }
}

// x: [tokens, heads, d] (any row stride, heads contiguous), cos/sin: [tokens, d] whose two halves
// are equal (rope_cos_sin duplicates the angles). out = x * cos + rotate_half(x) * sin.
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && cos.dtype() == torch::kFloat32 &&
                  sin.dtype() == torch::kFloat32 && x.dim() == 3 && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2) && cos.is_contiguous() && sin.is_contiguous(),
              "rope: float32 [tokens, heads, d] with contiguous heads");
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(d % 2 == 0 && cos.numel() == tokens * d && sin.numel() == tokens * d, "rope: shapes");
  auto out = torch::empty({tokens, heads, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row_stride = x.stride(0);
  at::parallel_for(0, tokens, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      rope_row(xp + t * row_stride, heads, d, cp + t * d, sp + t * d, op + t * heads * d);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "llm-inference-lab CPU kernels: paged attention, int8/int4 linear, norms, RoPE, SwiGLU";
  m.def("paged_attention", &paged_attention,
        "write this step's K/V to their slots, then attend through the block table");
  m.def("int8_linear", &int8_linear, "y = x @ (q * scale).T (+ bias), int8 weights");
  m.def("int4_linear", &int4_linear, "y = x @ (q * scale + min).T (+ bias), int4 groups");
  m.def("int4_q8_linear", &int4_q8_linear,
        "int4_linear with x first rounded to int8 in blocks of 32 (llama.cpp's Q4_1 x Q8_1)");
  m.def("int8_q8_linear", &int8_q8_linear,
        "int8_linear with x first rounded to int8 in blocks of 32 (the gguf output layer)");
  m.def("int4_q8_tiled_linear", &int4_q8_tiled_linear,
        "int4_q8_linear on Q4_1 blocks repacked in tiles of 16 channels (Int4TiledWeight)");
  m.def("int8_q8_tiled_linear", &int8_q8_tiled_linear,
        "per-channel int8 weights in tiles of 16 channels times x rounded to int8 blocks");
  m.def("int8_tiled_rows", &int8_tiled_rows,
        "rows ids of int8 tiles as float32, (q + 128 - 128) * scale: a tied embedding's lookup");
  m.def("q8_tile_formats", &q8_tile_formats,
        "the tiled formats (int4, int8) this build runs in vector code (else portable loops)");
  m.def("bf16_tiles_available", &bf16_tiles_available,
        "whether this build and CPU multiply bfloat16 matrices in tiles (AMX or AVX512-BF16)");
  m.def("bf16_tiles_kernel", &bf16_tiles_kernel,
        "the kernel that multiplies them here: \"AMX\", \"AVX512-BF16\" or \"\"");
  m.def("bf16_tiled_linear", &bf16_tiled_linear,
        "y = x @ W.T (+ bias), W bfloat16 in tiles (BFloat16TiledWeight), x rounded to bf16");
  m.def("f32_linear", &f32_linear, py::arg("x"), py::arg("w"), py::arg("bias"),
        py::arg("onednn"),
        "x @ w.T (+ bias): up to 8 rows on our kernel (w packed for the call), more on oneDNN or "
        "MKL");
  m.def("f32_packed_width", &f32_packed_width, "the width of a float32 matrix's packed copy");
  m.def("f32_pack", &f32_pack, py::arg("w"), py::arg("packed"),
        "packed := w in our float32 kernel's layout (4 channels' 16 weights together)");
  m.def("rms_norm", &rms_norm, "y = x * rsqrt(mean(x^2) + eps) * weight, row by row");
  m.def("add_rms_norm", &add_rms_norm, "(h + delta, rms_norm(h + delta) * weight), row by row");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[..., :n]) * x[..., n:] for x of last size 2n");
  m.def("rope", &rope, "x * cos + rotate_half(x) * sin, heads of [tokens, heads, d]");
  m.def("argmax_rows", &argmax_rows, "each row's first index of its largest value (torch.argmax)");
  register_fused_blocks(m);
}

// A layer's two blocks as one call each: the attention block (qkv projection, RoPE on queries
// and keys, paged attention, output projection) and the MLP block (gate_up projection, SwiGLU,
// down projection); and all the layers with their norms as one call a step (LayerStack). They
// call the very kernels the Python path calls, on the same tensors, in the same order
// (engine/models/llama.py: LlamaAttention.forward_native, LlamaMLP.forward_native,
// LlamaModel.run_layers), so their numbers are the Python path's, bit for bit; what goes
// away is the Python between the kernels. At batch 1 a 4-bit decode step's kernels take about
// 4.5 ms, and the splits, views, empty tensors and calls between them took another 1.3 ms (30
// layers x a dozen Python-level operations of a few microseconds each): the cost a CUDA graph
// removes from a GPU step (engine/worker/cuda_graphs.py).
//
// QuantLinear is one weight-only quantized matrix with its kernel chosen once (the layouts of
// engine/kernels/quant.py): "int4_tiles" (tiles), "int8_tiles" (tiles, scales), "int8" (qweight,
// scales), "int4" (packed, scales, mins), and in rows with activations rounded to int8 blocks
// "int4_q8" (packed, scales, mins) and "int8_q8" (qweight, scales); and, not quantized but
// also rounded once at load, a bfloat16 matrix in tiles (a float32 engine's bfloat16
// linears, or a bfloat16 engine's): "bf16_tiles" (tiles: bf16_tiles.cpp); and a float32
// matrix (w and its packed copy: f32_rows.cpp f32_pack), up to 8 rows on our kernel and more on
// the library the engine chose: "float32_onednn", "float32_mkl". Python builds it with
// engine/kernels/quant.py `kernel_linear` (engine/kernels/bfloat16_tiles.py `tiled_kernel`,
// engine/kernels/float32_linear.py `float32_kernel` for the others), and the layers of both
// paths call it (engine/layers/linear.py), so the choice of a kernel is made in one place.

#include <torch/extension.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels.h"

namespace {

enum class Kind { Int4Tiles, Int8Tiles, Int8, Int4, Int4Q8, Int8Q8, Bf16Tiles, F32Onednn, F32Mkl };

Kind kind_of(const std::string& name, size_t num_tensors) {
  const std::vector<std::pair<std::string, std::pair<Kind, size_t>>> kinds = {
      {"int4_tiles", {Kind::Int4Tiles, 1}}, {"int8_tiles", {Kind::Int8Tiles, 2}},
      {"int8", {Kind::Int8, 2}},            {"int4", {Kind::Int4, 3}},
      {"int4_q8", {Kind::Int4Q8, 3}},       {"int8_q8", {Kind::Int8Q8, 2}},
      {"bf16_tiles", {Kind::Bf16Tiles, 1}}, {"float32_onednn", {Kind::F32Onednn, 2}},
      {"float32_mkl", {Kind::F32Mkl, 2}},
  };
  for (const auto& [known, kind] : kinds) {
    if (known != name) continue;
    TORCH_CHECK(num_tensors == kind.second, "QuantLinear: ", name, " takes ", kind.second,
                " tensors, not ", num_tensors);
    return kind.first;
  }
  TORCH_CHECK(false, "QuantLinear: unknown kind ", name);
}

// The rows a team member multiplies by a matrix: as they are (a float32 matrix, a weight-only
// int8 or int4 one), rounded to int8 blocks (int8 and int4 tiles) or to bfloat16 (bfloat16
// tiles) in the member's own buffers; with its group sums for a weight-only int4 matrix at one
// row (row_group_sums, once per matrix rather than once per share).
struct TeamRows {
  const float* x;
  int64_t m;
  q8::RoundedView rounded;
  const uint16_t* bf16 = nullptr;
  const float* sums = nullptr;
};

// A member's buffers for the rows it rounds or sums (TeamRows); they only grow.
struct RowBuffers {
  q8::RoundingBuffer q8;
  std::vector<uint16_t> bf16;
  std::vector<float> sums;
};

struct QuantLinear {
  Kind kind;
  std::vector<torch::Tensor> t;  // the weight's tensors, in the order its kernel takes them
  int64_t group_size;
  // A tiled matrix's tiles (and scales) and their number, read from the tensors once: a team
  // member asking the tensors at each run of tiles read their metadata ~1,000 times a step, each
  // time from memory (the stream had evicted it).
  const uint8_t* tiles_at = nullptr;
  const float* scales_at = nullptr;
  int64_t tiles_count = 0, tile_record_bytes = 0;
  const float* f32_at = nullptr;  // a float32 matrix's packed copy (f32_pack), read once too
  QuantRows rows_at{};            // a weight-only int8 or int4 matrix's values, read once too
  int64_t bytes_total = 0;        // of the tiles, packed copy or rows a team reads (tile_bytes)
  int64_t out_n = 0, in_k = 0;     // out_features and in_features, read once too
  bool bf16_shared = false;        // bfloat16 tiles a team shares (bf16_tiles_team), asked once

  QuantLinear(const std::string& name, std::vector<torch::Tensor> tensors, int64_t group_size)
      : kind(kind_of(name, tensors.size())), t(std::move(tensors)), group_size(group_size) {
    bf16_shared = kind == Kind::Bf16Tiles && bf16_tiles_team();
    if (float32()) {
      TORCH_CHECK(t[0].scalar_type() == torch::kFloat32 && t[0].dim() == 2 && t[0].is_cpu(),
                  "QuantLinear: a float32 matrix [out, in] on the CPU");
      if (t[0].is_contiguous()) {  // else (a transposed view) the library's alone, no copy
        const int64_t width = f32_packed_width(t[0].size(1));
        TORCH_CHECK(t[1].scalar_type() == torch::kFloat32 && t[1].is_contiguous() &&
                        t[1].dim() == 2 && t[1].size(0) == t[0].size(0) && t[1].size(1) == width,
                    "QuantLinear: a float32 matrix's packed copy (f32_pack) is float32 [out, ",
                    width, "]");
        f32_at = t[1].data_ptr<float>();
        tiles_count = (t[0].size(0) + q8::TILE_CHANNELS - 1) / q8::TILE_CHANNELS;
        tile_record_bytes = q8::TILE_CHANNELS * width * sizeof(float);
        bytes_total = t[1].numel() * int64_t(sizeof(float));
      }
    }
    if (in_rows()) {
      rows_at = kind == Kind::Int8 ? int8_rows(t[0], t[1])
                                   : int4_rows(t[0], t[1], t[2], group_size);
      tiles_count = (rows_at.n + q8::TILE_CHANNELS - 1) / q8::TILE_CHANNELS;
      tile_record_bytes = q8::TILE_CHANNELS * rows_at.row_bytes();
      bytes_total = rows_at.n * rows_at.row_bytes();
    }
    if (bf16_team()) {
      TORCH_CHECK(t[0].scalar_type() == torch::kBFloat16 && t[0].dim() == 4 &&
                      t[0].is_contiguous() && t[0].size(2) == q8::TILE_CHANNELS,
                  "QuantLinear: bfloat16 tiles are a contiguous bfloat16 [tiles, groups, 16, 32]");
      tiles_at = static_cast<const uint8_t*>(t[0].data_ptr());
      tiles_count = t[0].size(0), tile_record_bytes = t[0][0].numel() * int64_t(sizeof(uint16_t));
      bytes_total = tiles_count * tile_record_bytes;
    }
    std::tie(out_n, in_k) = features();
    if (!tiled()) return;
    TORCH_CHECK(t[0].scalar_type() == torch::kUInt8 && t[0].dim() == 3 && t[0].is_contiguous(),
                "QuantLinear: tiles are a contiguous uint8 [tiles, groups, record]");
    tiles_at = t[0].data_ptr<uint8_t>();
    tiles_count = t[0].size(0), tile_record_bytes = t[0].size(1) * t[0].size(2);
    bytes_total = tiles_count * tile_record_bytes;
    if (kind == Kind::Int8Tiles) {
      TORCH_CHECK(t[1].scalar_type() == torch::kFloat32 && t[1].is_contiguous() &&
                      t[1].numel() == tiles_count * q8::TILE_CHANNELS,
                  "QuantLinear: int8 tiles' scales are contiguous float32 [out_features]");
      scales_at = t[1].data_ptr<float>();
    }
  }

  // y = x @ W^T (+ bias), x: [rows, in] float32, contiguous; bias float32, contiguous.
  torch::Tensor operator()(const torch::Tensor& x, const c10::optional<torch::Tensor>& bias) const {
    switch (kind) {
      case Kind::Int4Tiles: return int4_q8_tiled_linear(x, t[0], bias);
      case Kind::Int8Tiles: return int8_q8_tiled_linear(x, t[0], t[1], bias);
      case Kind::Int8:
      case Kind::Int4: return quant_rows_linear(x, rows_at, bias);
      case Kind::Int4Q8: return int4_q8_linear(x, t[0], t[1], t[2], group_size, bias);
      case Kind::Int8Q8: return int8_q8_linear(x, t[0], t[1], bias);
      case Kind::Bf16Tiles: return bf16_tiled_linear(x, t[0], bias);
      case Kind::F32Onednn: return f32_packed_linear(x, t[0], t[1], bias, true);
      case Kind::F32Mkl: return f32_packed_linear(x, t[0], t[1], bias, false);
    }
    TORCH_CHECK(false, "QuantLinear: bad kind");
  }

  // In tiles of 16 output channels (a GGUF's layers and output layer).
  bool tiled() const { return kind == Kind::Int4Tiles || kind == Kind::Int8Tiles; }
  bool float32() const { return kind == Kind::F32Onednn || kind == Kind::F32Mkl; }
  // A weight-only int8 or int4 matrix in rows (activations not rounded).
  bool in_rows() const { return kind == Kind::Int8 || kind == Kind::Int4; }
  // A bfloat16 matrix in tiles, where a team can share them (bf16_tiles_team).
  bool bf16_team() const { return bf16_shared; }
  // A team can share it, 16 output channels at a time: tiles, a float32 matrix's rows (our
  // kernel, as f32_linear runs a team step's rows: TEAM_MAX_ROWS <= F32_MAX_ROWS), or a
  // weight-only int8 or int4 matrix's rows (quant_rows_part, as its linear runs them), or bfloat16
  // tiles where the AVX512-BF16 kernel multiplies them.
  bool shared_by_team() const {
    return tiled() || f32_at != nullptr || in_rows() || bf16_team();
  }
  int64_t num_tiles() const { return tiles_count; }
  int64_t out_features() const { return out_n; }
  int64_t in_features() const { return in_k; }
  // Out and in features from the tensors' shapes (a team reads them from out_n and in_k).
  std::pair<int64_t, int64_t> features() const {
    if (in_rows()) return {rows_at.n, rows_at.k};
    if (float32()) return {t[0].size(0), t[0].size(1)};
    const int64_t in = kind == Kind::Bf16Tiles ? t[0].size(1) * t[0].size(3)
                                               : t[0].size(1) * q8::BLOCK;
    return {t[0].size(0) * q8::TILE_CHANNELS, in};
  }
  // Where tiles t0 .. t1 lie (a tiled matrix's records, a float32 matrix's packed channels, a
  // weight-only matrix's rows, one after the other).
  std::pair<const char*, const char*> tile_bytes(int64_t t0, int64_t t1) const {
    const char* base = float32()   ? reinterpret_cast<const char*>(f32_at)
                       : in_rows() ? static_cast<const char*>(rows_at.weights)
                                   : reinterpret_cast<const char*>(tiles_at);
    return {base + t0 * tile_record_bytes, base + std::min(bytes_total, t1 * tile_record_bytes)};
  }

  // What a member multiplies: `m` rows of `k` activations, rounded into `buffers` for tiles.
  TeamRows team_rows(const float* x, int64_t m, int64_t k, RowBuffers& buffers) const {
    if (bf16_team()) {
      uint16_t* rounded = q8::grow_to(buffers.bf16, m * k);
      bf16_round(x, m * k, rounded);
      return {x, m, {}, rounded};
    }
    if (in_rows() && rows_at.int4 && m == 1) {
      float* sums = q8::grow_to(buffers.sums, rows_at.num_groups());
      row_group_sums(rows_at, x, sums);
      return {x, m, {}, nullptr, sums};
    }
    if (!tiled()) return {x, m, {}};
    return {x, m, buffers.q8.round(x, m, k)};
  }

  // Tiles t0 .. t1 of y [rows, out_features] for the rows in `a`.
  void tiles_part(const TeamRows& a, const float* bias, float* y, int64_t t0, int64_t t1) const {
    if (bf16_team()) {
      bf16_tiles_part(a.bf16, a.m, in_k, reinterpret_cast<const uint16_t*>(tiles_at), out_n, bias,
                      y, t0, t1);
    } else if (in_rows()) {
      quant_rows_part(rows_at, a.x, a.sums, a.m, bias, y, t0 * q8::TILE_CHANNELS,
                      std::min(out_n, t1 * q8::TILE_CHANNELS));
    } else if (float32()) {
      const int64_t c1 = std::min(out_n, t1 * q8::TILE_CHANNELS);
      f32_rows_part(f32_at, in_k, a.x, a.m, bias, y, out_n, t0 * q8::TILE_CHANNELS, c1);
    } else if (kind == Kind::Int4Tiles) {
      int4_tiles_part(tiles_at, tiles_count, a.rounded, bias, y, t0, t1);
    } else {
      int8_tiles_part(tiles_at, scales_at, tiles_count, a.rounded, bias, y, t0, t1);
    }
  }
};

// x as the cache gives it back: rounded to the cache's dtype and widened again (a bfloat16 KV
// cache under a float32 model), as engine/layers/attention.py as_cached does for the first chunks.
torch::Tensor as_cached(const torch::Tensor& x, const torch::Tensor& cache) {
  if (x.scalar_type() == cache.scalar_type()) return x;
  return x.to(cache.scalar_type()).to(x.scalar_type());
}

// qkv → RoPE → paged attention (this step's K/V written into the cache first) → o.
struct AttentionBlock {
  QuantLinear qkv, o;
  c10::optional<torch::Tensor> qkv_bias;  // float32 (Qwen2's q/k/v biases), or none
  int64_t num_heads, num_kv_heads, head_dim;
  double scale;

  // x: [tokens, hidden]; cos, sin: [tokens, 1, head_dim]; the cache and the kernel's work as
  // paged_attention takes them; first_chunks: [n, 2] int64 (first row, rows) of the prefill
  // chunks that start a request (nothing cached yet), which attend to their own K/V with SDPA
  // as engine/layers/attention.py paged_attention_kernel does.
  torch::Tensor operator()(const torch::Tensor& x, const torch::Tensor& cos,
                           const torch::Tensor& sin, torch::Tensor& k_cache,
                           torch::Tensor& v_cache, const torch::Tensor& slots,
                           const torch::Tensor& block_tables, const torch::Tensor& tiles,
                           const torch::Tensor& first_chunks) const {
    TORCH_CHECK(first_chunks.dtype() == torch::kInt64 && first_chunks.is_contiguous() &&
                    first_chunks.dim() == 2 && first_chunks.size(1) == 2,
                "AttentionBlock: first_chunks is [n, 2] int64");
    const int64_t tokens = x.size(0), heads = num_heads, kv = num_kv_heads, d = head_dim;
    const torch::Tensor y = qkv(x, qkv_bias);
    const torch::Tensor qk = rope(y.narrow(1, 0, (heads + kv) * d).view({tokens, heads + kv, d}),
                                  cos, sin);
    const torch::Tensor q = qk.narrow(1, 0, heads), k = qk.narrow(1, heads, kv);
    const torch::Tensor v = y.narrow(1, (heads + kv) * d, kv * d).view({tokens, kv, d});
    torch::Tensor out = torch::empty(q.sizes(), q.options());
    paged_attention(q, k, v, k_cache, v_cache, slots, block_tables, tiles, scale, out);
    const int64_t* chunk = first_chunks.data_ptr<int64_t>();
    for (int64_t c = 0; c < first_chunks.size(0); ++c) {
      const int64_t start = chunk[2 * c], rows = chunk[2 * c + 1];
      const torch::Tensor o_chunk = at::scaled_dot_product_attention(
          q.narrow(0, start, rows).transpose(0, 1),
          as_cached(k.narrow(0, start, rows), k_cache).transpose(0, 1),
          as_cached(v.narrow(0, start, rows), v_cache).transpose(0, 1), {}, 0.0,
          /*is_causal=*/true, scale, /*enable_gqa=*/true);
      out.narrow(0, start, rows).copy_(o_chunk.transpose(0, 1));
    }
    return o(out.view({tokens, heads * d}), c10::nullopt);
  }
};

// down(silu(gate) * up), gate and up from one matmul.
struct MlpBlock {
  QuantLinear gate_up, down;

  torch::Tensor operator()(const torch::Tensor& x) const {
    return down(silu_and_mul(gate_up(x, c10::nullopt)), c10::nullopt);
  }
};

// A pause in a spin loop: the core runs its sibling thread (if any) and saves power meanwhile.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// What a member fetches into its cache while it waits at a barrier (SpinBarrier::wait): the
// start of its own share of the matrix it reads next. The other members are still streaming
// their part of this phase, and one thread alone reads slower than two (35-39 against 44-48
// GB/s on the Zen 5 VM), so the memory has room for what the next phase would otherwise start
// by waiting for. The layers about 2 % faster (docs/performance.md, fifteenth session).
struct FetchAhead {
  static constexpr int64_t MAX_BYTES = 256 << 10;  // of a share (the output layer's is 10 MB)
  static constexpr int64_t LINES_PER_LOOK = 4;     // cache lines asked for between two looks
  const char* at = nullptr;
  const char* end = nullptr;

  void set(std::pair<const char*, const char*> bytes) {
    at = bytes.first, end = std::min(bytes.second, bytes.first + MAX_BYTES);
  }
  bool pending() const { return at < end; }
  void some() {
    for (int64_t i = 0; i < LINES_PER_LOOK && at < end; ++i, at += 64)
      __builtin_prefetch(at, /*rw=*/0, /*locality: L2=*/2);
  }
};

// Where a team waits until every member is done with a phase. A waiter first spins (a phase's
// members finish microseconds apart), then sleeps until the last one to arrive wakes it (Linux's
// futex; elsewhere it yields the core at each look). How long it spins adapts: a wait that ended
// while spinning doubles the spin for the next ones, a wait that ended in sleep quarters it. With
// a core each, members seldom sleep; with more threads than cores (several engines on one
// machine) the member waited for is often off its core, and spinning for it only delays it, so
// the spin shrinks to almost nothing. The spin is written only when it changes: every member
// reads it at every barrier, and a write each time would move its cache line between the cores.
// OpenMP's own barrier follows OMP_WAIT_POLICY instead, and under PASSIVE (the app's setting:
// idle threads between steps must not spin) every waiter slept at once and had to be woken (on
// a VM, presumably a virtual CPU's exit from idle each time): a 4-bit step's 181 barriers took
// the layers from 2.0 to 4.3 ms (docs/performance.md, fourteenth session).
struct SpinBarrier {
  static constexpr int64_t MIN_SPIN = 16, MAX_SPIN = 1 << 12;  // pauses before sleeping
  std::atomic<int64_t> arrived{0};
  std::atomic<int32_t> generation{0}, sleepers{0};
  std::atomic<int64_t>* spin;  // the spin, kept from step to step (LayerStack::barrier_spin)

  // `size` members call it; each returns once all have arrived, seeing what every one wrote.
  // While it spins it fetches `ahead`; those looks do not count as pauses of the spin.
  void wait(int64_t size, FetchAhead& ahead) {
    const int32_t gen = generation.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == size) {
      arrived.store(0, std::memory_order_relaxed);
      generation.store(gen + 1);  // sequentially consistent, as is the read of sleepers below
      if (sleepers.load() > 0) wake_all();
      return;
    }
    const int64_t limit = spin->load(std::memory_order_relaxed);
    for (int64_t spins = 0; spins < limit;) {
      if (generation.load(std::memory_order_acquire) != gen) {
        adapt(limit, std::min(MAX_SPIN, 2 * limit));
        return;
      }
      if (ahead.pending()) {
        ahead.some();
      } else {
        cpu_relax();
        ++spins;
      }
    }
    adapt(limit, std::max(MIN_SPIN, limit / 4));
    sleepers.fetch_add(1);
    while (generation.load() == gen) sleep_while(gen);
    sleepers.fetch_sub(1);
  }

 private:
  void adapt(int64_t limit, int64_t next) {
    if (next != limit) spin->store(next, std::memory_order_relaxed);
  }
  int* word() { return reinterpret_cast<int*>(&generation); }
  // Sleep unless the generation has moved on from `gen` (checked by the kernel, atomically).
  void sleep_while(int32_t gen) {
#ifdef __linux__
    syscall(SYS_futex, word(), FUTEX_WAIT_PRIVATE, gen, nullptr, nullptr, 0);
#else
    (void)gen;
    std::this_thread::yield();
#endif
  }
  void wake_all() {
#ifdef __linux__
    syscall(SYS_futex, word(), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
#endif
  }
};

// A member of the team of threads that runs a whole decode step in one parallel region: its rank,
// the team's size, and the barrier where the team waits until every member is done with a phase.
struct TeamMember {
  int64_t rank, size;
  SpinBarrier* team_barrier;
  mutable FetchAhead ahead;  // the member's own: set before a barrier, fetched while it waits

  void barrier() const { team_barrier->wait(size, ahead); }
};

// Decode steps of up to this many tokens run as a team (below); a longer step (a prefill chunk)
// keeps the kernels' own parallel loops, which split its rows too.
constexpr int64_t TEAM_MAX_ROWS = 8;
static_assert(TEAM_MAX_ROWS <= F32_MAX_ROWS, "a team's float32 rows are on our kernel");
static_assert(q8::TILE_CHANNELS % QUANT_ROWS_ITEM == 0, "a team's shares of int8/int4 rows");

// Of a matrix's tiles, each member of a team first runs a fixed share (together, this many
// quarters of them), then takes the rest at least MIN_RUN tiles at a time (share_tiles, below).
constexpr int64_t FIXED_QUARTERS = 3;
constexpr int64_t MIN_RUN = 2;

// A member's own rows, kept from step to step (the buffers only grow): the residual stream, the
// norm's output, SwiGLU's output (and the rows the output layer reads), and the activations
// rounded for the next matrix.
struct MemberRows {
  std::vector<float> residual, normed, act;
  RowBuffers rounding;
};

// What the members of a team share in one step: the inputs, and one buffer per phase's output.
struct TeamStep {
  int64_t m, hidden, heads, kv, d, qkv_n, inter;
  const float* h;      // [m, hidden] the residual stream entering layer 0
  const float* cos;    // [m, d]
  const float* sin;    // [m, d]
  torch::Tensor qkv;   // [m, qkv_n]
  torch::Tensor qk;    // [m, heads + kv, d] queries and keys after RoPE
  torch::Tensor attn;  // [m, heads, d]
  torch::Tensor o, gate_up, down, h_out;  // [m, hidden], [m, 2 * inter], [m, hidden], [m, hidden]
  // where the buffers above lie, read once before the team starts (as QuantLinear's tiles)
  float *qkv_at, *qk_at, *attn_at, *o_at, *gate_up_at, *down_at;
  torch::Tensor q_view, k_view, v_view;   // the heads of qk and qkv that attention reads
  std::vector<torch::Tensor> k_caches, v_caches;
  torch::Tensor slots, block_tables, tiles;
  // the output layer's rows (logits_rows), their logits [rows, vocab]; none: no head this step
  const int64_t* head_rows = nullptr;
  int64_t num_head_rows = 0;
  torch::Tensor logits;
  float* logits_at = nullptr;
  int64_t plan_threads;
  TeamAttention attention;
  std::atomic<int64_t> next_item{0};
  SpinBarrier barrier;
  // per layer, the tiles handed out past the fixed shares: qkv's, o's, gate_up's, down's; then
  // the output layer's
  std::vector<std::atomic<int64_t>> tiles_taken;
};

// Every layer of the model, one after the other, as LlamaModel.run_layers runs them: the
// residual adds fused into the norms that follow them (add_rms_norm). One call a step.
//
// A decode step whose matrices a team can share (shared_by_team: in tiles, float32, weight-only
// int8 or int4 rows, or bfloat16 tiles without AMX) runs as a team instead: one parallel region for
// the whole step, each thread running every layer's loop, splitting each matrix's tiles (a float32
// or weight-only matrix's rows, 16 at a time) and the attention's items with the other threads and
// waiting at a barrier where a phase needs every thread's output (6 a layer); with a head
// (set_head) and the rows that sample, the final norm and the output layer too (28 of the 95 MB a
// 4-bit SmolLM2 step reads). Each thread rounds the activations it multiplies (for tiles) and keeps
// the residual stream and the norms' outputs itself (a few KB, the same numbers in each). A gguf
// decode step at batch 1 otherwise starts ~150 parallel loops and makes ~400 tensor operations
// (views, empty outputs) between them, while the other thread waits (docs/performance.md, twelfth
// session); the team does neither. The numbers are the loop's, bit for bit: the same row functions
// and tile kernels on the same rows, the same attention items. Inside the region the members read
// no tensor's metadata: where each matrix, buffer and norm lies, and each layer's attention work,
// are read before it starts (~1,000 such reads a step, each from memory after the stream had
// evicted it, made the layers ~3 % slower: docs/performance.md, sixteenth session).
struct LayerStack {
  std::vector<AttentionBlock> attention;
  std::vector<MlpBlock> mlp;
  std::vector<torch::Tensor> input_norms, post_norms;  // float32 weights, one per layer
  std::vector<const float*> input_norm_at, post_norm_at;  // where they lie (read once)
  std::vector<const float*> qkv_bias_at;  // each layer's q/k/v bias, or nullptr
  std::vector<double> scales;              // each layer's attention scale
  double eps;
  bool team;  // every matrix shared by a team (shared_by_team): decode steps can run as one
  int64_t team_steps = 0;  // steps run as a team (tests and describe() read it)
  // how long the team's barriers spin before they sleep, adapted as they wait (SpinBarrier)
  mutable std::atomic<int64_t> barrier_spin{SpinBarrier::MAX_SPIN};
  // The final norm's weight and the output layer, when a team step runs them too (set_head).
  c10::optional<torch::Tensor> final_norm;
  const float* final_norm_at = nullptr;
  c10::optional<QuantLinear> lm_head;

  LayerStack(std::vector<AttentionBlock> attention_, std::vector<MlpBlock> mlp_,
             std::vector<torch::Tensor> input_norms_, std::vector<torch::Tensor> post_norms_,
             double eps_)
      : attention(std::move(attention_)), mlp(std::move(mlp_)),
        input_norms(std::move(input_norms_)), post_norms(std::move(post_norms_)), eps(eps_),
        team(true) {
    for (size_t i = 0; i < attention.size(); ++i)
      for (const QuantLinear* linear :
           {&attention[i].qkv, &attention[i].o, &mlp[i].gate_up, &mlp[i].down})
        team = team && linear->shared_by_team();
    auto where = [](const torch::Tensor& w) {
      TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous(),
                  "LayerStack: the norms' weights are contiguous float32");
      return static_cast<const float*>(w.data_ptr<float>());
    };
    for (const torch::Tensor& w : input_norms) input_norm_at.push_back(where(w));
    for (const torch::Tensor& w : post_norms) post_norm_at.push_back(where(w));
    for (const AttentionBlock& a : attention) {
      qkv_bias_at.push_back(a.qkv_bias ? a.qkv_bias->data_ptr<float>() : nullptr);
      scales.push_back(a.scale);
    }
  }

  // The final norm (its float32 weight) and the output layer (one a team can share), for team
  // steps to run after the last layer: the model's final RMSNorm and lm_head, the same kernels on
  // the rows.
  void set_head(const torch::Tensor& norm_weight, const QuantLinear& head) {
    TORCH_CHECK(head.shared_by_team() && head.in_features() == input_norms[0].numel() &&
                    norm_weight.scalar_type() == torch::kFloat32 && norm_weight.is_contiguous() &&
                    norm_weight.numel() == input_norms[0].numel(),
                "LayerStack.set_head: a float32 norm weight and an output layer of the model's "
                "width that a team can share");
    final_norm = norm_weight, lm_head = head;
    final_norm_at = norm_weight.data_ptr<float>();
  }

  // h: the residual stream entering layer 0; k_caches[i], v_caches[i]: layer i's cache;
  // logits_rows: the rows whose logits are wanted. Returns (h, mlp_out, logits): the residual
  // stream and the last MLP's output after the last layer, not yet added (the final norm adds
  // them), and the logits [len(logits_rows), vocab] where a team ran the head (set_head), else
  // None (the caller runs the final norm and the output layer).
  std::tuple<torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>> operator()(
      torch::Tensor h, const torch::Tensor& cos, const torch::Tensor& sin,
      std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
      const torch::Tensor& slots, const torch::Tensor& block_tables, const torch::Tensor& tiles,
      const torch::Tensor& first_chunks, const c10::optional<torch::Tensor>& logits_rows) {
    const size_t layers = attention.size();
    TORCH_CHECK(layers > 0 && k_caches.size() == layers && v_caches.size() == layers,
                "LayerStack: one K and one V cache per layer");
    if (team && first_chunks.size(0) == 0 && h.size(0) <= TEAM_MAX_ROWS &&
        h.scalar_type() == torch::kFloat32) {
      ++team_steps;
      const bool with_head = lm_head.has_value() && logits_rows.has_value();
      return run_team(h.contiguous(), cos.contiguous(), sin.contiguous(), std::move(k_caches),
                      std::move(v_caches), slots, block_tables, tiles,
                      with_head ? logits_rows : c10::nullopt);
    }
    torch::Tensor x = rms_norm(h, input_norms[0], eps), mlp_out;
    for (size_t i = 0; i < layers; ++i) {
      const torch::Tensor attn_out = attention[i](x, cos, sin, k_caches[i], v_caches[i], slots,
                                                  block_tables, tiles, first_chunks);
      std::tie(h, x) = add_rms_norm(h, attn_out, post_norms[i], eps);
      mlp_out = mlp[i](x);
      if (i + 1 < layers) std::tie(h, x) = add_rms_norm(h, mlp_out, input_norms[i + 1], eps);
    }
    return {h, mlp_out, c10::nullopt};
  }

  std::tuple<torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>> run_team(
      const torch::Tensor& h, const torch::Tensor& cos, const torch::Tensor& sin,
      std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
      const torch::Tensor& slots, const torch::Tensor& block_tables, const torch::Tensor& tiles,
      const c10::optional<torch::Tensor>& logits_rows) const {
    TeamStep step;
    prepare_team(step, h, cos, sin, std::move(k_caches), std::move(v_caches), slots,
                 block_tables, tiles);
    if (logits_rows) prepare_head(step, *logits_rows);
#pragma omp parallel num_threads(step.plan_threads)
    {
#ifdef _OPENMP
      const TeamMember me{omp_get_thread_num(), omp_get_num_threads(), &step.barrier};
#else
      const TeamMember me{0, 1, &step.barrier};
#endif
      run_member(me, step);
    }
    if (logits_rows) return {step.h_out, step.down, step.logits};
    return {step.h_out, step.down, c10::nullopt};
  }

  // The rows the output layer reads (each a row of this step) and the logits' buffer.
  void prepare_head(TeamStep& s, const torch::Tensor& rows) const {
    TORCH_CHECK(rows.scalar_type() == torch::kInt64 && rows.dim() == 1 && rows.is_contiguous(),
                "LayerStack: logits_rows is a 1-D int64 tensor");
    s.head_rows = rows.data_ptr<int64_t>(), s.num_head_rows = rows.numel();
    for (int64_t j = 0; j < s.num_head_rows; ++j)
      TORCH_CHECK(s.head_rows[j] >= 0 && s.head_rows[j] < s.m, "LayerStack: logits row ",
                  s.head_rows[j], " is not a row of this step (", s.m, " rows)");
    s.logits = torch::empty({s.num_head_rows, lm_head->out_features()}, torch::kFloat32);
    s.logits_at = s.logits.data_ptr<float>();
  }

  // Everything that can fail is checked here, before the parallel region (an exception cannot
  // leave one), and every buffer is allocated here.
  void prepare_team(TeamStep& s, const torch::Tensor& h, const torch::Tensor& cos,
                    const torch::Tensor& sin, std::vector<torch::Tensor> k_caches,
                    std::vector<torch::Tensor> v_caches, const torch::Tensor& slots,
                    const torch::Tensor& block_tables, const torch::Tensor& tiles) const {
    const AttentionBlock& a0 = attention[0];
    s.m = h.size(0), s.hidden = h.size(1), s.heads = a0.num_heads, s.kv = a0.num_kv_heads;
    s.d = a0.head_dim, s.qkv_n = a0.qkv.out_features(), s.inter = mlp[0].down.in_features();
    TORCH_CHECK(h.dim() == 2 && cos.numel() == s.m * s.d && sin.numel() == s.m * s.d &&
                    cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32,
                "LayerStack: h [tokens, hidden], cos and sin [tokens, head_dim] float32");
    TORCH_CHECK(s.qkv_n == (s.heads + 2 * s.kv) * s.d &&
                    mlp[0].gate_up.out_features() == 2 * s.inter &&
                    a0.o.out_features() == s.hidden && mlp[0].down.out_features() == s.hidden,
                "LayerStack: the matrices' shapes do not fit the heads");
    auto opts = h.options();
    s.h = h.data_ptr<float>(), s.cos = cos.data_ptr<float>(), s.sin = sin.data_ptr<float>();
    s.qkv = torch::empty({s.m, s.qkv_n}, opts);
    s.qk = torch::empty({s.m, s.heads + s.kv, s.d}, opts);
    s.attn = torch::empty({s.m, s.heads, s.d}, opts);
    s.o = torch::empty({s.m, s.hidden}, opts);
    s.gate_up = torch::empty({s.m, 2 * s.inter}, opts);
    s.down = torch::empty({s.m, s.hidden}, opts);
    s.h_out = torch::empty({s.m, s.hidden}, opts);
    s.qkv_at = s.qkv.data_ptr<float>(), s.qk_at = s.qk.data_ptr<float>();
    s.attn_at = s.attn.data_ptr<float>(), s.o_at = s.o.data_ptr<float>();
    s.gate_up_at = s.gate_up.data_ptr<float>(), s.down_at = s.down.data_ptr<float>();
    s.q_view = s.qk.narrow(1, 0, s.heads);
    s.k_view = s.qk.narrow(1, s.heads, s.kv);
    s.v_view = s.qkv.narrow(1, (s.heads + s.kv) * s.d, s.kv * s.d).view({s.m, s.kv, s.d});
    for (size_t i = 0; i < attention.size(); ++i)
      check_paged_attention(s.q_view, s.k_view, s.v_view, k_caches[i], v_caches[i], slots,
                            block_tables, tiles, s.attn);
    s.k_caches = std::move(k_caches), s.v_caches = std::move(v_caches);
    s.slots = slots, s.block_tables = block_tables, s.tiles = tiles;
    s.plan_threads = at::get_num_threads();  // as paged_attention plans: the same items
    s.attention.plan(s.q_view, s.k_caches[0], s.v_caches[0], block_tables, tiles, s.attn,
                     s.plan_threads);
    s.attention.prepare(s.q_view, s.k_view, s.v_view, s.k_caches, s.v_caches, slots,
                        block_tables, tiles, scales, s.attn);
    s.tiles_taken = std::vector<std::atomic<int64_t>>(4 * attention.size() + 1);
    s.barrier.spin = &barrier_spin;
    for (auto& taken : s.tiles_taken) taken.store(0);
  }

  // One member's part of the step: every layer, phase by phase.
  void run_member(const TeamMember& me, TeamStep& s) const {
    thread_local MemberRows own;
    const int64_t m = s.m, hidden = s.hidden;
    const float feps = static_cast<float>(eps);
    float* res = q8::grow_to(own.residual, m * hidden);
    float* x = q8::grow_to(own.normed, m * hidden);
    std::copy(s.h, s.h + m * hidden, res);
    for (int64_t r = 0; r < m; ++r)
      rms_norm_row(res + r * hidden, input_norm_at[0], hidden, feps, x + r * hidden);
    for (size_t i = 0; i < attention.size(); ++i) {
      attention_phases(me, s, i, x, own.rounding);
      add_norm_rows(res, s.o_at, post_norm_at[i], feps, m, hidden, x);
      mlp_phases(me, s, i, x, own);
      if (i + 1 < attention.size())
        add_norm_rows(res, s.down_at, input_norm_at[i + 1], feps, m, hidden, x);
    }
    if (me.rank == 0) std::copy(res, res + m * hidden, s.h_out.data_ptr<float>());
    if (s.num_head_rows > 0) head_phase(me, s, res, x, own);
  }

  // The final norm of the rows that sample, then the output layer's tiles: one barrier.
  void head_phase(const TeamMember& me, TeamStep& s, float* res, float* x,
                  MemberRows& own) const {
    const int64_t hidden = s.hidden;
    float* rows = q8::grow_to(own.act, s.num_head_rows * hidden);
    for (int64_t j = 0; j < s.num_head_rows; ++j) {
      const int64_t r = s.head_rows[j];
      add_rms_norm_row(res + r * hidden, s.down_at + r * hidden, final_norm_at, hidden,
                       static_cast<float>(eps), x + r * hidden, rows + j * hidden);
    }
    share_tiles(me, *lm_head, lm_head->team_rows(rows, s.num_head_rows, hidden, own.rounding),
                nullptr, s.logits_at, s.tiles_taken.back(), nullptr);
  }

  // qkv, RoPE and the new K/V into the cache, attention, o: four barriers.
  void attention_phases(const TeamMember& me, TeamStep& s, size_t i, const float* x,
                        RowBuffers& rounding) const {
    const AttentionBlock& block = attention[i];
    share_tiles(me, block.qkv, block.qkv.team_rows(x, s.m, s.hidden, rounding), qkv_bias_at[i],
                s.qkv_at, s.tiles_taken[4 * i], &block.o);
    if (me.rank == 0) {
      const float* qkv = s.qkv_at;
      float* qk = s.qk_at;
      const int64_t rope_heads = s.heads + s.kv;
      for (int64_t r = 0; r < s.m; ++r)
        rope_row(qkv + r * s.qkv_n, rope_heads, s.d, s.cos + r * s.d, s.sin + r * s.d,
                 qk + r * rope_heads * s.d);
      s.attention.start_layer(i);
      s.next_item.store(0);
    }
    me.barrier();
    s.attention.run_items(i, s.next_item);
    me.barrier();
    share_tiles(me, block.o, block.o.team_rows(s.attn_at, s.m, s.heads * s.d, rounding), nullptr,
                s.o_at, s.tiles_taken[4 * i + 1], &mlp[i].gate_up);
  }

  // gate_up, SwiGLU, down: two barriers.
  void mlp_phases(const TeamMember& me, TeamStep& s, size_t i, const float* x,
                  MemberRows& own) const {
    share_tiles(me, mlp[i].gate_up, mlp[i].gate_up.team_rows(x, s.m, s.hidden, own.rounding),
                nullptr, s.gate_up_at, s.tiles_taken[4 * i + 2], &mlp[i].down);
    float* act = q8::grow_to(own.act, s.m * s.inter);
    const float* gate_up = s.gate_up_at;
    for (int64_t r = 0; r < s.m; ++r)
      silu_and_mul_row(gate_up + r * 2 * s.inter, s.inter, act + r * s.inter);
    const QuantLinear* next = i + 1 < attention.size() ? &attention[i + 1].qkv
                              : s.num_head_rows > 0         ? &*lm_head
                                                            : nullptr;
    share_tiles(me, mlp[i].down, mlp[i].down.team_rows(act, s.m, s.inter, own.rounding), nullptr,
                s.down_at, s.tiles_taken[4 * i + 3], next);
  }

  // A matrix's tiles into `out`. Each member first runs its own fixed share (the members together
  // FIXED_QUARTERS quarters of the tiles: three eighths each with two), then takes the rest as it
  // comes for more, in runs that shrink as the tiles run out (OpenMP's guided schedule), so that
  // a member that streams faster takes more and all finish within about a run of each other.
  // Then the barrier after which all of `out` is there for everyone, where a member that waits
  // fetches the start of its own share of `next` (the matrix the team reads next, if any). Why
  // both a fixed share and runs: with fixed halves the members waited ~15 % of the step at the
  // barriers, the one or the other (two threads streaming side by side do not get the memory
  // equally); with every tile claimed from the shared counter, each of a matrix's ~15 claims
  // moved the counter's cache line from one core to the other, and those reads took most of the
  // 5 % of samples spent in the team's own code (docs/performance.md, thirteenth session).
  static void share_tiles(const TeamMember& me, const QuantLinear& linear, const TeamRows& a,
                          const float* bias, float* out, std::atomic<int64_t>& taken,
                          const QuantLinear* next) {
    const int64_t n = linear.num_tiles();
    const int64_t own = own_share(n, me);
    linear.tiles_part(a, bias, out, me.rank * own, (me.rank + 1) * own);
    const int64_t shared = own * me.size;  // the first tile handed out by `taken`
    for (int64_t start = shared;;) {
      const int64_t run = std::max<int64_t>(MIN_RUN, (n - start) / (2 * me.size));
      start = shared + taken.fetch_add(run, std::memory_order_relaxed);
      if (start >= n) break;
      linear.tiles_part(a, bias, out, start, std::min(n, start + run));
      start += run;
    }
    me.ahead = FetchAhead{};
    if (next != nullptr) {
      const int64_t next_own = own_share(next->num_tiles(), me);
      me.ahead.set(next->tile_bytes(me.rank * next_own, (me.rank + 1) * next_own));
    }
    me.barrier();
  }

  // The tiles of a matrix of n that each member runs first, its fixed share (share_tiles).
  static int64_t own_share(int64_t n, const TeamMember& me) {
    return n * FIXED_QUARTERS / (4 * me.size);
  }

  // The residual stream `res` += delta, and x = its norm, row by row.
  static void add_norm_rows(float* res, const float* delta, const float* w, float eps,
                            int64_t m, int64_t hidden, float* x) {
    for (int64_t r = 0; r < m; ++r)
      add_rms_norm_row(res + r * hidden, delta + r * hidden, w, hidden, eps, res + r * hidden,
                       x + r * hidden);
  }
};

}  // namespace

// The calls run without Python's GIL (they touch no Python object): a whole step's layers take
// milliseconds, and the server's event loop, streaming to clients, runs meanwhile.
void register_fused_blocks(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<QuantLinear>(m, "QuantLinear",
                          "a weight-only quantized matrix and its kernel, chosen once")
      .def(py::init<const std::string&, std::vector<torch::Tensor>, int64_t>(), py::arg("kind"),
           py::arg("tensors"), py::arg("group_size"))
      .def("__call__", &QuantLinear::operator(), py::arg("x"), py::arg("bias") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("shared_by_team", &QuantLinear::shared_by_team,
                             "a team of threads can share it, 16 output channels at a time");
  py::class_<AttentionBlock>(m, "AttentionBlock", "qkv, RoPE, paged attention and o in one call")
      .def(py::init<QuantLinear, QuantLinear, c10::optional<torch::Tensor>, int64_t, int64_t,
                    int64_t, double>(),
           py::arg("qkv"), py::arg("o"), py::arg("qkv_bias"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("scale"))
      .def("__call__", &AttentionBlock::operator(), py::call_guard<py::gil_scoped_release>());
  py::class_<MlpBlock>(m, "MlpBlock", "gate_up, SwiGLU and down in one call")
      .def(py::init<QuantLinear, QuantLinear>(), py::arg("gate_up"), py::arg("down"))
      .def("__call__", &MlpBlock::operator(), py::arg("x"),
           py::call_guard<py::gil_scoped_release>());
  py::class_<LayerStack>(m, "LayerStack", "every layer's blocks and norms, one call a step")
      .def(py::init<std::vector<AttentionBlock>, std::vector<MlpBlock>, std::vector<torch::Tensor>,
                    std::vector<torch::Tensor>, double>(),
           py::arg("attention"), py::arg("mlp"), py::arg("input_norms"), py::arg("post_norms"),
           py::arg("eps"))
      .def("__call__", &LayerStack::operator(), py::arg("h"), py::arg("cos"), py::arg("sin"),
           py::arg("k_caches"), py::arg("v_caches"), py::arg("slots"), py::arg("block_tables"),
           py::arg("tiles"), py::arg("first_chunks"), py::arg("logits_rows") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def("set_head", &LayerStack::set_head, py::arg("final_norm"), py::arg("lm_head"))
      .def_readonly("team", &LayerStack::team,
                    "every matrix shared by a team: decode steps run as one team of threads")
      .def_readonly("team_steps", &LayerStack::team_steps,
                    "how many steps ran as one team of threads")
      .def_property(
          "barrier_spin", [](const LayerStack& s) { return s.barrier_spin.load(); },
          [](LayerStack& s, int64_t pauses) { s.barrier_spin.store(pauses); },
          "pauses the team's barriers spin before they sleep (adapted as they wait)");
}

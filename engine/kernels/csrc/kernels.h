// The extension's entry points, as Python sees them (PYBIND11_MODULE in cpu_kernels.cpp) and as
// the fused blocks (fused_blocks.cpp) call them from C++. Each is defined in the file named above
// its group.
#pragma once

#include <torch/extension.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "q8.h"

// f32_rows.cpp
constexpr int64_t F32_MAX_ROWS = 8;  // rows of activations on our kernel; more on the library
constexpr int64_t F32_PACKED_CHANNELS = 4;  // output channels packed together (f32_pack)
// The packed copy's width for `in` inputs: rounded up to 16 (the weights past `in` are zeros).
int64_t f32_packed_width(int64_t in);
// `packed` [out, f32_packed_width(in)] := w [out, in], for each 16 inputs 4 channels' 16 weights
// one after another (the last out % 4 channels one at a time).
void f32_pack(const torch::Tensor& w, torch::Tensor& packed);
// x @ w^T (+ bias): up to F32_MAX_ROWS rows on our kernel over w packed at `packed`, more on the
// library over w (what a float32 QuantLinear calls).
torch::Tensor f32_packed_linear(const torch::Tensor& x, const torch::Tensor& w,
                                const torch::Tensor& packed,
                                const c10::optional<torch::Tensor>& bias, bool onednn);
// The same with w packed for this call only (tests, one-off products).
torch::Tensor f32_linear(const torch::Tensor& x, const torch::Tensor& w,
                         const std::optional<torch::Tensor>& bias, bool onednn);
// Output channels c0 .. c1 of y [m, n] = x [m, k] @ W^T (+ bias), W packed at `packed`
// (f32_pack), m of at most F32_MAX_ROWS; c0 a multiple of F32_PACKED_CHANNELS, c1 too or n.
void f32_rows_part(const float* packed, int64_t k, const float* x, int64_t m, const float* bias,
                   float* y, int64_t n, int64_t c0, int64_t c1);

// cpu_kernels.cpp
void check_paged_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& slots, const torch::Tensor& block_tables,
                           const torch::Tensor& tiles, const torch::Tensor& out);
void paged_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots,
                     const torch::Tensor& block_tables, const torch::Tensor& tiles, double scale,
                     torch::Tensor& out);
// A weight-only int8 or int4 matrix in rows (engine/kernels/quant.py Int8Weight, Int4Weight),
// where its values lie, read from its tensors once (int8_rows, int4_rows check them): what
// int8_linear and int4_linear multiply, and what a member of the layer stack's team reads
// (fused_blocks.cpp) without touching a tensor.
struct QuantRows {
  const void* weights;  // int8 [n, k], or int4 packed uint8 [n, k / 2]
  const void* scales;   // int8: float32 [n]; int4: [n, k / group_size], float32 or float16
  const void* mins;     // int4: as scales; int8: nullptr
  bool int4, half;      // half: int4's scales and minimums are float16
  int64_t n, k, group_size;
  int64_t row_bytes() const { return int4 ? k / 2 : k; }
  // int4, one row: how many sums of the activation's groups quant_rows_part takes (0 for int8).
  int64_t num_groups() const { return int4 ? k / group_size : 0; }
};
QuantRows int8_rows(const torch::Tensor& qweight, const torch::Tensor& scales);
QuantRows int4_rows(const torch::Tensor& packed, const torch::Tensor& scales,
                    const torch::Tensor& mins, int64_t group_size);
// The sums of one row's groups of w.group_size values, w.num_groups() of them, into out.
void row_group_sums(const QuantRows& w, const float* x, float* out);
// Output channels c0 .. c1 of y [m, n] = x [m, k] @ W^T (+ bias) (row stride n); for m > 1, c0 a
// multiple of QUANT_ROWS_ITEM. x_sums: for int4 at one row, row_group_sums of x, computed once
// for all the ranges a call or a team member runs; else unused. Whoever runs a channel, its
// output is the same bit for bit.
constexpr int64_t QUANT_ROWS_ITEM = 16;
void quant_rows_part(const QuantRows& w, const float* x, const float* x_sums, int64_t m,
                     const float* bias, float* y, int64_t c0, int64_t c1);
torch::Tensor quant_rows_linear(const torch::Tensor& x, const QuantRows& w,
                                const c10::optional<torch::Tensor>& bias);
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& qweight,
                          const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias);
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scales, const torch::Tensor& mins,
                          int64_t group_size, const c10::optional<torch::Tensor>& bias);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& h,
                                                      const torch::Tensor& delta,
                                                      const torch::Tensor& weight, double eps);
torch::Tensor silu_and_mul(const torch::Tensor& gate_up);
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
// What the four above do to one row (one token for rope), for a thread that runs its own rows.
void rms_norm_row(const float* x, const float* weight, int64_t d, float eps, float* out);
void add_rms_norm_row(const float* h, const float* delta, const float* weight, int64_t d,
                      float eps, float* sum, float* out);
void silu_and_mul_row(const float* gate_up, int64_t n, float* out);
void rope_row(const float* x, int64_t heads, int64_t d, const float* cos, const float* sin,
              float* out);

// paged_attention (float32 q, k, v and out) for a team of threads inside one parallel region
// (fused_blocks.cpp's LayerStack). Once a step, before the region: `plan`, the work cut into
// items as paged_attention cuts it for `threads` (every layer has the same tiles), then
// `prepare`, every layer's work with its tensors read (inside the region each read came from
// memory: the stream had evicted them). Then for each layer one member calls `start_layer` (this
// layer's new K/V into its cache) and every member `run_items`, taking the next item from `next`
// until none is left. The same items and the same code as paged_attention, so the same numbers.
// Arguments checked by check_paged_attention.
struct AttentionPlan;
class TeamAttention {
 public:
  TeamAttention();
  ~TeamAttention();
  void plan(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
            const torch::Tensor& block_tables, const torch::Tensor& tiles, torch::Tensor& out,
            int64_t threads);
  void prepare(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
               std::vector<torch::Tensor>& k_caches, std::vector<torch::Tensor>& v_caches,
               const torch::Tensor& slots, const torch::Tensor& block_tables,
               const torch::Tensor& tiles, const std::vector<double>& scales,
               torch::Tensor& out);
  void start_layer(size_t layer) const;
  void run_items(size_t layer, std::atomic<int64_t>& next) const;

 private:
  struct Layer {
    std::function<void()> start;        // its new K/V into its cache
    std::function<void(int64_t)> item;  // one item of its attention
  };
  std::unique_ptr<AttentionPlan> plan_;
  std::vector<Layer> layers_;
  int64_t items_ = 0;
};

// q8_rows.cpp
torch::Tensor int4_q8_linear(const torch::Tensor& x, const torch::Tensor& packed,
                             const torch::Tensor& scales, const torch::Tensor& mins,
                             int64_t group_size, const c10::optional<torch::Tensor>& bias);
torch::Tensor int8_q8_linear(const torch::Tensor& x, const torch::Tensor& qweight,
                             const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias);

// q8_tiles.cpp
std::vector<std::string> q8_tile_formats();
torch::Tensor int4_q8_tiled_linear(const torch::Tensor& x, const torch::Tensor& tiles,
                                   const c10::optional<torch::Tensor>& bias);
torch::Tensor int8_q8_tiled_linear(const torch::Tensor& x, const torch::Tensor& tiles,
                                   const torch::Tensor& scales,
                                   const c10::optional<torch::Tensor>& bias);
// Tiles t0 .. t1 of the two above's y ([m, n] float32, written there) for rows already rounded;
// `tiles` (and `scales`) point at the matrix's n_tiles tiles (and its n scales).
void int4_tiles_part(const uint8_t* tiles, int64_t n_tiles, const q8::RoundedView& a,
                     const float* bias, float* y, int64_t t0, int64_t t1);
void int8_tiles_part(const uint8_t* tiles, const float* scales, int64_t n_tiles,
                     const q8::RoundedView& a, const float* bias, float* y, int64_t t0,
                     int64_t t1);
// Rows of an int8 tiled matrix as float32 (a tied embedding's lookup).
torch::Tensor int8_tiled_rows(const torch::Tensor& tiles, const torch::Tensor& scales,
                              const torch::Tensor& ids);

// bf16_tiles.cpp
bool bf16_tiles_available();
std::string bf16_tiles_kernel();
torch::Tensor bf16_tiled_linear(const torch::Tensor& x, const torch::Tensor& packed,
                                const c10::optional<torch::Tensor>& bias);
// For a team of threads (fused_blocks.cpp): whether one shares a matrix's tiles here (where the
// AVX512-BF16 kernel multiplies), x's values rounded to bfloat16 as bf16_tiled_linear rounds
// them, and channel tiles t0 .. t1 of its y [m, n] (+ bias) for m rows `a` already rounded, the
// tiles at `packed` ([n / 16, k / 32, 16, 32] bfloat16 values).
bool bf16_tiles_team();
void bf16_round(const float* x, int64_t count, uint16_t* out);
void bf16_tiles_part(const uint16_t* a, int64_t m, int64_t k, const uint16_t* packed, int64_t n,
                     const float* bias, float* y, int64_t t0, int64_t t1);

// sampling.cpp
torch::Tensor argmax_rows(const torch::Tensor& logits);

// fused_blocks.cpp
void register_fused_blocks(pybind11::module& m);

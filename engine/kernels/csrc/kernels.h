// The extension's entry points, as Python sees them (PYBIND11_MODULE in cpu_kernels.cpp) and as
// the fused blocks (fused_blocks.cpp) call them from C++. Each is defined in the file named above
// its group.
#pragma once

#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

// cpu_kernels.cpp
void paged_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots,
                     const torch::Tensor& block_tables, const torch::Tensor& tiles, double scale,
                     torch::Tensor& out);
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

// bf16_tiles.cpp
bool bf16_tiles_available();
torch::Tensor bf16_tiled_linear(const torch::Tensor& x, const torch::Tensor& packed,
                                const c10::optional<torch::Tensor>& bias);

// sampling.cpp
torch::Tensor argmax_rows(const torch::Tensor& logits);

// fused_blocks.cpp
void register_fused_blocks(pybind11::module& m);

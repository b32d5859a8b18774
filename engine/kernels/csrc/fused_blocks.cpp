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
// also rounded once at load, a bfloat16 matrix in AMX tiles (a float32 engine's bfloat16
// linears, or a bfloat16 engine's): "bf16_tiles" (tiles: bf16_tiles.cpp). Python builds it with
// engine/kernels/quant.py `kernel_linear` (engine/kernels/bfloat16_tiles.py `tiled_kernel` for
// the last), and the layers of both paths call it (engine/layers/linear.py), so the choice of a
// kernel is made in one place.

#include <torch/extension.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels.h"

namespace {

enum class Kind { Int4Tiles, Int8Tiles, Int8, Int4, Int4Q8, Int8Q8, Bf16Tiles };

Kind kind_of(const std::string& name, size_t num_tensors) {
  const std::vector<std::pair<std::string, std::pair<Kind, size_t>>> kinds = {
      {"int4_tiles", {Kind::Int4Tiles, 1}}, {"int8_tiles", {Kind::Int8Tiles, 2}},
      {"int8", {Kind::Int8, 2}},            {"int4", {Kind::Int4, 3}},
      {"int4_q8", {Kind::Int4Q8, 3}},       {"int8_q8", {Kind::Int8Q8, 2}},
      {"bf16_tiles", {Kind::Bf16Tiles, 1}},
  };
  for (const auto& [known, kind] : kinds) {
    if (known != name) continue;
    TORCH_CHECK(num_tensors == kind.second, "QuantLinear: ", name, " takes ", kind.second,
                " tensors, not ", num_tensors);
    return kind.first;
  }
  TORCH_CHECK(false, "QuantLinear: unknown kind ", name);
}

struct QuantLinear {
  Kind kind;
  std::vector<torch::Tensor> t;  // the weight's tensors, in the order its kernel takes them
  int64_t group_size;

  QuantLinear(const std::string& name, std::vector<torch::Tensor> tensors, int64_t group_size)
      : kind(kind_of(name, tensors.size())), t(std::move(tensors)), group_size(group_size) {}

  // y = x @ W^T (+ bias), x: [rows, in] float32, contiguous; bias float32, contiguous.
  torch::Tensor operator()(const torch::Tensor& x, const c10::optional<torch::Tensor>& bias) const {
    switch (kind) {
      case Kind::Int4Tiles: return int4_q8_tiled_linear(x, t[0], bias);
      case Kind::Int8Tiles: return int8_q8_tiled_linear(x, t[0], t[1], bias);
      case Kind::Int8: return int8_linear(x, t[0], t[1], bias);
      case Kind::Int4: return int4_linear(x, t[0], t[1], t[2], group_size, bias);
      case Kind::Int4Q8: return int4_q8_linear(x, t[0], t[1], t[2], group_size, bias);
      case Kind::Int8Q8: return int8_q8_linear(x, t[0], t[1], bias);
      case Kind::Bf16Tiles: return bf16_tiled_linear(x, t[0], bias);
    }
    TORCH_CHECK(false, "QuantLinear: bad kind");
  }
};

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
          q.narrow(0, start, rows).transpose(0, 1), k.narrow(0, start, rows).transpose(0, 1),
          v.narrow(0, start, rows).transpose(0, 1), {}, 0.0, /*is_causal=*/true, scale,
          /*enable_gqa=*/true);
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

// Every layer of the model, one after the other, as LlamaModel.run_layers runs them: the
// residual adds fused into the norms that follow them (add_rms_norm). One call a step.
struct LayerStack {
  std::vector<AttentionBlock> attention;
  std::vector<MlpBlock> mlp;
  std::vector<torch::Tensor> input_norms, post_norms;  // float32 weights, one per layer
  double eps;

  // h: the residual stream entering layer 0; k_caches[i], v_caches[i]: layer i's cache. Returns
  // (h, mlp_out) after the last layer: the residual stream and the last MLP's output, not yet
  // added (the final norm adds them).
  std::tuple<torch::Tensor, torch::Tensor> operator()(
      torch::Tensor h, const torch::Tensor& cos, const torch::Tensor& sin,
      std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
      const torch::Tensor& slots, const torch::Tensor& block_tables, const torch::Tensor& tiles,
      const torch::Tensor& first_chunks) const {
    const size_t layers = attention.size();
    TORCH_CHECK(layers > 0 && k_caches.size() == layers && v_caches.size() == layers,
                "LayerStack: one K and one V cache per layer");
    torch::Tensor x = rms_norm(h, input_norms[0], eps), mlp_out;
    for (size_t i = 0; i < layers; ++i) {
      const torch::Tensor attn_out = attention[i](x, cos, sin, k_caches[i], v_caches[i], slots,
                                                  block_tables, tiles, first_chunks);
      std::tie(h, x) = add_rms_norm(h, attn_out, post_norms[i], eps);
      mlp_out = mlp[i](x);
      if (i + 1 < layers) std::tie(h, x) = add_rms_norm(h, mlp_out, input_norms[i + 1], eps);
    }
    return {h, mlp_out};
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
           py::call_guard<py::gil_scoped_release>());
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
      .def("__call__", &LayerStack::operator(), py::call_guard<py::gil_scoped_release>());
}

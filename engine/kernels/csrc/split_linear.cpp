// split_linear: a float32 linear layer at one row, on the library the engine chose for float32
// (oneDNN's kernel, or MKL's through at::linear), its output channels cut into one range per
// thread, each range one call of that library on its slice of the weights.
//
// Why: at one row (decode at batch 1) neither library keeps both cores of our 2-vCPU VMs busy.
// On a Zen 5 (2026-12-06) oneDNN ran the o and down matrices of SmolLM2 no faster on 2 threads
// than on 1 and the others 1.2-1.35x; MKL ran on one thread only; `perf` put the second thread
// 33 % of the time in OpenMP's wait loop, 16 % in the matrices, during a float32 decode.
// Each output is still one call of the same library over the same inputs, so the numbers are
// the library's own, bit for bit (tests/test_split_linear.py checks this for both).
//
// Ranges are cut at multiples of 16 channels. Inside the parallel region each call runs on its
// thread alone (oneDNN and ATen start no nested threads there).
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "kernels.h"

namespace {

// mkldnn::_linear_pointwise(Tensor X, Tensor W, Tensor? B, str attr, Scalar?[] scalars,
// str? algorithm): what engine/kernels/float32_linear.py `onednn_linear` calls.
using OnednnLinear = at::Tensor(const at::Tensor&, const at::Tensor&,
                                const std::optional<at::Tensor>&, c10::string_view,
                                c10::List<std::optional<at::Scalar>>,
                                std::optional<c10::string_view>);

at::Tensor library_linear(const at::Tensor& x, const at::Tensor& w,
                          const std::optional<at::Tensor>& bias, bool onednn) {
  if (!onednn) return at::linear(x, w, bias);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<OnednnLinear>();
  return op.call(x, w, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

constexpr int64_t MIN_CHANNELS_PER_THREAD = 64;  // below this one call costs less than two

}  // namespace

torch::Tensor split_linear(const torch::Tensor& x, const torch::Tensor& w,
                           const std::optional<torch::Tensor>& bias, bool onednn) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32 &&
                  x.device().is_cpu() && w.device().is_cpu(),
              "split_linear: float32 on the CPU only");
  TORCH_CHECK(w.dim() == 2 && x.dim() >= 1 && x.size(-1) == w.size(1),
              "split_linear: x [..., in] and w [out, in]");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == w.size(0) &&
                        bias->scalar_type() == torch::kFloat32),
              "split_linear: bias [out], float32");
  const int64_t threads = at::get_num_threads(), n = w.size(0);
  if (x.dim() != 2 || x.size(0) != 1 || threads < 2 || n < MIN_CHANNELS_PER_THREAD * threads)
    return library_linear(x, w, bias, onednn);
  auto out = at::empty({1, n}, x.options());
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = n * t / threads / 16 * 16;
      const int64_t n1 = t + 1 == threads ? n : n * (t + 1) / threads / 16 * 16;
      std::optional<at::Tensor> part_bias;
      if (bias) part_bias = bias->narrow(0, n0, n1 - n0);
      const auto part = library_linear(x, w.narrow(0, n0, n1 - n0), part_bias, onednn);
      out.narrow(1, n0, n1 - n0).copy_(part);
    }
  });
  return out;
}

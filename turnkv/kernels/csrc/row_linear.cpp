// turnkv: torch.ops.turnkv_ops.row_linear(x, w, isa): x [M, K] @ w [N, K]^T, float32, each output
// in row_linear.h's fixed order (a library fragment of the extension binary, as norm.cpp's op);
// torch.ops.turnkv_ops.sigmoid_each(x): the sigmoid of every element on its own.

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>

#include "row_linear.h"

namespace tkv_rl {

static torch::Tensor row_linear_op(torch::Tensor x, torch::Tensor w, int64_t isa) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32 && x.device().is_cpu() &&
                    w.device().is_cpu() && x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
                "row_linear: float32 CPU x [M, K] and w [N, K]");
    TORCH_CHECK(isa >= 0 && std::min<int64_t>(isa, 2) <= best_isa(), "row_linear: ISA path ", isa, " not supported by this CPU");
    torch::Tensor xc = x.contiguous(), wc = w.contiguous();
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    auto y = torch::empty({M, N}, x.options());
    if (M > 0 && N > 0) row_linear(xc.data_ptr<float>(), M, K, wc.data_ptr<float>(), N, y.data_ptr<float>(), (int)isa);
    return y;
}

// 1 / (1 + exp(-x)) element by element with the C library's expf: ATen's scalar formula, so each
// element is the bits torch.sigmoid gives it alone. ATen's own loop runs vector steps (another exp)
// over all but a tail, so there an element's bits depend on where it falls in the tensor's length
// and its threads' split; here on nothing but its value. No SIMD clone of expf is declared without
// -ffast-math, so the loop stays one call per element.
static torch::Tensor sigmoid_each_op(torch::Tensor x) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.device().is_cpu(), "sigmoid_each: a float32 CPU tensor");
    torch::Tensor xc = x.contiguous();
    auto y = torch::empty_like(xc);
    const float* a = xc.data_ptr<float>();
    float* o = y.data_ptr<float>();
    at::parallel_for(0, xc.numel(), (int64_t)1 << 14, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; i++) o[i] = 1.0f / (1.0f + std::exp(-a[i]));
    });
    return y;
}

}  // namespace tkv_rl

namespace {
const bool g_row_linear_registered = [] {
    if (c10::Dispatcher::singleton().findSchema(c10::OperatorName("turnkv_ops::row_linear", "")).has_value()) return false;
    static torch::Library lib(torch::Library::FRAGMENT, "turnkv_ops", std::nullopt, __FILE__, __LINE__);
    lib.def("row_linear(Tensor x, Tensor w, int isa) -> Tensor", &tkv_rl::row_linear_op);
    lib.def("sigmoid_each(Tensor x) -> Tensor", &tkv_rl::sigmoid_each_op);
    return true;
}();
}  // namespace

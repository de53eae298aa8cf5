// turnkv: RMSNorm over the last dimension, float32, one fixed reduction order per row.
//
// out[r, d] = (x[r, d] * inv_r) * w[d]   (no w: x[r, d] * inv_r)
// inv_r = 1 / sqrt(ss_r / D + eps),  ss_r = sum_d x[r, d]^2 accumulated in 8 lanes (lane = d % 8,
// increasing d), then the fixed tree (0+4, 1+5, 2+6, 3+7), (0+2, 1+3), (0+1).
//
// torch's rms_norm on CPU runs as six ATen ops (~10 us for one 640-wide row, most of it dispatch);
// a decode step calls it 60-90 times. This is one call. A row's result depends only on that row,
// so it is the same bits for 1 row (decode) or 512 (a prefill chunk) and on every CPU (plain C++,
// the compiler may vectorize the lanes, never reassociate: no -ffast-math).
// Registered as torch.ops.turnkv_ops.rms_norm (a library fragment of the extension binary).

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <cmath>
#include <cstdint>
#include <optional>

#include "norm_row.h"

namespace tkv_norm {

static torch::Tensor rms_norm(torch::Tensor x, const std::optional<torch::Tensor>& weight, double eps) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.device().is_cpu() && x.dim() >= 1,
                "rms_norm: a float32 CPU tensor");
    const int64_t D = x.size(-1);
    const float* w = nullptr;
    if (weight.has_value()) {
        TORCH_CHECK(weight->scalar_type() == torch::kFloat32 && weight->device().is_cpu() && weight->dim() == 1 &&
                        weight->size(0) == D && weight->is_contiguous(), "rms_norm: weight must be float32 [D]");
        w = weight->data_ptr<float>();
    }
    torch::Tensor xc = x.contiguous();
    auto out = torch::empty(x.sizes(), x.options());
    const int64_t rows = D > 0 ? xc.numel() / D : 0;
    const float* xp = xc.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const float e = (float)eps;
    if (rows * D <= (int64_t)1 << 15) {       // decode-sized: no parallel region
        for (int64_t r = 0; r < rows; r++) row(xp + r * D, w, op + r * D, D, e);
    } else {
        at::parallel_for(0, rows, std::max<int64_t>(1, ((int64_t)1 << 14) / std::max<int64_t>(D, 1)),
                         [&](int64_t b, int64_t f) {
                             for (int64_t r = b; r < f; r++) row(xp + r * D, w, op + r * D, D, e);
                         });
    }
    return out;
}

}  // namespace tkv_norm

namespace {
const bool g_norm_registered = [] {
    if (c10::Dispatcher::singleton().findSchema(c10::OperatorName("turnkv_ops::rms_norm", "")).has_value()) return false;
    static torch::Library lib(torch::Library::FRAGMENT, "turnkv_ops", std::nullopt, __FILE__, __LINE__);
    lib.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor", &tkv_norm::rms_norm);
    return true;
}();
}  // namespace

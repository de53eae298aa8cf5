// turnkv: torch.ops.turnkv_ops.row_linear(x, w, isa): x [M, K] @ w [N, K]^T, float32, each output
// in row_linear.h's fixed order (a library fragment of the extension binary, as norm.cpp's op);
// torch.ops.turnkv_ops.sigmoid_each(x): the sigmoid of every element on its own;
// torch.ops.turnkv_ops.each_row(x, op): an ATen elementwise op on blocks of whole rows, in parallel.

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

// models/base.py's each_row, its blocks run by the threads: ATen's op (0 sigmoid, 1 silu,
// 2 softplus, 3 gelu tanh, 4 exp, 5 tanh) on x [N, W] (unit column stride; the caller's padded row
// stride keeps rows apart) into a fresh contiguous [N, W], one call per block of whole rows of at
// most EACH_ROW_GRAIN values (EACH_ROW_GRAIN-column pieces of a longer row). A call inside the
// parallel region runs on its thread alone (ATen does not split it again), so each block is the
// loop the Python fallback's call on the same block runs: the same bits, at any thread count.
static constexpr int64_t EACH_ROW_GRAIN = 16384;

static void each_row_block(const torch::Tensor& in, torch::Tensor out, int64_t op) {
    switch (op) {
        case 0: at::sigmoid_out(out, in); break;
        case 1: at::silu_out(out, in); break;
        case 2: at::softplus_out(out, in, 1, 20); break;
        case 3: at::gelu_out(out, in, "tanh"); break;
        case 4: at::exp_out(out, in); break;
        default: at::tanh_out(out, in);
    }
}

static torch::Tensor each_row_op(torch::Tensor x, int64_t op) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1,
                "each_row: a float32 CPU [N, W] with unit column stride");
    TORCH_CHECK(op >= 0 && op <= 5, "each_row: op 0-5");
    const int64_t N = x.size(0), W = x.size(1);
    auto y = torch::empty({N, W}, x.options());
    if (N == 0 || W == 0) return y;
    const int64_t rows = std::max<int64_t>(1, EACH_ROW_GRAIN / W), piece = std::min(W, EACH_ROW_GRAIN);
    // the blocks as plain tensors over the same memory: the workers are not in the caller's
    // inference mode, where an inference tensor's view could not be written
    float* const xp = x.data_ptr<float>();
    float* const yp = y.data_ptr<float>();
    const int64_t sx = x.stride(0);
    at::parallel_for(0, (N + rows - 1) / rows, 1, [&](int64_t b, int64_t e) {
        for (int64_t blk = b; blk < e; blk++) {
            const int64_t r0 = blk * rows, n = std::min(N, r0 + rows) - r0;
            for (int64_t c0 = 0; c0 < W; c0 += piece) {
                const int64_t c = std::min(piece, W - c0);
                each_row_block(torch::from_blob(xp + r0 * sx + c0, {n, c}, {sx, 1}, torch::kFloat32),
                               torch::from_blob(yp + r0 * W + c0, {n, c}, {W, 1}, torch::kFloat32), op);
            }
        }
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
    lib.def("each_row(Tensor x, int op) -> Tensor", &tkv_rl::each_row_op);
    return true;
}();
}  // namespace

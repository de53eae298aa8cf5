// turnkv: one layer's K/V cache writes and attention for a batch of spans (defined in
// attention.cpp; fused_layer.inc calls it from gguf_matmul.cpp, the same binary). One
// declaration for both, so the definition is checked against what its caller sees.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <vector>

namespace tkv_attn {
// ``out``: write the result there (contiguous float32 [rows of q, Hq * D]) instead of a new tensor.
// ``keep``: span j's K/V rows all written, but only its last keep[j] queries attended (the output's
// rows: sum keep)
torch::Tensor write_attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, const std::vector<torch::Tensor>& kbufs,
                           const std::vector<torch::Tensor>& vbufs, const std::vector<int64_t>& lens,
                           const std::vector<torch::Tensor>& tables, const std::vector<int64_t>& q_pos0,
                           const std::vector<int64_t>& k_pos0, const std::vector<int64_t>& kind,
                           const std::vector<int64_t>& wc, double scale, double softcap, int64_t isa,
                           const std::optional<torch::Tensor>& sinks,
                           const std::optional<std::vector<torch::Tensor>>& kscales,
                           const std::optional<std::vector<torch::Tensor>>& vscales,
                           const std::optional<torch::Tensor>& out = std::nullopt,
                           const std::optional<std::vector<int64_t>>& keep = std::nullopt);
}

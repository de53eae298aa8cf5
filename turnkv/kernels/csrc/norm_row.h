// turnkv: one RMSNorm row, float32, in one fixed reduction order (norm.cpp's op and the fused
// layer calls of fused_layer.inc share it, so both give the same bits).
//
// o[d] = (x[d] * inv) * w[d]   (no w: x[d] * inv),  inv = 1 / sqrt(ss / D + eps),
// ss = sum_d x[d]^2 in 8 lanes (lane = d % 8, increasing d), then (0+4, 1+5, 2+6, 3+7), (0+2, 1+3),
// (0+1). o may be x (every x[d] is read before o is written).
#pragma once
#include <cmath>
#include <cstdint>

namespace tkv_norm {

static inline void row(const float* x, const float* w, float* o, int64_t D, float eps) {
    float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
        for (int i = 0; i < 8; i++) lane[i] = lane[i] + x[d + i] * x[d + i];
    for (int i = 0; d < D; d++, i++) lane[i] = lane[i] + x[d] * x[d];
    for (int i = 0; i < 4; i++) lane[i] = lane[i] + lane[i + 4];
    for (int i = 0; i < 2; i++) lane[i] = lane[i] + lane[i + 2];
    const float ss = lane[0] + lane[1];
    const float inv = 1.f / std::sqrt(ss / (float)D + eps);
    if (w != nullptr) {
        for (int64_t j = 0; j < D; j++) o[j] = (x[j] * inv) * w[j];
    } else {
        for (int64_t j = 0; j < D; j++) o[j] = x[j] * inv;
    }
}

}  // namespace tkv_norm

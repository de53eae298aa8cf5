// turnkv GGUF int8-activation matmul: shared declarations (see docs/kernels.md).
#pragma once
#include <cstdint>
#include <cstring>
#include <cmath>
#include <vector>

namespace tkv {

// ggml type ids
enum QType : int { F16 = 1, BF16 = 30, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12,
                   Q5_K = 13, Q6_K = 14, IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22,
                   IQ4_XS = 23, IQ1_S = 19, IQ1_M = 29, TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39 };

// IQ4_NL / IQ4_XS: a 4-bit index into this non-linear table of int8 values (ggml's kvalues_iq4nl)
alignas(16) static const int8_t kIQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// MXFP4: a 4-bit E2M1 code (sign bit 3) -> twice its value, ggml's kvalues_mxfp4; the block's
// E8M0 scale is taken as half (e8m0_half) so that value x scale is exact
alignas(16) static const int8_t kMXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// MXFP4's E8M0 byte e -> 2^(e - 128) as float32 (ggml's GGML_E8M0_TO_FP32_HALF: e < 2 are subnormals)
inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

constexpr int TILE = 8;       // weight rows per tile of the scalar path
constexpr int TILE_MAX = 16;  // the widest tile (512-bit paths); sizes the scratch
extern int64_t g_prefetch;  // software prefetch distance in bytes
// the fused paths' (and the unpack path's full 8-row tiles') prefetch distance ahead in a tile's one
// stream, bytes (0 = off), per ggml type id (gguf_matmul.cpp: the defaults, TURNKV_KERNEL_PREFETCH_FUSED,
// set_prefetch_fused)
constexpr int PF_TYPES = 64;
extern int64_t g_prefetch_fused[PF_TYPES];
inline int64_t prefetch_fused(int qt) { return g_prefetch_fused[qt & (PF_TYPES - 1)]; }
extern int g_fused;         // 1: the fused decode path of the 32-value block types (TURNKV_KERNEL_FUSED=0 turns it off)
extern int g_pair;          // 1: that path pairs activation rows in 512-bit vectors (AVX-512; TURNKV_KERNEL_PAIR)
extern int g_vbmi;          // 1: IQ4_XS's decode looks its table up with vpermb (AVX-512 VBMI; TURNKV_KERNEL_VBMI)
// The most activation rows the fused decode path takes where the rows go in pairs (AVX-512 with
// g_pair: Zen 5): 9..31 rows run in passes of 8 over each tile, which comes from memory once and
// from L1 for the later passes. Elsewhere the limit stays 8 (unpaired 256-bit passes measured no
// gain there: docs/kernels.md). Past the limit, the unpack + dot path (16-row tiles on AVX-512
// from 16 rows on).
constexpr int FUSED_MAX_ROWS = 31;
extern int g_fused_rows;    // the paired limit in force (set_fused_rows, 8..FUSED_MAX_ROWS: tests, A/B)
inline int fused_rows_for(int isa) { return isa >= 2 && g_pair ? g_fused_rows : 8; }

inline bool is_kquant(int qt) { return qt == Q4_K || qt == Q5_K || qt == Q6_K; }
// the 2- and 3-bit types and the ternary ones (lowbit.h): 256-value super-blocks decoded to int8
// values and one integer scale (and, Q2_K, min) per 16 values
inline constexpr bool is_lowbit(int qt) {
    return qt == Q2_K || qt == Q3_K || qt == IQ2_XXS || qt == IQ2_XS || qt == IQ2_S || qt == IQ3_XXS || qt == IQ3_S ||
           qt == TQ1_0 || qt == TQ2_0 || qt == IQ1_S || qt == IQ1_M;
}
// 256-value super-blocks with 32- or 16-value sub-block scales: the k-quants, IQ4_XS, the low-bit types
inline bool is_super(int qt) { return is_kquant(qt) || qt == IQ4_XS || is_lowbit(qt); }
// weights signed as decoded (int8): Q8_0 as stored, the IQ4 types' and MXFP4's table values
inline constexpr bool signed_w(int qt) { return qt == Q8_0 || qt == IQ4_NL || qt == IQ4_XS || qt == MXFP4; }
inline int block_elems(int qt) { return is_super(qt) ? 256 : 32; }
// F16 / BF16 weights: their own matmul (float_matmul.inc), float activations, no blocks
inline bool is_float_w(int qt) { return qt == F16 || qt == BF16; }
inline constexpr int block_bytes(int qt) {
    switch (qt) {
        case Q4_0: return 18; case Q4_1: return 20; case Q5_0: return 22; case Q5_1: return 24;
        case Q8_0: return 34; case Q4_K: return 144; case Q5_K: return 176; case Q6_K: return 210;
        case IQ4_NL: return 18; case IQ4_XS: return 136; case MXFP4: return 17;
        case Q2_K: return 84; case Q3_K: return 110; case IQ2_XXS: return 66; case IQ2_XS: return 74;
        case IQ2_S: return 82; case IQ3_XXS: return 98; case IQ3_S: return 110;
        case TQ1_0: return 54; case TQ2_0: return 66; case IQ1_S: return 50; case IQ1_M: return 56;
    }
    return 0;
}

// Every type is read as tiles of 8 rows (turnkv/kernels/__init__.py, tile_rows): tile t = rows
// 8t..8t+7 (zero rows pad the last), block after block; block b of a tile is the 8 rows' block b
// cut into its fields (2- or 4-byte pieces, MXFP4's 1-byte scale: scales, mins, high bits, 4-byte groups of quants),
// each field of the 8 rows side by side (row r at r * width). So the field that starts at byte o
// of a row's block starts at byte 8 * o of the tile's block, and a 4-byte field there is one
// 32-byte vector with row r in lane r.
inline int64_t tiled_rows(int64_t n) { return (n + 7) / 8 * 8; }

// a block's field widths in GGUF order; returns how many
inline int block_fields(int qt, int* w) {
    int n = 0;
    auto add = [&](int width, int count) { for (int i = 0; i < count; i++) w[n++] = width; };
    switch (qt) {
        case Q4_0: add(2, 1); add(4, 4); break;                        // d, qs
        case Q4_1: add(2, 2); add(4, 4); break;                        // d, m, qs
        case Q5_0: add(2, 1); add(4, 1); add(4, 4); break;             // d, qh, qs
        case Q5_1: add(2, 2); add(4, 1); add(4, 4); break;             // d, m, qh, qs
        case Q8_0: add(2, 1); add(4, 8); break;                        // d, qs
        case Q4_K: add(2, 2); add(4, 3); add(4, 32); break;            // d, dmin, scales, qs
        case Q5_K: add(2, 2); add(4, 3); add(4, 8); add(4, 32); break; // d, dmin, scales, qh, qs
        case Q6_K: add(4, 32); add(4, 16); add(4, 4); add(2, 1); break; // ql, qh, scales, d
        case IQ4_NL: add(2, 1); add(4, 4); break;                      // d, qs (Q4_0's layout)
        case IQ4_XS: add(2, 2); add(4, 1); add(4, 32); break;          // d, scales_h, scales_l, qs
        case MXFP4: add(1, 1); add(4, 4); break;                       // e, qs (Q4_0's layout)
        case Q2_K: add(4, 4); add(4, 16); add(2, 2); break;            // scales, qs, d, dmin
        case Q3_K: add(4, 8); add(4, 16); add(4, 3); add(2, 1); break; // hmask, qs, scales, d
        case IQ2_XXS: add(2, 1); add(4, 16); break;                    // d, qs (indices, signs + scale)
        case IQ2_XS: add(2, 1); add(4, 16); add(4, 2); break;          // d, qs, scales
        case IQ2_S: add(2, 1); add(4, 8); add(4, 8); add(4, 2); add(4, 2); break;  // d, qs, signs, qh, scales
        case IQ3_XXS: add(2, 1); add(4, 16); add(4, 8); break;         // d, qs, scales and signs
        case IQ3_S: add(2, 1); add(4, 16); add(4, 2); add(4, 8); add(4, 1); break;  // d, qs, qh, signs, scales
        case TQ1_0: add(4, 12); add(4, 1); add(2, 1); break;           // qs (5 trits a byte), qh (4), d
        case TQ2_0: add(4, 16); add(2, 1); break;                      // qs (2 bits a value), d
        case IQ1_S: add(2, 1); add(4, 8); add(4, 4); break;            // d, qs, qh
        case IQ1_M: add(4, 8); add(4, 4); add(4, 2); break;            // qs, qh, scales (and d's bits)
    }
    return n;
}

// block b of row `row` of a tiled weight gathered back into GGUF's block layout (out: BB bytes)
inline void gather_block(const uint8_t* W, int64_t row_bytes, int qt, int64_t row, int b, uint8_t* out) {
    const int BB = block_bytes(qt), r = (int)(row % 8);
    const uint8_t* blk = W + (row / 8) * 8 * row_bytes + (int64_t)b * 8 * BB;
    int widths[64];
    const int nf = block_fields(qt, widths);
    int off = 0;
    for (int f = 0; f < nf; f++) {
        std::memcpy(out + off, blk + 8 * off + r * widths[f], widths[f]);
        off += widths[f];
    }
}

// exact IEEE half -> float (the same value on every path)
inline float fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, f;
    if (exp == 0) {
        if (man == 0) {
            f = sign;
        } else {
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            f = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        f = sign | 0x7f800000u | (man << 13);
    } else {
        f = sign | ((exp + 112) << 23) | (man << 13);
    }
    float r;
    std::memcpy(&r, &f, 4);
    return r;
}
inline uint16_t rd16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline float rdh(const uint8_t* p) { return fp16_to_fp32(rd16(p)); }

// Q4_K / Q5_K 6-bit scale and min of sub-block j
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Q6_K super-block fields past ql (128 bytes) and qh (64): 16 int8 scales, then the float16 d
constexpr int Q6K_SCALES = 192, Q6K_D = 208;

// The 256 quants of a Q4_K / Q5_K / Q6_K super-block (GGUF's layout, at p) as unsigned values, in
// order (the one place their bit layout is read: the scalar path and the row dequantization):
//   Q4_K / Q5_K: sub-block j = values 32j..32j+31, the low (even j) or high (odd j) nibbles of
//                qs[32 (j / 2) ..] (Q5_K: bit j of qh[i] above): 0..15 / 0..31;
//   Q6_K:        value 128h + 32k + l = nibble k / 2 of ql[64h + 32 (k % 2) + l] with bits
//                2k..2k+1 of qh[32h + l] above it: 0..63 (the quant is value - 32).
inline void kquant_values(int qt, const uint8_t* p, uint8_t* o) {
    if (qt == Q6_K) {
        const uint8_t* ql = p;
        const uint8_t* qh = p + 128;
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                const uint8_t a0 = ql[64 * h + l], a1 = ql[64 * h + 32 + l], hb = qh[32 * h + l];
                o[128 * h + l] = (a0 & 0xF) | ((hb & 3) << 4);
                o[128 * h + 32 + l] = (a1 & 0xF) | (((hb >> 2) & 3) << 4);
                o[128 * h + 64 + l] = (a0 >> 4) | (((hb >> 4) & 3) << 4);
                o[128 * h + 96 + l] = (a1 >> 4) | (((hb >> 6) & 3) << 4);
            }
        return;
    }
    const uint8_t* qs = p + (qt == Q4_K ? 16 : 48);
    const uint8_t* qh = p + 16;                        // Q5_K's fifth bits
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            int lo = qs[32 * c + l] & 0xF, hi = qs[32 * c + l] >> 4;
            if (qt == Q5_K) {
                lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
            }
            o[64 * c + l] = (uint8_t)lo;
            o[64 * c + 32 + l] = (uint8_t)hi;
        }
}

// IQ4_XS: the signed 6-bit scale (ls - 32) of sub-block j from its block's scales_h / scales_l
inline int iq4xs_scale(int j, const uint8_t* blk) {
    const int sh = blk[2] | (blk[3] << 8), sl = blk[4 + j / 2];
    return (((sl >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4)) - 32;
}

// Quantized activations of one call (computed once, read by every thread).
struct Act {
    int M = 0, K = 0, QB = 0, nb = 0;  // nb = K / QB
    int8_t* q = nullptr;               // [M][K]
    float* d = nullptr;                // [M][nb]   dx
    float* sx = nullptr;               // [M][K/32] dx * float(bsum32)  (QB == 32 only)
    int32_t* bs16 = nullptr;           // [M][K/16]
    int32_t* bs32 = nullptr;           // [M][K/32]
    const int16_t* q16 = nullptr;      // [M][K] q as int16 (avx2 Q8_0 / IQ4_XS calls past 8 rows; widen_act)
    float* fb32 = nullptr;             // [M][K/32] float(bsum32), exact (|bsum32| <= 32 * 127)
    int32_t* bp16 = nullptr;           // [M][K/32] chunk c's bs16 pair in int16 halves: bs16[2c] | bs16[2c + 1] << 16
    // rows 2p and 2p+1 side by side (the paired path, 2 <= M <= FUSED_MAX_ROWS; nullptr otherwise):
    // q2[(p * K/4 + g) * 2 + i] = row 2p+i's 4-byte group g; d2 / sx2 / b2[(p * nb + b) * 2 + i]
    // (b2: bs32), b16_2[(p * K/16 + j) * 2 + i] (bs16)
    int32_t* q2 = nullptr;
    float* d2 = nullptr;
    float* sx2 = nullptr;
    int32_t* b2 = nullptr;
    int32_t* b16_2 = nullptr;
};

// row m's activation block sums from its quantized values (every path's quantize, after the row's q and d)
inline void act_sums(const Act& a, int m) {
    const int K = a.K, nb = a.nb;
    const int8_t* q = a.q + (int64_t)m * K;
    int32_t* b16 = a.bs16 + (int64_t)m * (K / 16);
    for (int j = 0; j < K / 16; j++) {
        int s = 0;
        for (int i = 0; i < 16; i++) s += q[j * 16 + i];
        b16[j] = s;
    }
    int32_t* b32 = a.bs32 + (int64_t)m * (K / 32);
    float* f32 = a.fb32 + (int64_t)m * (K / 32);
    int32_t* bp = a.bp16 + (int64_t)m * (K / 32);
    for (int j = 0; j < K / 32; j++) {
        b32[j] = b16[2 * j] + b16[2 * j + 1];
        f32[j] = (float)b32[j];
        bp[j] = (int32_t)((uint32_t)(uint16_t)b16[2 * j] | (uint32_t)b16[2 * j + 1] << 16);
    }
    if (a.QB == 32)
        for (int j = 0; j < nb; j++) a.sx[(int64_t)m * nb + j] = a.d[(int64_t)m * nb + j] * (float)b32[j];
}

struct Args {
    const uint8_t* W;
    int64_t row_bytes;
    int N, K, M, qt;
    const Act* a;
    float* Y;  // [M][ldy]: output n of row m at Y[m * ldy + n]
    int64_t ldy;
    // where this thread's next range of weights starts (run_parts: its next part), or null: the
    // k-quant decode kernels prefetch its start as they finish this range
    const uint8_t* next = nullptr;
};

// Per-thread tile scratch: a tile's weights unpacked to one byte per value (avx2 Q8_0 / IQ4_XS: two) plus its scales.
struct Scratch {
    std::vector<uint8_t> buf;
    uint8_t* w;        // [TILE][K] u8 values (Q8_0, IQ4_NL, IQ4_XS, MXFP4: int8; avx2 Q8_0 / IQ4_XS: int16, w16_group)
    float* d;          // [nblocks][TILE] (SIMD: MXFP4's scales only, the others keep hd)
    float* m;          // [nblocks][TILE]   (Q4_1/Q5_1 min, k-quant dmin; SIMD Q4_K/Q5_K: [K/32][TILE] float mins, put_mins)
    int16_t* lsc;      // k-quants: [TILE][K/32][8] per-lane integer scale
    int32_t* rsc;      // Q4_K/Q5_K: [nsb][8][TILE] mins; Q6_K and the low-bit types: [nsb][16][TILE] scales
    int32_t* csc;      // SIMD Q4_K/Q5_K/IQ4_XS: [nsb][8][TILE] scales; Q2_K: [nsb][16][TILE] mins
    uint16_t* hd;      // SIMD: [nblocks][TILE] the blocks' float16 scale d, as stored
    uint16_t* hm;      // SIMD: [nblocks][TILE] float16 min m / dmin, as stored
    uint8_t* zero;     // a tile of 8 zero rows (valid blocks with scale 0): a 16-row tile's missing half
    std::vector<int16_t> x16buf;   // avx2 Q8_0 / IQ4_XS unpack path: the activations as int16 where Act::q16 is null (act16)
    const int16_t* x16 = nullptr;
    int K = -1;
    int64_t zero_bytes = 0;
    void ensure(int K_, int64_t row_bytes) {
        if (K_ == K && row_bytes <= zero_bytes) return;
        K = K_;
        zero_bytes = row_bytes;
        const size_t T = TILE_MAX;
        size_t need = T * K + 2 * sizeof(float) * T * (K / 32) + sizeof(int16_t) * T * (K / 32) * 8 +
                      2 * sizeof(int32_t) * T * (K / 16) + 2 * sizeof(uint16_t) * T * (K / 32) + 8 * row_bytes + 64 + 1024;
        if (buf.size() < need) buf.resize(need);
        uint8_t* p = buf.data();
        auto take = [&](size_t n) { uint8_t* r = p; p += (n + 63) & ~(size_t)63; return r; };
        w = take(T * K);
        d = (float*)take(sizeof(float) * T * (K / 32));
        m = (float*)take(sizeof(float) * T * (K / 32));
        lsc = (int16_t*)take(sizeof(int16_t) * T * (K / 32) * 8);
        rsc = (int32_t*)take(sizeof(int32_t) * T * (K / 16));
        csc = (int32_t*)take(sizeof(int32_t) * T * (K / 16));
        hd = (uint16_t*)take(sizeof(uint16_t) * T * (K / 32));
        hm = (uint16_t*)take(sizeof(uint16_t) * T * (K / 32));
        zero = take(8 * row_bytes + 64);
        std::memset(zero, 0, 8 * row_bytes + 64);
    }
};

inline void zero_row(Scratch& s, int K, int r, int qt) {
    std::memset(s.w + (size_t)r * K, 0, K);
    const int nblk = K / block_elems(qt);
    for (int b = 0; b < nblk; b++) s.d[b * TILE + r] = s.m[b * TILE + r] = 0.f;
    std::memset(s.lsc + (size_t)r * (K / 32) * 8, 0, sizeof(int16_t) * (K / 32) * 8);
    for (int i = 0; i < K / 16; i++) s.rsc[i * TILE + r] = 0;
}

}  // namespace tkv

// turnkv: the 1- to 3-bit GGUF types (Q2_K, Q3_K, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
// IQ3_S) and the ternary ones (TQ1_0, TQ2_0), one 256-value super-block of one row decoded to what the integer
// dot products take (docs/kernels.md):
//
//   t = (d * dx) * float(sum over the chunk's two 16-value halves h of sc_h * dot_h)
//       [Q2_K: - (dmin * dx) * float(sum_h mn_h * bsum_h)]
//
// dot_h = sum (v - offset) * xq over the half's 16 values: Q2_K / Q3_K keep their stored unsigned
// q (0..3 / 0..7; Q3_K's offset 4 comes off through the activation sums), TQ1_0 / TQ2_0 their
// trit or 2-bit q (offset 1, every scale 1), the IQ types their
// signed grid values (grid entry times its signs, |v| <= 62). d is the block's float16 scale times
// a power of two (exact): ggml's IQ2 scale d * (0.5 + s) / 4 is d / 8 * (2 s + 1), IQ3_XXS's
// d * (0.5 + s) / 2 is d / 4 * (2 s + 1), so every sub-block scale is an integer. IQ1_S / IQ1_M:
// ggml's d (2 s + 1) (g +- 1/8), g in {-1, 0, 1}, is d / 8 * (2 s + 1) (8 g +- 1), kept as the
// unsigned 8 g + 9 +- 1 (0 .. 18) with offset 9.
#pragma once
#include "common.h"
#include "lowbit_grids.h"   // written by build.py (grids_header) from gguf-py's grids

namespace tkv {

struct LowBlock {
    int8_t v[256];
    int32_t sc[16];   // per 16 values
    int32_t mn[16];   // Q2_K; 0 otherwise
    uint16_t d, dmin; // float16 as stored (dmin: Q2_K)
};

// the power of two the block's d is taken times (exact in float32)
inline constexpr float lowbit_dscale(int qt) {
    return qt == IQ2_XXS || qt == IQ2_XS || qt == IQ2_S || qt == IQ1_S || qt == IQ1_M ? 0.125f : qt == IQ3_XXS ? 0.25f : 1.f;
}
// the offset subtracted from each stored value (Q3_K: q - 4; TQ1_0 / TQ2_0: q - 1; IQ1: v - 9)
inline constexpr int lowbit_offset(int qt) {
    return qt == Q3_K ? 4 : qt == TQ1_0 || qt == TQ2_0 ? 1 : qt == IQ1_S || qt == IQ1_M ? 9 : 0;
}
inline constexpr bool lowbit_signed(int qt) { return is_lowbit(qt) && lowbit_offset(qt) == 0 && qt != Q2_K; }
// the largest stored value of the unsigned types (the AVX2 int16 pair sums' bound)
inline constexpr int lowbit_vmax(int qt) {
    return qt == Q2_K || qt == TQ1_0 || qt == TQ2_0 ? 3 : qt == Q3_K ? 7 : qt == IQ1_S || qt == IQ1_M ? 18 : 0;
}
// TQ1_0: trit n (0..2) of a byte holding 5 (ggml's q * 3^n, then (q * 3) >> 8)
inline int tq1_trit(uint8_t b, int n) {
    static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
    return ((uint8_t)(b * pow3[n]) * 3) >> 8;
}

// The grids expanded (one byte a value) and the sign masks: an 8-value group's signs as 8 bytes
// of 0xFF (negative) / 0x00, from the 8 sign bits (IQ2_S, IQ3_S) or from 7 bits and their parity
// (ggml's ksigns: IQ2_XXS, IQ2_XS, IQ3_XXS).
struct LowTables {
    uint64_t iq2xxs[256], iq2xs[512], iq2s[1024], sign8[256], sign7[128], iq1s[2048];
    uint32_t iq3xxs[256], iq3s[512];
};

inline LowTables make_low_tables() {
    LowTables t;
    auto iq2 = [](const uint16_t* packed, int n, uint64_t* out) {
        static const uint8_t map[4] = {0x08, 0x19, 0x2b, 0};
        for (int e = 0; e < n; e++) {
            uint64_t v = 0;
            for (int j = 0; j < 8; j++) v |= (uint64_t)map[(packed[e] >> (2 * j)) & 3] << (8 * j);
            out[e] = v;
        }
    };
    auto iq3 = [](const uint16_t* packed, int n, const uint8_t* map, uint32_t* out) {
        for (int e = 0; e < n; e++) {
            uint32_t v = 0;
            for (int j = 0; j < 4; j++) v |= (uint32_t)map[(packed[e] >> (4 * j)) & 0xF] << (8 * j);
            out[e] = v;
        }
    };
    static const uint8_t map3xxs[16] = {0x04, 0x0c, 0x14, 0x1c, 0x24, 0x2c, 0x34, 0x3e};
    static const uint8_t map3s[16] = {0x01, 0x03, 0x05, 0x07, 0x09, 0x0b, 0x0d, 0x0f};
    iq2(kIQ2XXSPacked, 256, t.iq2xxs);
    iq2(kIQ2XSPacked, 512, t.iq2xs);
    iq2(kIQ2SPacked, 1024, t.iq2s);
    for (int e = 0; e < 2048; e++) {   // IQ1: 8 g + 8 (0, 8, 16) a byte
        uint64_t v = 0;
        for (int j = 0; j < 8; j++) v |= (uint64_t)(8 * ((kIQ1SPacked[e] >> (2 * j)) & 3)) << (8 * j);
        t.iq1s[e] = v;
    }
    iq3(kIQ3XXSPacked, 256, map3xxs, t.iq3xxs);
    iq3(kIQ3SPacked, 512, map3s, t.iq3s);
    auto mask = [](int bits) {
        uint64_t m = 0;
        for (int i = 0; i < 8; i++)
            if ((bits >> i) & 1) m |= (uint64_t)0xFF << (8 * i);
        return m;
    };
    for (int b = 0; b < 256; b++) t.sign8[b] = mask(b);
    for (int b = 0; b < 128; b++) t.sign7[b] = mask(b | ((__builtin_popcount(b) & 1) << 7));
    return t;
}

static const LowTables kLow = make_low_tables();

inline uint32_t rd32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }

// 8 grid values (bytes, all 1..62) with their signs: -v is ~v + 1 bytewise, no carry between bytes
inline uint64_t signed8(uint64_t g, uint64_t m) { return (g ^ m) + (m & 0x0101010101010101ULL); }

// a block's bytes in GGUF's layout
struct GgufBytes {
    const uint8_t* p;
    uint8_t u8(int o) const { return p[o]; }
    uint16_t u16(int o) const { return rd16(p + o); }
    uint32_t u32(int o) const { return rd32(p + o); }
};
// row r of a tile's block of an IQ type (a 2-byte d, then 4-byte fields: common.h; IQ1_M: no d,
// D0 = 0): byte o >= D0 of the row's block is byte (o - D0) % 4 of field (o - D0) / 4, at 8 D0 +
// 32 field + 4 r
template <int D0 = 2>
struct TileRow {
    const uint8_t* blk;
    int r;
    const uint8_t* at(int o) const { return blk + 8 * D0 + 8 * ((o - D0) & ~3) + 4 * r + ((o - D0) & 3); }
    uint8_t u8(int o) const { return *at(o); }
    uint16_t u16(int o) const { return rd16(at(o)); }   // never across a field (even offsets)
    uint32_t u32(int o) const { return rd32(at(o)); }   // whole fields
};

// An IQ type's super-block from its bytes b (offsets of GGUF's layout): put(g, v) takes values
// 8g..8g+7 as one uint64 (byte i = value 8g + i), scale(i, s) the integer scale of values 16i..
// IQ1_M's float16 d, its 4 bits in the top of each of its 4 16-bit scale words (bytes 48..55)
template <class Src>
inline uint16_t iq1m_d(const Src& b) {
    return (b.u16(48) >> 12) | ((b.u16(50) >> 8) & 0xF0) | ((b.u16(52) >> 4) & 0xF00) | (b.u16(54) & 0xF000);
}

// IQ1_S / IQ1_M: group g's 8 values, 8 g + 9 -+ 1 by its delta's sign bit (no carry between bytes)
inline uint64_t iq1_values(int idx, bool negative) {
    return kLow.iq1s[idx] + (negative ? 0 : 0x0202020202020202ULL);
}

template <int QT, class Src, class Put, class Scale>
inline void decode_iq(const Src& b, const Put& put, const Scale& scale) {
    const LowTables& T = kLow;
    for (int ib = 0; ib < 8; ib++) {
        int s0, s1;
        if constexpr (QT == IQ1_S) {
            const int qh = b.u16(34 + 2 * ib);
            for (int l = 0; l < 4; l++) put(4 * ib + l, iq1_values(b.u8(2 + 4 * ib + l) | (((qh >> (3 * l)) & 7) << 8), qh & 0x8000));
            s0 = s1 = 2 * ((qh >> 12) & 7) + 1;
        } else if constexpr (QT == IQ1_M) {
            for (int l = 0; l < 4; l++) {
                const int h = (b.u8(32 + 2 * ib + l / 2) >> (4 * (l % 2))) & 0xF;
                put(4 * ib + l, iq1_values(b.u8(4 * ib + l) | ((h & 7) << 8), h & 8));
            }
            const int sw = b.u16(48 + 2 * (ib / 2));
            s0 = 2 * ((sw >> (6 * (ib % 2))) & 7) + 1;
            s1 = 2 * ((sw >> (6 * (ib % 2) + 3)) & 7) + 1;
        } else if constexpr (QT == IQ2_XXS) {
            const int q = 2 + 8 * ib;
            const uint32_t a = b.u32(q + 4);
            for (int l = 0; l < 4; l++) put(4 * ib + l, signed8(T.iq2xxs[b.u8(q + l)], T.sign7[(a >> (7 * l)) & 127]));
            s0 = s1 = 2 * (int)(a >> 28) + 1;
        } else if constexpr (QT == IQ2_XS) {
            for (int l = 0; l < 4; l++) {
                const uint16_t q = b.u16(2 + 2 * (4 * ib + l));
                put(4 * ib + l, signed8(T.iq2xs[q & 511], T.sign7[q >> 9]));
            }
            s0 = 2 * (b.u8(66 + ib) & 0xF) + 1;
            s1 = 2 * (b.u8(66 + ib) >> 4) + 1;
        } else if constexpr (QT == IQ2_S) {
            const int qh = b.u8(66 + ib);
            for (int l = 0; l < 4; l++) {
                const int idx = b.u8(2 + 4 * ib + l) | (((qh >> (2 * l)) & 3) << 8);
                put(4 * ib + l, signed8(T.iq2s[idx], T.sign8[b.u8(34 + 4 * ib + l)]));
            }
            s0 = 2 * (b.u8(74 + ib) & 0xF) + 1;
            s1 = 2 * (b.u8(74 + ib) >> 4) + 1;
        } else if constexpr (QT == IQ3_XXS) {
            const int q = 2 + 8 * ib;
            const uint32_t a = b.u32(66 + 4 * ib);
            for (int l = 0; l < 4; l++)
                put(4 * ib + l, signed8(T.iq3xxs[b.u8(q + 2 * l)] | (uint64_t)T.iq3xxs[b.u8(q + 2 * l + 1)] << 32,
                                        T.sign7[(a >> (7 * l)) & 127]));
            s0 = s1 = 2 * (int)(a >> 28) + 1;
        } else {  // IQ3_S
            const int q = 2 + 8 * ib, qh = b.u8(66 + ib);
            for (int l = 0; l < 4; l++) {
                const int i0 = b.u8(q + 2 * l) | (((qh >> (2 * l)) & 1) << 8), i1 = b.u8(q + 2 * l + 1) | (((qh >> (2 * l + 1)) & 1) << 8);
                put(4 * ib + l, signed8(T.iq3s[i0] | (uint64_t)T.iq3s[i1] << 32, T.sign8[b.u8(74 + 4 * ib + l)]));
            }
            s0 = s1 = 1 + 2 * ((b.u8(106 + ib / 2) >> (4 * (ib % 2))) & 0xF);
        }
        scale(2 * ib, s0);
        scale(2 * ib + 1, s1);
    }
}

inline void decode_k(int qt, const uint8_t* p, LowBlock& o) {
    const bool q3 = qt == Q3_K;
    const uint8_t* qs = p + (q3 ? 32 : 16);
    for (int n = 0; n < 2; n++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                int v = (qs[32 * n + l] >> (2 * j)) & 3;
                if (q3) v |= ((p[l] >> (4 * n + j)) & 1) << 2;   // hmask bit 4n + j of byte l
                o.v[128 * n + 32 * j + l] = (int8_t)v;
            }
    for (int i = 0; i < 16; i++) {
        if (q3) {   // 4 low bits in bytes 0..7 (high nibbles for 8..15), 2 high bits in bytes 8..11
            const int lo = (p[96 + i % 8] >> (4 * (i / 8))) & 0xF, hi = (p[104 + i % 4] >> (2 * (i / 4))) & 3;
            o.sc[i] = (lo | (hi << 4)) - 32;
            o.mn[i] = 0;
        } else {
            o.sc[i] = p[i] & 0xF;
            o.mn[i] = p[i] >> 4;
        }
    }
    o.d = rd16(p + (q3 ? 108 : 80));
    o.dmin = q3 ? 0 : rd16(p + 82);
}

// TQ2_0 (value 128 n + 32 j + l at bits 2 j of qs byte 32 n + l, as Q2_K) and TQ1_0 (values
// 0..159: trit n of qs byte m at 32 n + m; 160..239: of qs byte 32 + m at 160 + 16 n + m;
// 240..255: of qh byte j at 240 + 4 n + j), every scale 1
inline void decode_tq(int qt, const uint8_t* p, LowBlock& o) {
    if (qt == TQ2_0) {
        for (int v = 0; v < 256; v++) o.v[v] = (int8_t)((p[32 * (v / 128) + v % 32] >> (2 * ((v / 32) % 4))) & 3);
    } else {
        for (int n = 0; n < 5; n++) {
            for (int m = 0; m < 32; m++) o.v[32 * n + m] = (int8_t)tq1_trit(p[m], n);
            for (int m = 0; m < 16; m++) o.v[160 + 16 * n + m] = (int8_t)tq1_trit(p[32 + m], n);
        }
        for (int n = 0; n < 4; n++)
            for (int j = 0; j < 4; j++) o.v[240 + 4 * n + j] = (int8_t)tq1_trit(p[48 + j], n);
    }
    for (int i = 0; i < 16; i++) o.sc[i] = 1, o.mn[i] = 0;
    o.d = rd16(p + (qt == TQ2_0 ? 64 : 52));
    o.dmin = 0;
}

template <int QT>
inline void decode_iq_block(const uint8_t* p, LowBlock& o) {
    decode_iq<QT>(GgufBytes{p}, [&](int g, uint64_t v) { std::memcpy(o.v + 8 * g, &v, 8); },
                  [&](int i, int sc) { o.sc[i] = sc; });
}

// one super-block of one row, p in GGUF's block layout
inline void decode_lowbit(int qt, const uint8_t* p, LowBlock& o) {
    if (qt == Q2_K || qt == Q3_K) return decode_k(qt, p, o);
    if (qt == TQ1_0 || qt == TQ2_0) return decode_tq(qt, p, o);
    o.d = qt == IQ1_M ? iq1m_d(GgufBytes{p}) : rd16(p);
    o.dmin = 0;
    for (int i = 0; i < 16; i++) o.mn[i] = 0;
    switch (qt) {
        case IQ2_XXS: return decode_iq_block<IQ2_XXS>(p, o);
        case IQ2_XS: return decode_iq_block<IQ2_XS>(p, o);
        case IQ2_S: return decode_iq_block<IQ2_S>(p, o);
        case IQ3_XXS: return decode_iq_block<IQ3_XXS>(p, o);
        case IQ3_S: return decode_iq_block<IQ3_S>(p, o);
        case IQ1_S: return decode_iq_block<IQ1_S>(p, o);
        case IQ1_M: return decode_iq_block<IQ1_M>(p, o);
    }
}

}  // namespace tkv

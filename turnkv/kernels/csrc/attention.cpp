// turnkv: float32 attention for one sequence, chunk- and batch-invariant by construction.
//
// out[t, h*D:(h+1)*D] = softmax_s(score(q[h,t], k[h/rep, s])) @ v[h/rep, s] over the keys s a
// query at absolute position p = q_pos0 + t may see: lo(p) <= k_pos0 + s <= p, with
// lo = 0 (full), p - W + 1 (sliding window W) or (p / C) * C (chunked, chunk C). With attention
// sinks (gpt-oss), head h's softmax denominator has one more term exp(sinks[h]) (no value).
//
// The result of a query depends only on its vector, its position and the K/V of its visible keys:
//   - keys are visited in blocks aligned to absolute positions [64 j, 64 j + 64); each block's
//     partial (its own max mb, exp-sum lb, accumulator accb) depends on the block alone, and the
//     partials fold into the running (m, l, acc) in increasing j (online softmax, rescaled only at
//     those blocks): mn = max(m, mb), l = l e^(m-mn) + lb e^(mb-mn), acc = acc e^(m-mn) + accb e^(mb-mn);
//   - a score is one dot product over D in a fixed order (W lanes, lane = d % W, then a fixed
//     horizontal tree), times scale (then the optional softcap, tanh);
//   - inside a block, exp(s - mb) is elementwise; the block's exp-sum adds the 64 slots of the
//     block in W lanes (lane = pos % W) in increasing position, then a fixed tree; slots of
//     invisible keys hold exactly +0.0, which leaves every lane's rounding unchanged;
//   - P.V: accb[d] += p_s * v_s[d] from zero, for the block's visible keys in increasing position
//     (vectorized over d).
// Nothing depends on how many queries the call has, where its key range starts, or the thread
// count: threads split (kv head, query head group, query tile) units, and, when those are too few
// to keep the threads busy (a decode step of one or two sequences), a unit's key blocks: each
// block's partial is kept and the blocks fold afterwards in the same order with the same
// arithmetic. The query heads of a group share each K/V load, the queries of a tile each key
// block's reads, and two queries that see the same keys of a block its key and value rows' loads
// (AVX-512; AVX2 up to 3 heads a group); each keeps its own arithmetic. Each ISA path is invariant on
// its own; the paths differ from each other by rounding (their exp and FMA use differ).
// Registered as torch.ops.turnkv_attn.{attend,attend_many,best_isa} (a library fragment, so it shares the
// extension binary with gguf_matmul.cpp without touching its Python module).

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>

#include "cpu_family.h"
#include "write_attend.h"
#include <cstdlib>
#include <limits>
#include <optional>
#include <vector>

namespace tkv_attn {

constexpr int BLK = 64;        // keys per block, aligned to absolute positions
constexpr int MAXD = 1024;     // head_dim limit (stack accumulator)
constexpr int TILE = 16;       // the most queries one unit takes (run_many picks how many)
// prefetch the next key block's K/V rows into L2 while a block computes (TURNKV_ATTN_PREFETCH=0: off,
// 2: into L1 instead, A/B). L2, not L1: a block's K and V rows are 16 KB (D = 64, float16) to 64 KB
// (D = 256), and the next block's pulled into a 32 KB L1 evicted the rows being read (cold decode
// attention ~1.5x slower than with no software prefetch on a Zen 4, docs/kernels.md)
static int g_attn_prefetch = [] {
    const char* e = std::getenv("TURNKV_ATTN_PREFETCH");
    return e ? std::atoi(e) : 1;
}();
// Where a block's prefetches go: spread over the P.V pass (a row's share at each row) or in bursts
// with each chunk of scores (W rows at a time). Rows longer than 128 bytes always spread (bursts of
// Gemma 3's 512-byte rows filled the miss queue). For rows of up to 128 bytes (D = 64 in float16):
// spread on Zen 5 (8-sequence SmolLM2 decode steps 5% faster, interleaved in one process; with
// bursts perf put a fifth of the call's samples on V row loads waiting for memory) and on Zen 4
// (whole SmolLM2 decode steps, float16 K/V, interleaved in one process, bench/decode_ab.py:
// 0.95-0.97x at 8 sequences, 0.98x at one; bursts had won there on one layer's call before the
// later attention changes); bursts elsewhere until measured; docs/kernels.md.
// TURNKV_ATTN_SPREAD=0 / 1 forces either.
static bool short_rows_spread_default() { return tkv_cpu::amd_zen4_or_later(); }
static int g_attn_spread = [] {
    const char* e = std::getenv("TURNKV_ATTN_SPREAD");
    return e && *e ? (std::atoi(e) != 0 ? 1 : 0) : (short_rows_spread_default() ? 1 : -1);   // -1: by row size
}();

// set_spread (A/B in one process, bench/decode_ab.py): 1 spread, 0 bursts, -1 by row size;
// returns the previous. Where the prefetches go, never what is computed: the same bits.
static int64_t set_spread(int64_t v) {
    const int64_t before = g_attn_spread;
    g_attn_spread = v > 0 ? 1 : (v == 0 ? 0 : -1);
    return before;
}

enum Kind : int { FULL = 0, SLIDING = 1, CHUNKED = 2 };
enum Isa : int { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
enum KvType : int { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_I8 = 3, KV_I4 = 4 };

struct Params {
    const float* q;
    int64_t qsh, qst;  // strides (elements): head, row
    const void* k;     // float32, float16 or bfloat16 (``kv``), the same for k and v
    int64_t ksh, kst;
    const void* v;
    int64_t vsh, vst;
    int kv;            // KV_F32 / KV_F16 / KV_BF16 / KV_I8 / KV_I4
    // the units widen each key block to float32 in their scratch and read it there (int4 always,
    // int8 in prefill spans: attention_widen.inc), set by run_many
    bool blocks;
    // KV_I4 (``--kv-cache-mode int4``): k / v hold D / 2 bytes a row (channel c in the low nibble of
    // byte c, c + D / 2 in the high one), a float16 scale per gk (gv) channels at ksc (vsc) + head *
    // kscsh + row * kscst + c / gk; keys rotated in blocks of rk channels (cache/storage.py Int4Store)
    int gk, gv, rk;
    // KV_I8 (``--kv-cache-mode int8``): a float16 scale per (head, row) of K and of V, element
    // (h, s) at ksc[h * kscsh + s * kscst]; a value is int8 * scale, exact in float32
    const uint16_t* ksc;
    int64_t kscsh, kscst;
    const uint16_t* vsc;
    int64_t vscsh, vscst;
    float* out;        // [T, Hq * D]
    int Hq, Hk, T, S, D;
    int64_t q_pos0, k_pos0, wc;
    int kind;
    float scale, softcap;  // softcap <= 0: none
    const float* sinks;    // [Hq] attention-sink logits (gpt-oss), nullptr: none
    // paged K/V (a layer's block pool, write_attend): the row of position p is
    // tab[p / BLK] * BLK + p % BLK of k / v (and of the scales); nullptr: row p - k_pos0
    const int32_t* tab;
};

// the K/V row (of k, v and their scales) that holds absolute position ``pos``; the rows of one
// BLK-aligned block are consecutive either way
static inline int64_t row_of(const Params& P, int64_t pos) {
    return P.tab ? (int64_t)P.tab[pos / BLK] * BLK + pos % BLK : pos - P.k_pos0;
}

static inline int kv_elem_bytes(int kv) { return kv == KV_F32 ? 4 : (kv == KV_F16 || kv == KV_BF16) ? 2 : 1; }

// The stored rows from ``row`` of kv head kh (which 0: K, 1: V) as bytes, and their scales (int8 /
// int4; else nullptr)
static inline const char* stored_rows(const Params& P, int which, int kh, int64_t row, const uint16_t*& sc) {
    const uint16_t* s = which ? P.vsc : P.ksc;
    sc = s ? s + kh * (which ? P.vscsh : P.kscsh) + row * (which ? P.vscst : P.kscst) : nullptr;
    return (const char*)(which ? P.v : P.k) +
           (kh * (which ? P.vsh : P.ksh) + row * (which ? P.vst : P.kst)) * kv_elem_bytes(P.kv);
}

// visible absolute positions [lo, hi] of the query at p, limited to the keys present
static inline void visible(const Params& P, int64_t p, int64_t& lo, int64_t& hi) {
    int64_t l = 0;
    if (P.kind == SLIDING) l = p - P.wc + 1;
    else if (P.kind == CHUNKED) l = (p >= 0 ? p / P.wc : -((-p + P.wc - 1) / P.wc)) * P.wc;
    lo = std::max<int64_t>(std::max<int64_t>(l, 0), P.k_pos0);
    hi = std::min<int64_t>(p, P.k_pos0 + P.S - 1);
}

static inline int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// The blocks [jlo, jlo + nblk) that a tile of nq queries from t0 walks (each query its visible ones)
static inline void tile_blocks(const Params& P, int t0, int nq, int64_t& jlo, int64_t& nblk) {
    int64_t lo, hi, hmax = std::numeric_limits<int64_t>::min();
    jlo = std::numeric_limits<int64_t>::max();
    for (int qi = 0; qi < nq; qi++) {
        visible(P, P.q_pos0 + t0 + qi, lo, hi);
        jlo = std::min(jlo, floor_div(lo, BLK));
        hmax = std::max(hmax, hi);
    }
    nblk = hmax < jlo * BLK ? 0 : floor_div(hmax, BLK) - jlo + 1;
}

// A block's partial as a split unit keeps it (attention_body.inc): PART_HDR floats (mb, lb, unused)
// then its accumulator, padded to whole vectors of any ISA
constexpr int PART_HDR = 16;
static inline int64_t part_floats(int D) { return PART_HDR + ((int64_t)(D + 63) / 64) * 64; }

static inline float cap(float s, float softcap) { return std::tanh(s / softcap) * softcap; }

// The factor that turns the accumulator into the output: 1 / l, or, with an attention sink, the
// sink's exp(sink) as one more softmax term without a value, rescaled to max(m, sink) like one
// more block. Depends only on the head and the query's own (m, l): invariance is unchanged.
static inline float out_scale(const Params& P, int h, float m, float l) {
    if (P.sinks == nullptr) return 1.f / l;
    const float sk = P.sinks[h];
    const float mn = std::max(m, sk);
    const float alpha = std::exp(m - mn);
    return alpha / (l * alpha + std::exp(sk - mn));
}

#include "attention_int4.inc"
#include "attention_widen.inc"

// ------------------------------------------------------------------ scalar (plain C++, W = 16 emulated)

namespace scalar {

static inline float dot(const float* a, const float* b, int D) {
    float lane[16] = {0};
    int d = 0;
    for (; d + 16 <= D; d += 16)
        for (int i = 0; i < 16; i++) lane[i] = lane[i] + a[d + i] * b[d + i];
    for (int i = 0; d < D; d++, i++) lane[i] = lane[i] + a[d] * b[d];
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) lane[i] = lane[i] + lane[i + w];
    return lane[0];
}

static void unit(const Params& P, int h, int t) {
    const int D = P.D, rep = P.Hq / P.Hk, kh = h / rep;
    const float* qv = P.q + h * P.qsh + t * P.qst;
    const float* K = (const float*)P.k + kh * P.ksh;   // float32 K/V, or int4 widened a row at a time
    const float* V = (const float*)P.v + kh * P.vsh;
    const bool i4 = P.kv == KV_I4;
    float row[MAXD];
    float* o = P.out + (int64_t)t * P.Hq * D + (int64_t)h * D;
    int64_t lo, hi;
    visible(P, P.q_pos0 + t, lo, hi);
    float acc[MAXD];
    for (int d = 0; d < D; d++) acc[d] = 0.f;
    float buf[BLK];
    float m = -std::numeric_limits<float>::infinity(), l = 0.f;
    for (int64_t j = floor_div(lo, BLK); j * BLK <= hi; j++) {
        const int64_t b0 = j * BLK, a = std::max(lo, b0), b = std::min(hi, b0 + BLK - 1);
        float mb = -std::numeric_limits<float>::infinity();
        for (int64_t pos = a; pos <= b; pos++) {
            float s = dot(qv, i4 ? widen4_row(P, 0, kh, row_of(P, pos), row) : K + row_of(P, pos) * P.kst, D) * P.scale;
            if (P.softcap > 0) s = cap(s, P.softcap);
            buf[pos - b0] = s;
            mb = std::max(mb, s);
        }
        float lane[16] = {0};
        for (int i = 0; i < BLK; i++) {
            const int64_t pos = b0 + i;
            const float e = (pos >= a && pos <= b) ? std::exp(buf[i] - mb) : 0.f;
            buf[i] = e;
            lane[i % 16] = lane[i % 16] + e;
        }
        for (int w = 8; w >= 1; w /= 2)
            for (int i = 0; i < w; i++) lane[i] = lane[i] + lane[i + w];
        float accb[MAXD];
        for (int d = 0; d < D; d++) accb[d] = 0.f;
        for (int64_t pos = a; pos <= b; pos++) {
            const float e = buf[pos - b0];
            const float* vr = i4 ? widen4_row(P, 1, kh, row_of(P, pos), row) : V + row_of(P, pos) * P.vst;
            for (int d = 0; d < D; d++) accb[d] = accb[d] + e * vr[d];
        }
        const float mn = std::max(m, mb);
        const float fa = std::exp(m - mn), fb = std::exp(mb - mn);  // fa = 0 on the first block (m = -inf)
        l = l * fa + lane[0] * fb;
        for (int d = 0; d < D; d++) acc[d] = acc[d] * fa + accb[d] * fb;
        m = mn;
    }
    const float inv = out_scale(P, h, m, l);
    for (int d = 0; d < D; d++) o[d] = acc[d] * inv;
}

}  // namespace scalar

// ------------------------------------------------------------------ SIMD paths
// One body, compiled per ISA with a function target attribute (no -march): W lanes per vector.

// ---- AVX2 (W = 8)
namespace avx2 {
#define TKV_TARGET __attribute__((target("avx2,fma,f16c")))
typedef __m256 VF;
constexpr int W = 8;
#define SET1(x) _mm256_set1_ps(x)
TKV_TARGET static inline float hsum(VF x) {  // fixed tree: (0+4, 1+5, ...), then pairs
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
// hsum of W = 8 vectors at once: lane j of the result is exactly hsum(x[j]) (the same additions
// of the same lanes: halves, then (0+2, 1+3), then 0+1), the vectors' trees sharing shuffles.
// Its levels one by one: hs_p of two vectors, hs_r of two of those (4 vectors' partial sums), hs_f
// of two of those (all 8, key j in lane j); so the partial trees of 2 or 4 keys
// (attention_body.inc's dots_group) finish into the same bits.
TKV_TARGET static inline VF hs_p(VF a, VF b) {
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
TKV_TARGET static inline VF hs_r(VF a, VF b) {
    return _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
TKV_TARGET static inline VF hs_f(VF r0, VF r1) {
    // element 4k + e holds the sum of x[2e + k]
    const VF f = _mm256_add_ps(_mm256_shuffle_ps(r0, r1, _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm256_shuffle_ps(r0, r1, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
TKV_TARGET static inline VF hsum_many(const VF* x) {
    return hs_f(hs_r(hs_p(x[0], x[1]), hs_p(x[2], x[3])), hs_r(hs_p(x[4], x[5]), hs_p(x[6], x[7])));
}
// dots_group: KC keys' partial tree (KC = 4 for up to 3 heads, 2 for 4: the accumulators fit the
// 16 registers), two of which hs_f finishes, four hs_r then hs_f
constexpr int group_keys(int G) { return G <= 3 ? 4 : 2; }
template <int KC>
TKV_TARGET static inline VF hs_chunk(const VF* x) {
    if constexpr (KC == 4) return hs_r(hs_p(x[0], x[1]), hs_p(x[2], x[3]));
    else return hs_p(x[0], x[1]);
}
TKV_TARGET static inline __m256i tail_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#define LOAD(p) _mm256_loadu_ps(p)
#define STORE(p, x) _mm256_storeu_ps(p, x)
#define LOADT(p, n) _mm256_maskload_ps(p, tail_mask(n))
#define STORET(p, x, n) _mm256_maskstore_ps(p, tail_mask(n), x)
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define MUL(a, b) _mm256_mul_ps(a, b)
#define MAX(a, b) _mm256_max_ps(a, b)
#define ADD(a, b) _mm256_add_ps(a, b)
#define ZERO() _mm256_setzero_ps()
#define LOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p)))
#define LOAD_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p))), 16))
#define LOAD_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p))))
#define BCAST(p) _mm256_broadcast_ss(p)
#define VMIN(a, b) _mm256_min_ps(a, b)
#define FNMA(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define FLOOR(x) _mm256_floor_ps(x)
#define POW2I(fx) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23))
TKV_TARGET static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
#include "attention_exp.inc"
#include "attention_body.inc"
#include "attention_undef.inc"
}  // namespace avx2

// ---- AVX-512 (W = 16)
namespace avx512 {
#define TKV_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512dq")))
typedef __m512 VF;
constexpr int W = 16;
#define SET1(x) _mm512_set1_ps(x)
TKV_TARGET static inline float hsum(VF x) {  // fixed tree: halves, then avx2's
    __m256 lo = _mm512_castps512_ps256(x);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
    __m256 s8 = _mm256_add_ps(lo, hi);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
// hsum of W = 16 vectors at once: lane j of the result is exactly hsum(x[j]) (the same additions
// of the same lanes: halves, quarters, then (0+2, 1+3), then 0+1), the trees sharing shuffles.
// Its levels one by one: hs_p of two vectors, hs_q of two of those (4 vectors' partial sums),
// hs_r of two of those (8 vectors'), hs_f of two of those (all 16, key j in lane j); so the
// partial trees of 4 or 8 keys (attention_body.inc's dots_group) finish into the same bits.
TKV_TARGET static inline VF hs_p(VF a, VF b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
TKV_TARGET static inline VF hs_q(VF a, VF b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
TKV_TARGET static inline VF hs_r(VF a, VF b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
TKV_TARGET static inline VF hs_f(VF r0, VF r1) {
    // element 4k + e holds the sum of x[4e + k]
    const VF f = _mm512_add_ps(_mm512_shuffle_ps(r0, r1, _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_ps(r0, r1, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), f);
}
// x[0..7]'s part of the tree
TKV_TARGET static inline VF hsum_half(const VF* x) {
    return hs_r(hs_q(hs_p(x[0], x[1]), hs_p(x[2], x[3])), hs_q(hs_p(x[4], x[5]), hs_p(x[6], x[7])));
}
TKV_TARGET static inline VF hsum_many(const VF* x) { return hs_f(hsum_half(x), hsum_half(x + 8)); }
// dots_group: KC keys' partial tree (KC = 8 for up to 3 heads, 4 for 4: the accumulators fit the
// 32 registers), two of which hs_f finishes, four hs_r then hs_f
constexpr int group_keys(int G) { return G <= 3 ? 8 : 4; }
template <int KC>
TKV_TARGET static inline VF hs_chunk(const VF* x) {
    if constexpr (KC == 8) return hsum_half(x);
    else return hs_q(hs_p(x[0], x[1]), hs_p(x[2], x[3]));
}
#define LOAD(p) _mm512_loadu_ps(p)
#define STORE(p, x) _mm512_storeu_ps(p, x)
#define LOADT(p, n) _mm512_maskz_loadu_ps((__mmask16)((1u << (n)) - 1), p)
#define STORET(p, x, n) _mm512_mask_storeu_ps(p, (__mmask16)((1u << (n)) - 1), x)
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define MUL(a, b) _mm512_mul_ps(a, b)
#define MAX(a, b) _mm512_max_ps(a, b)
#define ADD(a, b) _mm512_add_ps(a, b)
#define ZERO() _mm512_setzero_ps()
#define LOAD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p)))
#define LOAD_BF16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p))), 16))
#define LOAD_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p))))
#define BCAST(p) _mm512_set1_ps(*(p))
#define VMIN(a, b) _mm512_min_ps(a, b)
#define FNMA(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define FLOOR(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define POW2I(fx) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23))
TKV_TARGET static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
#include "attention_exp.inc"
#include "attention_body.inc"
#include "attention_undef.inc"
}  // namespace avx512

#include "attention_dispatch.inc"
#include "attention_write.inc"


}  // namespace tkv_attn

// Registered by hand rather than with TORCH_LIBRARY_FRAGMENT: a process that already loaded an
// older build (`python -m turnkv.kernels.build` imports turnkv.kernels first) loads the new binary
// too, and a second registration of the same schema would abort it.
namespace {
const bool g_registered = [] {
    if (c10::Dispatcher::singleton().findSchema(c10::OperatorName("turnkv_attn::attend", "")).has_value()) return false;
    static torch::Library lib(torch::Library::FRAGMENT, "turnkv_attn", std::nullopt, __FILE__, __LINE__);
    lib.def("attend(Tensor q, Tensor k, Tensor v, int q_pos0, int k_pos0, int kind, int wc, float scale, "
            "float softcap, int isa, Tensor? sinks=None, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor",
            &tkv_attn::attend);
    lib.def("attend_many(Tensor[] q, Tensor[] k, Tensor[] v, int[] q_pos0, int[] k_pos0, int[] kind, int[] wc, "
            "float scale, float softcap, int isa, Tensor? sinks=None, Tensor[]? k_scales=None, Tensor[]? v_scales=None) -> Tensor",
            &tkv_attn::attend_many);
    lib.def("best_isa() -> int", &tkv_attn::best_isa);
    lib.def("set_max_group(int g) -> int", &tkv_attn::set_max_group);
    lib.def("set_tile(int n) -> int", &tkv_attn::set_tile);
    lib.def("set_split(int n) -> int", &tkv_attn::set_split);
    lib.def("set_spread(int n) -> int", &tkv_attn::set_spread);
    lib.def("set_block_rows(int n) -> int", &tkv_attn::set_block_rows);
    lib.def("kv_dtypes() -> int", &tkv_attn::kv_dtypes);
    return true;
}();
}  // namespace

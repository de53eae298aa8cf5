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
// (AVX-512); each keeps its own arithmetic. Each ISA path is invariant on
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
enum KvType : int { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_I8 = 3 };

struct Params {
    const float* q;
    int64_t qsh, qst;  // strides (elements): head, row
    const void* k;     // float32, float16 or bfloat16 (``kv``), the same for k and v
    int64_t ksh, kst;
    const void* v;
    int64_t vsh, vst;
    int kv;            // KV_F32 / KV_F16 / KV_BF16 / KV_I8
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
    const float* K = (const float*)P.k + kh * P.ksh;   // the scalar path gets float32 K/V only
    const float* V = (const float*)P.v + kh * P.vsh;
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
            float s = dot(qv, K + row_of(P, pos) * P.kst, D) * P.scale;
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
            const float* vr = V + row_of(P, pos) * P.vst;
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

// Cephes-style expf (the polynomial most SIMD math libraries use), explicit FMAs; |x| clamped
// to the float range. Elementwise: a lane's result never depends on the other lanes.
#define TKV_EXP_CONSTS                                              \
    const VF c_hi = SET1(88.3762626647949f), c_lo = SET1(-88.3762626647949f); \
    const VF c_log2e = SET1(1.44269504088896341f), c_half = SET1(0.5f);       \
    const VF c_c1 = SET1(0.693359375f), c_c2 = SET1(-2.12194440e-4f);        \
    const VF p0 = SET1(1.9875691500E-4f), p1 = SET1(1.3981999507E-3f), p2 = SET1(8.3334519073E-3f), \
             p3 = SET1(4.1665795894E-2f), p4 = SET1(1.6666665459E-1f), p5 = SET1(5.0000001201E-1f), \
             one = SET1(1.0f);

// ---- AVX2 (W = 8)
namespace avx2 {
#define TKV_TARGET __attribute__((target("avx2,fma,f16c")))
typedef __m256 VF;
constexpr int W = 8;
#define SET1(x) _mm256_set1_ps(x)
TKV_TARGET static inline VF vexp(VF x) {
    TKV_EXP_CONSTS
    x = _mm256_min_ps(x, c_hi);
    x = _mm256_max_ps(x, c_lo);
    VF fx = _mm256_floor_ps(_mm256_fmadd_ps(x, c_log2e, c_half));
    x = _mm256_fnmadd_ps(fx, c_c1, x);
    x = _mm256_fnmadd_ps(fx, c_c2, x);
    VF z = _mm256_mul_ps(x, x);
    VF y = _mm256_fmadd_ps(p0, x, p1);
    y = _mm256_fmadd_ps(y, x, p2);
    y = _mm256_fmadd_ps(y, x, p3);
    y = _mm256_fmadd_ps(y, x, p4);
    y = _mm256_fmadd_ps(y, x, p5);
    y = _mm256_fmadd_ps(y, z, _mm256_add_ps(x, one));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
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
TKV_TARGET static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
#include "attention_body.inc"
#undef LOAD
#undef STORE
#undef LOADT
#undef STORET
#undef FMA
#undef MUL
#undef MAX
#undef ADD
#undef ZERO
#undef SET1
#undef LOAD_F16
#undef LOAD_BF16
#undef LOAD_I8
#undef BCAST
#undef TKV_TARGET
}  // namespace avx2

// ---- AVX-512 (W = 16)
namespace avx512 {
#define TKV_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512dq")))
typedef __m512 VF;
constexpr int W = 16;
#define SET1(x) _mm512_set1_ps(x)
TKV_TARGET static inline VF vexp(VF x) {
    TKV_EXP_CONSTS
    x = _mm512_min_ps(x, c_hi);
    x = _mm512_max_ps(x, c_lo);
    VF fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, c_log2e, c_half), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, c_c1, x);
    x = _mm512_fnmadd_ps(fx, c_c2, x);
    VF z = _mm512_mul_ps(x, x);
    VF y = _mm512_fmadd_ps(p0, x, p1);
    y = _mm512_fmadd_ps(y, x, p2);
    y = _mm512_fmadd_ps(y, x, p3);
    y = _mm512_fmadd_ps(y, x, p4);
    y = _mm512_fmadd_ps(y, x, p5);
    y = _mm512_fmadd_ps(y, z, _mm512_add_ps(x, one));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
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
TKV_TARGET static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
#include "attention_body.inc"
#undef LOAD
#undef STORE
#undef LOADT
#undef STORET
#undef FMA
#undef MUL
#undef MAX
#undef ADD
#undef ZERO
#undef SET1
#undef LOAD_F16
#undef LOAD_BF16
#undef LOAD_I8
#undef BCAST
#undef TKV_TARGET
}  // namespace avx512

// ------------------------------------------------------------------ dispatch

static int detect_isa() {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool f512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
    if (!avx2) return ISA_SCALAR;
    return f512 ? ISA_AVX512 : ISA_AVX2;
}

static int64_t best_isa() {
    static const int isa = detect_isa();
    return isa;
}

// A unit is (kv head, group of up to G of its query heads, tile of up to TILE consecutive
// queries): the heads of a group share every K/V load, and the queries of a tile walk the key
// blocks together (attention_body.inc's unit_group); each (head, query)'s bits depend on neither.
using UnitFn = void (*)(const Params&, int, int, int, int64_t, int64_t, float*, int64_t);
constexpr int GMAX = 4;
namespace scalar {
template <int G>   // the scalar path never splits a unit's blocks (jb, je, part unused)
static void unit_n(const Params& P, int h0, int t0, int nq, int64_t, int64_t, float*, int64_t) {
    for (int t = t0; t < t0 + nq; t++)
        for (int g = 0; g < G; g++) unit(P, h0 + g, t);
}
}  // namespace scalar
// kUnit[isa][kv type][n - 1]: n heads from h0 (the scalar path runs on float32 K/V only)
#define TKV_UNITS(ns, L) {ns::unit1<ns::L>, ns::unit2<ns::L>, ns::unit3<ns::L>, ns::unit4<ns::L>}
#define TKV_SCALAR {scalar::unit_n<1>, scalar::unit_n<2>, scalar::unit_n<3>, scalar::unit_n<4>}
static const UnitFn kUnit[][4][GMAX] = {
    {TKV_SCALAR, TKV_SCALAR, TKV_SCALAR, TKV_SCALAR},
    {TKV_UNITS(avx2, LF32), TKV_UNITS(avx2, LF16), TKV_UNITS(avx2, LBF16), TKV_UNITS(avx2, LI8)},
    {TKV_UNITS(avx512, LF32), TKV_UNITS(avx512, LF16), TKV_UNITS(avx512, LBF16), TKV_UNITS(avx512, LI8)}};
#undef TKV_UNITS
#undef TKV_SCALAR
using FoldFn = void (*)(const Params&, int, int, int, int, const float*, int64_t);
static const FoldFn kFold[] = {nullptr, avx2::fold_parts, avx512::fold_parts};
// the most query heads one unit takes per ISA (AVX2 runs P.V 2 vectors wide past 2 heads, for its
// 16 registers)
static const int kGroupMax[] = {1, 4, 4};
static int g_group_limit = GMAX;   // set_max_group (tests: grouped == one head at a time)

// K/V element types the kernel reads: float32, float16, bfloat16, int8 with scales (the Python
// side checks for it)
static int64_t kv_dtypes() { return 4; }

static int64_t set_max_group(int64_t g) {
    const int64_t before = g_group_limit;
    g_group_limit = (int)std::max<int64_t>(1, std::min<int64_t>(GMAX, g));
    return before;
}

// Heads per unit: as many as the ISA holds in registers (a decode step's few units split their key
// blocks between the threads instead, run_many)
static int group_size(int rep, int isa) { return std::min(std::min(rep, kGroupMax[isa]), g_group_limit); }

// Split a unit's key blocks between threads when the units are fewer than this many per thread
// (0: never; set_split, tests and A/B: the same bits either way)
static int g_split = [] {
    const char* e = std::getenv("TURNKV_ATTN_SPLIT");
    return e ? std::atoi(e) : 2;
}();
static int64_t set_split(int64_t n) {
    const int64_t before = g_split;
    g_split = (int)std::max<int64_t>(0, n);
    return before;
}

// Queries per unit: TILE (or TURNKV_ATTN_TILE, A/B), fewer while that would leave threads idle.
static int g_tile = [] {
    const char* e = std::getenv("TURNKV_ATTN_TILE");
    const int v = e ? std::atoi(e) : TILE;
    return std::max(1, std::min(TILE, v));
}();
static int64_t set_tile(int64_t n) {
    const int64_t before = g_tile;
    g_tile = (int)std::max<int64_t>(1, std::min<int64_t>(TILE, n));
    return before;
}
static inline int64_t tiles_of(int64_t T, int Q) { return (T + Q - 1) / Q; }

// unit u of a sequence (units (kv head, head group) major, query tile minor) -> its call
struct Unit {
    int h0, n, t0, nq;   // heads [h0, h0 + n), queries [t0, t0 + nq)
};
static inline Unit unit_at(const Params& P, int G, int Q, int64_t u) {
    const int rep = P.Hq / P.Hk, groups = (rep + G - 1) / G;
    const int64_t tiles = tiles_of(P.T, Q), hg = u / tiles;
    const int t0 = (int)(u % tiles) * Q, kh = (int)(hg / groups), gi = (int)(hg % groups);
    return Unit{kh * rep + gi * G, std::min(G, rep - gi * G), t0, std::min<int>(Q, (int)P.T - t0)};
}
static inline void run_unit(const UnitFn* fns, const Params& P, int G, int Q, int64_t u) {
    const Unit w = unit_at(P, G, Q, u);
    fns[w.n - 1](P, w.h0, w.t0, w.nq, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(),
                 nullptr, 0);
}

// The rest of a sequence's Params (its shapes and pointers already set): positions, rule, scale,
// softcap, sinks; every query must see a key present (one before all keys would be a bug).
static void set_rule(Params& P, int64_t q_pos0, int64_t k_pos0, int64_t kind, int64_t wc, double scale,
                     double softcap, const std::optional<torch::Tensor>& sinks) {
    TORCH_CHECK(kind >= FULL && kind <= CHUNKED, "attend: kind 0 full, 1 sliding, 2 chunked");
    TORCH_CHECK(kind == FULL || wc >= 1, "attend: window / chunk must be >= 1");
    if (sinks.has_value()) {
        const torch::Tensor& s = *sinks;
        TORCH_CHECK(s.dim() == 1 && s.size(0) == P.Hq && s.scalar_type() == torch::kFloat32 && s.device().is_cpu() &&
                        s.is_contiguous(), "attend: sinks must be a contiguous float32 CPU tensor [Hq]");
    }
    P.q_pos0 = q_pos0;
    P.k_pos0 = k_pos0;
    P.wc = wc;
    P.kind = (int)kind;
    P.scale = (float)scale;
    P.softcap = softcap > 0 ? (float)softcap : 0.f;
    P.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
    if (P.T > 0) {
        for (int64_t t : {int64_t(0), int64_t(P.T - 1)}) {
            int64_t lo, hi;
            visible(P, q_pos0 + t, lo, hi);
            TORCH_CHECK(lo <= hi, "attend: query at ", q_pos0 + t, " sees no key (keys at ", k_pos0, "..",
                        k_pos0 + P.S - 1, ")");
        }
    }
}

// The K/V side of a sequence's Params: rows [row0, row0 + rows) of k / v [Hk, *, D] (float32,
// float16, bfloat16, or int8 with float16 row scales ks / vs [Hk, *, 1], any head / row strides).
static void set_kv(Params& P, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor* ks,
                   const torch::Tensor* vs, int64_t row0, int64_t rows, int64_t isa, const char* who) {
    const auto kt = k.scalar_type();
    TORCH_CHECK(v.scalar_type() == kt && (kt == torch::kFloat32 || kt == torch::kHalf || kt == torch::kBFloat16 || kt == torch::kChar),
                who, ": k/v both float32, float16, bfloat16 or int8 (with scales)");
    TORCH_CHECK((kt == torch::kChar) == (ks != nullptr && vs != nullptr), who, ": int8 K/V take k and v scales, other types neither");
    TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu() && k.stride(2) == 1 && v.stride(2) == 1,
                who, ": k/v must be CPU tensors with a contiguous last dim");
    P.kv = kt == torch::kFloat32 ? KV_F32 : kt == torch::kHalf ? KV_F16 : kt == torch::kBFloat16 ? KV_BF16 : KV_I8;
    TORCH_CHECK(P.kv == KV_F32 || isa != ISA_SCALAR, who, ": float16 / bfloat16 / int8 K/V need the avx2 or avx512 path");
    const int64_t es = k.element_size();
    P.k = (const char*)k.data_ptr() + row0 * k.stride(1) * es;
    P.ksh = k.stride(0);
    P.kst = k.stride(1);
    P.v = (const char*)v.data_ptr() + row0 * v.stride(1) * es;
    P.vsh = v.stride(0);
    P.vst = v.stride(1);
    P.S = (int)rows;
    P.tab = nullptr;
    P.ksc = P.vsc = nullptr;
    P.kscsh = P.kscst = P.vscsh = P.vscst = 0;
    if (P.kv == KV_I8) {
        for (const torch::Tensor* t : {ks, vs})
            TORCH_CHECK(t->scalar_type() == torch::kHalf && t->device().is_cpu() && t->dim() == 3 &&
                            t->size(0) == k.size(0) && t->size(1) == k.size(1) && t->size(2) == 1,
                        who, ": int8 K/V scales must be float16 [Hk, rows of k, 1]");
        P.kscsh = ks->stride(0);
        P.kscst = ks->stride(1);
        P.ksc = (const uint16_t*)ks->data_ptr() + row0 * P.kscst;
        P.vscsh = vs->stride(0);
        P.vscst = vs->stride(1);
        P.vsc = (const uint16_t*)vs->data_ptr() + row0 * P.vscst;
    }
}

// The query side: rows [row0, row0 + T) of q [Hq, *, D] (float32, last dim contiguous), Hk kv heads.
static void set_q(Params& P, const torch::Tensor& q, int64_t row0, int64_t T, int64_t Hk, int64_t isa, const char* who) {
    TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.device().is_cpu() && q.stride(2) == 1,
                who, ": q must be float32 [Hq, T, D] on the CPU with a contiguous last dim");
    const int64_t Hq = q.size(0), D = q.size(2);
    TORCH_CHECK(Hk > 0 && Hq % Hk == 0, who, ": query heads must be a multiple of kv heads");
    TORCH_CHECK(D <= MAXD, who, ": head_dim above ", MAXD);
    TORCH_CHECK(isa >= 0 && isa <= best_isa(), who, ": ISA path ", isa, " not supported by this CPU");
    P.q = q.data_ptr<float>() + row0 * q.stride(1);
    P.qsh = q.stride(0);
    P.qst = q.stride(1);
    P.out = nullptr;
    P.Hq = (int)Hq;
    P.Hk = (int)Hk;
    P.T = (int)T;
    P.D = (int)D;
}

// Checks one sequence's tensors and fills its Params (``out`` set by the caller). int8 K/V:
// k_scale / v_scale float16 [Hk, S, 1], else both absent.
static Params make_params(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t q_pos0,
                          int64_t k_pos0, int64_t kind, int64_t wc, double scale, double softcap, int64_t isa,
                          const std::optional<torch::Tensor>& sinks, const torch::Tensor* k_scale = nullptr,
                          const torch::Tensor* v_scale = nullptr) {
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "attend: q [Hq, T, D], k/v [Hk, S, D]");
    const int64_t Hk = k.size(0), S = k.size(1), D = q.size(2);
    TORCH_CHECK(v.size(0) == Hk && v.size(1) == S && k.size(2) == D && v.size(2) == D, "attend: k/v shapes");
    Params P;
    set_q(P, q, 0, q.size(1), Hk, isa, "attend");
    set_kv(P, k, v, k_scale, v_scale, 0, S, isa, "attend");
    set_rule(P, q_pos0, k_pos0, kind, wc, scale, softcap, sinks);
    return P;
}

// (head, query) units per thread: a thread gets >= ~128K multiply-adds of work
static int64_t grain_for(int64_t keys, int64_t D) {
    const int64_t per_unit = std::max<int64_t>(1, keys * D * 2);
    return std::max<int64_t>(1, ((int64_t)1 << 17) / per_unit);
}


// Several sequences' attention in one parallel region: span j's Params P[j] (``out`` set here),
// every span with the same heads and head_dim; the output stacks the spans' rows in order
// [sum T_j, Hq * D]. Every (span, head, query) unit runs the same code as ``attend`` on the same
// Params, so each row is bit-identical to that span's ``attend`` call.
// int8 K/V read by many queries (a prefill chunk): widened once to float32 rows (int8 x scale,
// exact: the very values every unit would compute on load), so each query reads float32 instead of
// widening every key again; a decode row reads the int8 rows themselves (half the bytes of fp16)
constexpr int I8_WIDEN_ROWS = 8;
static void widen_i8(Params& p, std::vector<torch::Tensor>& keep) {
    auto kf = torch::empty({p.Hk, p.S, p.D}, torch::kFloat32), vf = torch::empty({p.Hk, p.S, p.D}, torch::kFloat32);
    const int64_t D = p.D, S = p.S;
    for (int which = 0; which < 2; which++) {
        const int8_t* src = (const int8_t*)(which ? p.v : p.k);
        const uint16_t* sc = which ? p.vsc : p.ksc;
        const int64_t sh = which ? p.vsh : p.ksh, st = which ? p.vst : p.kst;
        const int64_t ssh = which ? p.vscsh : p.kscsh, sst = which ? p.vscst : p.kscst;
        float* dst = (which ? vf : kf).data_ptr<float>();
        at::parallel_for(0, (int64_t)p.Hk * S, std::max<int64_t>(1, 4096 / std::max<int64_t>(D, 1)), [&](int64_t b, int64_t e) {
            for (int64_t r = b; r < e; r++) {
                const int64_t h = r / S, t = r % S, at = row_of(p, p.k_pos0 + t);
                const float s = c10::detail::fp16_ieee_to_fp32_value(sc[h * ssh + at * sst]);
                const int8_t* row = src + h * sh + at * st;
                float* o = dst + r * D;
                for (int64_t d = 0; d < D; d++) o[d] = (float)row[d] * s;
            }
        });
    }
    p.k = kf.data_ptr<float>();
    p.v = vf.data_ptr<float>();
    p.ksh = p.vsh = S * D;
    p.kst = p.vst = D;
    p.kv = KV_F32;
    p.ksc = p.vsc = nullptr;
    p.tab = nullptr;
    keep.push_back(kf);
    keep.push_back(vf);
}

// Few units (a decode step of one or two sequences): each unit's key blocks are cut into
// ``parts`` ranges and the (range, unit) pieces run range-major, so each thread reads its share of
// every unit's K/V rows once; every block's partial is kept, then each (head, query) folds them in
// increasing position (fold_parts): the bits of the unsplit unit.
static void split_units(std::vector<Params>& P, const std::vector<int64_t>& first_unit, int G, int Q, int64_t isa,
                        int64_t threads) {
    struct Piece {
        size_t span;
        Unit w;
        int64_t jlo, nblk, off;
    };
    // reused by every layer of every decode step (no allocation); the workers reach the calling
    // thread's vector through this reference, not their own thread_local copy
    static thread_local std::vector<Piece> kept;
    std::vector<Piece>& units = kept;
    units.clear();
    int64_t floats = 0, most = 1;
    const int64_t Dp = part_floats(P[0].D);
    for (size_t j = 0; j < P.size(); j++)
        for (int64_t u = 0; u < first_unit[j + 1] - first_unit[j]; u++) {
            Piece p{j, unit_at(P[j], G, Q, u), 0, 0, floats};
            tile_blocks(P[j], p.w.t0, p.w.nq, p.jlo, p.nblk);
            floats += (int64_t)p.w.nq * p.w.n * p.nblk * Dp;
            most = std::max(most, p.nblk);
            units.push_back(p);
        }
    const int64_t nu = (int64_t)units.size();
    const int64_t parts = std::min<int64_t>(most, (2 * threads + nu - 1) / nu);
    static thread_local std::vector<float> partial;
    if (partial.size() < (size_t)floats + 16) partial.resize(floats + 16);
    float* const pb = (float*)(((uintptr_t)partial.data() + 63) & ~(uintptr_t)63);
    at::parallel_for(0, parts * nu, 1, [&](int64_t b, int64_t e) {
        for (int64_t x = b; x < e; x++) {
            const Piece& p = units[x % nu];
            const int64_t part = x / nu;
            const int64_t jb = p.jlo + p.nblk * part / parts, je = p.jlo + p.nblk * (part + 1) / parts;
            if (jb >= je) continue;
            const Params& pr = P[p.span];
            kUnit[isa][pr.kv][p.w.n - 1](pr, p.w.h0, p.w.t0, p.w.nq, jb, je, pb + p.off, p.nblk);
        }
    });
    for (const Piece& p : units) kFold[isa](P[p.span], p.w.h0, p.w.n, p.w.t0, p.w.nq, pb + p.off, p.nblk);
}

// ``into``: a float32 [rows, Hq * D] tensor to write the output to (the fused layer's buffer kept
// between calls), else a new one.
static torch::Tensor run_many(std::vector<Params>& P, int64_t isa, const torch::Tensor* into = nullptr) {
    const size_t n = P.size();
    std::vector<torch::Tensor> widened;
    for (Params& p : P)
        if (p.kv == KV_I8 && p.T >= I8_WIDEN_ROWS) widen_i8(p, widened);
    std::vector<int64_t> first_unit(n + 1, 0), first_row(n + 1, 0);
    int64_t Hq = -1, Hk = -1, D = -1, cost = 0, rows = 0;
    for (size_t j = 0; j < n; j++) {
        const Params& p = P[j];
        TORCH_CHECK(Hq < 0 || (p.Hq == Hq && p.Hk == Hk && p.D == D),
                    "attend_many: every span must have the same heads and head_dim");
        Hq = p.Hq;
        Hk = p.Hk;
        D = p.D;
        rows += p.T;
    }
    // AVX2 runs a group of 3-4 heads' P.V two vectors wide: for wide heads (D > 128) and queries
    // that share each block's rows from L1 (tiles: rows > spans) the extra passes over V cost more
    // than the shared loads save (Gemma 3's 4 x 256 prefill: 9.3 ms a 512-query causal call at 4, 7.5 at 2)
    const int G = isa == ISA_AVX2 && D > 128 && rows > (int64_t)n ? std::min(2, group_size((int)(Hq / Hk), (int)isa))
                                                                 : group_size((int)(Hq / Hk), (int)isa);
    const int rep = (int)(Hq / Hk), groups = (rep + G - 1) / G;
    int Q = g_tile;
    const int64_t threads = at::get_num_threads();
    auto count = [&](int q) {
        int64_t u = 0;
        for (const Params& p : P) u += Hk * groups * tiles_of(p.T, q);
        return u;
    };
    while (Q > 1 && count(Q) < 2 * threads) Q = (Q + 1) / 2;
    // one span (a prompt's chunk): as many tiles as a multiple of the threads, so they share the
    // tiles evenly (72 queries on 2 threads: 6 tiles of 12, not 5 of 16); a batch's spans of
    // different sizes are balanced by cost below
    if (n == 1 && threads > 1 && P[0].T > Q) {
        const int64_t tiles = (tiles_of(P[0].T, Q) + threads - 1) / threads * threads;
        Q = (int)std::max<int64_t>(1, (P[0].T + tiles - 1) / tiles);
    }
    for (size_t j = 0; j < n; j++) {
        const Params& p = P[j];
        first_unit[j + 1] = first_unit[j] + Hk * groups * tiles_of(p.T, Q);
        first_row[j + 1] = first_row[j] + p.T;
        const int64_t keys = p.kind == FULL ? p.S : std::min<int64_t>(p.S, p.wc);
        cost += keys * (int64_t)Hk * groups * p.T;
    }
    torch::Tensor out;
    if (into != nullptr) {
        TORCH_CHECK(into->scalar_type() == torch::kFloat32 && into->is_contiguous() && into->dim() == 2 &&
                        into->size(0) == first_row[n] && into->size(1) == Hq * D,
                    "write_attend: the output buffer must be contiguous float32 [rows, Hq * D]");
        out = *into;
    } else {
        out = torch::empty({first_row[n], Hq * D}, torch::kFloat32);
    }
    const int64_t units = first_unit[n];
    if (units == 0) return out;
    float* base = out.data_ptr<float>();
    for (size_t j = 0; j < n; j++) P[j].out = base + first_row[j] * Hq * D;
    if (isa != ISA_SCALAR && threads > 1 && units < (int64_t)g_split * threads) {
        split_units(P, first_unit, G, Q, isa, threads);
        return out;
    }
    // Each thread takes a contiguous range of units of about equal cost (queries x heads x the keys
    // the unit's middle query sees), not of equal count: a batch of one prefill chunk beside decode
    // rows has units 16-70x apart (split by count, one thread got the whole chunk). Which thread
    // runs a unit changes none of its bits.
    const int64_t grain = grain_for(std::max<int64_t>(1, cost / units), D * G);
    const int64_t nth = std::max<int64_t>(1, std::min<int64_t>(threads, (units + grain - 1) / grain));
    auto run_range = [&](int64_t b, int64_t e) {
        size_t j = std::upper_bound(first_unit.begin(), first_unit.end(), b) - first_unit.begin() - 1;
        for (int64_t u = b; u < e; u++) {
            while (u >= first_unit[j + 1]) j++;
            run_unit(kUnit[isa][P[j].kv], P[j], G, Q, u - first_unit[j]);
        }
    };
    if (nth == 1) {
        run_range(0, units);
        return out;
    }
    static thread_local std::vector<int64_t> ucost, bound;
    ucost.assign(units, 0);
    int64_t total = 0;
    for (size_t j = 0, u = 0; j < n; j++)
        for (int64_t i = 0; i < first_unit[j + 1] - first_unit[j]; i++, u++) {
            const Unit w = unit_at(P[j], G, Q, i);
            int64_t lo, hi;
            visible(P[j], P[j].q_pos0 + w.t0 + w.nq / 2, lo, hi);
            ucost[u] = (int64_t)w.nq * w.n * std::max<int64_t>(1, hi - lo + 1);
            total += ucost[u];
        }
    // unit u goes to the thread whose share holds the middle of its cost: contiguous ranges
    bound.assign(nth + 1, units);
    bound[0] = 0;
    {
        int64_t before = 0, t = 0;
        for (int64_t u = 0; u < units; u++) {
            const int64_t owner = std::min<int64_t>(nth - 1, (2 * before + ucost[u]) * nth / (2 * total));
            while (t < owner) bound[++t] = u;
            before += ucost[u];
        }
    }
    const std::vector<int64_t>& bd = bound;   // the workers read the calling thread's vector
    at::parallel_for(0, nth, 1, [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; t++) run_range(bd[t], bd[t + 1]);
    });
    return out;
}

// One sequence's attention (``attend``): the same units as a batch of one span.
static torch::Tensor attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t q_pos0, int64_t k_pos0,
                            int64_t kind, int64_t wc, double scale, double softcap, int64_t isa,
                            const std::optional<torch::Tensor>& sinks, const std::optional<torch::Tensor>& k_scale,
                            const std::optional<torch::Tensor>& v_scale) {
    std::vector<Params> P{make_params(q, k, v, q_pos0, k_pos0, kind, wc, scale, softcap, isa, sinks,
                                      k_scale.has_value() ? &*k_scale : nullptr, v_scale.has_value() ? &*v_scale : nullptr)};
    return run_many(P, isa);
}

// Several sequences' attention in one call: span j's queries qs[j] over its own keys/values.
static torch::Tensor attend_many(std::vector<torch::Tensor> qs, std::vector<torch::Tensor> ks,
                                 std::vector<torch::Tensor> vs, std::vector<int64_t> q_pos0,
                                 std::vector<int64_t> k_pos0, std::vector<int64_t> kind, std::vector<int64_t> wc,
                                 double scale, double softcap, int64_t isa, const std::optional<torch::Tensor>& sinks,
                                 std::optional<std::vector<torch::Tensor>> k_scales_opt,
                                 std::optional<std::vector<torch::Tensor>> v_scales_opt) {
    const std::vector<torch::Tensor> k_scales = k_scales_opt.value_or(std::vector<torch::Tensor>{});
    const std::vector<torch::Tensor> v_scales = v_scales_opt.value_or(std::vector<torch::Tensor>{});
    const size_t n = qs.size();
    TORCH_CHECK(n > 0 && ks.size() == n && vs.size() == n && q_pos0.size() == n && k_pos0.size() == n &&
                    kind.size() == n && wc.size() == n, "attend_many: one q, k, v, positions and kind per span");
    TORCH_CHECK(k_scales.size() == v_scales.size() && (k_scales.empty() || k_scales.size() == n),
                "attend_many: one k_scale and v_scale per span (int8 K/V), or none");
    const bool scaled = !k_scales.empty();
    std::vector<Params> P;
    P.reserve(n);
    for (size_t j = 0; j < n; j++)
        P.push_back(make_params(qs[j], ks[j], vs[j], q_pos0[j], k_pos0[j], kind[j], wc[j], scale, softcap, isa, sinks,
                                scaled ? &k_scales[j] : nullptr, scaled ? &v_scales[j] : nullptr));
    return run_many(P, isa);
}

// ------------------------------------------------------------------ K/V write + attention

// src [n] float32 -> dst in the cache's element type, rounded as ATen's copy_ rounds (to nearest
// even; float16 through F16C on the SIMD paths, which rounds the same way)
namespace avx2 {
__attribute__((target("avx2,fma,f16c"))) static void to_f16(const float* src, uint16_t* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i*)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) dst[i] = c10::Half(src[i]).x;
}
}  // namespace avx2

// int8 with a float16 scale, as cache/storage.quantize_int8 computes them: scale = fp16(clamp(max|x| /
// 127, 2^-24, 65504)), q = clamp(round_half_even(x / scale), -127, 127) (float32 division)
static void store_row_i8(const float* src, int8_t* dst, uint16_t* scale, int64_t n) {
    float amax = 0.f;
    for (int64_t i = 0; i < n; i++) amax = std::max(amax, std::fabs(src[i]));
    const float s = std::min(std::max(amax / 127.0f, 5.9604644775390625e-08f), 65504.0f);
    const c10::Half h(s);
    *scale = h.x;
    const float sf = (float)h;
    for (int64_t i = 0; i < n; i++) dst[i] = (int8_t)std::min(std::max(std::nearbyint(src[i] / sf), -127.f), 127.f);
}

static void store_row(const float* src, void* dst, int kv, int64_t n, int64_t isa) {
    if (kv == KV_F32) {
        std::memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (kv == KV_F16) {
        uint16_t* d = (uint16_t*)dst;
        if (isa >= ISA_AVX2) avx2::to_f16(src, d, n);
        else for (int64_t i = 0; i < n; i++) d[i] = c10::Half(src[i]).x;
    } else {
        uint16_t* d = (uint16_t*)dst;
        for (int64_t i = 0; i < n; i++) d[i] = c10::BFloat16(src[i]).x;
    }
}

// One layer's attention for every span of a batch, each span's cache write included (the
// decode-step work of a KV cache whose blocks hold K/V as they are, float32 / float16 / bfloat16,
// or int8 with float16 row scales: one call instead of a copy, a slice and a view per sequence).
// Span j owns rows [r_j, r_j + lens[j]) of q [Hq, R, D] and k / v [Hk, R, D] (float32, any head /
// row strides, last dim contiguous), r_j = the lengths before it. Its K/V live in a block pool
// kbufs[j] / vbufs[j] [Hk, slots, D] (cache/blocks.py), position p at row tables[j][p / BLK] * BLK
// + p % BLK (tables: int32, indexed by absolute block). Its new K/V rows (positions q_pos0[j] ..)
// are stored there, then its queries attend over the positions [k_pos0[j], q_pos0[j] + lens[j]).
// Returns [R, Hq * D] (``out`` when given: contiguous float32 of that shape, the fused layer's kept
// buffer), each row bit-identical to ``attend`` over the same keys.
torch::Tensor write_attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, const std::vector<torch::Tensor>& kbufs,
                           const std::vector<torch::Tensor>& vbufs, const std::vector<int64_t>& lens,
                           const std::vector<torch::Tensor>& tables, const std::vector<int64_t>& q_pos0,
                           const std::vector<int64_t>& k_pos0, const std::vector<int64_t>& kind,
                           const std::vector<int64_t>& wc, double scale, double softcap, int64_t isa,
                           const std::optional<torch::Tensor>& sinks,
                           const std::optional<std::vector<torch::Tensor>>& kscales,
                           const std::optional<std::vector<torch::Tensor>>& vscales,
                           const std::optional<torch::Tensor>& out) {
    const size_t n = kbufs.size();
    TORCH_CHECK(kscales.has_value() == vscales.has_value() && (!kscales.has_value() || (kscales->size() == n && vscales->size() == n)),
                "write_attend: int8 buffers come with one k and one v scale buffer per span");
    TORCH_CHECK(n > 0 && vbufs.size() == n && lens.size() == n && tables.size() == n && q_pos0.size() == n &&
                    k_pos0.size() == n && kind.size() == n && wc.size() == n,
                "write_attend: one buffer pair, length, block table, positions and kind per span");
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "write_attend: q [Hq, R, D], k/v [Hk, R, D]");
    TORCH_CHECK(k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32 && k.device().is_cpu() &&
                    v.device().is_cpu() && k.stride(2) == 1 && v.stride(2) == 1,
                "write_attend: k/v rows float32 on the CPU, last dim contiguous");
    const int64_t R = q.size(1), D = q.size(2), Hk = k.size(0);
    TORCH_CHECK(k.size(1) == R && k.size(2) == D && v.size(0) == Hk && v.size(1) == R && v.size(2) == D,
                "write_attend: k/v shapes");
    const float* kp = k.data_ptr<float>();
    const float* vp = v.data_ptr<float>();
    std::vector<Params> P(n);
    int64_t r0 = 0;
    for (size_t j = 0; j < n; j++) {
        const torch::Tensor& kb = kbufs[j];
        const torch::Tensor& vb = vbufs[j];
        const torch::Tensor& tb = tables[j];
        TORCH_CHECK(kb.dim() == 3 && vb.dim() == 3 && kb.size(0) == Hk && vb.size(0) == Hk && kb.size(2) == D &&
                        vb.size(2) == D && kb.size(1) == vb.size(1),
                    "write_attend: K/V buffers must be [Hk, slots, D]");
        TORCH_CHECK(tb.dim() == 1 && tb.scalar_type() == torch::kInt && tb.is_contiguous() && tb.device().is_cpu(),
                    "write_attend: block tables must be contiguous int32 CPU tensors");
        const int64_t T = lens[j], blocks = kb.size(1) / BLK, end = q_pos0[j] + T;
        TORCH_CHECK(T >= 0 && k_pos0[j] >= 0 && k_pos0[j] <= q_pos0[j] && r0 + T <= R,
                    "write_attend: span ", j, " positions out of range");
        const int32_t* tab = tb.data_ptr<int32_t>();
        if (T > 0) {
            TORCH_CHECK((end - 1) / BLK < tb.size(0), "write_attend: span ", j, "'s block table ends before its rows");
            for (int64_t b = k_pos0[j] / BLK; b <= (end - 1) / BLK; b++)
                TORCH_CHECK(tab[b] >= 0 && tab[b] < blocks, "write_attend: span ", j, " block ", b, " -> ", tab[b],
                            " outside the pool's ", blocks, " blocks");
        }
        Params& p = P[j];
        const torch::Tensor* ks = kscales.has_value() ? &(*kscales)[j] : nullptr;
        const torch::Tensor* vs = vscales.has_value() ? &(*vscales)[j] : nullptr;
        if (kb.scalar_type() != torch::kChar) ks = vs = nullptr;
        set_q(p, q, r0, T, Hk, isa, "write_attend");
        set_kv(p, kb, vb, ks, vs, 0, end - k_pos0[j], isa, "write_attend");
        p.tab = tab;
        set_rule(p, q_pos0[j], k_pos0[j], kind[j], wc[j], scale, softcap, sinks);
        const int64_t es = kb.element_size();
        char* kd = (char*)p.k;
        char* vd = (char*)p.v;
        for (int64_t t = 0; t < T; t++) {
            const int64_t at = row_of(p, q_pos0[j] + t);
            for (int64_t h = 0; h < Hk; h++) {
                const float* kr = kp + h * k.stride(0) + (r0 + t) * k.stride(1);
                const float* vr = vp + h * v.stride(0) + (r0 + t) * v.stride(1);
                char* kdst = kd + (h * p.ksh + at * p.kst) * es;
                char* vdst = vd + (h * p.vsh + at * p.vst) * es;
                if (p.kv == KV_I8) {
                    store_row_i8(kr, (int8_t*)kdst, (uint16_t*)p.ksc + h * p.kscsh + at * p.kscst, D);
                    store_row_i8(vr, (int8_t*)vdst, (uint16_t*)p.vsc + h * p.vscsh + at * p.vscst, D);
                } else {
                    store_row(kr, kdst, p.kv, D, isa);
                    store_row(vr, vdst, p.kv, D, isa);
                }
            }
        }
        r0 += T;
    }
    TORCH_CHECK(r0 == R, "write_attend: the span lengths must add up to the rows of q");
    return run_many(P, isa, out.has_value() ? &*out : nullptr);
}

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
    lib.def("kv_dtypes() -> int", &tkv_attn::kv_dtypes);
    return true;
}();
}  // namespace

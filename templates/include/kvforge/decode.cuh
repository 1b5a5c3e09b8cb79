// Paged decode attention over tier-homogeneous pages of one (sequence, kv head).
//
// One CTA serves one (split, kv head, sequence) and all GQA query heads of the kv head, so K
// and V are read once per group. Pages stream through an NSTAGE-deep cp.async pipeline: the
// runtime's page table gives each page's tier and length (so a copy never waits on a header
// load), the staged header is checked against it, and the page is dispatched on the header's
// tier (per page, never per element). Per page: scores by the tier's key codec (integer and
// fp16 keys on tensor cores, bf16 keys channel-parallel with the query slice in registers,
// spherical keys token-parallel through the LUT), an fp32 online softmax in the log2 domain, and value
// accumulation: on tensor cores in variants with integer-key tiers (fp16 V pairs, fp32
// accumulators), else with each thread owning 8 channels of every GQA head.
#pragma once
#include "codecs.cuh"
#include "kvforge/hadamard.cuh"
#include "kvforge/params.cuh"

namespace kvforge {

template <class... Ts> struct TierList {};


// The tail tier's segment: tail pages (tier 0, at most one per sequence and kv head) are read
// in place from global memory.
template <class... Ts> __host__ __device__ constexpr int tail_seg(TierList<Ts...>) { int m = 0; ((m = Ts::id == 0 ? Ts::SEG_BYTES : m), ...); return m; }
// The tail tier (id 0) of a variant, or void: certified phase 2 reads promoted blocks of a
// quantised page from their fp16 originals, which are tail-format pages.
template <class... Ts> struct TailOf { using type = void; };
template <class T, class... Ts> struct TailOf<T, Ts...> {
  template <bool B, class A, class Z> struct Pick { using type = Z; };
  template <class A, class Z> struct Pick<true, A, Z> { using type = A; };
  using type = typename Pick<T::id == 0, T, typename TailOf<Ts...>::type>::type;
};
template <class L> struct TailTier;
template <class... Ts> struct TailTier<TierList<Ts...>> : TailOf<Ts...> {};
// X, as a type that depends on T (so that code naming X's members in an `if constexpr` branch
// discarded for T is not checked when X is void).
template <class T, class X> struct Dependent { using type = X; };

// The per-warp layout (DecodeCta::compute_warp): each warp owns 8-token octets of every page
// and keeps its own online softmax, so a page costs one block barrier (stage reuse) and the
// warps drift instead of meeting at the score, softmax and value phases. Scores are
// S^T = Q K^T on m16n8k16 with the query heads as rows (A = q in fp16 high + low parts, B =
// the octet's keys as fp16), and the score accumulators of a lane (head g, score columns 2q, 2q + 1)
// are exactly its B fragment of P^T in O^T += V^T P^T on m16n8k8, so probabilities never leave
// registers. Variants whose every tier has fp16, integer or rotated keys and values take it
// when one of them is an integer or rotated tier (kvforge-spec `Codec::prefers_per_warp`) or
// all are fp16 at head_dim <= 128 (above, the block layout), and the schedule has tensor-core values: decided by kvforge-gen schedule.rs (`per_warp`) and
// rendered as Cfg::PER_WARP. Query fragments (Cfg::SMEM_BFRAG_OFF): fp16 high and low parts of
// q, D/4 u32 per lane of the heads (head g = lane / 4, quarter qd = lane % 4). Every key codec
// of the layout (Key::WARP) pairs channels 2e, 2e + 1. The lanes past the heads take zeros or
// a real head's fragments (see compute_warp).
// Block layout: key codecs whose tiers put a variant's values on tensor cores (K::MMA_VALUES;
// integer keys). Codecs without the flag keep CUDA-core values (see MMA_V).
template <class K, class = void> struct MmaValues { static constexpr bool value = false; };
template <class K> struct MmaValues<K, decltype(void(K::MMA_VALUES))> { static constexpr bool value = K::MMA_VALUES; };
template <class... Ts> __host__ __device__ constexpr bool any_mma_values(TierList<Ts...>) { return (false || ... || MmaValues<typename Ts::Key>::value); }
// Codecs that keep one scale per token out of their tensor-core operands (C::TOKEN_SCALE, with
// C::token_scale(seg, t)): their fragments are the bare levels, keys' scores are scaled after
// the mma and values' scales fold into the probabilities (rotated codes). The others
// dequantise in full.
// Key codecs scored on integer tensor cores in the per-warp layout (K::IMMA: int8 levels on a
// 2^−GRID grid, K::GRID_INV; rotated keys of up to 3 bits): DecodeCta::build_qfrag adds int8
// query fragments (Cfg::SMEM_BFRAG_OFF, after the fp16 ones; kvforge-gen `qfrag_bytes`).
template <class K, class = void> struct ImmaKeys { static constexpr bool value = false; };
template <class K> struct ImmaKeys<K, decltype(void(K::IMMA))> { static constexpr bool value = K::IMMA; };
template <class... Ts> __host__ __device__ constexpr bool any_imma_keys(TierList<Ts...>) { return (false || ... || ImmaKeys<typename Ts::Key>::value); }
template <class C, class = void> struct TokenScaled { static constexpr bool value = false; };
template <class C> struct TokenScaled<C, decltype(void(C::TOKEN_SCALE))> { static constexpr bool value = C::TOKEN_SCALE; };
// Value codecs whose per-warp pairs carry a constant bias (V::BIASED_PAIRS, with
// V::token_pairs_biased and V::VBIAS_H2, −bias in both fp16 halves): the rotated codes on the
// int8 grid. compute_warp adds Σ p·(−bias) per head into one more accumulator tile (vcorr),
// with the same probabilities, and merge_warps adds it to every channel.
template <class V, class = void> struct BiasedValues { static constexpr bool value = false; };
template <class V> struct BiasedValues<V, decltype(void(V::BIASED_PAIRS))> { static constexpr bool value = V::BIASED_PAIRS; };
template <class... Ts> __host__ __device__ constexpr bool any_biased_values(TierList<Ts...>) { return (false || ... || BiasedValues<typename Ts::Value>::value); }

// Shared-memory plan of one decode variant (bytes): Cfg::SMEM_*_OFF regions (queries, lookup
// tables, scores, softmax statistics, output, B or query fragments, then Cfg::NSTAGE stages of
// Cfg::STAGE_BYTES), computed by kvforge-gen schedule.rs (`decode_smem`, `nstage`), which also
// gives the host the launch's Cfg::SMEM_TOTAL.

// The rendered plan holds together: regions in order and 16-byte aligned, the stages last,
// ending at the launch's dynamic shared memory (Cfg::SMEM_TOTAL).
template <class Cfg>
struct SmemPlan {
  static_assert(Cfg::SMEM_Q_OFF == 0 && Cfg::SMEM_Q_OFF <= Cfg::SMEM_LUT_OFF && Cfg::SMEM_LUT_OFF <= Cfg::SMEM_SCORES_OFF &&
                    Cfg::SMEM_SCORES_OFF <= Cfg::SMEM_STATS_OFF && Cfg::SMEM_STATS_OFF <= Cfg::SMEM_OUT_OFF &&
                    Cfg::SMEM_OUT_OFF <= Cfg::SMEM_BFRAG_OFF && Cfg::SMEM_BFRAG_OFF <= Cfg::SMEM_STAGE_OFF &&
                    Cfg::SMEM_STAGE_OFF + Cfg::NSTAGE * Cfg::STAGE_BYTES == Cfg::SMEM_TOTAL,
                "shared-memory regions in order, the stages last");
  static_assert((Cfg::SMEM_LUT_OFF | Cfg::SMEM_SCORES_OFF | Cfg::SMEM_STATS_OFF | Cfg::SMEM_OUT_OFF | Cfg::SMEM_BFRAG_OFF |
                 Cfg::SMEM_STAGE_OFF | Cfg::STAGE_BYTES) % 16 == 0,
                "16-byte aligned regions (cp.async, uint4 loads)");
  static constexpr bool OK = true;
};

// TRACK: the kernel records per-page masses when DecodeParams asks (page_lse, page_head_lse).
// CERT (certified decode, block layout): also per-block masses (block_head_lse) and key error
// bounds (block_delta), and promoted blocks (page_info mask) read from their fp16 originals.
// Decode modules hold both instantiations (symbol and symbol_tracked), so that the plain
// entry compiles the tracking code out of its page loop (the ladder variants sit at their
// 128-register cap).
template <class Cfg, bool TRACK, bool CERT = false>
struct DecodeCta {
  static constexpr int D = Cfg::D, GQA = Cfg::GQA, P = Cfg::P, NT = Cfg::NTHREADS;
  static constexpr int TPT = NT / P > 0 ? (NT / P > 32 ? 32 : NT / P) : 1;  // threads per token (LUT scores)
  static constexpr int TSTRIDE = NT / TPT;                                 // tokens in flight (LUT scores)
  static constexpr int NC8 = D / 8;                                        // 8-channel slices
  static constexpr int TG = NT / NC8;                                      // tokens in flight (channel-parallel)
  using QT = typename Cfg::QT;
  static constexpr int NSTAGE = Cfg::NSTAGE;
  static_assert(NSTAGE >= 2, "a pipeline overlaps at least one copy with compute");
  static_assert(SmemPlan<Cfg>::OK, "shared-memory plan");
  // Values on tensor cores: O^T[c][h] += V^T[c][t] · P^T[t][h] (mma m16n8k16: 16 channels × 8
  // heads × 16 tokens). Warp w takes token blocks kb ≡ w (mod VW) of every page and channel
  // part vp = w / VW; its lane (g, q) owns channels cbase + [0, CPTV) (A rows g ↔ cbase + 2i,
  // g + 8 ↔ cbase + 2i + 1 of m-tile i) and tokens 4q..4q+3 of a block (A columns 2q, 2q+1 ↔
  // 4q, 4q+1; 2q+8, 2q+9 ↔ 4q+2, 4q+3). The accumulators stay in registers across pages.
  static constexpr int NW = NT / 32;
  static constexpr int KB = P / 16;
  static constexpr int VW = NW < KB ? NW : KB;
  static constexpr int VPARTS = NW / VW;
  static constexpr int CW = D / VPARTS, CPTV = CW / 8, MTV = CPTV / 2, VN = CPTV < 8 ? CPTV : 8;
  static_assert(P % 16 == 0 && NW % VW == 0 && CPTV % 2 == 0, "tensor-core value tiles");
  // Integer keys score on tensor cores in channel parts; part 1 lands in the OUT region, which
  // is free until the final reduction.
  static_assert(D >= P, "the OUT region holds a second score part");

  // Variants with integer-key tiers accumulate values on tensor cores (every tier, the fp16
  // tail too), unless the spec asks for fp32 value arithmetic (Cfg::TC_VALUES false: the
  // certified spec, whose bound assumes it); dense and spherical variants keep the CUDA-core
  // path: there each thread owns 8 channels of every GQA head, which reads fp16 V from shared
  // memory without bank conflicts (dense keys still *score* on tensor cores).
  static constexpr bool MMA_V = Cfg::TC_VALUES && any_mma_values(typename Cfg::Tiers{});
  static constexpr bool PW = Cfg::PER_WARP;
  // Per-warp layout: a lane (g, qd) holds key channels [qd·D/4, (qd + 1)·D/4) (NPAIR pairs)
  // and value channels [g·CV, (g + 1)·CV); KSW k-steps of the score mma, m-tiles of the value mma.
  static constexpr int NPAIR = D / 8, CV = D / 8, KSW = D / 16;
  // Per-warp layout, end: the warps' accumulator slices (merge_warps).
  static constexpr int MERGE_SLICE_BYTES = NW * 32 * (KSW + 1) * 16;
  static constexpr int TAIL_PAGE_BYTES = HEADER_BYTES + tail_seg(typename Cfg::Tiers{});
  static_assert(!PW || (NPAIR % 4 == 0 && P >= 4 * NW), "per-warp layout: whole uint4 query chunks, stats fit the score region");
  static constexpr int ACC_R = PW ? KSW : MMA_V ? MTV : GQA, ACC_C = PW || MMA_V ? 4 : 8;
  // Per-warp layout: octets per online-softmax round (compute_warp). Two when a page's octets
  // are whole rounds of the warps (P / 8 a multiple of 2·NW), so that the round's second
  // octet, o + NW, lies in the page: one maximum, rescale test and query-fragment load per 16
  // tokens instead of per 8.
  static constexpr int R = (P / 8) % (2 * NW) == 0 ? 2 : 1;

  u8* smem;
  const DecodeParams& p;
  int kvh;
  float acc[ACC_R][ACC_C];
  // Per-warp layout with biased value pairs (BiasedValues): the bias's share of every channel,
  // laid out as one accumulator tile (all rows equal).
  static constexpr bool VCORR = PW && any_biased_values(typename Cfg::Tiers{});
  float vcorr[4];
  // Per-warp layout: head g's running max and (this lane's share of the) sum, and, tracking,
  // this warp's log2 mass of head g in the current page (compute_warp sets it).
  float pw_m = NEG_INF, pw_l = 0.f, pw_plse;
  // Certified phase 2: the current page's promoted-block mask (page_info bits 16-23; block b
  // of CERT_BLOCK tokens is read from the page's fp16 original) and that original's segment.
  u32 pmask = 0;
  const u8* porig = nullptr;

  __device__ float* q_s() { return reinterpret_cast<float*>(smem + Cfg::SMEM_Q_OFF); }
  // Page-mass outputs; null in the untracked instantiation, so its tracking code folds away.
  __device__ float* page_lse() const { return TRACK ? p.page_lse : nullptr; }
  __device__ float* page_head_lse() const { return TRACK ? p.page_head_lse : nullptr; }
  __device__ float* block_head_lse() const { return CERT ? p.block_head_lse : nullptr; }
  using TailT = typename TailTier<typename Cfg::Tiers>::type;
  static constexpr int BPP = P / CERT_BLOCK;
  // Per-warp layout: the warps leave their page masses in page_warp_lse and the CTA folds
  // them. Decided at compile time: the tracked entry is launched only to record masses, and
  // always with the scratch (the runtime checks it); a runtime flag held a register through
  // the page loop. The fold writes whichever of page_lse and page_head_lse is asked for.
  static constexpr bool WARP_TRACKING = TRACK && PW;
  __device__ float* lut_s() { return reinterpret_cast<float*>(smem + Cfg::SMEM_LUT_OFF); }
  __device__ float* scores_s() { return reinterpret_cast<float*>(smem + Cfg::SMEM_SCORES_OFF); }
  __device__ float* m_s() { return reinterpret_cast<float*>(smem + Cfg::SMEM_STATS_OFF); }
  __device__ float* l_s() { return m_s() + GQA; }
  __device__ float* alpha_s() { return m_s() + 2 * GQA; }
  __device__ float* plse_s() { return m_s() + 3 * GQA; }
  __device__ u8* stage(int i) { return smem + Cfg::SMEM_STAGE_OFF + i * Cfg::STAGE_BYTES; }

  // Offset of tier T's LUT among the spherical tiers of this variant.
  template <class T, class... Ts> __device__ static constexpr int lut_offset(TierList<Ts...>) {
    int off = 0; bool found = false;
    ((found = found || same_type<T, Ts>::value, off += found ? 0 : GQA * Ts::Key::LUT_FLOATS_PER_HEAD), ...);
    return off;
  }

  template <class... Ts>
  __device__ void build_luts(TierList<Ts...>) {
    (build_lut<Ts>(), ...);
  }
  template <class T>
  __device__ void build_lut() {
    if constexpr (T::Key::SPHERICAL) {
      constexpr int NG = T::Key::NG, E = T::Key::E, GROUP = D / NG;
      const float* cb = side_table<float, T::Key::SLOT_CODEBOOK>(p.side[T::id], kvh, size_t(NG) * E * GROUP);
      // A tier without radius scales has no pages yet (the first encode sets them): its
      // table would never be read, and its null pointer must not be.
      const float* rs = side_table<float, T::Key::SLOT_RADIUS>(p.side[T::id], kvh, NG);
      if (rs == nullptr) return;
      T::Key::template build_lut<GQA, NT>(lut_s() + lut_offset<T>(typename Cfg::Tiers{}), q_s(), cb, rs);
    }
  }

  // Whether this variant serves `tier` (the tail is always served).
  template <class... Ts>
  __device__ static bool serves(TierList<Ts...>, int tier) { return tier == 0 || (false || ... || (tier == Ts::id)); }

  // Issues the copy of a page (header + segment) with page-table entry `info` into stage
  // `buf`; its size comes from the entry's tier. Tail pages are not staged (the caller reads
  // them in place), nor pages of a tier this variant lacks.
  template <class... Ts>
  __device__ void stage_page(TierList<Ts...>, u32 info, const u8* page, int buf) {
    const int tier = int(info & 0xff);
    if (tier == 0) return;
    ((tier == Ts::id ? (stage_async<NT, HEADER_BYTES + align16(Ts::SEG_BYTES)>(stage(buf), page), true) : false) || ...);
  }

  template <class... Ts>
  __device__ void compute_page(TierList<Ts...>, int tier, const u8* seg, int buf, int len, u32 gpage) {
    // A staged page's segment is addressed from the shared-memory array itself, so that its
    // reads compile to LDS rather than generic loads; the tail page is read in place.
    ((tier == Ts::id ? (compute<Ts>(Ts::id == 0 ? seg : stage(buf) + HEADER_BYTES, len, gpage), true) : false) || ...);
  }

  template <class T>
  __device__ void compute(const u8* seg, int len, u32 gpage) {
    if constexpr (PW) {
      // Full pages of a coded tier (all but, at most, the last of a sequence) take the loop
      // without the per-token length tests; the tail tier keeps one loop.
      if (T::id != 0 && len == P) compute_warp<T, true>(seg, P);
      else compute_warp<T, false>(seg, len);
    } else {
      compute_cta<T>(seg, len, gpage);
    }
    if (p.block_delta) write_delta<typename T::Key>(seg, len, gpage);
  }

  __device__ u32* qfrag_s() { return reinterpret_cast<u32*>(smem + Cfg::SMEM_BFRAG_OFF); }
  // Integer query fragments (tiers with ImmaKeys), after the fp16 ones: the uint4 of k-step j
  // (32 channels) for lane (g, qd) at j·4·GQA + lane, {hi, lo, hi', lo'} = int8 quads of
  // round(q·s_g) and round((q·s_g − hi)·128) at channels c0..c0 + 3 (hi, lo) and c0 + 4..c0 + 7
  // (hi', lo'), c0 = qd·D/4 + 8j: the high parts in A rows g, the low parts in rows g + 8 (as
  // the fp16 fragments). s_g = 127 / max_c |q[g][c]|; qinv_s()[g] = 1 / s_g.
  static constexpr bool IMMA_Q = any_imma_keys(typename Cfg::Tiers{});
  static constexpr int KSI = D / 32;
  __device__ u32* qfrag_i8_s() { return qfrag_s() + GQA * D; }
  static_assert(!PW || Cfg::SMEM_STAGE_OFF - Cfg::SMEM_BFRAG_OFF >= (IMMA_Q ? 6 : 4) * GQA * D, "query fragments: fp16 (and int8) parts fit their region (kvforge-gen qfrag_bytes)");
  __device__ static float* qinv_s() {
    __shared__ float s[8];
    return s;
  }
  // Query fragments, once per CTA: the A operand of k-step j for lane (g, qd), g < GQA, is the
  // uint4 at j·4·GQA + lane, {hi(2j), lo(2j), hi(2j + 1), lo(2j + 1)} of q[g] at pairs 2j,
  // 2j + 1 (channels qd·D/4 + 2e, + 1) of quarter qd: the fp16 high part in A rows g (the
  // heads), the low part in rows g + 8, which no head uses, so one mma takes both.
  __device__ void build_qfrag() {
    constexpr int CPT = D / 4, L4 = 4 * GQA;
    u32* f = qfrag_s();
    for (int i = threadIdx.x; i < L4 * NPAIR; i += NT) {
      const int e = i % NPAIR, lane = i / NPAIR, g = lane / 4, qd = lane % 4;
      const int ca = qd * CPT + 2 * e;
      u32 hi, lo;
      split_h2(q_s()[g * D + ca], q_s()[g * D + ca + 1], hi, lo);
      const int at = ((e / 2) * L4 + lane) * 4 + 2 * (e % 2);
      f[at] = hi;
      f[at + 1] = lo;
    }
    if constexpr (IMMA_Q) {
      static_assert(GQA <= 8 && D % 32 == 0, "int8 query fragments: heads in A rows 0-7, whole k-steps");
      if (threadIdx.x < 32) {
        for (int g = 0; g < GQA; ++g) {
          float m = 0.f;
          for (int c = threadIdx.x; c < D; c += 32) m = fmaxf(m, fabsf(q_s()[g * D + c]));
          m = warp_max(m);
          if (threadIdx.x == 0) qinv_s()[g] = m / 127.f;
        }
      }
      __syncthreads();
      u32* fi = qfrag_i8_s();
      for (int i = threadIdx.x; i < L4 * KSI * 2; i += NT) {
        // Item i: lane, k-step j, half h (channels c0 + 4h..c0 + 4h + 3).
        const int h = i % 2, j = (i / 2) % KSI, lane = i / (2 * KSI), g = lane / 4, qd = lane % 4;
        const int c0 = qd * CPT + 8 * j + 4 * h;
        const float inv = qinv_s()[g], s = inv > 0.f ? 1.f / inv : 0.f;
        u32 hi = 0, lo = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float x = q_s()[g * D + c0 + k] * s;
          const int a = min(127, max(-127, __float2int_rn(x)));
          const int b = min(127, max(-127, __float2int_rn((x - float(a)) * 128.f)));
          hi |= (u32(a) & 0xffu) << (8 * k);
          lo |= (u32(b) & 0xffu) << (8 * k);
        }
        const int at = (j * L4 + lane) * 4 + 2 * h;
        fi[at] = hi;
        fi[at + 1] = lo;
      }
    }
  }

  // One page in the per-warp layout (see the top of this file): warp w takes octets w, w + NW, ... of the
  // page's `len` tokens. No block barrier.
  // FULL: `len` is P, so every token of every octet is live (no length tests, no tail mask).
  template <class T, bool FULL>
  __device__ void compute_warp(const u8* seg, int len_) {
    const int len = FULL ? P : len_;
    auto live = [&](int t) { return FULL || t < len; };
    using K = typename T::Key;
    using V = typename T::Value;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, qd = lane & 3;
    const bool head = g < GQA;
    constexpr int L4 = 4 * GQA;
    // Lanes past the heads either select zero fragments or (K::WARP_SHARED_Q) read those of
    // head g mod GQA, a broadcast with no extra wavefronts: their score rows are then a real
    // head's, finite, and their probabilities never reach the accumulators (B column g is
    // zero below; merge_warps reads heads < GQA only). Where the fragments stay in
    // registers (fp16 keys) the select cost a MOV per register and octet.
    constexpr bool SHARED_Q = K::WARP_SHARED_Q;
    const uint4* qf = reinterpret_cast<const uint4*>(qfrag_s()) + (head ? lane : SHARED_Q ? (g % GQA) * 4 + qd : 0);
    float page_sum = 0.f;
    using Keys = typename K::template WarpKeys<NPAIR>;
    Keys keys(seg, qd);
    // Integer keys (ImmaKeys): int32 scores times 1/s_g (the query's int8 scale), 2^−GRID and
    // 1/128 (the low part's weight, see below).
    constexpr bool IMMA = ImmaKeys<K>::value;
    constexpr int NB = IMMA ? NPAIR / 2 : NPAIR;
    float qk = 1.f;
    if constexpr (IMMA) qk = qinv_s()[g % GQA] * (K::GRID_INV / 128.f);
    const uint4* qi = reinterpret_cast<const uint4*>(qfrag_i8_s()) + (g % GQA) * 4 + qd;
#pragma unroll 1
    for (int o = warp; o * 8 < len; o += R * NW) {
      // Score column n of an octet is token t0 + (n even ? n / 2 : 4 + (n / 2 ^ 1)), so that a
      // lane's value tokens ta, tb (columns 2qd, 2qd + 1) lie one row apart across qd rather
      // than two: int4 value rows are 64 bytes, and rows 2qd hit the same banks four ways
      // (two ways now); key rows of lanes g, g + 1 stay an odd number of rows apart. Octet r
      // of the round is o + r·NW (R = 2: in the page, see R).
      int ta[R], tb[R];
      u32 kb[R][NB];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int t0 = (o + r * NW) * 8;
        ta[r] = t0 + qd;
        tb[r] = t0 + 4 + (qd ^ 1);
        keys(seg, t0 + ((g & 1) ? 4 + ((g >> 1) ^ 1) : g >> 1), qd, kb[r]);
      }
      // Scores of head g, tokens ta and tb: C rows g hold the high parts' products, rows
      // g + 8 the low parts'. Two accumulator chains halve the mma dependency chain: the
      // round's two octets (R = 2, which also share each query fragment load), else the even
      // and odd k-steps of the one.
      float c[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      int ci[R][4];
      if constexpr (IMMA) {
        // Integer keys: k-steps of 32 channels, A rows g / g + 8 the query's int8 high / low
        // parts (lanes past the heads read head g mod GQA's, as SHARED_Q), exact int32 sums.
#pragma unroll
        for (int r = 0; r < R; ++r) ci[r][0] = ci[r][1] = ci[r][2] = ci[r][3] = 0;
#pragma unroll
        for (int j = 0; j < KSI; ++j) {
          const uint4 q4 = qi[j * L4];
          const u32 a[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const u32 b2[2] = {kb[r][2 * j], kb[r][2 * j + 1]};
            mma16832_s8(ci[r], a, b2);
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < KSW; ++j) {
          const uint4 q4 = SHARED_Q || head ? qf[j * L4] : make_uint4(0u, 0u, 0u, 0u);
          const u32 a[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const u32 b2[2] = {kb[r][2 * j], kb[r][2 * j + 1]};
            mma16816<false>(c[R == 2 ? r : j & 1], a, b2);
          }
        }
      }
      // Online softmax of head g over the round (token t0 < len of its first octet scores
      // finitely, so m_new is).
      float s[R][2];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float x0, x1;
        if constexpr (IMMA) {
          // hi·128 + lo in int32 (|hi| ≤ 127·127·D, below 2^31 / 128 up to D 1024), one conversion.
          x0 = float(ci[r][0] * 128 + ci[r][2]) * qk;
          x1 = float(ci[r][1] * 128 + ci[r][3]) * qk;
        } else if constexpr (R == 2) {
          x0 = c[r][0] + c[r][2];
          x1 = c[r][1] + c[r][3];
        } else {
          x0 = (c[0][0] + c[0][2]) + (c[1][0] + c[1][2]);
          x1 = (c[0][1] + c[0][3]) + (c[1][1] + c[1][3]);
        }
        if constexpr (TokenScaled<K>::value) {
          x0 *= K::token_scale(seg, ta[r]);
          x1 *= K::token_scale(seg, tb[r]);
        }
        s[r][0] = live(ta[r]) ? x0 : NEG_INF;
        s[r][1] = live(tb[r]) ? x1 : NEG_INF;
      }
      float mx = fmaxf(s[0][0], s[0][1]);
#pragma unroll
      for (int r = 1; r < R; ++r) mx = fmaxf(mx, fmaxf(s[r][0], s[r][1]));
      mx = group_max<4>(mx);
      const float m_new = fmaxf(pw_m, mx);
      const float alpha = softmax_exp2(pw_m - m_new);
      float pr[R][2], psum = 0.f;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        pr[r][0] = softmax_exp2(s[r][0] - m_new);
        pr[r][1] = softmax_exp2(s[r][1] - m_new);
        psum += pr[r][0] + pr[r][1];
      }
      pw_l = pw_l * alpha + psum;
      page_sum = page_sum * alpha + psum;
      pw_m = m_new;
      // Accumulator columns are heads 2qd and 2qd + 1, whose statistics live in lanes 8qd and
      // 8qd + 4; once a head's maximum settles, its pages skip the rescale. (A lazy rescale,
      // keeping the maximum until a score passes it by 2^8, was no faster.)
      if (__any_sync(0xffffffffu, alpha != 1.f)) {
        const float a0 = __shfl_sync(0xffffffffu, alpha, 8 * qd), a1 = __shfl_sync(0xffffffffu, alpha, 8 * qd + 4);
#pragma unroll
        for (int i = 0; i < KSW; ++i) { acc[i][0] *= a0; acc[i][1] *= a1; acc[i][2] *= a0; acc[i][3] *= a1; }
        if constexpr (VCORR) { vcorr[0] *= a0; vcorr[1] *= a1; vcorr[2] *= a0; vcorr[3] *= a1; }
      }
      // O^T += V^T P^T: the probabilities are this lane's B fragment as they stand (times the
      // tokens' value scales for token-scaled values; tokens past `len`, whose scales may be
      // anything, keep p = 0).
#pragma unroll
      for (int r = 0; r < R; ++r) {
        // Every lane computes its fragment and lanes past the heads then select zero: a
        // conditional computation compiled to a divergent branch around the scale loads.
        float p0 = pr[r][0], p1 = pr[r][1];
        if constexpr (TokenScaled<V>::value) {
          p0 = live(ta[r]) ? p0 * V::token_scale(seg, ta[r]) : 0.f;
          p1 = live(tb[r]) ? p1 * V::token_scale(seg, tb[r]) : 0.f;
        }
        const u32 b = head ? pack2<false>(p0, p1) : 0u;
        u32 vp[CV];
        constexpr bool BIASED = BiasedValues<V>::value;
        if constexpr (BIASED) {
          // Pairs ℓ + bias, finite for any code (rows past `len` need no mask), and Σ p·(−bias).
          V::template token_pairs_biased<CV>(seg, ta[r], tb[r], g * CV, vp);
          const u32 nb[2] = {V::VBIAS_H2, V::VBIAS_H2};
          mma1688(vcorr, nb, b);
        } else {
          V::template token_pairs<CV>(seg, ta[r], tb[r], g * CV, vp);
        }
        if (!FULL && !BIASED && (o + r * NW) * 8 + 8 > len) {
          // Rows past `len` may hold anything (a tail page's unwritten rows): p = 0 must not
          // meet a NaN.
          const u32 m = (ta[r] < len ? 0xffffu : 0u) | (tb[r] < len ? 0xffff0000u : 0u);
#pragma unroll
          for (int k = 0; k < CV; ++k) vp[k] &= m;
        }
#pragma unroll
        for (int i = 0; i < KSW; ++i) {
          const u32 a[2] = {vp[2 * i], vp[2 * i + 1]};
          mma1688(acc[i], a, b);
        }
      }
    }
    if constexpr (WARP_TRACKING) {
      // This warp's log2 mass of head g (a warp without octets in the page has none). The
      // page loop stores it: stored here, the page's global index stayed live through the
      // octet loop, and the ladder variants spilled at sm_80.
      page_sum += __shfl_xor_sync(0xffffffffu, page_sum, 1);
      page_sum += __shfl_xor_sync(0xffffffffu, page_sum, 2);
      pw_plse = warp * 8 < len ? pw_m + log2f(page_sum) : NEG_INF;
    }
  }

  // Per-warp layout, page tracking. A page's tokens are spread over the warps (octets), so its
  // log2 mass of a head is the log-sum of the warps' parts. In the page loop every warp stores
  // its parts straight to DecodeParams::page_warp_lse ([page][NW][GQA]; one store per head
  // lane, nothing kept in registers), and the CTA folds its pages after the loop
  // (fold_page_masses), when neither the page state nor the accumulators are live. The fold
  // used to run inside the page loop (warp 0 folding a batch of pages every few pages out of
  // a ring in the score region): its registers came on top of the page state, and the ladder
  // variants, at their 128-register cap, spilled in the tracked entry (issue 7: ncu measured
  // 196K / 1.57M local-memory sectors at batch 1 / 8, +17-19% time over the plain entry).
  // Floats of page_warp_lse per page (NW · GQA) are Cfg::WARP_LSE_PER_PAGE (kvforge-gen
  // schedule.rs `warp_lse_per_page`); 0 in the block layout, which folds a page's heads in
  // place (compute_cta).
  // Lanes per page in a fold: the heads, padded to a power of two (shuffle groups).
  static constexpr int TRACK_LANES = GQA <= 1 ? 1 : GQA <= 2 ? 2 : GQA <= 4 ? 4 : GQA <= 8 ? 8 : GQA <= 16 ? 16 : 32;
  static_assert(!PW || GQA <= 32, "page tracking: a page's heads in one warp");
  static_assert(!PW || Cfg::WARP_LSE_PER_PAGE == NW * GQA, "page_warp_lse: every warp's mass of every head of a page");

  // Stores this warp's log2 mass `x` of every head in page `gpage` (the head lanes qd = 0).
  __device__ void store_warp_mass(u32 gpage, float x) {
    const int lane = threadIdx.x % 32;
    if (lane % 4 == 0 && lane / 4 < GQA) p.page_warp_lse[(size_t(gpage) * NW + threadIdx.x / 32) * GQA + lane / 4] = x;
  }

  // Folds the per-warp masses of pages [gpage, gpage + count) into their per-head and
  // per-page log2 masses, with every thread of the CTA (all must call it: the page sums are
  // shuffles). Thread j of a pass takes page j / TRACK_LANES, head j % TRACK_LANES: the warps'
  // masses of the head are loaded at once and reduce serially in the thread (in warp order, as
  // the in-loop fold did, so the results are bit for bit the same), the page's heads across
  // its lane group.
  __device__ void fold_page_masses(u32 gpage, int count) {
    for (int j0 = 0; j0 < count * TRACK_LANES; j0 += NT) {
      const int j = j0 + int(threadIdx.x), r = j / TRACK_LANES, h = j % TRACK_LANES;
      const bool on = r < count && h < GQA;
      const float* pl = p.page_warp_lse + (on ? (size_t(gpage) + r) * NW * GQA + h : 0);
      float x[NW];
      float m = NEG_INF;
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        x[w] = on ? pl[w * GQA] : NEG_INF;
        m = fmaxf(m, x[w]);
      }
      float e = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) e += m == NEG_INF ? 0.f : exp2f(x[w] - m);
      const float lse = on && m != NEG_INF ? m + log2f(e) : NEG_INF;
      if (page_head_lse() != nullptr && on) page_head_lse()[size_t(gpage + r) * GQA + h] = lse;
      if (page_lse() != nullptr) {
        const float pm = group_max<TRACK_LANES>(lse);
        const float ps = group_sum<TRACK_LANES>(pm == NEG_INF ? 0.f : exp2f(lse - pm));
        if (on && h == 0) page_lse()[gpage + r] = pm == NEG_INF ? NEG_INF : pm + log2f(ps);
      }
    }
  }

  // Per-warp layout, end: every warp's accumulators rescaled to the heads' common maximum and
  // summed in a fixed warp order into OUT; m_s / l_s get the heads' totals.
  __device__ void merge_warps() {
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, qd = lane & 3;
    if constexpr (VCORR) {
      // The biased value pairs' share: the same for every channel of a head (column).
#pragma unroll
      for (int i = 0; i < KSW; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += vcorr[j];
    }
    float* wm = scores_s();
    float* wl = wm + NW * GQA;
    float l = pw_l;
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (qd == 0 && g < GQA) { wm[warp * GQA + g] = pw_m; wl[warp * GQA + g] = l; }
    __syncthreads();
    auto head_max = [&](int h) {
      float m = NEG_INF;
      for (int w = 0; w < NW; ++w) m = fmaxf(m, wm[w * GQA + h]);
      return m;
    };
    // f = 2^(m_warp − m_head) for warp `w`: 0 for a warp that saw none of the head's tokens.
    auto factor = [&](int h, int w, float m) { return wm[w * GQA + h] == NEG_INF ? 0.f : exp2f(wm[w * GQA + h] - m); };
    if (tid < GQA) {
      const float m = head_max(tid);
      float sum = 0.f;
      for (int w = 0; w < NW; ++w) sum += wl[w * GQA + tid] * factor(tid, w, m);
      m_s()[tid] = m;
      l_s()[tid] = sum;
    }
    float* out_s = reinterpret_cast<float*>(smem + Cfg::SMEM_OUT_OFF);
    if constexpr (MERGE_SLICE_BYTES <= NSTAGE * Cfg::STAGE_BYTES) {
      // Every warp's accumulators go as they lie in registers into its own slice of the idle
      // stages (lane rows of KSW float4, padded by one: no bank conflicts either way); then each
      // thread sums its outputs over the warps in warp order. The warps used to add into OUT
      // one after another, NW barriers, with 16-way bank conflicts (heads 128 floats apart,
      // lanes 16): a fixed cost every CTA pays, most visible at batch 1.
      float4* slice = reinterpret_cast<float4*>(stage(0));
#pragma unroll
      for (int i = 0; i < KSW; ++i) slice[(warp * 32 + lane) * (KSW + 1) + i] = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
      __syncthreads();
      const float* sl = reinterpret_cast<const float*>(slice);
      for (int o = threadIdx.x; o < GQA * D; o += NT) {
        const int h = o / D, c = o % D, r = c % CV;
        const int at = ((c / CV) * 4 + h / 2) * (KSW + 1) * 4 + (r / 2) * 4 + ((r & 1) << 1) + (h & 1);
        const float m = head_max(h);
        float v = 0.f;
        for (int w = 0; w < NW; ++w) v += sl[w * 32 * (KSW + 1) * 4 + at] * factor(h, w, m);
        out_s[o] = v;
      }
      __syncthreads();
    } else {
      const float f0 = 2 * qd < GQA ? factor(2 * qd, warp, head_max(2 * qd)) : 0.f;
      const float f1 = 2 * qd + 1 < GQA ? factor(2 * qd + 1, warp, head_max(2 * qd + 1)) : 0.f;
      for (int w = 0; w < NW; ++w) {
        if (warp == w) {
#pragma unroll
          for (int i = 0; i < KSW; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const int h = 2 * qd + (j & 1), c = g * CV + 2 * i + (j >> 1);
              if (h < GQA) {
                const float v = acc[i][j] * ((j & 1) ? f1 : f0);
                float* o = &out_s[h * D + c];
                *o = w == 0 ? v : *o + v;
              }
            }
        }
        __syncthreads();
      }
    }
  }

  template <class T>
  __device__ void compute_cta(const u8* seg, int len, u32 gpage) {
    using K = typename T::Key;
    float* mass = page_lse() ? page_lse() + gpage : nullptr;
    using V = typename T::Value;
    const int tid = threadIdx.x;
    float* sc = scores_s();
    float* sc1 = reinterpret_cast<float*>(smem + Cfg::SMEM_OUT_OFF);
    constexpr int KPARTS = score_parts<K>();
    if constexpr (K::MMA) {
      K::template mma_scores<GQA, NW, NT>(seg, len, q_s(), sc, sc1, smem + Cfg::SMEM_BFRAG_OFF);
    } else if constexpr (K::OUTLINE_SCORER) {
      const u16* order = side_table<u16, K::SLOT_ORDER>(p.side[T::id], kvh, 2 * D);
      score_outlined<K>(q_s(), seg, len, order, sc);
    } else if constexpr (K::CHANNEL_PARALLEL) {
      score_channel_parallel<K>(seg, len, sc);
    } else {
      const float* lut = lut_s() + lut_offset<T>(typename Cfg::Tiers{});
      for (int t0 = 0; t0 < P; t0 += TSTRIDE) {
        const int t = t0 + tid / TPT, part = tid % TPT;
        float s[GQA];
#pragma unroll
        for (int h = 0; h < GQA; ++h) s[h] = 0.f;
        if (t < len) K::template score_lut<GQA, TPT>(seg, t, part, lut, s);
#pragma unroll
        for (int h = 0; h < GQA; ++h) s[h] = group_sum<TPT>(s[h]);
        if (part == 0 && t < P) {
#pragma unroll
          for (int h = 0; h < GQA; ++h) sc[h * P + t] = t < len ? s[h] : NEG_INF;
        }
      }
    }
    __syncthreads();
    if constexpr (PROMOTES<T>) {
      if (pmask != 0) {
        rescore_promoted<typename Dependent<T, TailT>::type>(q_s(), porig, pmask, len, sc, KPARTS == 2 ? sc1 : nullptr);
        __syncthreads();
      }
    }
    // Online softmax: one warp per head.
    const int warp = tid / 32, lane = tid % 32;
    for (int h = warp; h < GQA; h += NT / 32) {
      float mx = NEG_INF;
      float x[cdiv(P, 32)];
#pragma unroll
      for (int i = 0; i < cdiv(P, 32); ++i) {
        const int t = lane + 32 * i;
        x[i] = NEG_INF;
        if (t < P) x[i] = KPARTS == 2 ? sc[h * P + t] + sc1[h * P + t] : sc[h * P + t];
        mx = fmaxf(mx, x[i]);
      }
      mx = warp_max(mx);
      const float m_old = m_s()[h];
      const float m_new = fmaxf(m_old, mx);
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < cdiv(P, 32); ++i) {
        const int t = lane + 32 * i;
        if (t >= P) break;
        const float e = exp2f(x[i] - m_new);
        sc[h * P + t] = e;
        sum += e;
      }
      sum = warp_sum(sum);
      if (block_head_lse() != nullptr) {
        // Per 16-token block: the half-warp's sum of the e's this warp just stored.
        __syncwarp();
#pragma unroll
        for (int i = 0; i < cdiv(P, 32); ++i) {
          const int t = lane + 32 * i;
          float e = t < P ? sc[h * P + t] : 0.f;
#pragma unroll
          for (int o = 8; o > 0; o >>= 1) e += __shfl_xor_sync(0xffffffffu, e, o);
          if ((lane & 15) == 0 && t < P) block_head_lse()[(size_t(gpage) * BPP + t / CERT_BLOCK) * GQA + h] = m_new + log2f(e);
        }
      }
      if (lane == 0) {
        const float alpha = exp2f(m_old - m_new);  // m_old = -inf gives 0
        alpha_s()[h] = alpha;
        plse_s()[h] = m_new + log2f(sum);
        if (page_head_lse()) page_head_lse()[size_t(gpage) * GQA + h] = m_new + log2f(sum);
        l_s()[h] = l_s()[h] * alpha + sum;
        m_s()[h] = m_new;
      }
    }
    __syncthreads();
    if (mass != nullptr && tid == 0) {
      float mx = NEG_INF;
      for (int h = 0; h < GQA; ++h) mx = fmaxf(mx, plse_s()[h]);
      float sum = 0.f;
      for (int h = 0; h < GQA; ++h) sum += exp2f(plse_s()[h] - mx);
      *mass = mx + log2f(sum);
    }
    if constexpr (MMA_V) {
      accumulate_values<V>(seg, len);
    } else {
      // Values: thread owns channels [c8*8, c8*8+8) of tokens tg, tg + TG, ...
      const int c8 = tid % NC8, tg = tid / NC8;
#pragma unroll
      for (int h = 0; h < GQA; ++h) {
        const float a = alpha_s()[h];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[h][i] *= a;
      }
      for (int t = tg; t < len; t += TG) {
        float v[8];
        if constexpr (PROMOTES<T>) {
          if ((pmask >> (t / CERT_BLOCK)) & 1u) Dependent<T, TailT>::type::Value::load8(porig, t, c8, v);
          else V::load8(seg, t, c8, v);
        } else {
          V::load8(seg, t, c8, v);
        }
#pragma unroll
        for (int h = 0; h < GQA; ++h) {
          const float w = sc[h * P + t];
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[h][i] = fmaf(w, v[i], acc[h][i]);
        }
      }
    }
  }

  // Certified phase 2 serves promoted blocks of a quantised page from the page's fp16
  // original (pinned host memory, read in place over UVA): the tracked block-layout entry of a
  // variant that has the tail tier, for pages of the other tiers.
  template <class T>
  static constexpr bool PROMOTES = CERT && !PW && !MMA_V && !same_type<TailT, void>::value && T::id != 0 && P % CERT_BLOCK == 0;

  // Scores of the promoted blocks' tokens from their fp16 keys (channel-parallel: thread
  // (token tt, slice c8), a shuffle tree over the slices), replacing the quantised ones; the
  // second score part, if any, is zeroed. Out of line and static (as score_outlined): its
  // query slice in registers would otherwise raise the register count of the whole page loop.
  template <class TT>
  __device__ static __noinline__ void rescore_promoted(const float* q, const u8* porig, u32 pmask, int len, float* sc, float* sc1) {
    const int tid = threadIdx.x, c8 = tid % NC8, tt = tid / NC8;
    typename TT::Key::template Scorer<GQA> scorer(q, c8);
    for (int t0 = 0; t0 < P; t0 += TG) {
      const int t = t0 + tt;
      const bool on = t < len && ((pmask >> (t / CERT_BLOCK)) & 1u);
      float s[GQA];
#pragma unroll
      for (int h = 0; h < GQA; ++h) s[h] = 0.f;
      if (on) scorer.score(porig, t, s);
#pragma unroll
      for (int h = 0; h < GQA; ++h) s[h] = group_sum<NC8>(s[h]);
      if (on && c8 == 0) {
#pragma unroll
        for (int h = 0; h < GQA; ++h) {
          sc[h * P + t] = s[h];
          if (sc1 != nullptr) sc1[h * P + t] = 0.f;
        }
      }
    }
  }

  // Codecs with a large scorer (K::OUTLINE_SCORER: mixed keys) score through one
  // out-of-line copy per codec (inlined into every zone tier's page step the 4-zone TriZone
  // variant spilled 3 KB per thread at gqa 8; outlined no variant spills, and it runs as fast
  // as the inlined single-tier variant), with chunk-major lanes: thread i takes 8-channel
  // chunk i / TG and tokens i % TG + j·TG, so the lanes of a warp share a chunk pair and hence
  // a segment (segments are whole eighths of head_dim: 1, 2 or 4 chunks, a multiple of the
  // chunks per warp) and run one dequantisation path instead of all of them. A token's
  // partial dots, spread over warps, meet through shared-memory atomics.
  // Static, so that `this` (whose accumulators must stay in registers) never escapes into
  // the out-of-line call: as a member function the call put them in local memory (2.5x
  // slower, L2-bound on local traffic; ncu).
  template <class K>
  __device__ static __noinline__ void score_outlined(const float* q, const u8* seg, int len, const u16* order, float* sc) {
    const int tid = threadIdx.x, c8 = tid / TG, tt = tid % TG;
    constexpr int RUN = P / TG > 0 ? P / TG : 1;
    for (int i = tid; i < GQA * P; i += NT) sc[i] = 0.f;
    __syncthreads();
    typename K::template Scorer<GQA> scorer(q, c8, order);
    if (K::chunk_stored(c8)) {
      for (int j = 0; j < RUN; ++j) {
        const int t = tt + j * TG;
        if (t >= len) break;
        float s[GQA];
        scorer.score(seg, t, s);
#pragma unroll
        for (int h = 0; h < GQA; ++h) atomicAdd(sc + h * P + t, s[h]);
      }
    }
    __syncthreads();
    for (int i = tid; i < GQA * P; i += NT)
      if (i % P >= len) sc[i] = NEG_INF;
  }

  // Channel-parallel scoring: the NC8 lanes of a token are consecutive and a shuffle tree sums
  // their partial dots; a thread scores P/TG consecutive tokens, so per-block state (the int
  // scale fold) changes at most once or twice per page.
  template <class K>
  __device__ __forceinline__ void score_channel_parallel(const u8* seg, int len, float* sc) {
    const int tid = threadIdx.x, c8 = tid % NC8, tt = tid / NC8;
    constexpr int RUN = P / TG > 0 ? P / TG : 1;
    typename K::template Scorer<GQA> scorer(q_s(), c8);
    for (int j = 0; j < RUN; ++j) {
      const int t = tt * RUN + j;
      float s[GQA];
#pragma unroll
      for (int h = 0; h < GQA; ++h) s[h] = 0.f;
      if (t < len) scorer.score(seg, t, s);
#pragma unroll
      for (int h = 0; h < GQA; ++h) s[h] = group_sum<NC8>(s[h]);
      if (c8 == 0 && t < P) {
#pragma unroll
        for (int h = 0; h < GQA; ++h) sc[h * P + t] = t < len ? s[h] : NEG_INF;
      }
    }
  }

  template <class K> __device__ static constexpr int score_parts() {
    if constexpr (K::MMA) return K::template Mma<NW>::KP;
    else return 1;
  }

  // P (probabilities in scores_s, 0 past `len`) times the page's values into acc; see the
  // layout note at the top of the struct.
  template <class V>
  __device__ void accumulate_values(const u8* seg, int len) {
    constexpr bool BF16 = V::BF16;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, qd = lane & 3;
    const int kbw = warp % VW, cbase = (warp / VW) * CW + g * CPTV;
    const float a0 = 2 * qd < GQA ? alpha_s()[2 * qd] : 0.f;
    const float a1 = 2 * qd + 1 < GQA ? alpha_s()[2 * qd + 1] : 0.f;
#pragma unroll
    for (int i = 0; i < MTV; ++i) { acc[i][0] *= a0; acc[i][1] *= a1; acc[i][2] *= a0; acc[i][3] *= a1; }
    const float* sc = scores_s();
#pragma unroll 1
    for (int kb = kbw; kb * 16 < len; kb += VW) {
      const int t = kb * 16 + 4 * qd;
      u32 b[2] = {0u, 0u};
      if (g < GQA) {
        float4 pv = *reinterpret_cast<const float4*>(sc + g * P + t);
        if constexpr (TokenScaled<V>::value) {
          // The tokens' value scales fold into p (0 past `len`, where a scale may be anything).
          pv.x = t < len ? pv.x * V::token_scale(seg, t) : 0.f;
          pv.y = t + 1 < len ? pv.y * V::token_scale(seg, t + 1) : 0.f;
          pv.z = t + 2 < len ? pv.z * V::token_scale(seg, t + 2) : 0.f;
          pv.w = t + 3 < len ? pv.w * V::token_scale(seg, t + 3) : 0.f;
        }
        b[0] = pack2<BF16>(pv.x, pv.y);
        b[1] = pack2<BF16>(pv.z, pv.w);
      }
      if (kb * 16 + 16 <= len) {
        value_block<V, false>(seg, t, cbase, b, 0u, 0u);
      } else {
        // Tokens past `len` have p = 0, but their bytes may be anything (a tail page's
        // unwritten rows): zero them so that no NaN reaches the accumulator.
        const u32 mlo = (t < len ? 0xffffu : 0u) | (t + 1 < len ? 0xffff0000u : 0u);
        const u32 mhi = (t + 2 < len ? 0xffffu : 0u) | (t + 3 < len ? 0xffff0000u : 0u);
        value_block<V, true>(seg, t, cbase, b, mlo, mhi);
      }
    }
  }
  template <class V, bool MASK>
  __device__ __forceinline__ void value_block(const u8* seg, int t, int cbase, const u32 (&b)[2], u32 mlo, u32 mhi) {
#pragma unroll
    for (int cc = 0; cc < CPTV / VN; ++cc) {
      u32 lo[VN], hi[VN];
      V::template pairs<VN>(seg, t, cbase + cc * VN, lo, hi);
#pragma unroll
      for (int m = 0; m < VN / 2; ++m) {
        u32 a[4] = {lo[2 * m], lo[2 * m + 1], hi[2 * m], hi[2 * m + 1]};
        if constexpr (MASK) { a[0] &= mlo; a[1] &= mlo; a[2] &= mhi; a[3] &= mhi; }
        mma16816<V::BF16>(acc[cc * VN / 2 + m], a, b);
      }
    }
  }

  // Certified decode: per 16-token block u of the page and query head, Δ_u = ½ Σ_c |q_c| σ_c /
  // sqrt(d) of the key block holding it (the largest logit error of its quantised keys), in
  // natural-log units (q_s() is pre-scaled by sm_scale · log2 e); 0 past the page's `len`
  // tokens. One warp per head.
  template <class K>
  __device__ void write_delta(const u8* seg, int len, u32 gpage) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int h = warp; h < GQA; h += NT / 32) {
      float d = 0.f;
      int kb = -1;  // key block d was computed for
      for (int u = 0; u < BPP; ++u) {
        float du = 0.f;
        if (u * CERT_BLOCK < len) {
          if constexpr (K::ERROR == KeyError::Step) {
            const int b = u * CERT_BLOCK / K::BLOCK_TOKENS;
            if (b != kb) {
              float s = 0.f;
              for (int c = lane; c < D; c += 32) s = fmaf(fabsf(q_s()[h * D + c]), K::step(seg, b, c), s);
              d = warp_sum(s) * (0.5f * 0.6931471805599453f);  // log2 domain → natural log
              kb = b;
            }
            du = d;
          } else if constexpr (K::ERROR == KeyError::Unbounded) {
            du = __int_as_float(0x7f800000);  // +inf: this scheme states no bound
          }
        }
        if (lane == 0) p.block_delta[(size_t(gpage) * BPP + u) * GQA + h] = du;
      }
    }
  }

  // The pages of (sequence `seq`, this kv head) in the page table, [first, first + n), and
  // those of split `split`, [first + lo, first + hi).
  struct Pages {
    u32 first;
    int n, lo, hi;
  };
  __device__ Pages pages(int seq, int split) const {
    const u32 first = p.page_indptr[seq * p.num_kv_heads + kvh];
    const u32 last = p.page_indptr[seq * p.num_kv_heads + kvh + 1];
    const int n = int(last - first);
    const int per = (n + p.num_splits - 1) / p.num_splits;
    const int lo = min(n, split * per), hi = min(n, lo + per);
    return {first, n, lo, hi};
  }

  __device__ void run(int seq, int split) {
    const int tid = threadIdx.x;
    const int hq0 = kvh * GQA;
    const int num_hq = p.num_kv_heads * GQA;
    const Pages pg = pages(seq, split);
    const u32 first = pg.first;
    const int n = pg.n, lo = pg.lo, hi = pg.hi;

    // Start streaming pages first: the copies overlap the query and LUT set-up. The page-table
    // entries are all loaded before the first copy is issued, so the prologue waits on one
    // round trip rather than one per stage (batch 1 lost 8-12% to that with deep pipelines).
    // The entry of the page computed next (tier | tokens << 8), loaded an iteration ahead.
    u32 cur_info;
    {
      u32 info[NSTAGE - 1];
      u64 off[NSTAGE - 1];
#pragma unroll
      for (int s = 0; s < NSTAGE - 1; ++s) {
        info[s] = lo + s < hi ? p.page_info[first + lo + s] : 0u;
        off[s] = lo + s < hi ? p.page_offsets[first + lo + s] : 0u;
      }
#pragma unroll
      for (int s = 0; s < NSTAGE - 1; ++s) {
        if (lo + s < hi) stage_page(typename Cfg::Tiers{}, info[s], p.arena + off[s], s);
        cp_async_commit();
      }
      cur_info = info[0];
    }
    // The head's tail page (tier 0, the last of its pages) is read in place from global memory:
    // a DRAM round trip per octet for its keys and another for its values, so the split that
    // ends with it would finish last. Its bytes are prefetched into L2 now (a hint: no wait).
    if (hi == n && n > 0 && (p.page_info[first + n - 1] & 0xffu) == 0u) {
      const u8* tail = p.arena + p.page_offsets[first + n - 1];
      for (int off = tid * 128; off < TAIL_PAGE_BYTES; off += NT * 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(tail + off));
    }
    // Page-table entries are loaded one iteration before their copy is issued, so the copy
    // never waits on a dependent global load.
    const int pre = lo + NSTAGE - 1;
    u64 next_off = pre < hi ? p.page_offsets[first + pre] : 0;
    u32 next_info = pre < hi ? p.page_info[first + pre] : 0;

    // Queries, pre-scaled into the log2 domain.
    const float qscale = p.sm_scale * 1.4426950408889634f;
    const QT* q = reinterpret_cast<const QT*>(p.q) + (size_t(seq) * num_hq + hq0) * D;
    for (int i = tid; i < GQA * D; i += NT) q_s()[i] = to_float(q[i]) * qscale;
    if (tid < GQA) { m_s()[tid] = NEG_INF; l_s()[tid] = 0.f; }
    __syncthreads();
    // Stored rows are in the spec's rotated basis: so is the query (before any LUT is built).
    if constexpr (Rotates<Cfg>::value) hadamard_rows<D, NT, false>(q_s(), GQA, p.rot_seed);
    build_luts(typename Cfg::Tiers{});
    if constexpr (PW) build_qfrag();
#pragma unroll
    for (int i = 0; i < ACC_R; ++i)
#pragma unroll
      for (int j = 0; j < ACC_C; ++j) acc[i][j] = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) vcorr[j] = 0.f;
    __syncthreads();

    // Stage of page i and of page i + NSTAGE - 1, kept incrementally (a modulo by a stage
    // count that is not a power of two costs a multiply-high chain per page).
    int buf = 0, abuf = NSTAGE - 1;
    for (int i = lo; i < hi; ++i, buf = buf + 1 == NSTAGE ? 0 : buf + 1, abuf = abuf + 1 == NSTAGE ? 0 : abuf + 1) {
      const int ahead = i + NSTAGE - 1;
      // Page i has landed, and every warp is done with page i - 1: its stage (`abuf`, refilled
      // below), the scores and the softmax statistics. This is the only barrier between two
      // pages, so the copy of page i + NSTAGE - 1 is issued after it.
      cp_async_wait<NSTAGE - 2>();
      __syncthreads();
      const u32 info = cur_info;
      if (i + 1 < hi) cur_info = p.page_info[first + i + 1];
      if (ahead < hi) stage_page(typename Cfg::Tiers{}, next_info, p.arena + next_off, abuf);
      cp_async_commit();
      if (ahead + 1 < hi) {
        next_off = p.page_offsets[first + ahead + 1];
        next_info = p.page_info[first + ahead + 1];
      }
      const int tier = int(info & 0xff);
      int len = int((info >> 8) & 0xff);
      u32 err = 0;
      PageHeader hd{};
      // Tail pages are read in place from global memory, other pages from their stage.
      const u8* page = tier == 0 ? p.arena + p.page_offsets[first + i] : stage(buf);
      if (!serves(typename Cfg::Tiers{}, tier)) {
        err = ERR_UNKNOWN_TIER;
      } else {
        hd = load_header(page);
        // A live entry (a device-resident plan's tail page) reads as many tokens as its header
        // holds: the append kernel keeps the header current, so the plan does not change per
        // token. A bad header is caught below all the same (its length must fit a page).
        if (len == int(PAGE_LIVE_LENGTH)) len = int(hd.length);
        if (hd.magic != PAGE_MAGIC) err = ERR_BAD_MAGIC;
        // The plan may read a prefix of a page (attend_prefix: causal evaluation of a prompt
        // plans page lists cut at every query's position), never more than the page holds.
        else if (hd.tier != tier || int(hd.length) < len || len > P) err = ERR_BAD_LENGTH;
      }
      if (err == 0 && len > 0) {
        // Dead but in the tracked per-warp entry (compute_warp sets it there); without it
        // NVRTC 13.0 scheduled the plain entries of block-layout variants differently.
        pw_plse = NEG_INF;
        if constexpr (CERT && !PW) {
          pmask = (info >> 16) & 0xffu;
          if (pmask != 0) porig = p.arena + p.promoted_offsets[first + i] + HEADER_BYTES;
        }
        compute_page(typename Cfg::Tiers{}, int(hd.tier), page + HEADER_BYTES, buf, len, first + i);
        if constexpr (WARP_TRACKING) store_warp_mass(first + i, pw_plse);
      } else {
        // Skipped page: a bad page never contributes; the runtime turns the flag into an error.
        if (err != 0 && tid == 0) atomicOr(p.error_flags, err);
        // A skipped or empty page has no mass (its entries must not keep an older step's).
        if constexpr (WARP_TRACKING) store_warp_mass(first + i, NEG_INF);
      }
    }
    cp_async_wait<0>();
    __syncthreads();
    // Past its page loop: the combine may start launching (it waits for this grid's writes).
    // (Triggering at the kernel's start instead was no faster.)
    grid_launch_dependents();

    // Reduce the warps' accumulators in a fixed order, so that a decode is bit-reproducible
    // (float atomics are not).
    float* out_s = reinterpret_cast<float*>(smem + Cfg::SMEM_OUT_OFF);
    if constexpr (PW) {
      merge_warps();
      // Page masses fold here, with the accumulators reduced (nothing of the page loop is
      // live); the barrier after the loop made every warp's stores visible to the CTA. The
      // split's pages are looked up again rather than kept in a register through the loop.
      if constexpr (WARP_TRACKING) {
        const Pages r = pages(seq, split);
        fold_page_masses(r.first + r.lo, r.hi - r.lo);
      }
    } else if constexpr (MMA_V) {
      // The token-block warps of each channel part one after another.
      const int warp = tid / 32, lane = tid % 32, g = lane >> 2, qd = lane & 3;
      const int kbw = warp % VW, cbase = (warp / VW) * CW + g * CPTV;
      for (int w = 0; w < VW; ++w) {
        if (kbw == w) {
#pragma unroll
          for (int i = 0; i < MTV; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const int h = 2 * qd + (j & 1), c = cbase + 2 * i + (j >> 1);
              if (h < GQA) {
                float* o = &out_s[h * D + c];
                *o = w == 0 ? acc[i][j] : *o + acc[i][j];
              }
            }
        }
        __syncthreads();
      }
    } else {
      // The lanes of a warp that hold the same channels by a shuffle tree, then the warps one
      // after another.
      static_assert(NC8 <= 32 && 32 % NC8 == 0, "a warp holds whole 8-channel slices");
      const int c8 = tid % NC8, warp = tid / 32, lane = tid % 32;
#pragma unroll
      for (int h = 0; h < GQA; ++h)
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
          for (int off = NC8; off < 32; off <<= 1) acc[h][i] += __shfl_xor_sync(0xffffffffu, acc[h][i], off);
      for (int w = 0; w < NT / 32; ++w) {
        if (warp == w && lane < NC8) {
#pragma unroll
          for (int h = 0; h < GQA; ++h)
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              float* o = &out_s[h * D + c8 * 8 + i];
              *o = w == 0 ? acc[h][i] : *o + acc[h][i];
            }
        }
        __syncthreads();
      }
    }
    // The output back from the rotated basis (linear, so before the division by l and the
    // split-K combine alike).
    if constexpr (Rotates<Cfg>::value) {
      __syncthreads();
      hadamard_rows<D, NT, true>(out_s, GQA, p.rot_seed);
    }
    for (int i = tid; i < GQA * D; i += NT) {
      const int h = i / D, c = i % D;
      const float l = l_s()[h];
      const float o = l > 0.f ? out_s[i] / l : 0.f;
      const size_t row = size_t(seq) * num_hq + hq0 + h;
      if (p.num_splits == 1) {
        reinterpret_cast<QT*>(p.out)[row * D + c] = from_float<QT>(o);
      } else {
        p.partial_out[(size_t(split) * p.batch * num_hq + row) * D + c] = o;
      }
      if (c == 0 && p.partial_lse != nullptr) {
        const float m = m_s()[h];
        p.partial_lse[size_t(split) * p.batch * num_hq + row] = l > 0.f ? (m + log2f(l)) * 0.6931471805599453f : NEG_INF;
      }
    }
  }
};

template <class Cfg, bool TRACK, bool CERT = false>
__device__ void decode_kernel(const DecodeParams& p) {
  extern __shared__ __align__(16) u8 smem[];
  DecodeCta<Cfg, TRACK, CERT> cta{smem, p, int(blockIdx.y)};
  cta.run(int(blockIdx.z), int(blockIdx.x));
}

// Certified decode's entry: the tracked decode that also records per-block masses and Δ_b and
// serves promoted blocks from their originals. Block layout only: the generated module passes
// a configuration without tensor-core values (CertCfg), whatever its plain entries run.
template <class Cfg>
__device__ void certified_decode_kernel(const DecodeParams& p) {
  static_assert(!DecodeCta<Cfg, true, true>::PW && !Cfg::TC_VALUES, "certified decode runs the block layout with fp32 values");
  decode_kernel<Cfg, true, true>(p);
}

}  // namespace kvforge

// Integer codecs (crates/kvforge-spec/src/codecs/int/): code packing, per-channel key codes
// (ChannelCodes, also the integer segments of mixed keys), IntKey and IntValue.
#pragma once
#include "kvforge/codecs/base.cuh"

namespace kvforge {

// Unpacks element `c` of a row of BITS-bit codes.
template <int BITS>
__device__ __forceinline__ int code_at(const u8* row, int c) {
  if constexpr (BITS == 8) return row[c];
  else if constexpr (BITS == 4) return (row[c >> 1] >> ((c & 1) * 4)) & 0xf;
  else return (row[c >> 2] >> ((c & 3) * 2)) & 0x3;
}

// Key code order (ChannelCodes: integer keys and the integer segments of mixed keys). 4-bit
// keys keep the even channels of each 8-channel word in its low half and the odd ones in its
// high half: channel c of a word at nibble (c & 1)·4 + (c >> 1). Adjacent channels 2e, 2e + 1
// then lie at the same bit of the two halves, so one LOP3 (after one shift by 8 per word for
// nibbles 2 and 3 of a half) makes them an fp16 pair, where the plain order took a PRMT per
// pair. 8 and 2 bits keep the plain order (one PRMT already serves one or two pairs).
// `key_slot` maps a channel to its code slot, `key_channel` a slot to its channel.
template <int BITS>
__host__ __device__ constexpr int key_slot(int c) {
  return BITS == 4 ? (c & ~7) | ((c & 1) << 2) | ((c & 7) >> 1) : c;
}
template <int BITS>
__host__ __device__ constexpr int key_channel(int s) {
  return BITS == 4 ? (s & ~7) | ((s & 3) << 1) | ((s & 7) >> 2) : s;
}
static_assert(key_slot<4>(1) == 4 && key_slot<4>(6) == 3 && key_channel<4>(key_slot<4>(13)) == 13, "4-bit key code order");
// Code bias B of integer codes (kvforge-spec int::reference::value_bias / key_bias):
// groups with a bias store the *biased* zero z̃ = zero − B·scale (rounded to the scale dtype)
// and decode as x̂ = (code + B)·scale + z̃, exactly (in f64; one HFMA2 rounds it once). B + code
// is what one LOP3 (4 bits, B = 64: a code at mantissa bits 4-7 with the exponent of 64) or
// one PRMT (8 bits with fp16 scales, B = 1024: a code byte beside the exponent byte 0x64)
// makes of a code, so the tensor-core paths dequantise a pair with it and one HFMA2, without
// the HSUB2 that took the magic off. The encoders code on the effective zero z̃ + B·scale.
// 2 bits and 8 bits with fp32 scales: no bias; keys are biased at 4 bits only (key_bias).
template <int BITS, class S>
__host__ __device__ constexpr float value_bias() {
  return BITS == 4 ? 64.f : BITS == 8 && sizeof(S) == 2 ? 1024.f : 0.f;
}
// Keys: 4 bits only (biasing 8-bit keys as well pushed the tracked entry of a multi-tier rdkv
// decode variant, d 128 gqa 3, past its 128 registers: 8 bytes of spill).
template <int BITS, class S>
__host__ __device__ constexpr float key_bias() {
  return BITS == 4 ? 64.f : 0.f;
}

// Packs the codes of channels [byte*PER, byte*PER + PER) of one row into one byte.
template <int BITS, class F>
__device__ __forceinline__ u8 pack_byte(int byte, F code_of) {
  constexpr int PER = 8 / BITS;
  u32 b = 0;
#pragma unroll
  for (int i = 0; i < PER; ++i) b |= u32(code_of(byte * PER + i)) << (i * BITS);
  return u8(b);
}

// Asymmetric quantisation of one value with stored (rounded) scale and zero.
template <int BITS>
__device__ __forceinline__ int quantize(float x, float scale, float zero) {
  constexpr int QMAX = (1 << BITS) - 1;
  if (scale == 0.f) return 0;
  const float c = round_half_up((x - zero) / scale);
  return int(fminf(fmaxf(c, 0.f), float(QMAX)));
}

// N channels of integer codes with a scale and zero per channel per block of BLOCK tokens:
// codes [P][N·BITS/8], scale and zero [P/BLOCK][N]. The storage of IntKey (N = D) and of each
// integer segment of MixedKey.
template <int BITS, int BLOCK, class S, int N, int P, int OFF_CODES, int OFF_SCALE, int OFF_ZERO>
struct ChannelCodes {
  static constexpr int NBLK = P / BLOCK, ROW = N * BITS / 8;
  static constexpr float BIAS = key_bias<BITS, S>();
  __device__ __forceinline__ static float dequant(const u8* seg, int t, int c) {
    const int b = t / BLOCK;
    const float code = float(code_at<BITS>(seg + OFF_CODES + t * ROW, key_slot<BITS>(c)));
    return (BIAS != 0.f ? code + BIAS : code) * load_scale<S>(seg + OFF_SCALE, b * N + c) + load_scale<S>(seg + OFF_ZERO, b * N + c);
  }
  // Codes channels [n0, n0 + nc) of the N (whole bytes of codes: n0 and nc multiples of 8)
  // from columns [xc0, xc0 + nc) of x ([P][ldx] floats in shared memory), all P tokens;
  // scratch: 2·NBLK·nc floats. L lanes share each (block, channel) min/max (see lanes_for).
  template <int NTHREADS, int L>
  __device__ static void encode(u8* seg, const float* x, int ldx, int xc0, int n0, int nc, float* scratch) {
    static_assert(L <= BLOCK && 32 % L == 0, "every lane of an item reads at least one token");
    float* sc = scratch;
    float* zr = sc + NBLK * nc;
    for_lane_items<NTHREADS, L>(NBLK * nc, [&](int i, bool on, int lane) {
      const int b = on ? i / nc : 0, c = on ? i % nc : 0;
      const float* col = x + b * BLOCK * ldx + xc0 + c;
      float mn = col[lane * ldx], mx = mn;
      for (int t = lane + L; t < BLOCK; t += L) {
        const float v = col[t * ldx];
        mn = fminf(mn, v);
        mx = fmaxf(mx, v);
      }
      lanes_minmax<L>(mn, mx);
      if (on && lane == 0) {
        const S s_st = from_float<S>((mx - mn) / float((1 << BITS) - 1));
        const S z_st = from_float<S>(BIAS == 0.f ? mn : mn - BIAS * to_float(s_st));  // BIAS·s is exact
        reinterpret_cast<S*>(seg + OFF_SCALE)[b * N + n0 + c] = s_st;
        reinterpret_cast<S*>(seg + OFF_ZERO)[b * N + n0 + c] = z_st;
        sc[i] = to_float(s_st);
        zr[i] = BIAS == 0.f ? to_float(z_st) : to_float(z_st) + BIAS * sc[i];  // the effective zero the codes are rounded on
      }
    });
    __syncthreads();
    const int bytes = nc * BITS / 8;
    u8* codes = seg + OFF_CODES + n0 * BITS / 8;
    for (int i = threadIdx.x; i < P * bytes; i += NTHREADS) {
      const int t = i / bytes, byte = i % bytes, b = t / BLOCK;
      // Slot `k` of the slice's row holds channel key_channel(k) (n0 is a multiple of 8).
      codes[t * ROW + byte] = pack_byte<BITS>(byte, [&](int k) {
        const int c = key_channel<BITS>(k);
        return quantize<BITS>(x[t * ldx + xc0 + c], sc[b * nc + c], zr[b * nc + c]);
      });
    }
    __syncthreads();
  }
  // Channel-parallel scoring of the 8 channels [c, c + 8) of token t: the scale folds into the
  // query slice once per block (qs = q · scale), the zero term Σ q · zero starts the sum.
  template <int GQA>
  __device__ __forceinline__ static void fold(const u8* seg, int b, int c, const float (&q)[GQA][8], float (&qs)[GQA][8], float (&zq)[GQA]) {
    float sc[8], zr[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      sc[i] = load_scale<S>(seg + OFF_SCALE, b * N + c + i);
      zr[i] = load_scale<S>(seg + OFF_ZERO, b * N + c + i);
      if constexpr (BIAS != 0.f) zr[i] += BIAS * sc[i];
    }
#pragma unroll
    for (int h = 0; h < GQA; ++h) {
      float z = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float qv = q[h][i];  // q may alias qs
        z = fmaf(qv, zr[i], z);
        qs[h][i] = qv * sc[i];
      }
      zq[h] = z;
    }
  }
  template <int GQA>
  __device__ __forceinline__ static void score8(const u8* seg, int t, int c, const float (&qs)[GQA][8], const float (&zq)[GQA], float (&s)[GQA]) {
    const u8* row = seg + OFF_CODES + t * ROW + c * BITS / 8;  // 8 codes = BITS bytes
    u32 lo, hi = 0;
    if constexpr (BITS == 8) { const uint2 w = *reinterpret_cast<const uint2*>(row); lo = w.x; hi = w.y; }
    else if constexpr (BITS == 4) lo = *reinterpret_cast<const u32*>(row);
    else lo = *reinterpret_cast<const u16*>(row);
    float k[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if constexpr (BITS == 8) k[i] = u2f(((i < 4 ? lo : hi) >> (8 * (i & 3))) & 0xff);
      else k[i] = u2f((lo >> (BITS * key_slot<BITS>(i))) & ((1u << BITS) - 1));
    }
#pragma unroll
    for (int h = 0; h < GQA; ++h) {
      float a = zq[h];
#pragma unroll
      for (int i = 0; i < 8; ++i) a = fmaf(qs[h][i], k[i], a);
      s[h] = a;
    }
  }
};

// Integer keys with a scale and zero per channel per block of BLOCK tokens (KIVI / seed 004).
// Decode scores them on tensor cores (mma_scores): the per-channel scale folds into the query
// once per block (q_c · scale_{b,c}) and the zero term Σ_c q_c zero_{b,c} is added once per
// block and head.
template <int BITS, int BLOCK, class S, int D, int P, int OFF_CODES, int OFF_SCALE, int OFF_ZERO>
struct IntKey {
  // Side-table slots (kvforge-spec `Codec::side_tables`; -1: none).
  static constexpr int SLOT_CODEBOOK = -1, SLOT_RADIUS = -1, SLOT_ORDER = -1;
  static constexpr int LUT_FLOATS_PER_HEAD = 0;
  static constexpr int NBLK = P / BLOCK;
  static constexpr bool SPHERICAL = false;
  static constexpr int ROW = D * BITS / 8;
  static constexpr int PER = 32 / BITS;  // codes per 32-bit word
  static constexpr int NCH = ROW / 4;
  static constexpr int BLOCK_TOKENS = BLOCK;
  static constexpr KeyError ERROR = KeyError::Step;
  // Quantisation step σ of channel c in block b: a code is rounded to nearest, so a stored key
  // is within σ/2 of its original (the certified decode's per-block logit bound).
  __device__ __forceinline__ static float step(const u8* seg, int b, int c) { return load_scale<S>(seg + OFF_SCALE, b * D + c); }

  // Tensor-core scoring (mma m16n8k16: 16 tokens × 8 query heads × 16 channels). The codes are
  // the A operand, exact in fp16; the per-channel scale of the token block folds into the
  // query (B = q · scale, split into an fp16 high part and an fp16 low part, two mmas, so the
  // product keeps ~22 bits); the zero term Σ_c q_c zero_c (fp32) initialises the accumulator.
  // Warp w scores tokens [16·mt, 16·mt + 16) of channel part kp (mt = w % MT, kp = w / MT);
  // with KP = 2 parts the second part's partial scores go to `sc1` and the softmax adds them.
  // The channel order inside a thread's slice is free (A and B use the same one): pair e of a
  // thread's CPT codes holds the codes of channels pair_lo(e) and pair_hi(e), which is what
  // one shift and one LOP3 pull out of a 32-bit word (the same bit of its two halves): channels
  // 2e, 2e + 1 in the 4-bit key order (key_slot), else channels CC apart.
  static constexpr bool CHANNEL_PARALLEL = false, OUTLINE_SCORER = false;
  static constexpr bool MMA = true;
  // Block-layout variants with integer-key tiers accumulate values on tensor cores (decode.cuh
  // MMA_V).
  static constexpr bool MMA_VALUES = true;
  template <int NWARPS> struct Mma {
    static constexpr int MT = P / 16;
    static constexpr int KP = NWARPS >= 2 * MT ? 2 : 1;
    static constexpr int CH = D / KP, CPT = CH / 4, KS = CH / 16, NPAIR = CPT / 2;
    static constexpr int BYTES = CPT * BITS / 8;
    static constexpr int CC = BYTES == 2 ? 4 : 16 / BITS;  // codes per half of a pair word
    static constexpr int NWORD = BYTES >= 4 ? BYTES / 4 : 1;
    __device__ static constexpr int pair_lo(int e) { return BITS == 4 ? 2 * e : (e / CC) * 2 * CC + e % CC; }
    __device__ static constexpr int pair_hi(int e) { return BITS == 4 ? 2 * e + 1 : pair_lo(e) + CC; }
    static_assert(P % 16 == 0 && BLOCK % 16 == 0 && CH % 16 == 0, "mma tiles");
    static_assert(BITS != 4 || CPT % 8 == 0, "4-bit key slices are whole 8-channel words");
    // When a key block spans several m-tiles (BLOCK ≥ 32) the warps that score it would fold
    // the same B; all threads fold it once per page into shared memory instead (COOP).
    static constexpr bool COOP = BLOCK >= 32;
    static constexpr int NBLK = P / BLOCK > 0 ? P / BLOCK : 1;
    static constexpr int CPP = CH / 32 > 2 ? CH / 32 : 2;  // channels per thread in the fold
    static constexpr int LANES = CH / CPP;                 // fold lanes per channel part
  };
  // Shared memory of the cooperative fold: per block and head D/2 u32 of B high parts, as
  // many of low parts (fragment order), then per block, part and head the zero term.
  template <int GQA, int NWARPS> __host__ __device__ static constexpr int bfrag_bytes() {
    return Mma<NWARPS>::COOP ? 4 * GQA * Mma<NWARPS>::NBLK * (D + Mma<NWARPS>::KP) : 0;
  }
  // All threads: B = q · scale (high and low fp16 parts) and the zero terms of every block of
  // the page, into `bf` (see bfrag_bytes). One barrier after it.
  // Index math is unsigned with power-of-two divisors (shifts and masks): in signed ints the
  // compiler rounds every division toward zero, and that made this fold 29% of the page's
  // instructions (ncu, rdkv b4).
  template <int GQA, int NWARPS, int NT>
  __device__ static void fold_page(const u8* seg, const float* q_s, u8* bf) {
    using M = Mma<NWARPS>;
    constexpr unsigned CPP = M::CPP, DC = D / CPP, ITEMS = M::NBLK * GQA * DC;
    constexpr unsigned CPT = M::CPT, CC = M::CC;
    static_assert(ITEMS % 32 == 0 && M::LANES <= 32, "whole warps per fold pass");
    static_assert(M::CPT % M::CPP == 0, "a fold item stays inside one thread's channel slice");
    u16* hi16 = reinterpret_cast<u16*>(bf);
    u16* lo16 = hi16 + M::NBLK * GQA * D;
    float* zs = reinterpret_cast<float*>(bf + 4 * M::NBLK * GQA * D);
    const S* scale = reinterpret_cast<const S*>(seg + OFF_SCALE);
    const S* zero = reinterpret_cast<const S*>(seg + OFF_ZERO);
#pragma unroll 1
    for (unsigned i = threadIdx.x; i < ITEMS; i += NT) {
      const unsigned c = (i % DC) * CPP, hb = i / DC, h = hb % GQA, blk = hb / GQA;
      const unsigned kp = c / M::CH, cq = c % M::CH, qd = cq / CPT, o0 = cq % CPT;
      const unsigned base = 2 * ((((blk * GQA + h) * M::KP + kp) * (4 * M::NPAIR)) + qd * M::NPAIR);  // u16 index
      float z = 0.f;
#pragma unroll
      for (unsigned k = 0; k < CPP; k += 2) {
        const float2 qv = *reinterpret_cast<const float2*>(q_s + h * D + c + k);
        const float2 sv = make_float2(to_float(scale[blk * D + c + k]), to_float(scale[blk * D + c + k + 1]));
        constexpr float BIAS = key_bias<BITS, S>();  // the effective zero z̃ + bias·scale
        float2 zv = make_float2(to_float(zero[blk * D + c + k]), to_float(zero[blk * D + c + k + 1]));
        if constexpr (BIAS != 0.f) { zv.x += BIAS * sv.x; zv.y += BIAS * sv.y; }
        z = fmaf(qv.x, zv.x, z);
        z = fmaf(qv.y, zv.y, z);
        const float x[2] = {qv.x * sv.x, qv.y * sv.y};
#pragma unroll
        for (unsigned j = 0; j < 2; ++j) {
          const __half xh = __float2half_rn(x[j]);
          const __half xl = __float2half_rn(x[j] - __half2float(xh));
          // Position of channel o in the thread's pair order (pair_lo / pair_hi): pair e, half `half`.
          const unsigned o = o0 + k + j, r = o % (2 * CC);
          const unsigned e = BITS == 4 ? o / 2 : (o / (2 * CC)) * CC + r % CC, half = BITS == 4 ? o % 2 : r / CC;
          hi16[base + 2 * e + half] = __half_as_ushort(xh);
          lo16[base + 2 * e + half] = __half_as_ushort(xl);
        }
      }
      z = group_sum<M::LANES>(z);
      if (i % M::LANES == 0) zs[(blk * M::KP + kp) * GQA + h] = z;
    }
    __syncthreads();
  }

  template <int GQA, int NWARPS, int NT>
  __device__ static void mma_scores(const u8* seg, int len, const float* q_s, float* sc0, float* sc1, u8* bf) {
    using M = Mma<NWARPS>;
    constexpr int CPT = M::CPT, NPAIR = M::NPAIR;
    constexpr u32 MASK = ((1u << BITS) - 1) * 0x00010001u;
    static_assert(GQA <= 8, "one mma column per query head");
    if constexpr (M::COOP) fold_page<GQA, NWARPS, NT>(seg, q_s, bf);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, qd = lane & 3;
#pragma unroll 1
    for (int u = warp; u < M::MT * M::KP; u += NWARPS) {
      const int mt = u % M::MT, kp = u / M::MT;
      const int c0 = kp * M::CH + qd * CPT;  // the thread's channel slice [c0, c0 + CPT)
      const int blk = mt * 16 / BLOCK;
      u32 bhi[NPAIR], blo[NPAIR];
      float z0, z1;
      if constexpr (M::COOP) {
        const u32* hi32 = reinterpret_cast<const u32*>(bf);
        const u32* lo32 = hi32 + M::NBLK * GQA * D / 2;
        const float* zs = reinterpret_cast<const float*>(bf + 4 * M::NBLK * GQA * D) + (blk * M::KP + kp) * GQA;
        if (g < GQA) {
          const int base = ((blk * GQA + g) * M::KP + kp) * (4 * NPAIR) + qd * NPAIR;
#pragma unroll
          for (int e = 0; e < NPAIR; e += 4) {
            const uint4 h = *reinterpret_cast<const uint4*>(hi32 + base + e);
            const uint4 l = *reinterpret_cast<const uint4*>(lo32 + base + e);
            bhi[e] = h.x; bhi[e + 1] = h.y; bhi[e + 2] = h.z; bhi[e + 3] = h.w;
            blo[e] = l.x; blo[e + 1] = l.y; blo[e + 2] = l.z; blo[e + 3] = l.w;
          }
        } else {
#pragma unroll
          for (int e = 0; e < NPAIR; ++e) { bhi[e] = 0; blo[e] = 0; }
        }
        z0 = 2 * qd < GQA ? zs[2 * qd] : 0.f;
        z1 = 2 * qd + 1 < GQA ? zs[2 * qd + 1] : 0.f;
      } else {
      float z = 0.f;
      if (g < GQA) {
        float qv[CPT], sv[CPT], zv[CPT];
        const float* qh = q_s + g * D + c0;
#pragma unroll
        for (int i = 0; i < CPT; i += 4) {
          const float4 v = *reinterpret_cast<const float4*>(qh + i);
          qv[i] = v.x; qv[i + 1] = v.y; qv[i + 2] = v.z; qv[i + 3] = v.w;
        }
        load_floats<S, CPT>(seg + OFF_SCALE + (blk * D + c0) * int(sizeof(S)), sv);
        load_floats<S, CPT>(seg + OFF_ZERO + (blk * D + c0) * int(sizeof(S)), zv);
#pragma unroll
        for (int i = 0; i < CPT; ++i) z = fmaf(qv[i], key_bias<BITS, S>() != 0.f ? zv[i] + key_bias<BITS, S>() * sv[i] : zv[i], z);
#pragma unroll
        for (int e = 0; e < NPAIR; ++e) {
          const int ca = M::pair_lo(e), cb = M::pair_hi(e);
          split_h2(qv[ca] * sv[ca], qv[cb] * sv[cb], bhi[e], blo[e]);
        }
      } else {
#pragma unroll
        for (int e = 0; e < NPAIR; ++e) { bhi[e] = 0; blo[e] = 0; }
      }
      z += __shfl_xor_sync(0xffffffffu, z, 1);
      z += __shfl_xor_sync(0xffffffffu, z, 2);
      z0 = __shfl_sync(0xffffffffu, z, 8 * qd);
      z1 = __shfl_sync(0xffffffffu, z, 8 * qd + 4);
      }
      float c[4] = {z0, z1, z0, z1};
      const int t0 = mt * 16 + g;
      u32 a0[NPAIR], a1[NPAIR];
      row_pairs(seg + OFF_CODES + t0 * ROW + c0 * BITS / 8, a0, MASK);
      row_pairs(seg + OFF_CODES + (t0 + 8) * ROW + c0 * BITS / 8, a1, MASK);
#pragma unroll
      for (int j = 0; j < M::KS; ++j) {
        const u32 a[4] = {a0[2 * j], a1[2 * j], a0[2 * j + 1], a1[2 * j + 1]};
        const u32 bh[2] = {bhi[2 * j], bhi[2 * j + 1]}, bl[2] = {blo[2 * j], blo[2 * j + 1]};
        mma16816<false>(c, a, bh);
        mma16816<false>(c, a, bl);
      }
      store_mma_scores<GQA, P>(c, t0, len, qd, kp == 0 ? sc0 : sc1, kp == 0);
    }
  }
  // Per-warp decode (DecodeCta::compute_warp): the B fragments of token t's keys dequantised
  // to fp16 (code · scale + zero, one rounding: far below the code step), the thread's channel
  // slice [qd·D/4, (qd + 1)·D/4) with pair e = channels 2e, 2e + 1 (the fp16 keys' order, so
  // every tier of a variant shares one set of query fragments). 4 bits: a pair's codes lie at
  // the same bit of a word's two halves (key_slot), one LOP3 puts them into the halves'
  // mantissas (adjacent_pairs; nibbles 2 and 3 of the halves after one shift by 8 per word);
  // 8 and 2 bits: they lie in one code byte (two for 8 bits), one PRMT puts them there. The
  // pair's (scale, zero) are the u32s as they lie in memory. With the biased zero
  // (key_bias, 4 bits) a pair is then that one LOP3 and one HFMA2. The plain 4-bit order (a
  // pair in one byte) and the unbiased zero took a PRMT, a LOP3, an HSUB2 and an HFMA2 per
  // pair: int4 keys 64 → 44 instructions per octet and lane. The order with codes 4
  // (16 / bits) channels apart took a shift per pair and a PRMT per scale pair and per zero
  // pair: 92 → 64 instructions per octet and lane for int4 keys. Dequantising the 8 tokens a
  // warp scores costs fewer instructions than folding the block's scales into its query (the
  // fold is per block, and every warp would repeat it).
  // The layout takes keys whose scale block spans the page: the thread's scale and zero pairs
  // are then loaded once per page (they were 8 of the octet's 10 key LDS.128, each 4
  // shared-memory wavefronts, and shared memory is as busy as the issue slots here). With
  // smaller blocks they are reloaded per octet, and fp32 scales are rounded to fp16 pairs,
  // which was both slower than the block layout and outside the selftest tolerance
  // (docs/perf/NOTES.md, v11).
  static constexpr bool WARP = BLOCK >= P && D * BITS >= 128;
  // Lanes past the heads read a real head's query fragments (DecodeCta::compute_warp). With
  // one octet per softmax round this let ptxas recompute address math in the loop
  // (docs/perf/NOTES.md, v12); with two octets per round the zero select is the dearer one (a
  // predicated load, two register clears and the select per k-step; v13).
  static constexpr bool WARP_SHARED_Q = true;
  // A warp's key reader for one page (constructed per page, called per octet).
  template <int NPAIR> struct WarpKeys {
    u32 s[NPAIR], z[NPAIR];
    __device__ __forceinline__ WarpKeys(const u8* seg, int qd) {
      const int c0 = qd * 2 * NPAIR;
      scale_pairs<NPAIR>(seg + OFF_SCALE + c0 * int(sizeof(S)), s);
      scale_pairs<NPAIR>(seg + OFF_ZERO + c0 * int(sizeof(S)), z);
    }
    __device__ __forceinline__ void operator()(const u8* seg, int t, int qd, u32 (&b)[NPAIR]) {
      static_assert(WARP && 2 * NPAIR * BITS / 8 >= 4, "whole code words per slice");
      // Biased codes (key_bias: 4 bits): the pairs are 64 + code, and z the biased zero.
      adjacent_pairs<NPAIR>(seg + OFF_CODES + t * ROW + qd * 2 * NPAIR * BITS / 8, b);
#pragma unroll
      for (int e = 0; e < NPAIR; ++e) b[e] = h2_fma(b[e], s[e], z[e]);
    }
  };
  // The codes of channels 2e, 2e + 1 of a row slice as exact fp16 pairs. 8 bits: the two code
  // bytes beside the exponent byte 0x64 (1024 + c, less the magic). 4 bits (key_slot order): pair e of a word
  // at nibble e of both halves, moved to mantissa bits 4-7 (a shift by 4 left, none, 4 right
  // or 8 right) and left biased, 64 + c (key_bias: the biased zero takes the 64 off).
  // 2 bits: one byte holds two pairs; its four codes sit at bits 8-9 (4 + c) and 2-3 (256 + c)
  // for pair 2j, at 4-5 (64 + c) and 6-7 (16 + c) for pair 2j + 1. HSUB2 of the magic leaves
  // the codes.
  template <int N>
  __device__ __forceinline__ static void adjacent_pairs(const u8* p, u32 (&out)[N]) {
    constexpr int BYTES = N * 2 * BITS / 8;
    u32 w[BYTES / 4];
    load_words<BYTES>(p, w);
#pragma unroll
    for (int e = 0; e < N; ++e) {
      if constexpr (BITS == 8) {
        const u32 x = __byte_perm(w[e / 2], 0x64646464u, (e & 1) ? 0x4342 : 0x4140);  // 1024 + c
        out[e] = key_bias<BITS, S>() != 0.f ? x : h2_unbias(x, 0x64006400u);
      } else if constexpr (BITS == 4) {
        const u32 v = w[e / 4];
        const u32 x = e % 4 == 0 ? v << 4 : e % 4 == 1 ? v : e % 4 == 2 ? v >> 4 : v >> 8;
        out[e] = h2_biased(x, 0x00f000f0u, 0x54005400u);
      } else {
        const u32 x = __byte_perm(w[e / 8], 0u, ((e / 2) % 4) * 0x1111);
        out[e] = (e & 1) ? h2_codes(x, 0x00c00030u, 0x4c005400u) : h2_codes(x, 0x000c0300u, 0x5c004400u);
      }
    }
  }
  // NPAIR (scale or zero) pairs of adjacent channels.
  template <int NPAIR>
  __device__ __forceinline__ static void scale_pairs(const u8* p, u32 (&out)[NPAIR]) {
    if constexpr (sizeof(S) == 2) {
      load_words<4 * NPAIR>(p, out);
    } else {
      float f[2 * NPAIR];
      load_floats<S, 2 * NPAIR>(p, f);
#pragma unroll
      for (int e = 0; e < NPAIR; ++e) out[e] = pack2<false>(f[2 * e], f[2 * e + 1]);
    }
  }

  // The codes of one thread's row slice as exact fp16 pairs in pair_lo order.
  template <int N>
  __device__ __forceinline__ static void row_pairs(const u8* p, u32 (&out)[N], u32 mask) {
    constexpr int BYTES = N * 2 * BITS / 8;
    constexpr int CC = BYTES == 2 ? 4 : 16 / BITS;
    u32 w[BYTES >= 4 ? BYTES / 4 : 1];
    load_words<BYTES>(p, w);
    if constexpr (BYTES == 2) w[0] = __byte_perm(w[0], 0u, 0x4140);  // codes 0-3 | codes 4-7 << 16
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = h2_codes(w[e / CC] >> ((e % CC) * BITS), mask);
  }

  __device__ __forceinline__ static float dequant(const u8* seg, int t, int c, const float*, const float*, const u16*) {
    return ChannelCodes<BITS, BLOCK, S, D, P, OFF_CODES, OFF_SCALE, OFF_ZERO>::dequant(seg, t, c);
  }

  // Transcode slices are whole channels (a scale and zero per channel per block of tokens):
  // x [P][COLS] holds channels [c0, c0 + COLS); scratch: 2 * NBLK * COLS floats.
  static constexpr bool SLICE_CHANNELS = true;
  template <int NTHREADS, class Slice>
  __device__ static void encode(u8* seg, const float* x, int* scratch, Slice s, const float*, const float*, const u16*) {
    static_assert(Slice::ROWS == P && Slice::COLS % 8 == 0, "integer key slices are whole 8-channel chunks of every token");
    constexpr int L = lanes_for(NTHREADS, NBLK * Slice::COLS, BLOCK);
    ChannelCodes<BITS, BLOCK, S, D, P, OFF_CODES, OFF_SCALE, OFF_ZERO>::template encode<NTHREADS, L>(seg, x, Slice::COLS, 0, s.c0, Slice::COLS,
                                                                                                     reinterpret_cast<float*>(scratch));
  }
};

// Integer values with a scale and zero per token per group of GROUP channels.
template <int BITS, int GROUP, class S, int D, int P, int OFF_CODES, int OFF_SCALE, int OFF_ZERO>
struct IntValue {
  static constexpr int ROW = D * BITS / 8;
  static constexpr int NGRP = D / GROUP;
  static constexpr bool BF16 = false;
  static constexpr float BIAS = value_bias<BITS, S>();

  // Transposed fp16 pairs for tensor-core value accumulation (see DenseValue::token_pairs):
  // out[k] = (v̂[ta][c0 + k], v̂[tb][c0 + k]), the N channels inside one value group. The codes
  // of the two tokens are interleaved by one PRMT per 16-bit chunk, each pair is pulled out by
  // one LOP3 as (M + c, M + c'), and one HSUB2 + one HFMA2 with the two tokens' (scale,
  // zero) pairs give code · scale + zero rounded once to fp16. 4 bits store the zero biased
  // (value_bias), so that the LOP3's 64 + c goes straight into the HFMA2 (no HSUB2), exact;
  // folding the bias into the zero in the kernel (zero − bias · scale rounded to fp16) had
  // rounded that term, and rdkv int2 then missed the 2^-10 reference tolerance. The per-warp layout needs the
  // channels of a lane (head_dim / 8) inside one group.
  static constexpr bool WARP = GROUP % (D / 8) == 0;
  template <int N>
  __device__ __forceinline__ static void token_pairs(const u8* seg, int ta, int tb, int c0, u32 (&out)[N]) {
    constexpr int TB = N * BITS / 8;                       // code bytes per token
    constexpr int CCV = 16 / BITS < N ? 16 / BITS : N;     // codes per 16-bit chunk
    constexpr u32 MASK = ((1u << BITS) - 1) * 0x00010001u;
    static_assert(GROUP % N == 0, "a thread's channels share one value group");
    const int grp = c0 / GROUP;
    u32 wa[TB >= 4 ? TB / 4 : 1], wb[TB >= 4 ? TB / 4 : 1];
    load_words<TB>(seg + OFF_CODES + ta * ROW + c0 * BITS / 8, wa);
    load_words<TB>(seg + OFF_CODES + tb * ROW + c0 * BITS / 8, wb);
    u32 s2, z2;
    if constexpr (sizeof(S) == 2) {
      const u16* sp = reinterpret_cast<const u16*>(seg + OFF_SCALE);
      const u16* zp = reinterpret_cast<const u16*>(seg + OFF_ZERO);
      s2 = __byte_perm(sp[ta * NGRP + grp], sp[tb * NGRP + grp], 0x5410);
      z2 = __byte_perm(zp[ta * NGRP + grp], zp[tb * NGRP + grp], 0x5410);
    } else {
      const S* sp = reinterpret_cast<const S*>(seg + OFF_SCALE);
      const S* zp = reinterpret_cast<const S*>(seg + OFF_ZERO);
      s2 = pack2<false>(to_float(sp[ta * NGRP + grp]), to_float(sp[tb * NGRP + grp]));
      z2 = pack2<false>(to_float(zp[ta * NGRP + grp]), to_float(zp[tb * NGRP + grp]));
    }
#pragma unroll
    for (int ci = 0; ci < N / CCV; ++ci) {
      const u32 x = __byte_perm(wa[ci / 2], wb[ci / 2], (ci & 1) ? 0x7632 : 0x5410);
      if constexpr (BITS == 4) {
        // Biased codes (value_bias): each code moved to mantissa bits 4-7 (a shift by 4 left,
        // none, 4 right, 8 right), 64 + code after one LOP3, and the biased zero takes the 64
        // off in the HFMA2.
#pragma unroll
        for (int k = 0; k < CCV; ++k) {
          const u32 xk = k == 0 ? x << 4 : k == 1 ? x : k == 2 ? x >> 4 : x >> 8;
          out[ci * CCV + k] = h2_fma(h2_biased(xk, 0x00f000f0u, 0x54005400u), s2, z2);
        }
      } else {
        // Code k sits at bit k·BITS of each half: the codes of the low byte are read in place,
        // those of the high byte after one shift by 8, each with the magic 2^(10 - p) whose
        // mantissa unit is bit p (p = (k·BITS) mod 8): one shift per chunk rather than per code.
        const u32 xh = x >> 8;
#pragma unroll
        for (int k = 0; k < CCV; ++k) {
          constexpr int PER_BYTE = 8 / BITS > 0 ? 8 / BITS : 1;
          const int pos = (k % PER_BYTE) * BITS;
          const u32 magic = u32(25 - pos) << 10 | u32(25 - pos) << 26;
          // 8 bits with fp16 scales: biased (value_bias), 1024 + c goes into the HFMA2 as it is.
          const u32 xk = k < PER_BYTE ? x : xh;
          out[ci * CCV + k] = h2_fma(BIAS != 0.f ? h2_biased(xk, MASK << pos, magic) : h2_codes(xk, MASK << pos, magic), s2, z2);
        }
      }
    }
  }
  // lo[k] = (v̂[t][c0+k], v̂[t+1][c0+k]), hi[k] = (v̂[t+2][c0+k], v̂[t+3][c0+k]).
  template <int N>
  __device__ __forceinline__ static void pairs(const u8* seg, int t, int c0, u32 (&lo)[N], u32 (&hi)[N]) {
    token_pairs<N>(seg, t, t + 1, c0, lo);
    token_pairs<N>(seg, t + 2, t + 3, c0, hi);
  }

  __device__ __forceinline__ static void load8(const u8* seg, int t, int c8, float (&v)[8]) {
    const int grp = (c8 * 8) / GROUP;
    const float sc = load_scale<S>(seg + OFF_SCALE, t * NGRP + grp);
    const float zr = load_scale<S>(seg + OFF_ZERO, t * NGRP + grp);
    const u8* row = seg + OFF_CODES + t * ROW;
    if constexpr (BITS == 8) {
      const uint2 w = reinterpret_cast<const uint2*>(row)[c8];
#pragma unroll
      for (int i = 0; i < 4; ++i) { v[i] = fmaf(u2f((w.x >> (8 * i)) & 0xff) + BIAS, sc, zr); v[4 + i] = fmaf(u2f((w.y >> (8 * i)) & 0xff) + BIAS, sc, zr); }
    } else if constexpr (BITS == 4) {
      const u32 w = reinterpret_cast<const u32*>(row)[c8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = fmaf(u2f((w >> (4 * i)) & 0xf) + BIAS, sc, zr);
    } else {
      const u32 w = reinterpret_cast<const u16*>(row)[c8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = fmaf(u2f((w >> (2 * i)) & 0x3), sc, zr);
    }
  }

  __device__ __forceinline__ static float dequant(const u8* seg, int t, int c) {
    const int grp = c / GROUP;
    const float code = float(code_at<BITS>(seg + OFF_CODES + t * ROW, c));
    return (BIAS != 0.f ? code + BIAS : code) * load_scale<S>(seg + OFF_SCALE, t * NGRP + grp) + load_scale<S>(seg + OFF_ZERO, t * NGRP + grp);
  }

  // Codes tokens [t0, t0 + ROWS) of a transcode slice from x [ROWS][D]. L lanes share each
  // (token, group): its min/max, then its code bytes (see lanes_for).
  template <int NTHREADS, class Slice>
  __device__ static void encode(u8* seg, const float* x, Slice s) {
    static_assert(Slice::COLS == D, "value slices are whole tokens");
    constexpr int GBYTES = GROUP * BITS / 8, ITEMS = Slice::ROWS * NGRP;
    constexpr int L = lanes_for(NTHREADS, ITEMS, GROUP);
    for_lane_items<NTHREADS, L>(ITEMS, [&](int i, bool on, int lane) {
      const int tt = on ? i / NGRP : 0, grp = on ? i % NGRP : 0;
      const float* xs = x + tt * D + grp * GROUP;
      float mn = xs[lane], mx = mn;
      for (int c = lane + L; c < GROUP; c += L) { mn = fminf(mn, xs[c]); mx = fmaxf(mx, xs[c]); }
      lanes_minmax<L>(mn, mx);
      if (!on) return;
      const S s_st = from_float<S>((mx - mn) / float((1 << BITS) - 1));
      const S z_st = from_float<S>(BIAS == 0.f ? mn : mn - BIAS * to_float(s_st));  // biased zero (value_bias)
      const int t = s.t0 + tt;
      if (lane == 0) {
        reinterpret_cast<S*>(seg + OFF_SCALE)[t * NGRP + grp] = s_st;
        reinterpret_cast<S*>(seg + OFF_ZERO)[t * NGRP + grp] = z_st;
      }
      const float sc = to_float(s_st), zr = BIAS == 0.f ? to_float(z_st) : to_float(z_st) + BIAS * sc;  // the effective zero
      u8* out = seg + OFF_CODES + t * ROW + grp * GBYTES;
      for (int byte = lane; byte < GBYTES; byte += L)
        out[byte] = pack_byte<BITS>(byte, [&](int c) { return quantize<BITS>(xs[c], sc, zr); });
    });
  }
};

}  // namespace kvforge

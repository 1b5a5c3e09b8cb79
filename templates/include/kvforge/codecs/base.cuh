// What every codec header shares: the transcode page slice, lane helpers, scale storage,
// the certified-decode error kinds, tensor-core score stores and TierDef (a tier's id,
// segment bytes and codecs). Each scheme's codec structs live in codecs/<scheme>.cuh; its
// Rust side (layout, C++ type string, side tables, f64 reference) in
// crates/kvforge-spec/src/codecs/<scheme>/.
#pragma once
#include "kvforge/common.cuh"

namespace kvforge {

// Small unsigned integer (< 2^23) to float without the quarter-rate I2F unit: or it into the
// mantissa of 2^23 and subtract 2^23 (exact).
__device__ __forceinline__ float u2f(u32 x) { return __int_as_float(0x4B000000u | x) - 8388608.0f; }

// The part of a page one transcode CTA codes: rows [t0, t0 + ROWS) × columns [c0, c0 + COLS)
// of the page's [P][D] keys or values, held in shared memory as x[ROWS][COLS]. A page's work is
// split over several CTAs (transcode.cuh), so each codec codes a slice along an axis its
// numbers are independent on: whole tokens for per-token codes (values, dense and spherical
// keys), whole channels for per-channel ones (integer and mixed keys, `SLICE_CHANNELS`; mixed
// keys' columns are stored positions).
template <int ROWS_, int COLS_>
struct PageSlice {
  static constexpr int ROWS = ROWS_, COLS = COLS_;
  int t0, c0;
};

// Lanes that share each of `items` independent reductions (a min/max over a block's tokens, an
// argmax over a codebook) so that a CTA of `nt` threads is busy: a slice has too few items to
// give every thread one, and each item is a serial chain otherwise. The largest power of two
// ≤ min(32, cap, nt / items), at least 1; lanes of one item are consecutive threads of a warp.
__host__ __device__ constexpr int lanes_for(int nt, int items, int cap) {
  int l = 1;
  while (2 * l <= 32 && 2 * l <= cap && 2 * l * items <= nt) l *= 2;
  return l;
}

// Min and max over the L lanes of an item (xor shuffles inside an aligned group of L lanes;
// every lane of the warp must call it). fminf/fmaxf ignore NaN, so the result does not depend
// on which lane saw which value: the serial scan's.
template <int L>
__device__ __forceinline__ void lanes_minmax(float& mn, float& mx) {
#pragma unroll
  for (int o = L / 2; o > 0; o /= 2) {
    mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, o));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  }
}

// Runs body(i, on, lane) for items 0..items-1 with L consecutive lanes per item (lanes_for).
// The trip count is the same for every thread of the CTA, so every lane reaches the body's
// shuffles; lanes past the last item get on == false with an item index they must not
// write through.
template <int NTHREADS, int L, class Body>
__device__ __forceinline__ void for_lane_items(int items, Body body) {
  const int lane = threadIdx.x % L;
  for (int base = 0; base < items; base += NTHREADS / L) {
    const int i = base + int(threadIdx.x) / L;
    body(i, i < items, lane);
  }
}

// Storage type of quantisation scales.
template <class S> __device__ __forceinline__ float load_scale(const u8* p, int i) { return to_float(reinterpret_cast<const S*>(p)[i]); }
template <class S> __device__ __forceinline__ float round_scale(float x) { return to_float(from_float<S>(x)); }

// What a key scheme can state about its logit error, for certified decode: exact keys, a
// per-channel quantisation step per block (|q·(k − k̂)| ≤ ½ Σ_c |q_c| σ_c), or no bound.
enum class KeyError { Exact, Step, Unbounded };


// Tensor-core scores of one m16n8k16 tile (tokens t0 and t0 + 8 of the page × query heads
// 2qd and 2qd + 1) into the [GQA][P] score array of channel part `first_part` (0) or the
// second part: tokens past `len` score -inf in part 0 and add nothing in part 1.
template <int GQA, int P>
__device__ __forceinline__ void store_mma_scores(const float (&c)[4], int t0, int len, int qd, float* dst, bool first_part) {
  const float pad = first_part ? NEG_INF : 0.f;
  const int h0 = 2 * qd;
  if (h0 < GQA) {
    dst[h0 * P + t0] = t0 < len ? c[0] : pad;
    dst[h0 * P + t0 + 8] = t0 + 8 < len ? c[2] : pad;
  }
  if (h0 + 1 < GQA) {
    dst[(h0 + 1) * P + t0] = t0 < len ? c[1] : pad;
    dst[(h0 + 1) * P + t0 + 8] = t0 + 8 < len ? c[3] : pad;
  }
}

// Side table SLOT of one tier (`DecodeParams::side[tier]`, slots as kvforge-spec's
// `Codec::side_tables` declares them: the key codec's, then the value codec's), at the slice
// of kv head `kvh` of `len` elements per head: null when the codec has no such table
// (SLOT < 0) or the runtime has not set it.
template <class E, int SLOT>
__device__ __forceinline__ const E* side_table(const void* const (&tier)[SIDE_SLOTS], int kvh, size_t len) {
  if constexpr (SLOT < 0) {
    return nullptr;
  } else {
    const E* t = static_cast<const E*>(tier[SLOT]);
    return t ? t + size_t(kvh) * len : nullptr;
  }
}

// A tier: its id (the page header's tier byte), segment bytes and codecs.
template <int ID, int SEG_BYTES_, class K, class V>
struct TierDef {
  static constexpr int id = ID;
  static constexpr int SEG_BYTES = SEG_BYTES_;
  using Key = K;
  using Value = V;
};

}  // namespace kvforge

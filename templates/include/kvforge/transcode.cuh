// Transcode full pages from tier SRC to tier DST (encode when SRC is the tail tier). A page is
// always re-coded whole (seed 004 P1: metadata never goes stale), but its work is split over
// Cfg::SPLIT CTAs: a launch moves a few pages (the RDR controller's ~4 per launch), and one CTA
// per page left the GPU idle and each page one long latency chain.
// Split s dequantises only the slice it codes into fp32 shared memory, then the destination
// codec quantises and packs it: key slice s (whole channels or whole tokens, as the
// destination key codec's numbers allow; see PageSlice) and value slice s (whole tokens).
#pragma once
#include "codecs.cuh"
#include "kvforge/params.cuh"

namespace kvforge {

// How a page's work splits over SPLIT CTAs: CTA s codes key slice s, then value slice s. Key
// slices are D / SPLIT channels of every token where the destination's key numbers are per
// channel (integer and mixed keys: stored positions), else P / SPLIT tokens; value slices are
// P / SPLIT tokens. SPLIT and the slice axis (Cfg::KEY_CHANNELS) are the generator's
// (kvforge-gen schedule.rs `transcode_split`, `slices_channels`).
template <class Cfg>
struct TranscodeSplit {
  static constexpr int D = Cfg::D, P = Cfg::P, SPLIT = Cfg::SPLIT;
  static constexpr bool KEY_CHANNELS = Cfg::KEY_CHANNELS;
  static_assert(SPLIT >= 1 && P % SPLIT == 0, "value slices of whole tokens");
  static_assert(!KEY_CHANNELS || D % (8 * SPLIT) == 0, "key slices of whole 8-channel chunks");
  using KeySlice = PageSlice<KEY_CHANNELS ? P : P / SPLIT, KEY_CHANNELS ? D / SPLIT : D>;
  using ValueSlice = PageSlice<P / SPLIT, D>;
  // Floats of the larger slice (both are P·D / SPLIT).
  static constexpr int FLOATS = KeySlice::ROWS * KeySlice::COLS > ValueSlice::ROWS * ValueSlice::COLS ? KeySlice::ROWS * KeySlice::COLS
                                                                                                     : ValueSlice::ROWS * ValueSlice::COLS;
  static_assert(Cfg::SMEM_X_OFF + FLOATS * 4 <= Cfg::SMEM_SCRATCH_OFF && Cfg::SMEM_SCRATCH_OFF <= Cfg::SMEM_TOTAL,
                "the slice fits in shared memory before the scratch");
  __device__ static KeySlice key(int s) { return KEY_CHANNELS ? KeySlice{0, s * KeySlice::COLS} : KeySlice{s * KeySlice::ROWS, 0}; }
  __device__ static ValueSlice value(int s) { return ValueSlice{s * ValueSlice::ROWS, 0}; }
};

// Shared memory (kvforge-gen schedule.rs `transcode_smem`): the slice in fp32 at
// Cfg::SMEM_X_OFF, then the destination key codec's scratch for one key slice at
// Cfg::SMEM_SCRATCH_OFF (int and mixed keys 2 * NBLK * (D / SPLIT) floats, spherical
// (P / SPLIT) * NG ints).

// Whether a source page is what the launch says it is (a kvforge header, tier SRC, a full
// page). Every CTA of the page checks on its own before it writes anything, so no part of a
// destination is written from a bad source.
template <class Cfg>
__device__ __forceinline__ bool source_ok(const u8* src) {
  const PageHeader hd = load_header(src);
  return hd.magic == PAGE_MAGIC && hd.tier == Cfg::Src::id && hd.length == u32(Cfg::P);
}

template <class Cfg>
__device__ void transcode_kernel(const TranscodeParams& p) {
  extern __shared__ __align__(16) u8 smem[];
  using Src = typename Cfg::Src;
  using Dst = typename Cfg::Dst;
  using Split = TranscodeSplit<Cfg>;
  using KeySlice = typename Split::KeySlice;
  using ValueSlice = typename Split::ValueSlice;
  constexpr int D = Cfg::D, NT = Cfg::NTHREADS;
  const int page = blockIdx.x / Cfg::SPLIT, split = blockIdx.x % Cfg::SPLIT;
  if (page >= p.num_pages) return;
  const u8* src = p.arena + p.src_offsets[page];
  u8* dst = p.arena + p.dst_offsets[page];
  if (!source_ok<Cfg>(src)) {
    if (threadIdx.x == 0) atomicOr(p.error_flags, ERR_SOURCE_TIER);
    return;
  }
  const int kvh = int(p.kv_heads[page]);
  float* x = reinterpret_cast<float*>(smem + Cfg::SMEM_X_OFF);
  int* scratch = reinterpret_cast<int*>(smem + Cfg::SMEM_SCRATCH_OFF);
  const u8* sseg = src + HEADER_BYTES;
  u8* dseg = dst + HEADER_BYTES;
  constexpr int SNG = Cfg::SRC_NG, SE = Cfg::SRC_E, DNG = Cfg::DST_NG, DE = Cfg::DST_E;
  const float* scb = side_table<float, Src::Key::SLOT_CODEBOOK>(p.side[Src::id], kvh, size_t(SNG) * SE * (D / SNG));
  const float* srs = side_table<float, Src::Key::SLOT_RADIUS>(p.side[Src::id], kvh, SNG);
  const float* dcb = side_table<float, Dst::Key::SLOT_CODEBOOK>(p.side[Dst::id], kvh, size_t(DNG) * DE * (D / DNG));
  const float* drs = side_table<float, Dst::Key::SLOT_RADIUS>(p.side[Dst::id], kvh, DNG);
  const u16* sord = side_table<u16, Src::Key::SLOT_ORDER>(p.side[Src::id], kvh, 2 * D);
  // Keys: column c of the slice is natural channel c, or for mixed destination keys stored
  // position c, natural channel dord[c] (channel orders exist only for mixed tiers; null =
  // identity). Mixed source keys gather through their own inverse order in dequant.
  const u16* dord = side_table<u16, Dst::Key::SLOT_ORDER>(p.side[Dst::id], kvh, 2 * D);
  const KeySlice ks = Split::key(split);
  for (int i = threadIdx.x; i < KeySlice::ROWS * KeySlice::COLS; i += NT) {
    const int t = ks.t0 + i / KeySlice::COLS, c = ks.c0 + i % KeySlice::COLS;
    x[i] = Src::Key::dequant(sseg, t, dord ? int(dord[c]) : c, scb, srs, sord);
  }
  __syncthreads();
  Dst::Key::template encode<NT>(dseg, x, scratch, ks, dcb, drs, dord);
  __syncthreads();
  // Values.
  const ValueSlice vs = Split::value(split);
  for (int i = threadIdx.x; i < ValueSlice::ROWS * D; i += NT) x[i] = Src::Value::dequant(sseg, vs.t0 + i / D, i % D);
  __syncthreads();
  Dst::Value::template encode<NT>(dseg, x, vs);
  if (split == 0 && threadIdx.x == 0) store_header(dst, u8(Dst::id), u32(Cfg::P));
}

}  // namespace kvforge

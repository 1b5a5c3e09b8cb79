// Transcode one full page from tier SRC to tier DST (encode when SRC is the tail tier): the
// source is dequantised into fp32 shared memory, then the destination codec quantises and
// packs it. A page is always re-coded whole (seed 004 P1: metadata never goes stale).
#pragma once
#include "codecs.cuh"
#include "kvforge/params.cuh"

namespace kvforge {

template <class Cfg>
struct TranscodeSmem {
  static constexpr int X = 0;
  static constexpr int SCRATCH = X + align16(Cfg::P * Cfg::D * 4);
  // Destination key codec's scratch: int and mixed keys 2 * NBLK * D floats, spherical P * NG ints.
  static constexpr int TOTAL = SCRATCH + align16(Cfg::SCRATCH_BYTES);
};

template <class Cfg>
__device__ void transcode_kernel(const TranscodeParams& p) {
  extern __shared__ __align__(16) u8 smem[];
  using Src = typename Cfg::Src;
  using Dst = typename Cfg::Dst;
  constexpr int D = Cfg::D, P = Cfg::P, NT = Cfg::NTHREADS;
  const int page = blockIdx.x;
  if (page >= p.num_pages) return;
  const u8* src = p.arena + p.src_offsets[page];
  u8* dst = p.arena + p.dst_offsets[page];
  const PageHeader hd = load_header(src);
  if (hd.magic != PAGE_MAGIC || hd.tier != Src::id || hd.length != u32(P)) {
    if (threadIdx.x == 0) atomicOr(p.error_flags, ERR_SOURCE_TIER);
    return;
  }
  const int kvh = int(p.kv_heads[page]);
  auto cb = [&](int tier, int ng, int e, int g) -> const float* {
    return p.codebooks[tier] ? p.codebooks[tier] + size_t(kvh) * ng * e * g : nullptr;
  };
  auto rs = [&](int tier, int ng) -> const float* {
    return p.radius_scales[tier] ? p.radius_scales[tier] + size_t(kvh) * ng : nullptr;
  };
  float* x = reinterpret_cast<float*>(smem + TranscodeSmem<Cfg>::X);
  int* scratch = reinterpret_cast<int*>(smem + TranscodeSmem<Cfg>::SCRATCH);
  const u8* sseg = src + HEADER_BYTES;
  u8* dseg = dst + HEADER_BYTES;
  constexpr int SNG = Cfg::SRC_NG, SE = Cfg::SRC_E, DNG = Cfg::DST_NG, DE = Cfg::DST_E;
  const float* scb = cb(Src::id, SNG, SE, D / SNG);
  const float* srs = rs(Src::id, SNG);
  const float* dcb = cb(Dst::id, DNG, DE, D / DNG);
  const float* drs = rs(Dst::id, DNG);
  auto order = [&](int tier) -> const u16* {
    return p.channel_orders[tier] ? p.channel_orders[tier] + size_t(kvh) * 2 * D : nullptr;
  };
  // Keys (natural channel order in x; mixed keys scatter and gather through their order).
  const u16* sord = order(Src::id);
  for (int i = threadIdx.x; i < P * D; i += NT) x[i] = Src::Key::dequant(sseg, i / D, i % D, scb, srs, sord);
  __syncthreads();
  Dst::Key::template encode<NT>(dseg, x, scratch, dcb, drs, order(Dst::id));
  __syncthreads();
  // Values.
  for (int i = threadIdx.x; i < P * D; i += NT) x[i] = Src::Value::dequant(sseg, i / D, i % D);
  __syncthreads();
  Dst::Value::template encode<NT>(dseg, x);
  __syncthreads();
  if (threadIdx.x == 0) store_header(dst, u8(Dst::id), u32(P));
}

}  // namespace kvforge

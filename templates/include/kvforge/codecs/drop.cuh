// Drop codecs (crates/kvforge-spec/src/codecs/drop/): evicted tokens have no bytes.
#pragma once
#include "kvforge/codecs/base.cuh"

namespace kvforge {

// Evicted tokens: no bytes, never scored. Only used in transcode bookkeeping.
struct DropKey {
  // Side-table slots (kvforge-spec `Codec::side_tables`; -1: none).
  static constexpr int SLOT_CODEBOOK = -1, SLOT_RADIUS = -1, SLOT_ORDER = -1;
  static constexpr bool WARP = false;  // not on the per-warp decode path
  static constexpr int LUT_FLOATS_PER_HEAD = 0;
  static constexpr bool MMA = false;
  template <int GQA, int NWARPS> __host__ __device__ static constexpr int bfrag_bytes() { return 0; }
  static constexpr bool SPHERICAL = false;
  static constexpr KeyError ERROR = KeyError::Exact;
  static constexpr bool CHANNEL_PARALLEL = true, OUTLINE_SCORER = false;
  static constexpr bool SLICE_CHANNELS = false;
  template <int GQA> struct Scorer {
    __device__ Scorer(const float*, int) {}
    __device__ void score(const u8*, int, float (&)[GQA]) {}
  };
  template <int GQA, int TPT>
  __device__ static void score_lut(const u8*, int, int, const float*, float (&)[GQA]) {}
};

struct DropValue { static constexpr bool WARP = false; };

}  // namespace kvforge

// RDR's importance window (seed 000 C.2, the max over a window of decode steps) kept on the
// device. A decode that records per-page log2 masses (DecodeParams::page_lse) is followed by
// this fold: every page's share of its (sequence, kv head)'s total for the step enters a
// running per-page maximum. The host reads and resets the window only when the controller
// runs, so a decode step costs no transfer (issue 7: the host fold of downloaded masses was
// most of the controller's cost) and, when the decode has a split-K combine, no launch
// either: extra CTAs of the combine fold (a separate fold launch costs a launch per step).
//
// The window stores log2 shares, not shares: a max commutes with exp2, and far-away pages
// whose share is below f32's smallest normal stay ordered instead of flushing to zero. NaN
// marks a page not observed since the last read (fmaxf(NaN, x) = x).
#pragma once
#include "common.cuh"
#include "kvforge/params.cuh"

namespace kvforge {

// A set of log2 values as (max, Σ 2^(x − max)): merging two is exact up to rounding, so one
// pass and one block reduction give the step's log2 total.
struct Log2Sum {
  float m, s;
};

__device__ __forceinline__ Log2Sum log2sum_merge(Log2Sum a, Log2Sum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == NEG_INF) return {NEG_INF, 0.f};
  return {m, a.s * exp2f(a.m - m) + b.s * exp2f(b.m - m)};
}

__device__ __forceinline__ Log2Sum log2sum_warp(Log2Sum a) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const Log2Sum b{__shfl_xor_sync(0xffffffffu, a.m, o), __shfl_xor_sync(0xffffffffu, a.s, o)};
    a = log2sum_merge(a, b);
  }
  return a;
}

// Folds one (decode entry, kv head) group's page masses into its window row, with the NT
// threads of the calling CTA (all of them must call it). Each thread keeps its first R
// pages' log-mass and window value in registers: both loads are issued before the
// reduction, so a step costs one memory round trip for up to R × NT pages.
//
// Called by the standalone fold kernel below and by the split-K combine kernel's extra CTAs
// (combine.cuh), which runs right after the decode anyway: there the fold costs no launch.
template <int NT, int R = 4>
__device__ __forceinline__ void mass_window_fold(const MassWindowParams& p, int entry, int head) {
  static_assert(NT % 32 == 0 && NT <= 1024, "whole warps");
  __shared__ Log2Sum warp_part[NT / 32];
  __shared__ float total_s;
  const int tid = threadIdx.x;
  const int row = entry * p.num_kv_heads + head;
  const u32 begin = p.page_indptr[row];
  // The host sizes the window before launching; the clamp only keeps a bad launch in bounds.
  const u32 n = min(p.page_indptr[row + 1] - begin, u32(p.capacity));
  const float* lse = p.page_lse + begin;
  float* win = p.window + (size_t(p.slots[entry]) * p.num_kv_heads + head) * p.capacity;

  float x[R], w[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const u32 k = tid + i * NT;
    x[i] = k < n ? lse[k] : NEG_INF;
    w[i] = k < n ? win[k] : 0.f;
  }
  Log2Sum acc{NEG_INF, 0.f};
#pragma unroll
  for (int i = 0; i < R; ++i) acc = log2sum_merge(acc, {x[i], 1.f});
  for (u32 k = tid + R * NT; k < n; k += NT) acc = log2sum_merge(acc, {lse[k], 1.f});

  acc = log2sum_warp(acc);
  if (tid % 32 == 0) warp_part[tid / 32] = acc;
  __syncthreads();
  if (tid < 32) {
    Log2Sum a = tid < NT / 32 ? warp_part[tid] : Log2Sum{NEG_INF, 0.f};
    a = log2sum_warp(a);
    if (tid == 0) total_s = a.m + log2f(a.s);
  }
  __syncthreads();
  const float total = total_s;
  // A step without finite mass (no page scored) observes nothing.
  if (!(total > NEG_INF)) return;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const u32 k = tid + i * NT;
    if (k < n) win[k] = fmaxf(w[i], x[i] - total);
  }
  for (u32 k = tid + R * NT; k < n; k += NT) win[k] = fmaxf(win[k], lse[k] - total);
}

// The standalone fold, for decodes without a split-K combine: one CTA of NT threads per
// (decode entry, kv head), grid (kv heads, entries).
template <int NT>
__device__ void mass_window_kernel(const MassWindowParams& p) {
  mass_window_fold<NT>(p, blockIdx.y, blockIdx.x);
}

}  // namespace kvforge

// Split-K (flash-decoding) combine: merges the partial outputs of the splits of every
// (sequence, query head) by their log-sum-exp. When the decode recorded page masses for
// RDR's importance window (CombineParams::fold), CTAs past the rows fold them, one per
// (sequence, kv head): the combine runs after the decode anyway, so the window costs no
// launch of its own, and the fold CTAs run beside the combine's.
#pragma once
#include "common.cuh"
#include "kvforge/mass_window.cuh"
#include "kvforge/params.cuh"

namespace kvforge {

// Pages a fold CTA of the combine keeps in registers per thread: 512 pages (32K tokens at
// 64-token pages) and more in one round trip at every head dim.
template <int D>
constexpr int fold_pages_per_thread() {
  return D >= 128 ? 4 : 8;
}

// One CTA per row, D threads; then, with a fold, one CTA per (sequence, kv head).
template <class QT, int D>
__device__ void combine_kernel(const CombineParams& p) {
  const int row = blockIdx.x, c = threadIdx.x;
  grid_wait_primary();  // the decode's partials and page masses are complete and visible
  if (row >= p.rows) {
    const int group = row - p.rows;
    if (p.fold.page_lse != nullptr && p.fold.num_kv_heads > 0 && group < p.fold_groups)
      mass_window_fold<D, fold_pages_per_thread<D>()>(p.fold, group / p.fold.num_kv_heads, group % p.fold.num_kv_heads);
    return;
  }
  // Warp 0 turns the splits' log-sum-exps into weights in shared memory, CHUNK splits at a
  // time; then every thread loads its channel of all the chunk's partials at once (one memory
  // round trip, not one per 8 splits) and sums them. (A per-thread loop of dependent lse and
  // partial loads waited one round trip per split; loads unrolled by 8 still waited 8 round
  // trips at 64 splits.)
  constexpr int CHUNK = 64;
  __shared__ float w_s[CHUNK];
  __shared__ float den_s;
  const int lane = c % 32;
  const float* lse = p.partial_lse + row;
  float mx = NEG_INF;
  if (c < 32) {
    for (int s = lane; s < p.num_splits; s += 32) mx = fmaxf(mx, lse[size_t(s) * p.rows]);
    mx = warp_max(mx);
  }
  float num = 0.f, den = 0.f;
  for (int base = 0; base < p.num_splits; base += CHUNK) {
    const int n = min(CHUNK, p.num_splits - base);
    const float* po = p.partial_out + (size_t(base) * p.rows + row) * D + c;
    float part[CHUNK];
#pragma unroll
    for (int s = 0; s < CHUNK; ++s) part[s] = s < n ? po[size_t(s) * p.rows * D] : 0.f;
    if (c < 32) {
      float sum = 0.f;
#pragma unroll
      for (int s = lane; s < CHUNK; s += 32) {
        const float l = s < n ? lse[size_t(base + s) * p.rows] : NEG_INF;
        const float w = l == NEG_INF ? 0.f : __expf(l - mx);
        w_s[s] = w;  // 0 past the chunk's splits: their partials are loaded as 0 too
        sum += w;
      }
      sum = warp_sum(sum);
      if (lane == 0) den_s = sum;
    }
    __syncthreads();
    den += den_s;
#pragma unroll
    for (int s = 0; s < CHUNK; ++s) num = fmaf(w_s[s], part[s], num);
    __syncthreads();
  }
  // Thread 0 (warp 0) holds the maximum for the row's lse.
  reinterpret_cast<QT*>(p.out)[size_t(row) * D + c] = from_float<QT>(den > 0.f ? num / den : 0.f);
  if (p.lse != nullptr && c == 0) p.lse[row] = den > 0.f ? mx + logf(den) : NEG_INF;
}

}  // namespace kvforge

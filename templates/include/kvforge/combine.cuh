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
  if (row >= p.rows) {
    const int group = row - p.rows;
    if (p.fold.page_lse != nullptr && p.fold.num_kv_heads > 0 && group < p.fold_groups)
      mass_window_fold<D, fold_pages_per_thread<D>()>(p.fold, group / p.fold.num_kv_heads, group % p.fold.num_kv_heads);
    return;
  }
  float mx = NEG_INF;
  for (int s = 0; s < p.num_splits; ++s) mx = fmaxf(mx, p.partial_lse[size_t(s) * p.rows + row]);
  float den = 0.f, num = 0.f;
  for (int s = 0; s < p.num_splits; ++s) {
    const float l = p.partial_lse[size_t(s) * p.rows + row];
    if (l == NEG_INF) continue;
    const float w = __expf(l - mx);
    den += w;
    num += w * p.partial_out[(size_t(s) * p.rows + row) * D + c];
  }
  reinterpret_cast<QT*>(p.out)[size_t(row) * D + c] = from_float<QT>(den > 0.f ? num / den : 0.f);
  if (p.lse != nullptr && c == 0) p.lse[row] = den > 0.f ? mx + logf(den) : NEG_INF;
}

}  // namespace kvforge

// Split-K (flash-decoding) combine: merges the partial outputs of the splits of every
// (sequence, query head) by their log-sum-exp.
#pragma once
#include "common.cuh"
#include "kvforge/params.cuh"

namespace kvforge {

// One CTA per row, D threads.
template <class QT, int D>
__device__ void combine_kernel(const CombineParams& p) {
  const int row = blockIdx.x, c = threadIdx.x;
  if (row >= p.rows) return;
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

// Decode-step append (issue 29): one token per listed sequence, written from device memory
// into every (sequence, kv head)'s tail page, so a serving loop's append is one launch instead
// of a host round trip per sequence. The host does the bookkeeping (which page, which row, new
// tail pages, encoding filled ones); this writes the rows and the page header.
//
// One CTA of D threads per row r = i · kv_heads + h of the launch: k and v row r of the
// caller's [n][kv_heads][D] buffers (spec dtype) go to row `pos` of the tail page at
// `rows[2r]` (arena offset), where `pos = rows[2r + 1]`. With ROTATE the rows are mapped to the
// stored basis first (hadamard_rows, fp32, then rounded to nearest in the spec dtype), as the
// host path's `Basis::to_stored` does. A page's first row (pos 0) also zeroes the rest of the
// page, so it holds what the host path uploads. The header (tier 0, length pos + 1, FNV-1a
// checksum) is rewritten last.
#pragma once
#include "common.cuh"
#include "hadamard.cuh"

namespace kvforge {

template <class T, int D, int P, bool ROTATE>
__device__ void append_kernel(u8* arena, const u64* rows, const T* k, const T* v, int n_rows, int k_off, int v_off, int page_bytes, u32 rot_seed) {
  static_assert(sizeof(T) == 2, "tail pages hold 16-bit values");
  const int r = blockIdx.x, c = threadIdx.x;
  if (r >= n_rows) return;
  u8* page = arena + rows[2 * r];
  const int pos = int(rows[2 * r + 1]);
  if (pos < 0 || pos >= P) return;  // the host never asks for this; never write past the page
  if (pos == 0) {
    // A fresh tail page: everything after the header reads as zero, as on the host path.
    u32* words = reinterpret_cast<u32*>(page + HEADER_BYTES);
    for (int i = c; i < (page_bytes - HEADER_BYTES) / 4; i += D) words[i] = 0u;
    __syncthreads();
  }
  T* kdst = reinterpret_cast<T*>(page + k_off) + size_t(pos) * D;
  T* vdst = reinterpret_cast<T*>(page + v_off) + size_t(pos) * D;
  const T* ksrc = k + size_t(r) * D;
  const T* vsrc = v + size_t(r) * D;
  if constexpr (ROTATE) {
    __shared__ float x[2 * D];
    x[c] = to_float(ksrc[c]);
    x[D + c] = to_float(vsrc[c]);
    __syncthreads();  // hadamard_rows reads whole rows per warp
    hadamard_rows<D, D, false>(x, 2, rot_seed);  // ends with a barrier
    kdst[c] = from_float<T>(x[c]);
    vdst[c] = from_float<T>(x[D + c]);
  } else {
    kdst[c] = ksrc[c];
    vdst[c] = vsrc[c];
  }
  if (c == 0) store_header(page, u8(0), u32(pos + 1));
}

}  // namespace kvforge

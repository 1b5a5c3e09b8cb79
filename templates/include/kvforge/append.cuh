// Appends from device memory (issue 29): a decode step's one token per sequence, or a prompt's
// tokens of one sequence, written into tail-format pages (tier 0) without staging through the
// host. The host does the bookkeeping (which page, which rows, new pages, encoding filled
// ones); this writes the rows and the page header.
//
// One CTA of D threads per chunk r of the launch: a run of `count` consecutive tokens of one
// (sequence, kv head) going to rows pos0 .. pos0 + count - 1 of the page at `rows[2r]` (arena
// offset). `rows[2r + 1]` packs pos0 (bits 0..15), count (bits 16..31) and the caller's row of
// the chunk's first token (bits 32..63): token i of the chunk is row `src_row + i · src_stride`
// of the caller's [tokens][kv_heads][D] buffers k and v (spec dtype), so src_stride is
// kv_heads. A decode step is one chunk of one token per (sequence, kv head); a prompt is one
// chunk per (page, kv head). With ROTATE the rows are mapped to the stored basis first
// (hadamard_rows, fp32, then rounded to nearest in the spec dtype), as the host path's
// `Basis::to_stored` does. A chunk starting a page (pos0 0) first zeroes the rest of the page,
// so it holds what the host path uploads. The header (tier 0, length pos0 + count, FNV-1a
// checksum) is rewritten last.
//
// pos0 = POS_FROM_HEADER (0xffff) reads the position from the page header's length instead:
// a CUDA-graph-captured decode step replays the same chunk list every step, and the token
// lands after the ones the page holds now (a header without kvforge's magic writes nothing).
#pragma once
#include "common.cuh"
#include "hadamard.cuh"

namespace kvforge {

constexpr int POS_FROM_HEADER = 0xffff;

template <class T, int D, int P, bool ROTATE>
__device__ void append_kernel(u8* arena, const u64* rows, const T* k, const T* v, int n_rows, int src_stride, int k_off, int v_off, int page_bytes, u32 rot_seed) {
  static_assert(sizeof(T) == 2, "tail pages hold 16-bit values");
  const int r = blockIdx.x, c = threadIdx.x;
  if (r >= n_rows) return;
  u8* page = arena + rows[2 * r];
  const u64 w = rows[2 * r + 1];
  int pos0 = int(w & 0xffffu);
  const int count = int((w >> 16) & 0xffffu);
  const size_t src_row = size_t(w >> 32);
  if (pos0 == POS_FROM_HEADER) {
    // Thread 0 reads, every thread takes it after the barrier: thread 0 rewrites the header
    // at the end, which no other warp may read first.
    __shared__ int from_header;
    if (c == 0) {
      const PageHeader h = load_header(page);
      from_header = h.magic == PAGE_MAGIC ? int(h.length) : P;
    }
    __syncthreads();
    pos0 = from_header;
  }
  if (count <= 0 || pos0 + count > P) return;  // the host never asks for this; never write past the page
  if (pos0 == 0) {
    // A fresh page: everything after the header reads as zero, as on the host path.
    u32* words = reinterpret_cast<u32*>(page + HEADER_BYTES);
    for (int i = c; i < (page_bytes - HEADER_BYTES) / 4; i += D) words[i] = 0u;
    __syncthreads();
  }
  for (int i = 0; i < count; ++i) {
    const int pos = pos0 + i;
    T* kdst = reinterpret_cast<T*>(page + k_off) + size_t(pos) * D;
    T* vdst = reinterpret_cast<T*>(page + v_off) + size_t(pos) * D;
    const size_t row = src_row + size_t(i) * size_t(src_stride);
    const T* ksrc = k + row * D;
    const T* vsrc = v + row * D;
    if constexpr (ROTATE) {
      // Thread c writes x[c] and x[D + c] and reads them back after the transform; the
      // transform's barriers order every other access.
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
  }
  if (c == 0) store_header(page, u8(0), u32(pos0 + count));
}

}  // namespace kvforge

// The rotated basis of a spec whose tiers include a rotating codec (kvforge-spec `Basis`,
// docs/LAYOUT.md): y = R x with R = H · diag(s) / √D, H the Sylvester Hadamard matrix and s the
// seeded signs. Stored rows are rotated once, when they are appended (on the host, or by the
// decode-step append kernel, append.cuh); decode rotates the query in its prologue
// (q·k = Rq·Rk) and rotates the output back in its epilogue (Σ p v = Rᵀ Σ p Rv), so no stored
// row is rotated again.
#pragma once
#include "common.cuh"

namespace kvforge {

// Sign of channel c under `seed`: the low bit of murmur3's 32-bit finaliser of
// c ^ seed · 0x9E3779B9 (kvforge-spec `codecs::rotated::hadamard::sign`).
__device__ __forceinline__ float hadamard_sign(int c, u32 seed) {
  u32 h = u32(c) ^ (seed * 0x9E3779B9u);
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return (h & 1u) ? -1.f : 1.f;
}

// Rotates (INVERSE: rotates back) `rows` rows of D floats in shared memory in place, with all
// NT threads of the CTA, after a barrier that made the rows visible; ends with a barrier.
// Forward: signs, the butterflies, 1/√D; inverse: the butterflies, 1/√D, signs. Warp w takes
// rows w, w + NT/32, ...: lane l holds channels l + 32k (k < D/32), the butterflies of span
// below 32 are shuffles and the wider ones stay in the lane's registers, spans in ascending
// order as in the reference. (A block-wide version, one barrier per span, cost batch-1 decode
// ~14%: docs/perf/NOTES.md, v12.)
template <int D, int NT, bool INVERSE>
__device__ void hadamard_rows(float* x, int rows, u32 seed) {
  static_assert((D & (D - 1)) == 0 && D >= 32, "the Hadamard transform needs a power-of-two head dim of at least 32");
  constexpr int V = D / 32;
  constexpr float NORM = D == 64 ? 0.125f : D == 128 ? 0.08838834764831845f : D == 256 ? 0.0625f : 0.f;
  static_assert(NORM > 0.f, "head dims 64, 128 and 256");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < rows; r += NT / 32) {
    float v[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      v[k] = x[r * D + lane + 32 * k];
      if constexpr (!INVERSE) v[k] *= hadamard_sign(lane + 32 * k, seed);
    }
#pragma unroll
    for (int len = 1; len < 32; len <<= 1)
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float o = __shfl_xor_sync(0xffffffffu, v[k], len);
        v[k] = (lane & len) ? o - v[k] : v[k] + o;
      }
#pragma unroll
    for (int len = 1; len < V; len <<= 1)
#pragma unroll
      for (int k = 0; k < V; ++k)
        if ((k & len) == 0) {
          const float u = v[k], w = v[k + len];
          v[k] = u + w;
          v[k + len] = u - w;
        }
#pragma unroll
    for (int k = 0; k < V; ++k) x[r * D + lane + 32 * k] = v[k] * (INVERSE ? NORM * hadamard_sign(lane + 32 * k, seed) : NORM);
  }
  __syncthreads();
}

// Whether a decode configuration rotates (Cfg::ROTATE, rendered only for specs with a rotated
// basis; absent means the identity basis).
template <class Cfg, class = void> struct Rotates { static constexpr bool value = false; };
template <class Cfg> struct Rotates<Cfg, decltype(void(Cfg::ROTATE))> { static constexpr bool value = Cfg::ROTATE; };

}  // namespace kvforge

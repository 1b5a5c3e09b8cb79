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
// NT threads of the CTA; ends with a barrier. Forward: signs, the butterflies, 1/√D; inverse:
// the butterflies, 1/√D, signs.
template <int D, int NT, bool INVERSE>
__device__ void hadamard_rows(float* x, int rows, u32 seed) {
  static_assert((D & (D - 1)) == 0, "the Hadamard transform needs a power-of-two head dim");
  const int tid = threadIdx.x;
  if constexpr (!INVERSE) {
    for (int i = tid; i < rows * D; i += NT) x[i] *= hadamard_sign(i % D, seed);
  }
  __syncthreads();
#pragma unroll 1
  for (int len = 1; len < D; len <<= 1) {
    for (int i = tid; i < rows * D / 2; i += NT) {
      const int r = i / (D / 2), j = i % (D / 2);
      const int a = r * D + (j / len) * 2 * len + j % len, b = a + len;
      const float u = x[a], v = x[b];
      x[a] = u + v;
      x[b] = u - v;
    }
    __syncthreads();
  }
  constexpr float NORM = D == 64 ? 0.125f : D == 128 ? 0.08838834764831845f : D == 256 ? 0.0625f : 0.f;
  static_assert(NORM > 0.f, "head dims 64, 128 and 256");
  for (int i = tid; i < rows * D; i += NT) x[i] *= INVERSE ? NORM * hadamard_sign(i % D, seed) : NORM;
  __syncthreads();
}

// Whether a decode configuration rotates (Cfg::ROTATE, rendered only for specs with a rotated
// basis; absent means the identity basis).
template <class Cfg, class = void> struct Rotates { static constexpr bool value = false; };
template <class Cfg> struct Rotates<Cfg, decltype(void(Cfg::ROTATE))> { static constexpr bool value = Cfg::ROTATE; };

}  // namespace kvforge

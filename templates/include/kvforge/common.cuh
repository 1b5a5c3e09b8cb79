// kvforge device library: element types, staging copies, page headers.
// Hand-written; the generated kernels only instantiate it.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace kvforge {

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

constexpr int MAX_TIERS = 16;
// Side tables per tier (`DecodeParams::side`): kvforge-spec `codecs::SIDE_SLOTS`.
constexpr int SIDE_SLOTS = 2;
// -inf without <math.h> (NVRTC has no host headers).
#define NEG_INF (__int_as_float(0xff800000u))
constexpr int HEADER_BYTES = 16;
constexpr u32 PAGE_MAGIC = 0x3446564Bu;  // "KVF4" little endian (kvforge-spec PAGE_MAGIC: the layout version)

// Error bits a kernel ORs into `error_flags`; the runtime turns them into typed errors.
constexpr u32 ERR_UNKNOWN_TIER = 1u;   // a page's tier is not served by this variant
constexpr u32 ERR_BAD_MAGIC = 2u;      // a page header is not a kvforge header
constexpr u32 ERR_BAD_LENGTH = 4u;     // a page claims more tokens than a page holds
constexpr u32 ERR_SOURCE_TIER = 8u;    // a transcode source page is not in the expected tier

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }

template <class A, class B> struct same_type { static constexpr bool value = false; };
template <class A> struct same_type<A, A> { static constexpr bool value = true; };

__host__ __device__ constexpr int align16(int x) { return (x + 15) / 16 * 16; }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }
__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int popc(unsigned x) { return x == 0 ? 0 : int(x & 1u) + popc(x >> 1); }
__host__ __device__ constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }

// The fixed 16-byte page header (layout documented in docs/LAYOUT.md).
struct PageHeader {
  u32 magic;
  u8 tier;
  u8 flags;
  u16 reserved;
  u32 length;
  u32 checksum;
};

// FNV-1a over the first 12 header bytes; equals kvforge_spec::layout::fnv1a.
__device__ __forceinline__ u32 header_checksum(const PageHeader& h) {
  u8 b[12];
  b[0] = h.magic & 0xff; b[1] = (h.magic >> 8) & 0xff; b[2] = (h.magic >> 16) & 0xff; b[3] = h.magic >> 24;
  b[4] = h.tier; b[5] = h.flags; b[6] = h.reserved & 0xff; b[7] = h.reserved >> 8;
  b[8] = h.length & 0xff; b[9] = (h.length >> 8) & 0xff; b[10] = (h.length >> 16) & 0xff; b[11] = h.length >> 24;
  u32 c = 0x811c9dc5u;
#pragma unroll
  for (int i = 0; i < 12; ++i) { c ^= b[i]; c *= 0x01000193u; }
  return c;
}

__device__ __forceinline__ PageHeader load_header(const u8* page) {
  const uint4 raw = *reinterpret_cast<const uint4*>(page);
  PageHeader h;
  h.magic = raw.x;
  h.tier = raw.y & 0xff;
  h.flags = (raw.y >> 8) & 0xff;
  h.reserved = raw.y >> 16;
  h.length = raw.z;
  h.checksum = raw.w;
  return h;
}

__device__ __forceinline__ void store_header(u8* page, u8 tier, u32 length) {
  PageHeader h;
  h.magic = PAGE_MAGIC; h.tier = tier; h.flags = 0; h.reserved = 0; h.length = length;
  h.checksum = header_checksum(h);
  uint4 raw;
  raw.x = h.magic;
  raw.y = u32(h.tier) | (u32(h.flags) << 8) | (u32(h.reserved) << 16);
  raw.z = h.length;
  raw.w = h.checksum;
  *reinterpret_cast<uint4*>(page) = raw;
}

// 16-byte asynchronous global->shared copies (sm_80+): the decode kernel stages page i+1
// while it computes on page i.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const u32 s = static_cast<u32>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Copies BYTES (a multiple of 16) with all threads of the block, unrolled (a runtime-length
// loop cost ~90 instructions per warp per decode page in address and bound arithmetic).
template <int NTHREADS, int BYTES>
__device__ __forceinline__ void stage_async(u8* dst, const u8* src) {
  const int t = threadIdx.x * 16;
#pragma unroll
  for (int k = 0; k < BYTES / (NTHREADS * 16); ++k) cp_async16(dst + t + k * NTHREADS * 16, src + t + k * NTHREADS * 16);
  constexpr int REST = BYTES % (NTHREADS * 16), DONE = BYTES - REST;
  if (REST > 0 && t < REST) cp_async16(dst + DONE + t, src + DONE + t);
}

// Certified decode: attention masses, key error bounds and promotion are per CERT_BLOCK-token
// block (params.cuh, shared with the host).

// Programmatic dependent launch (sm_90): the decode lets the split-K combine, launched with
// programmatic stream serialisation, start while its last CTAs finish; the combine waits for
// the decode's writes before it reads them. No-ops before sm_90 (and without the launch
// attribute, the stream orders the kernels as usual).
__device__ __forceinline__ void grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_wait_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

template <int WIDTH>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

template <int WIDTH>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float warp_max(float x) { return group_max<32>(x); }
// 2^x for the online softmax: one MUFU.EX2 with results below 2^−126 flushed to zero (exp2f
// wraps the same MUFU in a range test and two predicated multiplies to keep them subnormal).
// A probability below 2^−126 of the running maximum weighs nothing in an fp32 sum, and the
// fp16 operands the mma reads flush below 2^−24 anyway. 2^−inf = 0.
__device__ __forceinline__ float softmax_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float warp_sum(float x) { return group_sum<32>(x); }

// Tensor-core helpers (mma.sync m16n8k16, sm_80+). With g = lane / 4 and q = lane % 4 a thread
// holds A[g][2q..2q+1], A[g+8][2q..], A[g][2q+8..], A[g+8][2q+8..] (four 32-bit pairs, low half
// first), B[2q..2q+1][g], B[2q+8..2q+9][g], and C[g][2q..2q+1], C[g+8][2q..2q+1].
template <bool BF16>
__device__ __forceinline__ void mma16816(float (&c)[4], const u32 (&a)[4], const u32 (&b)[2]) {
  if constexpr (BF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// mma.sync m16n8k8 (fp16 inputs, fp32 accumulators): a thread holds A[g][2q..2q+1] and
// A[g+8][2q..2q+1], B[2q..2q+1][g], and C as in m16n8k16.
__device__ __forceinline__ void mma1688(float (&c)[4], const u32 (&a)[2], u32 b) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(b));
}

// mma.sync m16n8k32 (int8 inputs, int32 accumulators, exact): a thread holds A[g][4q..4q+3],
// A[g+8][4q..], A[g][4q+16..4q+19], A[g+8][4q+16..] (four int8 quads, byte k = column + k),
// B[4q..4q+3][g], B[4q+16..4q+19][g], and C as in m16n8k16.
__device__ __forceinline__ void mma16832_s8(int (&c)[4], const u32 (&a)[4], const u32 (&b)[2]) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two floats as one fp16 (or bf16) pair, `lo` in the low half.
template <bool BF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  if constexpr (BF16) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const u32*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const u32*>(&h);
  }
}
__device__ __forceinline__ float2 unpack2h(u32 x) { return __half22float2(*reinterpret_cast<const __half2*>(&x)); }
// (x, y) as an fp16 pair `hi` plus the fp16 pair of what it rounded off, `lo`: two mmas with
// hi and lo carry ~22 bits of each factor (the fp32-grade products scoring relies on).
__device__ __forceinline__ void split_h2(float x, float y, u32& hi, u32& lo) {
  hi = pack2<false>(x, y);
  const float2 h = unpack2h(hi);
  lo = pack2<false>(x - h.x, y - h.y);
}

// Codes placed in the mantissas of an fp16 pair: (x & mask) | magic, where magic's halves are
// powers of two 2^E (mantissa 0) chosen so that a code's lowest bit is worth 1: the pair is
// (2^E_lo + lo, 2^E_hi + hi) exactly. One LOP3: written in C, ptxas splits it in two (one
// immediate each).
__device__ __forceinline__ u32 h2_biased(u32 x, u32 mask, u32 magic) {
  u32 biased;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(biased) : "r"(x), "r"(mask), "r"(magic));
  return biased;
}
// Small codes as fp16 pairs: a pair word (x & mask) | 0x6400_6400 is (1024 + lo, 1024 + hi)
// exactly (codes in mantissa bits 0..); subtracting the magic leaves the exact codes (no I2F,
// one LOP3 + one HSUB2 per pair). Codes elsewhere in the mantissas take another magic.
__device__ __forceinline__ u32 h2_unbias(u32 biased, u32 magic) {
  u32 r;
  asm("sub.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(biased), "r"(magic));
  return r;
}
__device__ __forceinline__ u32 h2_codes(u32 x, u32 mask, u32 magic = 0x64006400u) { return h2_unbias(h2_biased(x, mask, magic), magic); }
// c * s + z on fp16 pairs, rounded once.
__device__ __forceinline__ u32 h2_fma(u32 c, u32 s, u32 z) {
  u32 r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(c), "r"(s), "r"(z));
  return r;
}

// `BYTES` bytes (1, 2, 4, 8, 16 or 32) of 16-byte aligned-enough memory as 32-bit words
// (a 1- or 2-byte load fills the low bits of word 0).
template <int BYTES>
__device__ __forceinline__ void load_words(const u8* p, u32 (&w)[BYTES >= 4 ? BYTES / 4 : 1]) {
  if constexpr (BYTES == 1) w[0] = *p;
  else if constexpr (BYTES == 2) w[0] = *reinterpret_cast<const u16*>(p);
  else if constexpr (BYTES == 4) w[0] = *reinterpret_cast<const u32*>(p);
  else if constexpr (BYTES == 8) { const uint2 v = *reinterpret_cast<const uint2*>(p); w[0] = v.x; w[1] = v.y; }
  else {
#pragma unroll
    for (int i = 0; i < BYTES / 16; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
      w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
    }
  }
}

// N scales (fp16 or fp32, 16-byte aligned, N·sizeof(S) a multiple of 16) as floats, with
// 16-byte loads.
template <class S, int N>
__device__ __forceinline__ void load_floats(const u8* p, float (&out)[N]) {
  static_assert(N * sizeof(S) % 16 == 0, "whole 16-byte vectors");
#pragma unroll
  for (int i = 0; i < N * int(sizeof(S)) / 16; ++i) {
    const uint4 v = reinterpret_cast<const uint4*>(p)[i];
    if constexpr (sizeof(S) == 4) {
      out[4 * i] = __uint_as_float(v.x); out[4 * i + 1] = __uint_as_float(v.y);
      out[4 * i + 2] = __uint_as_float(v.z); out[4 * i + 3] = __uint_as_float(v.w);
    } else {
      const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const S* e = reinterpret_cast<const S*>(&w[j]);
        out[8 * i + 2 * j] = to_float(e[0]);
        out[8 * i + 2 * j + 1] = to_float(e[1]);
      }
    }
  }
}

// Round half away from zero for non-negative inputs, as kvforge-ref does.
__device__ __forceinline__ float round_half_up(float x) { return floorf(x + 0.5f); }

}  // namespace kvforge

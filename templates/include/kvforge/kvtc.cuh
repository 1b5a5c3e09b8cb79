// kvtc restore (seed 003 §3) on the device: packed, entropy-decoded chunks of one side (keys or
// values) -> fp16 rows of every layer. The f64 reference is kvforge-kvtc (`pack::decode`,
// `codec::reconstruct`, `Rope::apply`; `restore::reference_restore` mirrors this file's order of
// operations); kvforge-rt `kvtc` launches it.
//
// Two kernels, launched back to back on one stream:
//   dequant: every (chunk, group) CTA unpacks its group's LSB-first codes and fp16 shift/scale
//            (crates/kvforge-kvtc/src/pack.rs layout) into an fp16 coefficient matrix
//            coeff[rows][ldc] (row = chunk * n + token, column = principal component; gaps of the
//            allocation and the padding to a multiple of BK are groups of zero bits: written 0).
//   restore: out = coeff · basis + mean, then RoPE for keys, as a tiled tensor-core matmul, one
//            launch per block of a block-diagonal basis (a run of whole layers: its kdim
//            coefficient columns times its own [kdim][p] basis, written at feature feat0)
//            (mma.sync m16n8k16, fp16 in, fp32 accumulate; 128 x 128 x 32 CTA tiles, 3-stage
//            cp.async pipeline, XOR-swizzled shared memory read with ldmatrix). The epilogue
//            stages each 64-row half of the tile in shared memory (fp32), adds the mean, rotates
//            channel pairs (c, c + rope_dim/2) of each head and writes 16-byte fp16 vectors to
//            out[layer][out_row0 + row][kv_head * head_dim + channel].
// Dequantising once into a matrix rather than per output tile: every coefficient feeds all
// p / 128 column tiles, so unpacking it in each would repeat the bit work p / 128 times.
//
// Requirements (checked by the host): p % 8 == 0, head_dim divides BN, kdim % BK == 0, ldc % 8 == 0,
// the basis has kdim rows (zero past the calibration's components), feat0 a multiple of
// layer_width, bits <= 16.
#pragma once
#include "common.cuh"

namespace kvforge {
namespace kvtc {

constexpr int BM = 128, BN = 128, BK = 32, STAGES = 3, THREADS = 256;

// One group of the allocation, as the dequant kernel reads it: components [start, start + len),
// `bits` per code (0: written as zeros), and where its planes start in a chunk of n tokens:
// fp16 (shift, scale) pairs at `offset`, codes at `offset + 4 n`.
struct GroupDesc {
  int start;
  int len;
  int bits;
  u32 offset;
};

struct DequantParams {
  const u8* packed;         // [chunks][chunk_bytes]
  const GroupDesc* groups;  // [n_groups], covering [0, ldc)
  __half* coeff;            // [chunks * n][ldc]
  int chunks;
  int n;  // tokens per chunk
  u32 chunk_bytes;
  int n_groups;
  int ldc;
};

struct RestoreParams {
  const __half* coeff;          // [rows][ldc], this block's kdim columns from the pointer on
  const __half* basis;          // [kdim][p], row = component of this block
  const float* mean;            // [p], this block's features
  const double* inv_freq;       // [rope_dim / 2]
  const long long* positions;   // [rows], RoPE position of each row (keys)
  __half* out;                  // [layers][out_rows][layer_width]
  int rows;
  int ldc;
  int kdim;   // components of this block (a multiple of BK; 0: the mean alone)
  int p;      // features of this block
  int feat0;  // first feature of this block (whole layers)
  int layer_width;  // kv_heads * head_dim
  int head_dim;
  int rope_dim;     // 0: no RoPE (values, or keys without it)
  int out_rows;
  int out_row0;
};

__device__ __forceinline__ u32 byte_at(const u8* b, unsigned long long i) { return b[i]; }

template <int NTHREADS>
__device__ void dequant_kernel(const DequantParams& p) {
  const GroupDesc g = p.groups[blockIdx.x];
  const int chunk = blockIdx.y;
  const int n = p.n;
  const u8* base = p.packed + (unsigned long long)chunk * p.chunk_bytes + g.offset;
  __half* out = p.coeff + (unsigned long long)chunk * n * p.ldc + g.start;
  const int total = n * g.len;
  for (int e = threadIdx.x; e < total; e += NTHREADS) {
    const int t = e / g.len, j = e - t * g.len;
    float x = 0.f;
    if (g.bits > 0) {
      const u8* s = base + 4 * t;
      const __half lo = __ushort_as_half((unsigned short)(s[0] | (s[1] << 8)));
      const __half sc = __ushort_as_half((unsigned short)(s[2] | (s[3] << 8)));
      const u8* codes = base + 4ull * n;
      const unsigned long long bit = (unsigned long long)e * g.bits;
      const unsigned long long first = bit >> 3, last = (bit + g.bits - 1) >> 3;
      u32 w = byte_at(codes, first);
      if (last > first) w |= byte_at(codes, first + 1) << 8;
      if (last > first + 1) w |= byte_at(codes, first + 2) << 16;
      const u32 code = (w >> (bit & 7)) & ((1u << g.bits) - 1u);
      x = __half2float(lo) + (float)code * __half2float(sc);
    }
    out[(unsigned long long)t * p.ldc + j] = __float2half_rn(x);
  }
}

__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
  const u32 s = static_cast<u32>(__cvta_generic_to_shared(smem));
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* smem) {
  const u32 s = static_cast<u32>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* smem) {
  const u32 s = static_cast<u32>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}

// Shared-memory tiles, 16-byte chunks XOR-swizzled so that ldmatrix's eight row addresses fall
// in distinct banks: A is [BM][BK] (4 chunks a row, chunk ^ ((row >> 1) & 3)), B is [BK][BN]
// (16 chunks a row, chunk ^ (row & 7)).
__device__ __forceinline__ int a_off(int row, int chunk) { return row * BK + ((chunk ^ ((row >> 1) & 3)) << 3); }
__device__ __forceinline__ int b_off(int row, int chunk) { return row * BN + ((chunk ^ (row & 7)) << 3); }

struct RestoreSmem {
  __half a[STAGES][BM * BK];
  __half b[STAGES][BK * BN];
};
constexpr int STAGE_LD = BN + 4;  // fp32 epilogue staging [BM / 2][STAGE_LD]
static_assert(sizeof(RestoreSmem) >= (BM / 2) * STAGE_LD * sizeof(float), "epilogue staging fits in the pipeline buffers");

__device__ __forceinline__ void load_tile(RestoreSmem& sm, int stage, const RestoreParams& p, int m0, int n0, int kt) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int i = 0; i < (BM * BK / 8) / THREADS; ++i) {
    const int id = tid + i * THREADS, row = id / (BK / 8), ch = id % (BK / 8);
    const bool ok = m0 + row < p.rows;
    const __half* src = p.coeff + (unsigned long long)(ok ? m0 + row : 0) * p.ldc + kt * BK + ch * 8;
    cp_async16_zfill(&sm.a[stage][a_off(row, ch)], src, ok);
  }
#pragma unroll
  for (int i = 0; i < (BK * BN / 8) / THREADS; ++i) {
    const int id = tid + i * THREADS, row = id / (BN / 8), ch = id % (BN / 8);
    const bool ok = n0 + ch * 8 < p.p;
    const __half* src = p.basis + (unsigned long long)(kt * BK + row) * p.p + (ok ? n0 + ch * 8 : 0);
    cp_async16_zfill(&sm.b[stage][b_off(row, ch)], src, ok);
  }
}

// Column tiles of GROUP_M row tiles are walked together so that the CTAs resident at once share
// a few coefficient tiles and basis column tiles in L2.
constexpr int GROUP_M = 8;

__device__ void restore_kernel(const RestoreParams& p) {
  __shared__ __align__(128) RestoreSmem sm;
  const int num_m = cdiv(p.rows, BM), num_n = cdiv(p.p, BN);
  const int bid = blockIdx.x;
  const int per_group = GROUP_M * num_n;
  const int first_m = (bid / per_group) * GROUP_M;
  const int gsize = cmin(num_m - first_m, GROUP_M);
  const int m_tile = first_m + (bid % per_group) % gsize;
  const int n_tile = (bid % per_group) / gsize;
  const int m0 = m_tile * BM, n0 = n_tile * BN;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp / 4, wn = warp % 4;  // warp tile: 64 rows x 32 columns
  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int k = 0; k < 4; ++k) acc[i][j][k] = 0.f;

  const int ktiles = p.kdim / BK;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ktiles) load_tile(sm, s, p, m0, n0, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (kt + STAGES - 1 < ktiles) load_tile(sm, (kt + STAGES - 1) % STAGES, p, m0, n0, kt + STAGES - 1);
    cp_async_commit();
    const int s = kt % STAGES;
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      u32 a[4][4], b[4][2];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        const int row = wm * 64 + mi * 16 + (lane % 16);
        ldmatrix_x4(a[mi], &sm.a[s][a_off(row, kk * 2 + lane / 16)]);
      }
#pragma unroll
      for (int nj = 0; nj < 2; ++nj) {
        const int k = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
        const int col = wn * 32 + nj * 16 + (lane / 16) * 8;
        u32 r[4];
        ldmatrix_x4_trans(r, &sm.b[s][b_off(k, col / 8)]);
        b[2 * nj][0] = r[0];
        b[2 * nj][1] = r[1];
        b[2 * nj + 1][0] = r[2];
        b[2 * nj + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) mma16816<false>(acc[mi][ni], a[mi], b[ni]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // Epilogue, one 64-row half of the tile at a time (the warps of row half wm stage theirs).
  float* stage = reinterpret_cast<float*>(&sm);
  const int g = lane / 4, q = lane % 4;
  const int half_rope = p.rope_dim / 2;
  for (int h = 0; h < 2; ++h) {
    if (wm == h) {
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          const int r = mi * 16 + g, c = wn * 32 + ni * 8 + 2 * q;
          stage[r * STAGE_LD + c] = acc[mi][ni][0];
          stage[r * STAGE_LD + c + 1] = acc[mi][ni][1];
          stage[(r + 8) * STAGE_LD + c] = acc[mi][ni][2];
          stage[(r + 8) * STAGE_LD + c + 1] = acc[mi][ni][3];
        }
    }
    __syncthreads();
    for (int v = threadIdx.x; v < (BM / 2) * (BN / 8); v += THREADS) {
      const int r = v / (BN / 8), c0 = (v % (BN / 8)) * 8;
      const int row = m0 + h * (BM / 2) + r, f0 = n0 + c0;
      if (row >= p.rows || f0 >= p.p) continue;
      const int layer = (p.feat0 + f0) / p.layer_width, within = p.feat0 + f0 - layer * p.layer_width;
      const int ch0 = f0 % p.head_dim;
      const double pos = p.rope_dim > 0 ? (double)p.positions[row] : 0.0;
      u32 packed[4];
#pragma unroll
      for (int e = 0; e < 8; e += 2) {
        float y[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int c = c0 + e + u, ch = ch0 + e + u;
          float x = stage[r * STAGE_LD + c] + p.mean[f0 + e + u];
          if (ch < p.rope_dim) {
            // angle in f64, reduced to [-pi, pi] before the fp32 sincos: positions reach 1e5+
            const int i = ch < half_rope ? ch : ch - half_rope;
            double a = pos * p.inv_freq[i];
            a -= rint(a * 0.15915494309189535) * 6.283185307179586;
            float sn, cs;
            sincosf((float)a, &sn, &cs);
            if (ch < half_rope) {
              const float b = stage[r * STAGE_LD + c + half_rope] + p.mean[f0 + e + u + half_rope];
              x = x * cs - b * sn;
            } else {
              const float b = stage[r * STAGE_LD + c - half_rope] + p.mean[f0 + e + u - half_rope];
              x = x * cs + b * sn;
            }
          }
          y[u] = x;
        }
        packed[e / 2] = pack2<false>(y[0], y[1]);
      }
      uint4 w;
      w.x = packed[0];
      w.y = packed[1];
      w.z = packed[2];
      w.w = packed[3];
      *reinterpret_cast<uint4*>(p.out + ((unsigned long long)layer * p.out_rows + p.out_row0 + row) * p.layer_width + within) = w;
    }
    __syncthreads();
  }
}

}  // namespace kvtc
}  // namespace kvforge

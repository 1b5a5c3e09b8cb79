// ParisKV retrieval (seed 001 §4) on the device: per-key summaries of the retrieval region, and
// per decode step vote -> top-C -> rerank -> top-k -> fetch -> attend. The f64 reference, the
// byte layout and the tie rules are kvforge-paris (`summary`, `retrieval`); the kernels follow
// them so that the GPU tests compare against it. The rotation is the rotated tier's
// (hadamard.cuh); the 16 direction levels are the rotated tier's Prop. 4.1 Lloyd-Max table at
// the subspace dim M (`levels(M, 4)`), passed in the params.
//
// Shapes: S sequences, Hkv kv heads, Hq = G * Hkv query heads, head dim D = B * M.
// Retrieval rows: a retrieval (bonus, vote, top-C, rerank, top-k, fetch) runs once per retrieval
// row, NR = Hkv * RG rows per sequence. By default RG = 1: one row per kv head, whose query is the
// sum of its G query heads (kvforge-paris `group_query`: the group's summed logits, whose eq. 10
// estimate is the sum of the heads' estimates), so the G heads share one top-k and one fetch.
// RG = G is the per-query-head option (each row the query of one head). Row r of a sequence
// belongs to kv head r / RG and sums query heads r * SH .. r * SH + SH - 1, SH = G / RG.
// Summaries per (sequence, kv head), `cap` keys each: ids [cap][B] u8, codes [cap][D/2] u8
// (channel c in byte c/2, low nibble for even c), weights [cap][B] fp16, hist [B][2^M] u32.
// The Whole64 layout (kvforge-paris `SummaryLayout::Whole64`, D/2 bytes per key; section
// "Whole64" below) keeps the same ids and hist and replaces codes and weights by one row of
// 3 D / 8 bytes per key in `codes` (magnitude bit stream, then the 8-bit log weight code) and
// one weight-grid top code per (sequence, kv head) in `wtop`; `weights` is unused.
// Full-precision K/V of the retrieval region: fp16 rows in pinned host memory, read over UVA:
// row t of (sequence s, kv head h) at host_k + ((s Hkv + h) host_cap + t) host_stride (halves),
// likewise host_v. The runtime interleaves them (host_stride = 2 D, host_v = host_k + D: [S][Hkv]
// [host_cap][K | V]), so that a token's K and V rows are one 4 D-byte run in one host page.
#pragma once
#include "common.cuh"
#include "hadamard.cuh"

namespace kvforge {
namespace paris {

// The summaries of every (sequence, kv head).
struct Index {
  u8* ids;
  u8* codes;
  __half* weights;
  u32* hist;
  const u32* len;  // [S] keys indexed per sequence
  int cap;         // key capacity per (sequence, kv head)
  int hkv;
  int* wtop;       // Whole64: [S][Hkv] the weight grid's top code (WTOP_NONE: none yet); else unused
};

struct EncodeParams {
  Index ix;
  const __half* keys;  // [rows][Hkv][D]
  const u32* seq_of;   // [rows] sequence of each new row
  const u32* pos_of;   // [rows] position of each new row in its sequence's retrieval region
  int rows;
  u32 seed;
  float levels[16];  // levels(M, 4); Whole64: levels(D, 4)
  float low[8];      // Whole64: levels(D, 3) of the low coordinates; else unused
};

struct BonusParams {
  const __half* q;  // [S][Hq][D]
  const u32* hist;  // Index::hist
  const u32* target;  // [S] ceil(rho * n), at least 1
  float* qrot;      // [S][NR][D] out: R q / |q| of each row's summed query
  float* qnorm;     // [S][NR] out
  u8* bonus;        // [S][Hkv][W][B][2^M] 32-bit words out, W = ceil(RG / 4): row g of a kv head
                    // in byte g % 4 of word g / 4 (bytes of absent rows stay zero)
  u32* score_hist;  // [S][NR][256] zeroed here for the vote
  u32* est_hist;    // [S][NR][EST_BINS] zeroed here for the rerank
  int nr, rg, share, hkv;  // rows per sequence, rows per kv head, query heads per row, kv heads
  u32 seed;
};

struct VoteParams {
  const u8* ids;
  const u32* len;
  const u8* bonus;  // BonusParams::bonus (packed)
  u8* scores;       // [S][NR][sstride] out
  u32* score_hist;  // [S][NR][256] out (zeroed by the bonus kernel): keys per collision score
  int cap, hkv;
  int sstride;      // score row stride: cap rounded up to 16 keys
};

// The integer-bucket top-C over many CTAs: bucket_count then bucket_emit, each over chunks of
// BUCKET_CHUNK keys of every (sequence, retrieval row).
struct BucketParams {
  const u8* scores;  // [S][NR][cap] (cap: VoteParams::sstride)
  const u32* hist;   // [S][NR][256] (VoteParams::score_hist)
  const u32* n;      // [S] keys
  const u32* want;   // [S] candidates to keep
  u32* chunk_gt;     // [S][NR][chunks]: keys above the threshold per chunk
  u32* chunk_eq;     // [S][NR][chunks]: keys at the threshold per chunk
  u32* out;          // [S][NR][stride] out: candidates ascending by key index
  u32* out_count;    // [S][NR] out
  int cap, stride, nr, chunks;
};

struct SelectParams {
  const u8* scores;  // [S][NR][cap] (select; cap: VoteParams::sstride) or unused (top-k)
  const float* est;  // [S][NR][cmax] (top-k) or unused (select)
  const u32* cand;   // [S][NR][cmax] (top-k: maps positions back to key indices)
  const u32* n;      // [S] values per row: keys (select) or unused (top-k reads count)
  const u32* count;  // [S][NR] candidates found (top-k)
  const u32* want;   // [S] how many to keep
  u32* out;          // [S][NR][stride] out: kept key indices, ascending (select) / by position (top-k)
  u32* out_count;    // [S][NR] out
  const u32* est_hist;  // [S][NR][EST_BINS] (one-pass top-k): estimates per top-EST_BITS key bin
  int cap, cmax, stride, nr;
};

struct RerankParams {
  Index ix;
  const float* qrot;  // [S][NR][D]
  const float* qnorm;
  const u32* cand;   // [S][NR][cmax]
  const u32* count;  // [S][NR]
  float* est;        // [S][NR][cmax] out
  u32* est_hist;     // [S][NR][EST_BINS] out (zeroed by the bonus kernel)
  const __half* q;   // [S][Hq][D]: rerank_hmax reads the G query heads of each row's kv head
  int cmax, nr, rg;
  int chunk;         // candidates per CTA: a multiple of RERANK_STEP, at most RERANK_CHUNK
  u32 seed;          // rerank_hmax: the shared rotation's seed
  float levels[16];  // as EncodeParams
  float low[8];
};

struct FetchParams {
  const __half* host_k;  // [S][Hkv][host_cap][D], pinned host memory (device pointer, UVA)
  const __half* host_v;
  const u32* top;        // [S][NR][kmax]
  const u32* top_count;  // [S][NR]
  __half* k_out;         // [S][NR][kmax][D]
  __half* v_out;
  u32* error_flags;
  const u32* len;        // [S] retrieval-region keys
  int host_cap, kmax, nr, rg, hkv;
  int host_stride;       // halves from one host row to the next (D, or 2 D interleaved)
  int per_cta;           // 16-byte pieces per work item: a multiple of the CTA's threads, at
                         // most threads * FETCH_UNROLL
  int rows;              // retrieval rows of the launch (S * NR)
};

struct AttendParams {
  const __half* q;        // [S][Hq][D]
  const __half* dense_k;  // [S][Hkv][dense_cap][D]: sinks, local window, update buffer on the GPU
  const __half* dense_v;
  const u32* dense_len;   // [S]
  // Retrieved rows of the query head's retrieval row (query head / share): staged by paris_fetch
  // (k_rows/v_rows [S][NR][kmax][D]) or, fused, read from pinned host memory through `top`
  // (host_k/host_v as in FetchParams).
  const __half* k_rows;
  const __half* v_rows;
  const __half* host_k;
  const __half* host_v;
  const u32* top;         // [S][NR][kmax]
  const u32* top_count;   // [S][NR]
  float* out;             // [S][Hq][D]
  float* lse;             // [S][Hq] natural-log sum of exp of the scaled logits
  float scale;
  int dense_cap, host_cap, kmax, hq, hkv, share;
  int host_stride;        // as FetchParams::host_stride
  // ParisKV inside the main cache (kvforge_rt::retrieval): a softmax block of the same queries
  // over the cache's GPU region, folded into `out` / `lse` in the epilogue; null: none.
  const u16* merge_out;   // [S][Hq][D], fp16 or (merge_bf16 != 0) bf16 bits
  const float* merge_lse; // [S][Hq], natural log
  int merge_bf16;
};

constexpr u32 ERR_TOP_RANGE = 1u;  // a retrieved index is past the retrieval region

// The one-pass top-k of the rerank estimates: the rerank counts every estimate in the bin of the
// top EST_BITS bits of its order key (float_key), so the top-k's threshold bin is known before
// the estimates are read; keys of that bin (at most TIE_CAP, else the radix select) are
// resolved on their low bits in shared memory.
constexpr int EST_BITS = 14, EST_BINS = 1 << EST_BITS, TIE_CAP = 4096;

// ---------------------------------------------------------------------------------------------
// Block helpers

template <int NT>
__device__ __forceinline__ u32 block_exclusive_scan(u32 x, u32* smem_warp, u32& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  u32 v = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const u32 y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  if (lane == 31) smem_warp[warp] = v;
  __syncthreads();
  if (warp == 0) {
    u32 w = lane < NT / 32 ? smem_warp[lane] : 0u;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const u32 y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    if (lane < NT / 32) smem_warp[lane] = w;
  }
  __syncthreads();
  total = smem_warp[NT / 32 - 1];
  const u32 before = (warp > 0 ? smem_warp[warp - 1] : 0u) + v - x;
  __syncthreads();
  return before;
}

template <int NT>
__device__ __forceinline__ float block_reduce(float x, float* smem, bool is_max) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, x, o);
    x = is_max ? fmaxf(x, y) : x + y;
  }
  if (lane == 0) smem[warp] = x;
  __syncthreads();
  float r = smem[0];
  for (int w = 1; w < NT / 32; ++w) r = is_max ? fmaxf(r, smem[w]) : r + smem[w];
  __syncthreads();
  return r;
}

// Orders floats as unsigned integers (larger float, larger key).
__device__ __forceinline__ u32 float_key(float f) {
  const u32 b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Radix-select step: given the 256-bin histogram `hist` (in shared memory) of the keys still in
// play, the bin holding the `room`-th largest key, and how many of that bin's keys to keep
// (`room` minus the keys in higher bins). One block scan over the bins read from the top; NT ≥
// 256. Returns through shared `s_bin` / `s_room` (valid after the call, for every thread).
template <int NT>
__device__ __forceinline__ void block_pick_bin(const u32* hist, u32 room, u32* warp_sums, u32* s_bin, u32* s_room) {
  static_assert(NT >= 256, "one thread per bin");
  const u32 t = threadIdx.x, x = t < 256 ? hist[255 - t] : 0u;
  if (t == 0) {
    *s_bin = 0;
    *s_room = room;
  }
  u32 total;
  const u32 above = block_exclusive_scan<NT>(x, warp_sums, total);
  // Bin 255 - t holds the room-th key: fewer than `room` keys above it, at least `room` with it.
  if (t < 256 && above < room && above + x >= room) {
    *s_bin = 255 - t;
    *s_room = room - above;
  }
  __syncthreads();
}

// Keeps the `want` largest of `n` keys `key(i)` (KEY_BITS wide), ties in index order, writing
// their positions ascending to out[0..]; returns the count. Radix select from the top bits (8
// per pass; the shared histogram's adds are warp-aggregated, since the top bits of float keys
// crowd one or two bins), then one emission over contiguous per-thread segments with two block
// scans. kvforge-paris `top_candidates` / `top_k_by` define the same set.
template <int NT, int KEY_BITS, class Key>
__device__ u32 block_select(const Key& key, u32 n, u32 want, u32* out) {
  __shared__ u32 hist[256];
  __shared__ u32 warp_sums[NT / 32];
  __shared__ u32 s_bin, s_room;
  if (want >= n) {
    for (u32 i = threadIdx.x; i < n; i += NT) out[i] = i;
    return n;
  }
  if (want == 0) return 0;
  const u32 lane = threadIdx.x & 31;
  u32 prefix = 0, mask = 0, room = want;
#pragma unroll 1
  for (int shift = KEY_BITS - 8; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += NT) hist[b] = 0;
    __syncthreads();
    // Uniform trip count per thread: every lane of a warp reaches the match.
    for (u32 base = 0; base < n; base += NT) {
      const u32 i = base + threadIdx.x;
      const u32 k = i < n ? key(i) : 0u;
      const bool in = i < n && (k & mask) == prefix;
      const u32 bin = (k >> shift) & 255u;
      const u32 peers = __match_any_sync(0xffffffffu, in ? bin : 256u + lane);
      if (in && lane == u32(__ffs(peers) - 1)) atomicAdd(&hist[bin], u32(__popc(peers)));
    }
    __syncthreads();
    block_pick_bin<NT>(hist, room, warp_sums, &s_bin, &s_room);
    prefix |= s_bin << shift;
    room = s_room;
    mask |= 255u << shift;
    __syncthreads();
  }
  // prefix is the threshold key t: keep every key > t and the first `room` keys == t. Thread
  // j owns positions [j·per, (j+1)·per): count, scan, emit.
  const u32 per = (n + NT - 1) / NT, lo = min(n, threadIdx.x * per), hi = min(n, lo + per);
  u32 gt = 0, eq = 0;
  for (u32 i = lo; i < hi; ++i) {
    const u32 k = key(i);
    gt += k > prefix;
    eq += k == prefix;
  }
  u32 eq_total, emit_total;
  const u32 eq_before = block_exclusive_scan<NT>(eq, warp_sums, eq_total);
  const u32 eq_keep = eq_before < room ? min(eq, room - eq_before) : 0u;
  u32 pos = block_exclusive_scan<NT>(gt + eq_keep, warp_sums, emit_total);
  u32 eq_left = eq_keep;
  for (u32 i = lo; i < hi; ++i) {
    const u32 k = key(i);
    if (k > prefix || (k == prefix && eq_left > 0)) {
      eq_left -= k == prefix;
      out[pos++] = i;
    }
  }
  __syncthreads();
  return emit_total;
}

// ---------------------------------------------------------------------------------------------
// Encode: summaries of new retrieval-region keys. Grid (ceil(rows / ROWS), Hkv), NT threads,
// ROWS = NT / 32 keys per CTA (one warp per key for the norm).

// The CTA's `rows` keys of kv head h from append row r0 as rotated unit vectors in x (rows past
// `rows` zero), their norms |k| in `norms` (a warp per key, summed in Acc and rounded once; a zero
// or subnormal-inverse key leaves x zero). Both encoders' prologue.
template <int D, int NT, int ROWS, class Acc>
__device__ void unit_rotated_keys(const EncodeParams& p, float (&x)[ROWS][D], float (&norms)[ROWS], int r0, int h, int rows) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < ROWS * D; i += NT) {
    const int r = i / D, c = i % D;
    x[r][c] = r < rows ? __half2float(p.keys[(size_t(r0 + r) * p.ix.hkv + h) * D + c]) : 0.f;
  }
  __syncthreads();
  {
    Acc s = 0;
    for (int c = lane; c < D; c += 32) s += Acc(x[warp][c]) * Acc(x[warp][c]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) norms[warp] = float(sqrt(s));
  }
  __syncthreads();
  for (int i = threadIdx.x; i < ROWS * D; i += NT) {
    const float n = norms[i / D], v = 1.f / n;
    x[i / D][i % D] = (n == 0.f || isinf(v)) ? 0.f : x[i / D][i % D] * v;
  }
  __syncthreads();
  hadamard_rows<D, NT, false>(&x[0][0], ROWS, p.seed);
}

template <int D, int M, int NT>
__device__ void encode_kernel(const EncodeParams& p) {
  constexpr int B = D / M, ROWS = NT / 32;
  __shared__ float x[ROWS][D];
  __shared__ float norms[ROWS];
  const int h = blockIdx.y, r0 = blockIdx.x * ROWS;
  const int rows = cmin(ROWS, p.rows - r0);
  // |k| (f32 sum; the reference sums in f64 and rounds once), then R k / |k|.
  unit_rotated_keys<D, NT, ROWS, float>(p, x, norms, r0, h, rows);
  for (int w = threadIdx.x; w < rows * B; w += NT) {
    const int r = w / B, b = w % B;
    const u32 s = p.seq_of[r0 + r], pos = p.pos_of[r0 + r];
    const size_t key = (size_t(s) * p.ix.hkv + h) * p.ix.cap + pos;
    const float* sub = &x[r][b * M];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < M; ++j) ss += sub[j] * sub[j];
    const float rad = sqrtf(ss), rinv = 1.f / rad;
    const bool zero = norms[r] == 0.f || isinf(1.f / norms[r]) || rad == 0.f || isinf(rinv);
    u32 id = 0;
    float alpha = 0.f;
    u8 codes[M];
#pragma unroll
    for (int j = 0; j < M; ++j) {
      const float u = sub[j] * rinv;
      int c = 0;
#pragma unroll
      for (int t = 0; t < 15; ++t) c += u > (p.levels[t] + p.levels[t + 1]) * 0.5f ? 1 : 0;
      codes[j] = zero ? u8(8) : u8(c);
      id |= u32(codes[j] >= 8) << j;
      alpha += p.levels[c] * u;
    }
    p.ix.ids[key * B + b] = u8(id);
#pragma unroll
    for (int j = 0; j < M; j += 2) p.ix.codes[key * (D / 2) + (b * M + j) / 2] = u8(codes[j] | (codes[j + 1] << 4));
    p.ix.weights[key * B + b] = __float2half_rn(zero || !(alpha > 0.f) ? 0.f : norms[r] * rad / alpha);
    atomicAdd(&p.ix.hist[((size_t(s) * p.ix.hkv + h) * B + b) * (1 << M) + id], 1u);
  }
}

// ---------------------------------------------------------------------------------------------
// Vote. Bonus tables: one CTA of 256 threads per (sequence, retrieval row, subspace) sums the
// row's query heads, rotates the sum and ranks the subspace's 2^M centroids by <q_b, w> (ties
// by id); a centroid gets T - floor(before * T / target) while the keys of the centroids ranked
// before it number fewer than target = ceil(rho * n). The subspace-0 CTA also writes the
// rotated query and its norm and zeroes the row's score histogram for the vote.

template <int D, int M, int TIERS>
__device__ void bonus_kernel(const BonusParams& p) {
  constexpr int B = D / M, C = 1 << M, NT = 256;
  static_assert(C <= NT, "one thread per centroid");
  static_assert(B * TIERS <= 255, "collision scores are bytes");
  __shared__ float q[D];
  __shared__ float score[C];
  __shared__ u32 occ[C];
  __shared__ float red[NT / 32];
  const int sh = blockIdx.x, b = blockIdx.y, s = sh / p.nr, r = sh % p.nr, h = r / p.rg;
  const u32* hist = p.hist + (size_t(s * p.hkv + h) * B + b) * C;
  // The row's query: the sum of its `share` query heads (f32, in head order).
  const __half* qh = p.q + (size_t(s) * p.nr + r) * p.share * D;
  for (int c = threadIdx.x; c < D; c += NT) {
    float x = 0.f;
    for (int j = 0; j < p.share; ++j) x += __half2float(qh[size_t(j) * D + c]);
    q[c] = x;
  }
  for (int c = threadIdx.x; c < C; c += NT) occ[c] = hist[c];
  __syncthreads();
  float v = 0.f;
  for (int c = threadIdx.x; c < D; c += NT) v += q[c] * q[c];
  const float norm = sqrtf(block_reduce<NT>(v, red, false));
  const float inv = norm > 0.f ? 1.f / norm : 0.f;
  for (int c = threadIdx.x; c < D; c += NT) q[c] *= inv;
  __syncthreads();
  hadamard_rows<D, NT, false>(q, 1, p.seed);
  if (b == 0) {
    for (int c = threadIdx.x; c < D; c += NT) p.qrot[size_t(sh) * D + c] = q[c];
    if (threadIdx.x == 0) p.qnorm[sh] = norm;
    for (int c = threadIdx.x; c < 256; c += NT) p.score_hist[size_t(sh) * 256 + c] = 0;
  }
  {
    // Subspace b's CTA zeroes bins [b, b + 1) * EST_BINS / B of the row's estimate histogram.
    static_assert(EST_BINS % (4 * B) == 0, "whole 16-byte stores");
    uint4* eh = reinterpret_cast<uint4*>(p.est_hist + size_t(sh) * EST_BINS + size_t(b) * (EST_BINS / B));
    for (int c = threadIdx.x; c < EST_BINS / B / 4; c += NT) eh[c] = make_uint4(0, 0, 0, 0);
  }
  const int w = threadIdx.x;
  if (w < C) {
    float sc = 0.f;
#pragma unroll
    for (int j = 0; j < M; ++j) sc += (w >> j & 1) ? q[b * M + j] : -q[b * M + j];
    score[w] = sc;
  }
  __syncthreads();
  // Rank the centroids (higher score first, ties by lower id) with a bitonic sort of
  // (score key, id) pairs, then an exclusive scan of their key counts in rank order: the keys
  // of the centroids ranked before each one. O(C log² C) work instead of every pair.
  __shared__ u64 order[NT];
  order[w] = w < C ? (u64(float_key(score[w])) << 32) | u64(0xffffffffu - u32(w)) : 0ull;
  __syncthreads();
  for (int k = 2; k <= NT; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      const int o = w ^ j;
      if (o > w) {
        const u64 a = order[w], c = order[o];
        // Descending within blocks whose bit k is clear, ascending otherwise.
        if (((w & k) == 0) == (a < c)) {
          order[w] = c;
          order[o] = a;
        }
      }
      __syncthreads();
    }
  }
  const u32 ranked = 0xffffffffu - u32(order[w]);  // the centroid at rank w (w < C)
  const u32 cnt = w < C ? occ[ranked] : 0u;
  // Counts reach n ≤ 2^32 - 1 keys in total: the scan's 32-bit sums do not wrap.
  u32 total;
  const u32 before = block_exclusive_scan<NT>(cnt, reinterpret_cast<u32*>(red), total);
  if (w < C) {
    const u64 target = p.target[s];
    const u8 bonus = u64(before) < target ? u8(TIERS - u64(before) * TIERS / target) : u8(0);
    if (p.rg == 1) {
      // One retrieval row per kv head: a byte table [S][Hkv][B][C] (the row vote's layout).
      p.bonus[((size_t(s) * p.hkv + h) * B + b) * C + ranked] = bonus;
    } else {
      const int g = r % p.rg, W = (p.rg + 3) / 4;
      p.bonus[((((size_t(s) * p.hkv + h) * W + g / 4) * B + b) * C + ranked) * 4 + g % 4] = bonus;
    }
  }
}

// Collision scores. Grid (ceil(len / VOTE_CHUNK), S * Hkv), NT threads, VOTE_CHUNK keys per
// CTA (each thread 4 consecutive keys per step, VOTE_CHUNK / (4 NT) steps). The G = RG
// retrieval rows' bonus tables of the kv head, written packed by the bonus kernel, sit in shared
// memory 4 rows to a word: one lookup per (key, subspace) serves 4 rows and the byte sums cannot
// carry (B T <= 255). Each key's scores go to each row's scores (4 keys, one 32-bit store) and to
// the CTA's score histogram, flushed with one global add per non-empty bin.
constexpr int VOTE_CHUNK = 4096;

template <int D, int M, int G, int NT>
__device__ void vote_kernel(const VoteParams& p) {
  constexpr int B = D / M, C = 1 << M, W = (G + 3) / 4, STEPS = VOTE_CHUNK / (4 * NT);
  static_assert(VOTE_CHUNK % (4 * NT) == 0, "whole steps");
  static_assert(W * B * C * 4 + G * 256 * 4 <= 48 * 1024, "the packed bonus tables of a kv head's query heads fit static shared memory");
  __shared__ __align__(16) u32 bonus[W * B * C];
  __shared__ u32 hist[G * 256];
  const int sh = blockIdx.y, s = sh / p.hkv, h = sh % p.hkv;
  const size_t qh0 = size_t(s) * p.hkv * G + size_t(h) * G;
  const u32 n = p.len[s], lo = blockIdx.x * VOTE_CHUNK;
  if (lo >= n) return;
  static_assert((W * B * C) % 4 == 0, "16-byte copies of the tables");
  const uint4* tables = reinterpret_cast<const uint4*>(p.bonus + size_t(sh) * W * B * C * 4);
  for (int i = threadIdx.x; i < W * B * C / 4; i += NT) reinterpret_cast<uint4*>(bonus)[i] = tables[i];
  for (int i = threadIdx.x; i < G * 256; i += NT) hist[i] = 0;
  __syncthreads();
  const u8* ids_base = p.ids + size_t(sh) * p.cap * B;
#pragma unroll 1
  for (int step = 0; step < STEPS; ++step) {
    const u32 i0 = lo + (step * NT + threadIdx.x) * 4;
    if (i0 >= n) break;
    u32 sc[4][W];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      alignas(16) u8 id[B];
      const u32 i = i0 + r;
      if (i < n) {
        const u8* ids = ids_base + size_t(i) * B;
        if constexpr (B % 16 == 0) {
#pragma unroll
          for (int v = 0; v < B / 16; ++v) *reinterpret_cast<uint4*>(&id[16 * v]) = reinterpret_cast<const uint4*>(ids)[v];
        } else if constexpr (B % 8 == 0) {
#pragma unroll
          for (int v = 0; v < B / 8; ++v) *reinterpret_cast<uint2*>(&id[8 * v]) = reinterpret_cast<const uint2*>(ids)[v];
        } else {
#pragma unroll
          for (int b = 0; b < B; ++b) id[b] = ids[b];
        }
      }
#pragma unroll
      for (int wd = 0; wd < W; ++wd) {
        u32 x = 0;
        if (i < n) {
#pragma unroll
          for (int b = 0; b < B; ++b) x += bonus[(wd * B + b) * C + id[b]];
        }
        sc[r][wd] = x;
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      u32 packed = 0;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const u32 v = (sc[r][g / 4] >> (8 * (g % 4))) & 255u;
        packed |= v << (8 * r);
        if (i0 + r < n) atomicAdd(&hist[g * 256 + v], 1u);
      }
      // Rows are padded to a multiple of 16 keys (sstride), so the 4-key word stays in the row.
      *reinterpret_cast<u32*>(p.scores + (qh0 + g) * p.sstride + i0) = packed;
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < G * 256; j += NT)
    if (hist[j]) atomicAdd(&p.score_hist[(qh0 + j / 256) * 256 + j % 256], hist[j]);
}

// The vote of one retrieval row per kv head (RG = 1). Grid and keys per thread as vote_kernel.
// The bonus tables are bytes ([B][C], B C bytes of shared memory): a warp's 32 lookups of a
// subspace fall on at most two words per bank (a 256-byte table is 64 words), where 32-bit
// entries (256 words) cost three to four passes. The score histogram is counted per thread
// without atomics: thread t owns byte `bin % 4` of word `(bin / 4) NT + t` (its own bank; a
// CTA gives a thread VOTE_CHUNK / NT ≤ 255 keys, so bytes do not wrap), and the warps sum the
// columns with redux at the end, two bins to a word.
template <int D, int M, int TIERS, int NT>
__device__ void vote_row_kernel(const VoteParams& p) {
  constexpr int B = D / M, C = 1 << M, BINS = B * TIERS + 1, WORDS = (BINS + 3) / 4, STEPS = VOTE_CHUNK / (4 * NT);
  static_assert(VOTE_CHUNK % (4 * NT) == 0 && VOTE_CHUNK / NT <= 255, "whole steps; byte counters");
  static_assert(B % 4 == 0 && (B * C) % 16 == 0, "ids and tables in whole words");
  static_assert(BINS <= 256, "collision scores are bytes");
  // Per-thread counters where they fit beside the tables (D ≤ 128 at M = 8); else shared
  // atomics on the CTA's histogram.
  constexpr bool PRIVATE = B * C + WORDS * NT * 4 <= 40 * 1024;
  __shared__ __align__(16) u8 table[B * C];
  __shared__ u32 counts[PRIVATE ? WORDS * NT : 1];
  __shared__ u32 hist[BINS];
  const int sh = blockIdx.y, s = sh / p.hkv;
  const u32 n = p.len[s], lo = blockIdx.x * VOTE_CHUNK;
  if (lo >= n) return;
  {
    const uint4* src = reinterpret_cast<const uint4*>(p.bonus + size_t(sh) * B * C);
    for (int i = threadIdx.x; i < B * C / 16; i += NT) reinterpret_cast<uint4*>(table)[i] = src[i];
  }
  if constexpr (PRIVATE)
    for (int i = threadIdx.x; i < WORDS * NT; i += NT) counts[i] = 0;
  for (int i = threadIdx.x; i < BINS; i += NT) hist[i] = 0;
  __syncthreads();
  u8* mine = reinterpret_cast<u8*>(counts) + 4 * threadIdx.x;
  const u8* ids_base = p.ids + size_t(sh) * p.cap * B;
  // The 4 keys' ids at i0 (zero past n), loaded one step ahead of their lookups. The kernel is
  // bound by the lookups' shared-memory wavefronts (a 256-byte table spans each bank twice), not
  // by the loads: the prefetch and one PRMT per id byte (the byte plus the table offset in one
  // add) took it from ~88 to ~86 µs at 1M keys × 8 rows (docs/paris.md).
  auto load = [&](u32 i0, u32 (&word)[4][B / 4]) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const u32* ids = reinterpret_cast<const u32*>(ids_base + size_t(i0 + r) * B);
      if (i0 + r >= n) {
#pragma unroll
        for (int v = 0; v < B / 4; ++v) word[r][v] = 0;
      } else {
        if constexpr (B % 16 == 0) {
#pragma unroll
          for (int v = 0; v < B / 16; ++v) {
            const uint4 x = reinterpret_cast<const uint4*>(ids)[v];
            word[r][4 * v] = x.x;
            word[r][4 * v + 1] = x.y;
            word[r][4 * v + 2] = x.z;
            word[r][4 * v + 3] = x.w;
          }
        } else {
#pragma unroll
          for (int v = 0; v < B / 4; ++v) word[r][v] = ids[v];
        }
      }
    }
  };
  u32 word[4][B / 4], next[4][B / 4];
  load(lo + threadIdx.x * 4, word);
#pragma unroll
  for (int step = 0; step < STEPS; ++step) {
    const u32 i0 = lo + (step * NT + threadIdx.x) * 4;
    if (i0 >= n) break;
    if (step + 1 < STEPS) load(i0 + 4 * NT, next);
    u32 packed = 0;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      u32 sc = 0;
#pragma unroll
      for (int v = 0; v < B / 4; ++v)
#pragma unroll
        for (int j = 0; j < 4; ++j) sc += table[(4 * v + j) * C + __byte_perm(word[r][v], 0u, 0x4440u + j)];
      if (i0 + r < n) {
        packed |= sc << (8 * r);
        if constexpr (PRIVATE)
          mine[(sc >> 2) * (4 * NT) + (sc & 3)] += 1;
        else
          atomicAdd(&hist[sc], 1u);
      }
    }
    // Rows are padded to a multiple of 16 keys (sstride), so the 4-key word stays in the row.
    *reinterpret_cast<u32*>(p.scores + size_t(sh) * p.sstride + i0) = packed;
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int v = 0; v < B / 4; ++v) word[r][v] = next[r][v];
  }
  __syncthreads();
  // Column sums: bytes 0 and 2 (bins 4 w, 4 w + 2) and bytes 1 and 3 in 16-bit halves; a
  // warp's 32 threads add at most 32 × 255 per half.
  const int lane = threadIdx.x & 31;
  for (int w = 0; w < (PRIVATE ? WORDS : 0); ++w) {
    const u32 x = counts[w * NT + threadIdx.x];
    const u32 even = __reduce_add_sync(0xffffffffu, x & 0x00ff00ffu), odd = __reduce_add_sync(0xffffffffu, (x >> 8) & 0x00ff00ffu);
    if (lane == 0) {
      const u32 c[4] = {even & 0xffffu, odd & 0xffffu, even >> 16, odd >> 16};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (c[j] && 4 * w + j < BINS) atomicAdd(&hist[4 * w + j], c[j]);
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < BINS; j += NT)
    if (hist[j]) atomicAdd(&p.score_hist[size_t(sh) * 256 + j], hist[j]);
}

// Threshold score t and how many keys scoring exactly t to keep (the reference's top-C rule),
// from the row's score histogram, by the whole CTA (NT = 256: a thread per score).
template <int NT>
__device__ __forceinline__ void bucket_threshold(const u32* hist, u32 n, u32 want, u32* warp_sums, u32& t, u32& room) {
  __shared__ u32 s_bin, s_room, h[256];
  if (want >= n) {
    t = 0;
    room = n;
    return;
  }
  for (int b = threadIdx.x; b < 256; b += NT) h[b] = hist[b];
  __syncthreads();
  block_pick_bin<NT>(h, want, warp_sums, &s_bin, &s_room);
  t = s_bin;
  room = s_room;
}

template <int NT>
__device__ __forceinline__ u32 block_sum(u32 x, u32* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  if (lane == 0) smem[warp] = x;
  __syncthreads();
  u32 r = 0;
  for (int w = 0; w < NT / 32; ++w) r += smem[w];
  __syncthreads();
  return r;
}

// The keys above and at the threshold in a row's chunks before `chunk` (the per-chunk counts
// `gt` / `eq` of a count kernel), summed by the whole CTA: where the chunk's keys start.
template <int NT>
__device__ __forceinline__ void chunks_before(const u32* gt, const u32* eq, u32 chunk, u32* smem, u32& gt_before, u32& eq_before) {
  u32 g = 0, e = 0;
  for (u32 c = threadIdx.x; c < chunk; c += NT) {
    g += gt[c];
    e += eq[c];
  }
  gt_before = block_sum<NT>(g, smem);
  eq_before = block_sum<NT>(e, smem);
}

// Keys per thread of the bucket top-C (PER, a multiple of 16: 16-byte loads of scores; rows are
// padded to 16 keys): 16 (`bucket_count` / `bucket_emit`) or 64 (`..._wide`). Each CTA computes
// the threshold and its chunk's offset before its loads, so many short rows (1M keys × 8 rows:
// 2048 CTAs of 4096 keys) do better with a quarter of the CTAs, while few (128K keys × 8 rows:
// 64 CTAs of 16384 keys) leave SMs idle; the runtime picks by the grid it would get.
constexpr int BUCKET_PER_THREAD = 16, BUCKET_PER_THREAD_WIDE = 64;

// The scores of keys [i0, i0 + PER) of a row, four to a word (16-byte loads of the 16-key
// groups that start below n).
template <int PER>
__device__ __forceinline__ void load_scores(const u8* row, u32 i0, u32 n, u32 (&w)[PER / 4]) {
#pragma unroll
  for (int v = 0; v < PER / 16; ++v) {
    const uint4 x = i0 + 16 * v < n ? *reinterpret_cast<const uint4*>(row + i0 + 16 * v) : make_uint4(0, 0, 0, 0);
    w[4 * v] = x.x;
    w[4 * v + 1] = x.y;
    w[4 * v + 2] = x.z;
    w[4 * v + 3] = x.w;
  }
}

// Score j of scores `w` loaded from key i0; keys at or past n read as 256, neither above nor at
// any threshold the callers compare with (they test `!= 256u` for "above").
template <int PER>
__device__ __forceinline__ u32 score_at(const u32 (&w)[PER / 4], u32 i0, u32 n, int j) {
  return i0 + j < n ? (w[j / 4] >> (8 * (j % 4))) & 255u : 256u;
}

// Counts, per chunk, the keys above and at the threshold. Grid (chunks, S * Hq).
template <int NT, int PER>
__device__ void bucket_count_kernel(const BucketParams& p) {
  constexpr int CHUNK = NT * PER;
  static_assert(NT == 256, "a thread per score in bucket_threshold");
  __shared__ u32 red[NT / 32];
  const int sh = blockIdx.y, s = sh / p.nr;
  const u32 n = p.n[s], want = cmin(p.want[s], p.stride);
  u32 t, room;
  bucket_threshold<NT>(p.hist + size_t(sh) * 256, n, want, red, t, room);
  const u8* sc = p.scores + size_t(sh) * p.cap;
  const u32 i0 = blockIdx.x * CHUNK + threadIdx.x * PER;
  u32 w[PER / 4];
  load_scores<PER>(sc, i0, n, w);
  u32 gt = 0, eq = 0;
  if (want < n) {
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      // A score of 256 is never >= t.
      const u32 v = score_at<PER>(w, i0, n, j);
      gt += v != 256u && v > t;
      eq += v == t;
    }
  }
  gt = block_sum<NT>(gt, red);
  eq = block_sum<NT>(eq, red);
  if (threadIdx.x == 0) {
    p.chunk_gt[size_t(sh) * p.chunks + blockIdx.x] = gt;
    p.chunk_eq[size_t(sh) * p.chunks + blockIdx.x] = eq;
  }
}

// Writes the candidates of each chunk at their index-order positions. Grid (chunks, S * Hq);
// thread j owns keys [PER j, PER (j + 1)) of the chunk: count, two
// block scans, emit.
template <int NT, int PER>
__device__ void bucket_emit_kernel(const BucketParams& p) {
  constexpr int CHUNK = NT * PER;
  static_assert(NT == 256, "a thread per score in bucket_threshold");
  __shared__ u32 red[NT / 32];
  const int sh = blockIdx.y, s = sh / p.nr;
  const u32 n = p.n[s], want = cmin(p.want[s], p.stride);
  u32* out = p.out + size_t(sh) * p.stride;
  if (blockIdx.x == 0 && threadIdx.x == 0) p.out_count[sh] = min(want, n);
  const u32 lo = blockIdx.x * CHUNK;
  if (lo >= n) return;
  if (want >= n) {
    // Every key is a candidate (want <= stride).
    for (u32 i = lo + threadIdx.x; i < min(lo + CHUNK, n); i += NT) out[i] = i;
    return;
  }
  u32 t, room;
  bucket_threshold<NT>(p.hist + size_t(sh) * 256, n, want, red, t, room);
  u32 gt_before, eq_before;
  chunks_before<NT>(p.chunk_gt + size_t(sh) * p.chunks, p.chunk_eq + size_t(sh) * p.chunks, blockIdx.x, red, gt_before, eq_before);
  const u32 i0 = lo + threadIdx.x * PER;
  u32 w[PER / 4];
  load_scores<PER>(p.scores + size_t(sh) * p.cap, i0, n, w);
  u32 gt = 0, eq = 0;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const u32 v = score_at<PER>(w, i0, n, j);
    gt += v != 256u && v > t;
    eq += v == t;
  }
  u32 eq_total, emit_total;
  const u32 eq_rank = eq_before + block_exclusive_scan<NT>(eq, red, eq_total);
  const u32 eq_keep = eq_rank < room ? min(eq, room - eq_rank) : 0u;
  u32 pos = gt_before + min(eq_before, room) + block_exclusive_scan<NT>(gt + eq_keep, red, emit_total);
  u32 eq_left = eq_keep;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const u32 v = score_at<PER>(w, i0, n, j);
    const bool g = v != 256u && v > t, e = v == t && eq_left > 0;
    if (g || e) {
      eq_left -= e && !g;
      out[pos++] = i0 + j;
    }
  }
}

// Integer-bucket top-C of the collision scores: one CTA of NT threads per (sequence, retrieval
// row); candidates ascending by key index.
template <int NT>
__device__ void select_kernel(const SelectParams& p) {
  const int sh = blockIdx.x, s = sh / p.nr;
  const u8* sc = p.scores + size_t(sh) * p.cap;
  u32* out = p.out + size_t(sh) * p.stride;
  const u32 n = p.n[s];
  const u32 got = block_select<NT, 8>([&](u32 i) { return u32(sc[i]); }, n, cmin(p.want[s], p.stride), out);
  if (threadIdx.x == 0) p.out_count[sh] = got;
}

// Rerank (eq. 10): est = |q| sum_b w_b sum_j l[c_j] q_bj for every candidate. Grid
// (ceil(cmax / chunk), S * NR), NT threads, a thread per candidate over `p.chunk` candidates per
// CTA (the [D][16] lookup of l_c q_j is built once per CTA). The runtime takes RERANK_CHUNK
// where rows are many and smaller chunks where few rows would leave SMs idle (batch 1). The
// lookups of a warp's lanes share the channel, so its 16 entries sit in 16 banks: no conflicts.
constexpr int RERANK_CHUNK = 2048, RERANK_UNROLL = 2;

// The direction codes (D / 2 bytes as D / 32 uint4) and the B fp16 weights of index key `key`.
template <int D, int M>
__device__ __forceinline__ void rerank_load(const RerankParams& p, size_t key, uint4 (&r)[D / 32], __half (&w)[D / M]) {
  constexpr int B = D / M;
  const uint4* row = reinterpret_cast<const uint4*>(p.ix.codes + key * (D / 2));
#pragma unroll
  for (int v = 0; v < D / 32; ++v) r[v] = row[v];
  if constexpr ((B * 2) % 16 == 0) {
#pragma unroll
    for (int v = 0; v < B * 2 / 16; ++v) reinterpret_cast<uint4*>(w)[v] = reinterpret_cast<const uint4*>(p.ix.weights + key * B)[v];
  } else {
#pragma unroll
    for (int bb = 0; bb < B; ++bb) w[bb] = p.ix.weights[key * B + bb];
  }
}

// The 4-bit code of channel `k` (0..31) of a row's uint4 `words` (eight per 32-bit word, LSB first).
__device__ __forceinline__ u32 rerank_code(const u32 (&words)[4], int k) { return (words[k / 8] >> (4 * (k % 8))) & 15u; }

// The candidate loop of both reranks, over candidates lo..hi of row `sh` (keys from `base`):
// RERANK_UNROLL candidates per thread and iteration, their codes and weights loaded before any
// is scored (several gathers in flight per thread); `score(codes, weights)` gives a candidate's
// estimate, written to `est` and counted in the row's estimate histogram.
template <int D, int M, int NT, class Score>
__device__ __forceinline__ void rerank_candidates(const RerankParams& p, int sh, u32 lo, u32 hi, size_t base, Score score) {
  constexpr int B = D / M;
#pragma unroll 1
  for (u32 c0 = lo + threadIdx.x; c0 < hi; c0 += RERANK_UNROLL * NT) {
    uint4 r[RERANK_UNROLL][D / 32];
    alignas(16) __half w[RERANK_UNROLL][B];
#pragma unroll
    for (int u = 0; u < RERANK_UNROLL; ++u) {
      const u32 c = c0 + u * NT;
      if (c >= hi) break;
      rerank_load<D, M>(p, base + p.cand[size_t(sh) * p.cmax + c], r[u], w[u]);
    }
#pragma unroll
    for (int u = 0; u < RERANK_UNROLL; ++u) {
      const u32 c = c0 + u * NT;
      if (c >= hi) break;
      const float e = score(r[u], w[u]);
      p.est[size_t(sh) * p.cmax + c] = e;
      atomicAdd(&p.est_hist[size_t(sh) * EST_BINS + (float_key(e) >> (32 - EST_BITS))], 1u);
    }
  }
}

template <int D, int M, int NT>
__device__ void rerank_kernel(const RerankParams& p) {
  constexpr int B = D / M;
  __shared__ float lut[D * 16];
  __shared__ float qs[D];
  const int sh = blockIdx.y, s = sh / p.nr, h = (sh % p.nr) / p.rg;
  const u32 count = p.count[sh], lo = blockIdx.x * u32(p.chunk);
  if (lo >= count) return;
  for (int i = threadIdx.x; i < D; i += NT) qs[i] = p.qrot[size_t(sh) * D + i];
  __syncthreads();
  for (int i = threadIdx.x; i < D * 16; i += NT) lut[i] = p.levels[i % 16] * qs[i / 16];
  __syncthreads();
  const float qn = p.qnorm[sh];
  const size_t base = size_t(s * p.ix.hkv + h) * p.ix.cap;
  rerank_candidates<D, M, NT>(p, sh, lo, min(count, lo + u32(p.chunk)), base, [&](const uint4 (&r)[D / 32], const __half (&w)[B]) {
    float acc = 0.f, dot = 0.f;
#pragma unroll
    for (int v = 0; v < D / 32; ++v) {
      const u32 words[4] = {r[v].x, r[v].y, r[v].z, r[v].w};
#pragma unroll
      for (int k = 0; k < 32; ++k) {
        const int ch = v * 32 + k;
        dot += lut[ch * 16 + rerank_code(words, k)];
        if ((ch + 1) % M == 0) {
          acc += __half2float(w[ch / M]) * dot;
          dot = 0.f;
        }
      }
    }
    return qn * acc;
  });
}

// Rerank by the group's largest estimate (kvforge-paris `Rank::GroupMax`, "hmax"): one
// retrieval row per kv head (RG = 1; its candidates come from the summed query's vote), each
// candidate scored by the eq. 10 estimate of each of the kv head's G query heads,
// est = max_g |q_g| sum_b w_b sum_j l[c_j] q~_gj (q~_g = R q_g / |q_g|, the reference's
// `Query::new` per head). Grid, candidates per thread and the estimate histogram as
// rerank_kernel; the CTA normalises and rotates the G queries itself (a warp per head).
//
// A candidate's codes and weights are read and unpacked once for all G heads: the lookup table
// (dynamic shared memory, D * 16 * hmax_pairs(G) * 4 bytes) holds, per (channel, code), the G
// heads' l_c q~_gj as fp16 pairs, so one 4-, 8- or 16-byte shared load (G <= 2, <= 4, <= 8)
// serves every head of the group; a warp's lanes read one channel's 16 entries, a contiguous
// 16 * 4 * hmax_pairs(G) bytes (conflict-free per phase). A subspace's M lookups add in half2 (the
// entries are l_c times unit-vector coordinates, |x| < 1); the weighted sum over subspaces and
// the norm are f32, as in rerank_kernel. Identical codes give identical estimates, so ties stay
// ties. G > 8 is not rendered (the runtime refuses GroupMax there).
__host__ __device__ constexpr int hmax_pairs(int g) { return g <= 2 ? 1 : g <= 4 ? 2 : 4; }

template <int P>
struct alignas(4 * P) HmaxEntry {
  u32 w[P];
};

// Bytes of dynamic shared memory rerank_hmax asks for beyond its table: room to start the table
// at a multiple of HMAX_ALIGN (see hmax_entry).
constexpr int HMAX_ALIGN = 256;

// The (channel `ch`, code) entry of the table at shared address `base` (a multiple of
// HMAX_ALIGN >= 64 P), the code being bits [4 k, 4 k + 4) of `word`. The entry's byte offset is
// ch * 64 P + code * 4 P: the code lands in place with one shift and one LOP3 that also ORs
// the aligned base in, and ch * 64 P is the load's immediate, so an entry costs two integer
// instructions and the load (the plain index took a shift, two LOP3 and an IMAD).
template <int P>
__device__ __forceinline__ HmaxEntry<P> hmax_entry(u32 base, u32 word, int k, int ch) {
  constexpr int SH = P == 1 ? 2 : P == 2 ? 3 : 4;  // log2(4 P)
  const int r = 4 * k - SH;
  const u32 moved = r >= 0 ? word >> r : word << -r;
  const u32 addr = ((moved & (15u << SH)) | base) + u32(ch * 64 * P);
  HmaxEntry<P> e;
  if constexpr (P == 1)
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(e.w[0]) : "r"(addr));
  else if constexpr (P == 2)
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(e.w[0]), "=r"(e.w[1]) : "r"(addr));
  else
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(e.w[0]), "=r"(e.w[1]), "=r"(e.w[2]), "=r"(e.w[3]) : "r"(addr));
  return e;
}

// Query heads G of retrieval row sh (p.q [rows][G][D] fp16) as rotated unit vectors in qs and
// their norms in qn (a warp per head), then the table's base in the dynamic shared memory
// `lut` (the first multiple of HMAX_ALIGN): returns the table as half2 and its shared address.
// Both group-max reranks' prologue.
template <int D, int G, int NT>
__device__ __half2* hmax_queries(const RerankParams& p, int sh, float (&qs)[G][D], float (&qn)[G], u32* lut, u32& lut_base) {
  const __half* qh = p.q + size_t(sh) * G * D;
  for (int i = threadIdx.x; i < G * D; i += NT) qs[i / D][i % D] = __half2float(qh[i]);
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int g = warp; g < G; g += NT / 32) {
    float v = 0.f;
    for (int c = lane; c < D; c += 32) v += qs[g][c] * qs[g][c];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const float norm = sqrtf(v), inv = norm > 0.f ? 1.f / norm : 0.f;
    for (int c = lane; c < D; c += 32) qs[g][c] *= inv;
    if (lane == 0) qn[g] = norm;
  }
  __syncthreads();
  hadamard_rows<D, NT, false>(&qs[0][0], G, p.seed);
  const u32 raw = u32(__cvta_generic_to_shared(lut));
  lut_base = (raw + HMAX_ALIGN - 1) & ~u32(HMAX_ALIGN - 1);
  return reinterpret_cast<__half2*>(lut + (lut_base - raw) / 4);
}

template <int D, int M, int G, int NT>
__device__ void rerank_hmax_kernel(const RerankParams& p) {
  if constexpr (G >= 1 && G <= 8) {
    constexpr int B = D / M, P = hmax_pairs(G);
    extern __shared__ __align__(16) u32 hmax_lut[];  // [D][16][P] half2
    __shared__ float qs[G][D];
    __shared__ float qn[G];
    const int sh = blockIdx.y, s = sh / p.nr, h = sh % p.nr;
    const u32 count = p.count[sh], lo = blockIdx.x * u32(p.chunk);
    if (lo >= count) return;
    // Row sh is kv head h of sequence s (RG = 1): its query heads are h G .. h G + G - 1.
    u32 lut_base;
    __half2* lut2 = hmax_queries<D, G, NT>(p, sh, qs, qn, hmax_lut, lut_base);
    for (int i = threadIdx.x; i < D * 16 * P; i += NT) {
      const int pp = i % P, code = (i / P) % 16, ch = i / (16 * P);
      const float l = p.levels[code];
      const float a = 2 * pp < G ? l * qs[2 * pp][ch] : 0.f, b = 2 * pp + 1 < G ? l * qs[2 * pp + 1][ch] : 0.f;
      lut2[i] = __floats2half2_rn(a, b);
    }
    __syncthreads();
    float norms[G];
#pragma unroll
    for (int g = 0; g < G; ++g) norms[g] = qn[g];
    const size_t base = size_t(s * p.ix.hkv + h) * p.ix.cap;
    rerank_candidates<D, M, NT>(p, sh, lo, min(count, lo + u32(p.chunk)), base, [&](const uint4 (&r)[D / 32], const __half (&w)[B]) {
      float acc[G];
#pragma unroll
      for (int g = 0; g < G; ++g) acc[g] = 0.f;
      __half2 dot[P];
#pragma unroll
      for (int v = 0; v < D / 32; ++v) {
        const u32 words[4] = {r[v].x, r[v].y, r[v].z, r[v].w};
#pragma unroll
        for (int k = 0; k < 32; ++k) {
          const int ch = v * 32 + k;
          const HmaxEntry<P> e = hmax_entry<P>(lut_base, words[k / 8], k % 8, ch);
#pragma unroll
          for (int j = 0; j < P; ++j) {
            const __half2 x = *reinterpret_cast<const __half2*>(&e.w[j]);
            dot[j] = ch % M == 0 ? x : __hadd2(dot[j], x);
          }
          if ((ch + 1) % M == 0) {
            const float wb = __half2float(w[ch / M]);
#pragma unroll
            for (int j = 0; j < P; ++j) {
              const float2 f = __half22float2(dot[j]);
              if (2 * j < G) acc[2 * j] = fmaf(wb, f.x, acc[2 * j]);
              if (2 * j + 1 < G) acc[2 * j + 1] = fmaf(wb, f.y, acc[2 * j + 1]);
            }
          }
        }
      }
      float e = norms[0] * acc[0];
#pragma unroll
      for (int g = 1; g < G; ++g) e = fmaxf(e, norms[g] * acc[g]);
      return e;
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Whole64 (kvforge-paris `SummaryLayout::Whole64`; f64 reference `compact::Layout::whole_eighth`,
// device row `compact::WholeRow`). One normalisation per key: every coordinate of the rotated
// unit key k~ = R k / |k| is coded on levels(D, 4) (code c in 0..15, sign c >= 8), except the 8
// low coordinates j % (D/8) == D/8 - 1 on levels(D, 3) (c in 0..7, sign c >= 4); one weight per
// key w = |k| / alpha, alpha = sum_j l[c_j] k~_j, stored as an 8-bit code on a log grid of 1/32
// octave: code 0 is w = 0, code c >= 1 is 2^((base + c) / 32), base = top - 255 with `top` the
// (sequence, kv head)'s grid top code (Index::wtop; base -128 when no key had a positive weight).
// Stored per key: ids [B] u8 = the sign plane (bit j of byte b is the sign of coordinate 8 b + j:
// the vote's ids, unchanged; M = 8), and a row of 3 D / 8 bytes: the magnitudes (|code - middle|:
// c - E/2 for a positive code, E/2 - 1 - c otherwise, 3 bits, 2 for a low coordinate) as one
// little-endian bit stream, coordinate j at bit 3 j - j / (D/8), 3 D - 8 bits, then the weight code
// in the last byte. D/8 + 3 D/8 = D/2 bytes.
//
// The grid is fixed per (sequence, kv head) by the first append (the prefill) that holds a key of
// positive weight for that kv head: while some kv head of the sequence has none (wtop WTOP_NONE:
// no append yet, or only zero keys, which code weight 0 on any grid), the runtime resets the
// sequence's wtop, runs encode_whole_kernel<SCALE = true> over the append's keys (atomic max of
// round(32 log2 w)) and restores the kv heads already fixed, so that its largest weight takes code 255 (kvforge-paris `LogGrid::fit`); the
// encoder then codes those and every later key on that grid, clamping to 1..255
// (`CompactSummaries::on_grid`). A streaming encoder never revisits a key. The norm, alpha, the
// weight and its log are computed in f64 as the reference does, so the weight codes match it
// bit for bit but where round(32 log2 w) sits on a half (the codes, as the seed layout's encoder,
// where the f32 rotation puts a coordinate on the other side of a threshold).

template <int D>
struct Whole {
  static constexpr int P = D / 8;         // a low coordinate every P
  static constexpr int ROW = 3 * D / 8;   // row bytes
  static constexpr int WORDS = ROW / 4;   // row 32-bit words; the weight is the top byte of the last
  static constexpr int IDW = D / 32;      // id words (4 ids per word)
  __host__ __device__ static constexpr bool low(int j) { return j % P == P - 1; }
  __host__ __device__ static constexpr int offset(int j) { return 3 * j - j / P; }
  __host__ __device__ static constexpr int width(int j) { return low(j) ? 2 : 3; }
};

// Index::wtop before any key with a positive weight (i32::MIN on the host).
constexpr int WTOP_NONE = -2147483647 - 1;

// The weight grid's base of a (sequence, kv head) from its top code.
__device__ __forceinline__ int whole_base(int top) { return top == WTOP_NONE ? -128 : top - 255; }

// The log-grid position round(32 log2 w) of a positive finite weight (f64, as the reference).
__device__ __forceinline__ int whole_log(double w) { return int(llround(32.0 * log2(w))); }

// Encode (SCALE false) or fit the grid (SCALE true). Grid (ceil(rows / ROWS), Hkv), NT threads,
// ROWS = NT / 32 keys per CTA, a warp per key.
template <int D, int M, int NT, bool SCALE>
__device__ void encode_whole_kernel(const EncodeParams& p) {
  if constexpr (M == 8 && D % 64 == 0) {
    using W = Whole<D>;
    constexpr int B = D / M, ROWS = NT / 32;
    __shared__ float x[ROWS][D];
    __shared__ u8 mags[ROWS][D];
    __shared__ float norms[ROWS];
    const int h = blockIdx.y, r0 = blockIdx.x * ROWS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rows = cmin(ROWS, p.rows - r0);
    // |k|: f64 sum, rounded once (the reference's).
    unit_rotated_keys<D, NT, ROWS, double>(p, x, norms, r0, h, rows);
    const int r = warp;
    if (r >= rows) return;
    const u32 s = p.seq_of[r0 + r], pos = p.pos_of[r0 + r];
    const size_t key = (size_t(s) * p.ix.hkv + h) * p.ix.cap + pos;
    const bool zero = norms[r] == 0.f || isinf(1.f / norms[r]);
    double alpha = 0.0;
    u32 signs[W::IDW];
#pragma unroll
    for (int t = 0; t < W::IDW; ++t) {
      const int j = t * 32 + lane;
      const float u = x[r][j];
      const bool lo = W::low(j);
      const int half = lo ? 4 : 8;
      int c = 0;
      if (lo) {
#pragma unroll
        for (int i = 0; i < 7; ++i) c += u > (p.low[i] + p.low[i + 1]) * 0.5f ? 1 : 0;
      } else {
#pragma unroll
        for (int i = 0; i < 15; ++i) c += u > (p.levels[i] + p.levels[i + 1]) * 0.5f ? 1 : 0;
      }
      if (zero) c = half;
      alpha += double(lo ? p.low[c] : p.levels[c]) * double(u);
      const bool pos_sign = c >= half;
      mags[r][j] = u8(pos_sign ? c - half : half - 1 - c);
      signs[t] = __ballot_sync(0xffffffffu, pos_sign);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) alpha += __shfl_xor_sync(0xffffffffu, alpha, o);
    const double w = !zero && alpha > 0.0 ? double(norms[r]) / alpha : 0.0;
    const bool positive = w > 0.0 && isfinite(w);
    const int hk = int(s) * p.ix.hkv + h;
    if constexpr (SCALE) {
      if (lane == 0 && positive) atomicMax(&p.ix.wtop[hk], whole_log(w));
      return;
    }
    __syncwarp();
    const int code = positive ? max(1, min(255, whole_log(w) - whole_base(p.ix.wtop[hk]))) : 0;
    // The magnitude stream: lane `lane` builds row word `lane`.
    if (lane < W::WORDS) {
      u32 word = 0;
#pragma unroll
      for (int j = 0; j < D; ++j) {
        const int o = W::offset(j) - 32 * lane;
        const u32 m = mags[r][j];
        if (o >= 0 && o < 32) word |= m << o;
        else if (o < 0 && o > -W::width(j)) word |= m >> -o;
      }
      if (lane == W::WORDS - 1) word = (word & 0x00ffffffu) | (u32(code) << 24);
      reinterpret_cast<u32*>(p.ix.codes + key * W::ROW)[lane] = word;
    }
    if (lane < W::IDW) reinterpret_cast<u32*>(p.ix.ids + key * B)[lane] = signs[lane];
    if (lane < B) {
      u32 id = 0;
#pragma unroll
      for (int t = 0; t < W::IDW; ++t) id = lane / 4 == t ? (signs[t] >> (8 * (lane % 4))) & 255u : id;
      atomicAdd(&p.ix.hist[(size_t(hk) * B + lane) * (1 << M) + id], 1u);
    }
  }
}

// One candidate's ids (the sign plane) and row.
template <int D>
struct WholeKey {
  u32 ids[Whole<D>::IDW];
  u32 row[Whole<D>::WORDS];
};

template <int D>
__device__ __forceinline__ void whole_load(const Index& ix, size_t key, WholeKey<D>& k) {
  using W = Whole<D>;
  const u8* ids = ix.ids + key * (D / 8);
  const u8* row = ix.codes + key * W::ROW;
  if constexpr (W::IDW % 4 == 0) {
#pragma unroll
    for (int v = 0; v < W::IDW / 4; ++v) reinterpret_cast<uint4*>(k.ids)[v] = reinterpret_cast<const uint4*>(ids)[v];
  } else {
#pragma unroll
    for (int v = 0; v < W::IDW / 2; ++v) reinterpret_cast<uint2*>(k.ids)[v] = reinterpret_cast<const uint2*>(ids)[v];
  }
  if constexpr (W::ROW % 16 == 0) {
#pragma unroll
    for (int v = 0; v < W::WORDS / 4; ++v) reinterpret_cast<uint4*>(k.row)[v] = reinterpret_cast<const uint4*>(row)[v];
  } else {
#pragma unroll
    for (int v = 0; v < W::WORDS / 2; ++v) reinterpret_cast<uint2*>(k.row)[v] = reinterpret_cast<const uint2*>(row)[v];
  }
}

// The lookup index of coordinate j: sign << 3 | magnitude. Called in fully unrolled loops, so
// that j, the bit offset and the words are constants.
template <int D>
__device__ __forceinline__ u32 whole_index(const WholeKey<D>& k, int j) {
  using W = Whole<D>;
  const int o = W::offset(j), wd = o / 32, sh = o % 32, width = W::width(j);
  u32 m = k.row[wd] >> sh;
  if (sh + width > 32) m |= k.row[wd + 1] << (32 - sh);
  return ((k.ids[j / 32] >> (j % 32)) & 1u) << 3 | (m & ((1u << width) - 1));
}

// The weight of a candidate: 2^((base + code) / 32), 0 for code 0.
__device__ __forceinline__ float whole_weight(u32 code, int base) { return code == 0 ? 0.f : exp2f(float(base + int(code)) * (1.f / 32.f)); }

// The level of lookup index `idx` (sign << 3 | magnitude) of coordinate j (`low`: levels(D, 3)).
__device__ __forceinline__ float whole_level(const RerankParams& p, bool low, int idx) {
  const int sign = idx >> 3, mag = idx & 7, half = low ? 4 : 8;
  if (mag >= half) return 0.f;
  const int c = sign ? half + mag : half - 1 - mag;
  return low ? p.low[c] : p.levels[c];
}

// The candidate loop of the Whole64 reranks (as rerank_candidates): `score(key)` gives a
// candidate's estimate.
template <int D, int NT, class Score>
__device__ __forceinline__ void whole_candidates(const RerankParams& p, int sh, u32 lo, u32 hi, size_t base, Score score) {
#pragma unroll 1
  for (u32 c0 = lo + threadIdx.x; c0 < hi; c0 += RERANK_UNROLL * NT) {
    WholeKey<D> k[RERANK_UNROLL];
#pragma unroll
    for (int u = 0; u < RERANK_UNROLL; ++u) {
      const u32 c = c0 + u * NT;
      if (c >= hi) break;
      whole_load<D>(p.ix, base + p.cand[size_t(sh) * p.cmax + c], k[u]);
    }
#pragma unroll
    for (int u = 0; u < RERANK_UNROLL; ++u) {
      const u32 c = c0 + u * NT;
      if (c >= hi) break;
      const float e = score(k[u]);
      p.est[size_t(sh) * p.cmax + c] = e;
      atomicAdd(&p.est_hist[size_t(sh) * EST_BINS + (float_key(e) >> (32 - EST_BITS))], 1u);
    }
  }
}


// Rerank of the summed query (rerank_kernel's grid and chunks): est = |q| w sum_j l[c_j] q~_j.
template <int D, int M, int NT>
__device__ void rerank_whole_kernel(const RerankParams& p) {
  if constexpr (M == 8 && D % 64 == 0) {
    __shared__ float lut[D * 16];
    __shared__ float qs[D];
    const int sh = blockIdx.y, s = sh / p.nr, h = (sh % p.nr) / p.rg;
    const u32 count = p.count[sh], lo = blockIdx.x * u32(p.chunk);
    if (lo >= count) return;
    for (int i = threadIdx.x; i < D; i += NT) qs[i] = p.qrot[size_t(sh) * D + i];
    __syncthreads();
    for (int i = threadIdx.x; i < D * 16; i += NT) lut[i] = whole_level(p, Whole<D>::low(i / 16), i % 16) * qs[i / 16];
    __syncthreads();
    const float qn = p.qnorm[sh];
    const int wbase = whole_base(p.ix.wtop[s * p.ix.hkv + h]);
    const size_t base = size_t(s * p.ix.hkv + h) * p.ix.cap;
    whole_candidates<D, NT>(p, sh, lo, min(count, lo + u32(p.chunk)), base, [&](const WholeKey<D>& k) {
      float dot = 0.f;
#pragma unroll
      for (int j = 0; j < D; ++j) dot += lut[j * 16 + whole_index<D>(k, j)];
      return qn * (whole_weight(k.row[Whole<D>::WORDS - 1] >> 24, wbase) * dot);
    });
  }
}

// Rerank by the group's largest head estimate (rerank_hmax_kernel's table, grid and dynamic
// shared memory; the entry of coordinate j and lookup index sign << 3 | magnitude): 8
// coordinates add in half2, the sum over the key in f32, est = max_g |q_g| w dot_g.
template <int D, int G, int P>
__device__ __forceinline__ void whole_hmax_dot(u32 lut_base, const WholeKey<D>& k, float (&acc)[G]) {
  __half2 dot[P];
#pragma unroll
  for (int j = 0; j < D; ++j) {
    const HmaxEntry<P> e = hmax_entry<P>(lut_base, whole_index<D>(k, j), 0, j);
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const __half2 x = *reinterpret_cast<const __half2*>(&e.w[i]);
      dot[i] = j % 8 == 0 ? x : __hadd2(dot[i], x);
    }
    if (j % 8 == 7) {
#pragma unroll
      for (int i = 0; i < P; ++i) {
        const float2 f = __half22float2(dot[i]);
        if (2 * i < G) acc[2 * i] += f.x;
        if (2 * i + 1 < G) acc[2 * i + 1] += f.y;
      }
    }
  }
}

template <int D, int M, int G, int NT>
__device__ void rerank_whole_hmax_kernel(const RerankParams& p) {
  if constexpr (M == 8 && D % 64 == 0 && G >= 1 && G <= 8) {
    constexpr int P = hmax_pairs(G);
    extern __shared__ __align__(16) u32 hmax_lut[];  // [D][16][P] half2
    __shared__ float qs[G][D];
    __shared__ float qn[G];
    const int sh = blockIdx.y, s = sh / p.nr, h = sh % p.nr;
    const u32 count = p.count[sh], lo = blockIdx.x * u32(p.chunk);
    if (lo >= count) return;
    u32 lut_base;
    __half2* lut2 = hmax_queries<D, G, NT>(p, sh, qs, qn, hmax_lut, lut_base);
    for (int i = threadIdx.x; i < D * 16 * P; i += NT) {
      const int pp = i % P, idx = (i / P) % 16, ch = i / (16 * P);
      const float l = whole_level(p, Whole<D>::low(ch), idx);
      const float a = 2 * pp < G ? l * qs[2 * pp][ch] : 0.f, b = 2 * pp + 1 < G ? l * qs[2 * pp + 1][ch] : 0.f;
      lut2[i] = __floats2half2_rn(a, b);
    }
    __syncthreads();
    float norms[G];
#pragma unroll
    for (int g = 0; g < G; ++g) norms[g] = qn[g];
    const int wbase = whole_base(p.ix.wtop[s * p.ix.hkv + h]);
    const size_t base = size_t(s * p.ix.hkv + h) * p.ix.cap;
    whole_candidates<D, NT>(p, sh, lo, min(count, lo + u32(p.chunk)), base, [&](const WholeKey<D>& k) {
      float acc[G];
#pragma unroll
      for (int g = 0; g < G; ++g) acc[g] = 0.f;
      whole_hmax_dot<D, G, P>(lut_base, k, acc);
      const float w = whole_weight(k.row[Whole<D>::WORDS - 1] >> 24, wbase);
      float e = norms[0] * (w * acc[0]);
#pragma unroll
      for (int g = 1; g < G; ++g) e = fmaxf(e, norms[g] * (w * acc[g]));
      return e;
    });
  }
}

// Top-k of the rerank estimates: one CTA per (sequence, retrieval row); writes key indices.
// STAGED first copies the row's estimates into dynamic shared memory (cmax floats), so the
// radix passes and the emission read shared rather than global memory.
template <int NT, bool STAGED>
__device__ void topk_kernel(const SelectParams& p) {
  extern __shared__ float staged[];
  __shared__ u32 pos[1024];
  const int sh = blockIdx.x, s = sh / p.nr;
  const float* est = p.est + size_t(sh) * p.cmax;
  const u32 n = p.count[sh], k = cmin(cmin(p.want[s], p.stride), 1024);
  u32 got;
  if constexpr (STAGED) {
    for (u32 i = threadIdx.x; i < n; i += NT) staged[i] = est[i];
    __syncthreads();
    got = block_select<NT, 32>([&](u32 i) { return float_key(staged[i]); }, n, k, pos);
  } else {
    got = block_select<NT, 32>([&](u32 i) { return float_key(est[i]); }, n, k, pos);
  }
  __syncthreads();
  for (u32 i = threadIdx.x; i < got; i += NT) p.out[size_t(sh) * p.stride + i] = p.cand[size_t(sh) * p.cmax + pos[i]];
  if (threadIdx.x == 0) p.out_count[sh] = got;
}

// The top-k's threshold bin of a row's estimate histogram `hist` (EST_BINS bins): the bin
// holding the k-th largest estimate, and how many of its keys to keep (k minus the keys in
// higher bins). Thread j owns bins EST_BINS - 1 - BPT j down to EST_BINS - BPT (j + 1), read from
// the top; one block scan. Returns through shared `s_bin` / `s_room` (valid after the call).
template <int NT>
__device__ __forceinline__ void est_threshold(const u32* hist, u32 k, u32* warp_sums, u32* s_bin, u32* s_room) {
  constexpr int BPT = EST_BINS / NT;
  static_assert(EST_BINS % NT == 0 && BPT % 4 == 0, "whole 16-byte loads of bins");
  const u32 top_bin = EST_BINS - 1 - threadIdx.x * BPT;
  u32 mine = 0;
  {
    const uint4* h4 = reinterpret_cast<const uint4*>(hist + top_bin + 1 - BPT);
#pragma unroll 4
    for (int v = 0; v < BPT / 4; ++v) {
      const uint4 x = h4[v];
      mine += x.x + x.y + x.z + x.w;
    }
  }
  if (threadIdx.x == 0) {
    *s_bin = 0;
    *s_room = k;
  }
  u32 total;
  u32 above = block_exclusive_scan<NT>(mine, warp_sums, total);
  if (above < k && above + mine >= k) {
    for (int j = 0; j < BPT; ++j) {
      const u32 c = hist[top_bin - j];
      if (above + c >= k) {
        *s_bin = top_bin - j;
        *s_room = k - above;
        break;
      }
      above += c;
    }
  }
  __syncthreads();
}

// Estimates per thread and pass of the one-pass top-k (topk_hist's tiles, the split top-k's
// chunks).
constexpr int TOPK_PER_THREAD = 8;

// The keys (float_key of the estimates) of a CTA's TOPK_PER_THREAD positions from i0, and how
// many lie above / in bin t (positions past n: 0, in neither).
__device__ __forceinline__ void topk_chunk_keys(const float* est, u32 i0, u32 n, u32 t, u32 (&key)[TOPK_PER_THREAD], u32& g, u32& e) {
  g = 0;
  e = 0;
#pragma unroll
  for (int u = 0; u < TOPK_PER_THREAD; ++u) {
    key[u] = i0 + u < n ? float_key(est[i0 + u]) : 0u;
    const u32 bin = key[u] >> (32 - EST_BITS);
    g += i0 + u < n && bin > t;
    e += i0 + u < n && bin == t;
  }
}

// Writes the keys `key` of a thread's TOPK_PER_THREAD positions from i0 (those below n): the
// candidates of bins above t at out[gp..], the low bits and positions of bin t's at
// tie_key / tie_pos[ep..], both in index order.
__device__ __forceinline__ void topk_emit_keys(const u32 (&key)[TOPK_PER_THREAD], u32 i0, u32 n, u32 t, const u32* cand, u32* out, u32 gp, u32* tie_key, u32* tie_pos, u32 ep) {
#pragma unroll
  for (int u = 0; u < TOPK_PER_THREAD; ++u) {
    if (i0 + u >= n) break;
    const u32 bin = key[u] >> (32 - EST_BITS);
    if (bin > t) {
      out[gp++] = cand[i0 + u];
    } else if (bin == t) {
      tie_key[ep] = key[u] & ((1u << (32 - EST_BITS)) - 1u);
      tie_pos[ep++] = i0 + u;
    }
  }
}

// The radix select over a whole row of `n` estimates, keeping k: the top-k where the threshold
// bin holds more than TIE_CAP keys. Writes the row's out and out_count.
template <int NT>
__device__ __forceinline__ void topk_radix_row(const float* est, const u32* cand, u32 n, u32 k, u32* pos, u32* out, u32* out_count) {
  const u32 got = block_select<NT, 32>([&](u32 i) { return float_key(est[i]); }, n, k, pos);
  __syncthreads();
  for (u32 i = threadIdx.x; i < got; i += NT) out[i] = cand[pos[i]];
  if (threadIdx.x == 0) *out_count = got;
}

// The threshold bin's winners: `above` keys of higher bins are written; keep `room` of the
// bin's `ties` keys by their low 32 - EST_BITS bits (tie_key(i), selected as 24-bit keys: whole
// 8-bit radix passes), ties in index order (tie_pos(i) their positions), after them.
template <int NT, class TieKey, class TiePos>
__device__ __forceinline__ void topk_take_ties(const TieKey& tie_key, const TiePos& tie_pos, u32 ties, u32 room, u32 above, const u32* cand, u32* pos, u32* out, u32* out_count) {
  static_assert(32 - EST_BITS <= 24, "tie keys fit the 24-bit select");
  const u32 got = block_select<NT, 24>(tie_key, ties, room, pos);
  __syncthreads();
  for (u32 i = threadIdx.x; i < got; i += NT) out[above + i] = cand[tie_pos(pos[i])];
  if (threadIdx.x == 0) *out_count = above + got;
}

// One-pass top-k of the rerank estimates: one CTA of NT = 1024 threads per (sequence, retrieval
// row). The threshold bin t and its room come from the rerank's histogram (a block scan over
// EST_BINS / NT bins per thread), then ONE pass over the estimates in tiles of 8 per thread, with one block
// scan per tile (above and at-threshold counts packed in a word) writes the keys of bins above t
// to the output and the keys of bin t, in index order, to shared memory; the radix select on
// their low bits keeps `room` of them (ties in index order: the same set as kvforge-paris
// `top_k_by` and the radix topk_kernel). A threshold bin of more than TIE_CAP keys falls back to
// the radix select over the whole row.
template <int NT>
__device__ void topk_hist_kernel(const SelectParams& p) {
  constexpr int TILE = NT * TOPK_PER_THREAD;
  static_assert(TILE < 65536, "packed tile counts");
  __shared__ u32 tie_key[TIE_CAP];
  __shared__ u32 tie_pos[TIE_CAP];
  __shared__ u32 pos[1024];
  __shared__ u32 warp_sums[NT / 32];
  __shared__ u32 s_bin, s_room;
  const int sh = blockIdx.x, s = sh / p.nr;
  const float* est = p.est + size_t(sh) * p.cmax;
  const u32* cand = p.cand + size_t(sh) * p.cmax;
  u32* out = p.out + size_t(sh) * p.stride;
  const u32 n = p.count[sh], k = cmin(cmin(p.want[s], p.stride), 1024);
  if (k >= n || k == 0) {
    const u32 got = k == 0 ? 0u : n;
    for (u32 i = threadIdx.x; i < got; i += NT) out[i] = cand[i];
    if (threadIdx.x == 0) p.out_count[sh] = got;
    return;
  }
  const u32* hist = p.est_hist + size_t(sh) * EST_BINS;
  est_threshold<NT>(hist, k, warp_sums, &s_bin, &s_room);
  const u32 t = s_bin, room = s_room, ties = hist[t];
  if (ties > TIE_CAP) {
    topk_radix_row<NT>(est, cand, n, k, pos, out, p.out_count + sh);
    return;
  }
  u32 gt_off = 0, eq_off = 0;
#pragma unroll 1
  for (u32 base = 0; base < n; base += TILE) {
    u32 key[TOPK_PER_THREAD], g, e, tile_total;
    const u32 i0 = base + threadIdx.x * TOPK_PER_THREAD;
    topk_chunk_keys(est, i0, n, t, key, g, e);
    const u32 before = block_exclusive_scan<NT>((g << 16) | e, warp_sums, tile_total);
    topk_emit_keys(key, i0, n, t, cand, out, gt_off + (before >> 16), tie_key, tie_pos, eq_off + (before & 0xffffu));
    gt_off += tile_total >> 16;
    eq_off += tile_total & 0xffffu;
  }
  __syncthreads();
  // gt_off == k - room keys above the bin are written.
  topk_take_ties<NT>([&](u32 i) { return tie_key[i]; }, [&](u32 i) { return tie_pos[i]; }, ties, room, gt_off, cand, pos, out, p.out_count + sh);
}

// The one-pass top-k split over many CTAs per row, for launches with fewer retrieval rows than
// SMs (batch 1: 8 rows would leave 124 of 132 SMs idle under topk_hist). Two kernels over a grid
// (chunks, rows) of TOPK_CHUNK estimates per CTA; the set and its order are topk_hist's (the keys
// of bins above the threshold in index order, then the threshold bin's `room` winners by
// position, or the radix select's positions when the bin holds more than TIE_CAP keys).
//   topk_split_count: each CTA finds the threshold bin (est_threshold) and counts its chunk's
//     keys above and in it; CTA 0 of a row stores the bin and its room and zeroes the row's
//     finish counter.
//   topk_split_emit: each CTA writes its chunk's keys above the bin at their index-order
//     positions and those in the bin (low bits and position) to the row's tie buffer; the last
//     CTA of the row to finish (a counter behind a fence) selects the bin's winners.
constexpr int TOPK_SPLIT_NT = 256, TOPK_CHUNK = TOPK_PER_THREAD * TOPK_SPLIT_NT;

struct TopkSplitParams {
  const float* est;     // [rows][cmax]
  const u32* cand;      // [rows][cmax]
  const u32* count;     // [rows] candidates found
  const u32* want;      // [S] keys to keep
  const u32* est_hist;  // [rows][EST_BINS]
  u32* chunk_gt;        // [rows][chunks] scratch: keys above the threshold bin per chunk
  u32* chunk_eq;        // [rows][chunks] scratch: keys in it per chunk
  u32* thresh;          // [rows][2] scratch: the threshold bin and its room
  u32* done;            // [rows] scratch: emit CTAs finished
  u32* tie_key;         // [rows][TIE_CAP] scratch: low bits of the bin's keys, by position
  u32* tie_pos;         // [rows][TIE_CAP] scratch: their positions
  u32* out;             // [rows][stride]
  u32* out_count;       // [rows]
  int cmax, stride, nr, chunks;
};

template <int NT>
__device__ void topk_split_count_kernel(const TopkSplitParams& p) {
  static_assert(NT == TOPK_SPLIT_NT, "TOPK_CHUNK estimates per CTA");
  __shared__ u32 warp_sums[NT / 32];
  __shared__ u32 s_bin, s_room;
  const int sh = blockIdx.y, s = sh / p.nr;
  const u32 n = p.count[sh], k = cmin(cmin(p.want[s], p.stride), 1024);
  // CTA 0 of a row stores its threshold; CTAs past the row's candidates have nothing to count.
  if (k >= n || k == 0 || (blockIdx.x != 0 && blockIdx.x * TOPK_CHUNK >= n)) return;
  est_threshold<NT>(p.est_hist + size_t(sh) * EST_BINS, k, warp_sums, &s_bin, &s_room);
  const u32 t = s_bin;
  u32 key[TOPK_PER_THREAD], g, e;
  topk_chunk_keys(p.est + size_t(sh) * p.cmax, blockIdx.x * TOPK_CHUNK + threadIdx.x * TOPK_PER_THREAD, n, t, key, g, e);
  g = block_sum<NT>(g, warp_sums);
  e = block_sum<NT>(e, warp_sums);
  if (threadIdx.x == 0) {
    p.chunk_gt[size_t(sh) * p.chunks + blockIdx.x] = g;
    p.chunk_eq[size_t(sh) * p.chunks + blockIdx.x] = e;
    if (blockIdx.x == 0) {
      p.thresh[2 * sh] = t;
      p.thresh[2 * sh + 1] = s_room;
      p.done[sh] = 0;
    }
  }
}

template <int NT>
__device__ void topk_split_emit_kernel(const TopkSplitParams& p) {
  static_assert(NT == TOPK_SPLIT_NT, "TOPK_CHUNK estimates per CTA");
  __shared__ u32 warp_sums[NT / 32];
  __shared__ u32 pos[1024];
  __shared__ bool s_last;
  const int sh = blockIdx.y, s = sh / p.nr;
  const float* est = p.est + size_t(sh) * p.cmax;
  const u32* cand = p.cand + size_t(sh) * p.cmax;
  u32* out = p.out + size_t(sh) * p.stride;
  const u32 n = p.count[sh], k = cmin(cmin(p.want[s], p.stride), 1024);
  const u32 lo = blockIdx.x * TOPK_CHUNK;
  if (k >= n || k == 0) {
    const u32 got = k == 0 ? 0u : n;
    for (u32 i = lo + threadIdx.x; i < min(lo + TOPK_CHUNK, got); i += NT) out[i] = cand[i];
    if (blockIdx.x == 0 && threadIdx.x == 0) p.out_count[sh] = got;
    return;
  }
  const u32 t = p.thresh[2 * sh], room = p.thresh[2 * sh + 1], ties = p.est_hist[size_t(sh) * EST_BINS + t];
  u32* tie_key = p.tie_key + size_t(sh) * TIE_CAP;
  u32* tie_pos = p.tie_pos + size_t(sh) * TIE_CAP;
  if (ties <= TIE_CAP && lo < n) {
    u32 gt_before, eq_before;
    chunks_before<NT>(p.chunk_gt + size_t(sh) * p.chunks, p.chunk_eq + size_t(sh) * p.chunks, blockIdx.x, warp_sums, gt_before, eq_before);
    const u32 i0 = lo + threadIdx.x * TOPK_PER_THREAD;
    u32 key[TOPK_PER_THREAD], g, e, total;
    topk_chunk_keys(est, i0, n, t, key, g, e);
    const u32 before = block_exclusive_scan<NT>((g << 16) | e, warp_sums, total);
    topk_emit_keys(key, i0, n, t, cand, out, gt_before + (before >> 16), tie_key, tie_pos, eq_before + (before & 0xffffu));
  }
  // The last CTA of the row to get here sees every other CTA's writes (each fenced them before
  // counting itself).
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(p.done + sh, 1u) == u32(gridDim.x) - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  if (ties > TIE_CAP) {
    topk_radix_row<NT>(est, cand, n, k, pos, out, p.out_count + sh);
    return;
  }
  // k - room keys above the bin are written; the bin's keys are read from L2: other CTAs wrote
  // them.
  topk_take_ties<NT>([&](u32 i) { return __ldcg(tie_key + i); }, [&](u32 i) { return __ldcg(tie_pos + i); }, ties, room, k - room, cand, pos, out, p.out_count + sh);
}

// ---------------------------------------------------------------------------------------------
// Fetch: the k retrieved K/V rows of each retrieval row from pinned host memory (UVA) into
// device staging, once for the query heads that share the row. 16-byte pieces: piece e of a
// row is token e / (2V)'s K (its first V pieces) or V (the rest). A work item is one row's
// pieces [y per_cta, (y + 1) per_cta); a 1-D grid of NT-thread CTAs strides over the S * NR *
// ceil(2 kmax V / per_cta) items. The runtime picks per_cta (a multiple of NT, at most NT *
// FETCH_UNROLL) so that few rows still cover every SM, and caps the grid at a few CTAs per SM:
// the host link, not the SMs, bounds a large fetch, and the pipelined step runs retrieval
// kernels beside it. A thread first loads the token indices of all its pieces (independent
// loads from device memory), then issues every host read (FETCH_UNROLL 16-byte UVA loads in
// flight per thread, none waiting on another), then stores. A warp's 32 pieces are one token's
// K and V rows at D 128: one run of 4 D bytes in host memory when interleaved.
constexpr int FETCH_UNROLL = 8;

template <int D, int NT>
__device__ void fetch_kernel(const FetchParams& p) {
  constexpr int V = D * 2 / 16;  // uint4 per row
  // Work item w = (retrieval row w / ychunks, its share w % ychunks of the row's pieces); the
  // grid may be smaller than the items (a grid-stride loop), so that a large batch's fetch,
  // bound by the host link, leaves SM slots to kernels on another stream.
  const u32 ychunks = (2 * u32(p.kmax) * V + u32(p.per_cta) - 1) / u32(p.per_cta), items = u32(p.rows) * ychunks;
#pragma unroll 1
  for (u32 item = blockIdx.x; item < items; item += gridDim.x) {
    const int sh = int(item / ychunks), s = sh / p.nr, h = (sh % p.nr) / p.rg;
    const u32 first = (item % ychunks) * u32(p.per_cta), lo = first + threadIdx.x;
    // The row's count, the sequence's length and the token indices are loaded side by side (the
    // indices of the whole top buffer row, kmax of them, before the count says how many are
    // used), so that each host read waits on one round trip to device memory, not three.
    const u32 cap_end = min(2 * u32(p.kmax) * V, first + u32(p.per_cta));
    const u32* top = p.top + size_t(sh) * p.kmax;
    u32 t[FETCH_UNROLL];
#pragma unroll
    for (int u = 0; u < FETCH_UNROLL; ++u) {
      const u32 e = lo + u * NT;
      t[u] = e < cap_end ? __ldg(top + e / (2 * V)) : 0u;
    }
    const u32 total = 2 * __ldg(p.top_count + sh) * V, len = __ldg(p.len + s);
    const u32 end = min(total, first + u32(p.per_cta));
    if (lo >= end) continue;
    const size_t sv = size_t(p.host_stride) / 8;  // uint4 from one host row to the next
    const uint4* hk = reinterpret_cast<const uint4*>(p.host_k) + size_t(s * p.hkv + h) * p.host_cap * sv;
    const uint4* hv = reinterpret_cast<const uint4*>(p.host_v) + size_t(s * p.hkv + h) * p.host_cap * sv;
    uint4* ko = reinterpret_cast<uint4*>(p.k_out) + size_t(sh) * p.kmax * V;
    uint4* vo = reinterpret_cast<uint4*>(p.v_out) + size_t(sh) * p.kmax * V;
    uint4 x[FETCH_UNROLL];
#pragma unroll
    for (int u = 0; u < FETCH_UNROLL; ++u) {
      const u32 e = lo + u * NT, c = e % (2 * V);
      x[u] = make_uint4(0, 0, 0, 0);
      if (e < end && t[u] < len) x[u] = c < V ? hk[size_t(t[u]) * sv + c] : hv[size_t(t[u]) * sv + c - V];
    }
#pragma unroll
    for (int u = 0; u < FETCH_UNROLL; ++u) {
      const u32 e = lo + u * NT, r = e / (2 * V), c = e % (2 * V);
      if (e >= end) continue;
      if (t[u] >= len) {
        atomicOr(p.error_flags, ERR_TOP_RANGE);
        continue;
      }
      if (c < V)
        ko[size_t(r) * V + c] = x[u];
      else
        vo[size_t(r) * V + c - V] = x[u];
    }
  }
}

// ParisKV inside the main cache (kvforge_rt::retrieval): the cache's decode of the GPU region
// (AttendParams::merge_out in the spec dtype, merge_lse) and the attention over the retrieved
// rows are softmax blocks over disjoint keys, so one softmax over both is their mean weighted by
// e^lse. A query head with no rows of its own (lb = -inf: its sequence's retrieval region is
// empty) takes the cache's block alone.
struct Merge {
  float wa, wb, lse;  // weights of the cache's block and of the own rows; the merged lse
  bool on;
};

__device__ inline Merge merge_weights(float la, float lb, bool on) {
  if (!on) return Merge{0.f, 1.f, lb, false};
  const float m = fmaxf(la, lb);
  const float wa = la == NEG_INF ? 0.f : expf(la - m), wb = lb == NEG_INF ? 0.f : expf(lb - m);
  const float tot = wa + wb, inv = tot > 0.f ? 1.f / tot : 0.f;
  return Merge{wa * inv, wb * inv, m == NEG_INF ? NEG_INF : m + logf(tot), true};
}

// Element i of the cache's block, fp16 or bf16 bits.
__device__ inline float merged_value(const u16* out, int bf16, size_t i) {
  const u32 bits = out[i];
  return bf16 ? __uint_as_float(bits << 16) : __half2float(__ushort_as_half(u16(bits)));
}

// ---------------------------------------------------------------------------------------------
// Attention over the dense rows (sinks + local + update buffer) and the k retrieved rows of the
// query head's retrieval row with one softmax. One CTA of NT threads per (sequence, query head);
// dynamic shared memory holds dense_cap + kmax logits (FUSED: and the row's kmax top indices).
// D / 8 lanes own a row (16-byte loads, ATTEND_UNROLL rows in flight per lane group: at batch 1
// the few CTAs wait on their loads, so more rows in flight pay; docs/paris.md has the sweep),
// NT * 8 / D rows per step. FUSED reads the retrieved rows from host memory through `top`,
// staged in shared memory first so that no host read waits on an index load.
// Every lane group accumulates its rows in ascending order whatever the unroll: the staged and
// fused results are the same bits.
constexpr int ATTEND_UNROLL = 8;

template <int D, int G, int NT, bool FUSED>
__device__ void attend_kernel(const AttendParams& p) {
  constexpr int L = D / 8, RG = NT / L;  // lanes per row, rows per step
  constexpr int UNROLL = ATTEND_UNROLL;
  static_assert(L <= 32 && 32 % L == 0 && NT % L == 0, "a row's lanes sit in one warp");
  extern __shared__ float logit[];
  u32* top_s = reinterpret_cast<u32*>(logit + p.dense_cap + p.kmax);  // FUSED: [kmax]
  __shared__ float red[NT / 32];
  __shared__ float acc[RG][D];
  const int sh = blockIdx.x, s = sh / p.hq, h = (sh % p.hq) / G;
  const int sub = threadIdx.x % L, grp = threadIdx.x / L;
  float q[8];
  {
    const uint4 x = reinterpret_cast<const uint4*>(p.q + size_t(sh) * D)[sub];
    const __half2* hx = reinterpret_cast<const __half2*>(&x);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __half22float2(hx[j]);
      q[2 * j] = f.x * p.scale;
      q[2 * j + 1] = f.y * p.scale;
    }
  }
  // The retrieval row whose top-k this query head attends.
  const size_t row = size_t(s) * (p.hq / p.share) + (sh % p.hq) / p.share;
  const u32 nd = p.dense_len[s], nk = p.top_count[row], n = nd + nk;
  const size_t dense0 = size_t(s * p.hkv + h) * p.dense_cap, host0 = size_t(s * p.hkv + h) * p.host_cap;
  if (FUSED) {
    for (u32 i = threadIdx.x; i < nk; i += NT) top_s[i] = p.top[row * p.kmax + i];
    __syncthreads();
  }
  // The 16 bytes of row r this lane reads (channels 8 sub .. 8 sub + 7).
  auto load = [&](const __half* dense, const __half* staged, const __half* host, u32 r) -> uint4 {
    const __half* src;
    if (r < nd)
      src = dense + (dense0 + r) * D;
    else if (FUSED)
      src = host + (host0 + top_s[r - nd]) * size_t(p.host_stride);
    else
      src = staged + (row * p.kmax + r - nd) * D;
    return reinterpret_cast<const uint4*>(src)[sub];
  };
  auto dot8 = [&](const uint4& x) {
    const __half2* hx = reinterpret_cast<const __half2*>(&x);
    float d = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __half22float2(hx[j]);
      d += q[2 * j] * f.x + q[2 * j + 1] * f.y;
    }
    return d;
  };
  // Logits. The loop's trip count is uniform per warp (the shuffles need every lane).
#pragma unroll 1
  for (u32 r0 = 0; r0 < n; r0 += RG * UNROLL) {
    uint4 x[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const u32 r = r0 + u * RG + grp;
      x[u] = r < n ? load(p.dense_k, p.k_rows, p.host_k, r) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float d = dot8(x[u]);
#pragma unroll
      for (int o = L / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
      const u32 r = r0 + u * RG + grp;
      if (sub == 0 && r < n) logit[r] = d;
    }
  }
  __syncthreads();
  float mx = NEG_INF;
  for (u32 r = threadIdx.x; r < n; r += NT) mx = fmaxf(mx, logit[r]);
  mx = block_reduce<NT>(mx, red, true);
  float sum = 0.f;
  for (u32 r = threadIdx.x; r < n; r += NT) {
    const float e = __expf(logit[r] - mx);
    logit[r] = e;
    sum += e;
  }
  sum = block_reduce<NT>(sum, red, false);
  __syncthreads();
  // Values: lane group grp accumulates channels 8 sub .. 8 sub + 7 of rows grp, grp + RG, ...
  float o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
  for (u32 r0 = 0; r0 < n; r0 += RG * UNROLL) {
    uint4 x[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const u32 r = r0 + u * RG + grp;
      x[u] = r < n ? load(p.dense_v, p.v_rows, p.host_v, r) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const u32 r = r0 + u * RG + grp;
      const float e = r < n ? logit[r] : 0.f;
      const __half2* hx = reinterpret_cast<const __half2*>(&x[u]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = __half22float2(hx[j]);
        o[2 * j] += e * f.x;
        o[2 * j + 1] += e * f.y;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[grp][8 * sub + j] = o[j];
  __syncthreads();
  const float lb = n > 0 ? mx + __logf(sum) : NEG_INF;
  const Merge mg = merge_weights(p.merge_out != nullptr ? p.merge_lse[sh] : NEG_INF, lb, p.merge_out != nullptr);
  for (int c = threadIdx.x; c < D; c += NT) {
    float t = 0.f;
#pragma unroll
    for (int g = 0; g < RG; ++g) t += acc[g][c];
    const float own = n > 0 ? t / sum : 0.f;
    p.out[size_t(sh) * D + c] = mg.on ? mg.wa * merged_value(p.merge_out, p.merge_bf16, size_t(sh) * D + c) + mg.wb * own : own;
  }
  if (threadIdx.x == 0) p.lse[sh] = mg.lse;
}
}  // namespace paris
}  // namespace kvforge

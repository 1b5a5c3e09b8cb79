// ParisKV retrieval (seed 001 §4) on the device: per-key summaries of the retrieval region, and
// per decode step vote -> top-C -> rerank -> top-k -> fetch -> attend. The f64 reference, the
// byte layout and the tie rules are kvforge-paris (`summary`, `retrieval`); the kernels follow
// them so that the GPU tests compare against it. The rotation is the rotated tier's
// (hadamard.cuh); the 16 direction levels are the rotated tier's Prop. 4.1 Lloyd-Max table at
// the subspace dim M (`levels(M, 4)`), passed in the params.
//
// Shapes: S sequences, Hkv kv heads, Hq = G * Hkv query heads, head dim D = B * M.
// Summaries per (sequence, kv head), `cap` keys each: ids [cap][B] u8, codes [cap][D/2] u8
// (channel c in byte c/2, low nibble for even c), weights [cap][B] fp16, hist [B][2^M] u32.
// Full-precision K/V of the retrieval region: fp16 [S][Hkv][host_cap][D] in pinned host memory,
// read over UVA.
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
};

struct EncodeParams {
  Index ix;
  const __half* keys;  // [rows][Hkv][D]
  const u32* seq_of;   // [rows] sequence of each new row
  const u32* pos_of;   // [rows] position of each new row in its sequence's retrieval region
  int rows;
  u32 seed;
  float levels[16];
};

struct BonusParams {
  const __half* q;  // [S][Hq][D]
  const u32* hist;  // Index::hist
  const u32* target;  // [S] ceil(rho * n), at least 1
  float* qrot;      // [S][Hq][D] out: R q / |q|
  float* qnorm;     // [S][Hq] out
  u8* bonus;        // [S][Hq][B][2^M] out
  int hq, hkv;
  u32 seed;
};

struct VoteParams {
  const u8* ids;
  const u32* len;
  const u8* bonus;  // BonusParams::bonus
  u8* scores;       // [S][Hq][cap] out
  u32* score_hist;  // [S][Hq][256] out (zeroed before the launch): keys per collision score
  int cap, hkv;
};

// The integer-bucket top-C over many CTAs: bucket_count then bucket_emit, each over chunks of
// BUCKET_CHUNK keys of every (sequence, query head).
struct BucketParams {
  const u8* scores;  // [S][Hq][cap]
  const u32* hist;   // [S][Hq][256] (VoteParams::score_hist)
  const u32* n;      // [S] keys
  const u32* want;   // [S] candidates to keep
  u32* chunk_gt;     // [S][Hq][chunks]: keys above the threshold per chunk
  u32* chunk_eq;     // [S][Hq][chunks]: keys at the threshold per chunk
  u32* out;          // [S][Hq][stride] out: candidates ascending by key index
  u32* out_count;    // [S][Hq] out
  int cap, stride, hq, chunks;
};

struct SelectParams {
  const u8* scores;  // [S][Hq][cap] (select) or unused (top-k)
  const float* est;  // [S][Hq][cmax] (top-k) or unused (select)
  const u32* cand;   // [S][Hq][cmax] (top-k: maps positions back to key indices)
  const u32* n;      // [S] values per row: keys (select) or unused (top-k reads count)
  const u32* count;  // [S][Hq] candidates found (top-k)
  const u32* want;   // [S] how many to keep
  u32* out;          // [S][Hq][stride] out: kept key indices, ascending (select) / by position (top-k)
  u32* out_count;    // [S][Hq] out
  int cap, cmax, stride, hq;
};

struct RerankParams {
  Index ix;
  const float* qrot;
  const float* qnorm;
  const u32* cand;   // [S][Hq][cmax]
  const u32* count;  // [S][Hq]
  float* est;        // [S][Hq][cmax] out
  int cmax, hq;
  float levels[16];
};

struct FetchParams {
  const __half* host_k;  // [S][Hkv][host_cap][D], pinned host memory (device pointer, UVA)
  const __half* host_v;
  const u32* top;        // [S][Hq][kmax]
  const u32* top_count;  // [S][Hq]
  __half* k_out;         // [S][Hq][kmax][D]
  __half* v_out;
  u32* error_flags;
  const u32* len;        // [S] retrieval-region keys
  int host_cap, kmax, hq, hkv;
};

struct AttendParams {
  const __half* q;        // [S][Hq][D]
  const __half* dense_k;  // [S][Hkv][dense_cap][D]: sinks, local window, update buffer on the GPU
  const __half* dense_v;
  const u32* dense_len;   // [S]
  // Retrieved rows: staged by paris_fetch (k_rows/v_rows [S][Hq][kmax][D]) or, fused, read from
  // pinned host memory through `top` (host_k/host_v as in FetchParams).
  const __half* k_rows;
  const __half* v_rows;
  const __half* host_k;
  const __half* host_v;
  const u32* top;
  const u32* top_count;   // [S][Hq]
  float* out;             // [S][Hq][D]
  float* lse;             // [S][Hq] natural-log sum of exp of the scaled logits
  float scale;
  int dense_cap, host_cap, kmax, hq, hkv;
};

constexpr u32 ERR_TOP_RANGE = 1u;  // a retrieved index is past the retrieval region

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

// Keeps the `want` largest of `n` keys `key(i)` (KEY_BITS wide), ties in index order, writing
// their positions ascending to out[0..]; returns the count. Radix select from the top bits (8
// per pass), then one emission pass with two block scans per tile. kvforge-paris
// `top_candidates` / `top_k_by` define the same set.
template <int NT, int KEY_BITS, class Key>
__device__ u32 block_select(const Key& key, u32 n, u32 want, u32* out) {
  __shared__ u32 hist[256];
  __shared__ u32 warp_sums[NT / 32];
  __shared__ u32 s_prefix, s_room;
  if (want >= n) {
    for (u32 i = threadIdx.x; i < n; i += NT) out[i] = i;
    return n;
  }
  if (want == 0) return 0;
  u32 prefix = 0, mask = 0, room = want;
#pragma unroll 1
  for (int shift = KEY_BITS - 8; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += NT) hist[b] = 0;
    __syncthreads();
    for (u32 i = threadIdx.x; i < n; i += NT) {
      const u32 k = key(i);
      if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      u32 above = 0;
      int b = 255;
      while (above + hist[b] < room) above += hist[b--];
      s_prefix = prefix | (u32(b) << shift);
      s_room = room - above;
    }
    __syncthreads();
    prefix = s_prefix;
    room = s_room;
    mask |= 255u << shift;
    __syncthreads();
  }
  // prefix is the threshold key t: keep every key > t and the first `room` keys == t.
  u32 emitted = 0, eq_seen = 0;
#pragma unroll 1
  for (u32 base = 0; base < n; base += NT) {
    const u32 i = base + threadIdx.x;
    const u32 k = i < n ? key(i) : 0u;
    const u32 gt = i < n && k > prefix, eq = i < n && k == prefix;
    u32 eq_total, emit_total;
    const u32 eq_rank = eq_seen + block_exclusive_scan<NT>(eq, warp_sums, eq_total);
    const u32 emit = gt || (eq && eq_rank < room);
    const u32 pos = emitted + block_exclusive_scan<NT>(emit, warp_sums, emit_total);
    if (emit) out[pos] = i;
    eq_seen += eq_total;
    emitted += emit_total;
  }
  return emitted;
}

// ---------------------------------------------------------------------------------------------
// Encode: summaries of new retrieval-region keys. Grid (ceil(rows / ROWS), Hkv), NT threads,
// ROWS = NT / 32 keys per CTA (one warp per key for the norm).

template <int D, int M, int NT>
__device__ void encode_kernel(const EncodeParams& p) {
  constexpr int B = D / M, ROWS = NT / 32;
  __shared__ float x[ROWS][D];
  const int h = blockIdx.y, r0 = blockIdx.x * ROWS;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int rows = cmin(ROWS, p.rows - r0);
  for (int i = threadIdx.x; i < ROWS * D; i += NT) {
    const int r = i / D, c = i % D;
    x[r][c] = r < rows ? __half2float(p.keys[(size_t(r0 + r) * p.ix.hkv + h) * D + c]) : 0.f;
  }
  __syncthreads();
  // |k| (f32 sum; the reference sums in f64 and rounds once), then k / |k|.
  __shared__ float norms[ROWS];
  {
    float s = 0.f;
    for (int c = lane; c < D; c += 32) s += x[warp][c] * x[warp][c];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) norms[warp] = sqrtf(s);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < ROWS * D; i += NT) {
    const float n = norms[i / D], v = 1.f / n;
    x[i / D][i % D] = (n == 0.f || isinf(v)) ? 0.f : x[i / D][i % D] * v;
  }
  __syncthreads();
  hadamard_rows<D, NT, false>(&x[0][0], ROWS, p.seed);
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
// Vote. Bonus tables: one CTA of 256 threads per (sequence, query head) rotates the query and
// ranks each subspace's 2^M centroids by <q_b, w> (ties by id); a centroid gets
// T - floor(before * T / target) while the keys of the centroids ranked before it number
// fewer than target = ceil(rho * n).

template <int D, int M, int TIERS>
__device__ void bonus_kernel(const BonusParams& p) {
  constexpr int B = D / M, C = 1 << M, NT = 256;
  static_assert(C <= NT, "one thread per centroid");
  static_assert(B * TIERS <= 255, "collision scores are bytes");
  __shared__ float q[D];
  __shared__ float score[C];
  __shared__ u32 rank[C];
  __shared__ float red[NT / 32];
  const int sh = blockIdx.x, s = sh / p.hq, hq = sh % p.hq, h = hq / (p.hq / p.hkv);
  for (int c = threadIdx.x; c < D; c += NT) q[c] = __half2float(p.q[size_t(sh) * D + c]);
  __syncthreads();
  float v = 0.f;
  for (int c = threadIdx.x; c < D; c += NT) v += q[c] * q[c];
  const float norm = sqrtf(block_reduce<NT>(v, red, false));
  const float inv = norm > 0.f ? 1.f / norm : 0.f;
  for (int c = threadIdx.x; c < D; c += NT) q[c] *= inv;
  __syncthreads();
  hadamard_rows<D, NT, false>(q, 1, p.seed);
  for (int c = threadIdx.x; c < D; c += NT) p.qrot[size_t(sh) * D + c] = q[c];
  if (threadIdx.x == 0) p.qnorm[sh] = norm;
  const u64 target = p.target[s];
  const u32* hist = p.hist + size_t(s * p.hkv + h) * B * C;
#pragma unroll 1
  for (int b = 0; b < B; ++b) {
    const int w = threadIdx.x;
    if (w < C) {
      float sc = 0.f;
#pragma unroll
      for (int j = 0; j < M; ++j) sc += (w >> j & 1) ? q[b * M + j] : -q[b * M + j];
      score[w] = sc;
    }
    __syncthreads();
    if (w < C) {
      u32 rk = 0;
      for (int o = 0; o < C; ++o) rk += (score[o] > score[w] || (score[o] == score[w] && o < w)) ? 1u : 0u;
      rank[w] = rk;
    }
    __syncthreads();
    if (w < C) {
      u64 before = 0;
      for (int o = 0; o < C; ++o) before += rank[o] < rank[w] ? hist[b * C + o] : 0u;
      p.bonus[(size_t(sh) * B + b) * C + w] = before < target ? u8(TIERS - before * TIERS / target) : u8(0);
    }
    __syncthreads();
  }
}

// Collision scores. Grid (ceil(cap / NT), S * Hkv), NT threads; each thread scores one key for
// the G query heads of its kv head (the ids are read once), and the CTA adds its keys to each
// query head's score histogram.
template <int D, int M, int G, int NT>
__device__ void vote_kernel(const VoteParams& p) {
  constexpr int B = D / M, C = 1 << M;
  static_assert(G * B * C <= 40 * 1024, "the bonus tables of a kv head's query heads fit static shared memory");
  __shared__ u8 bonus[G * B * C];
  __shared__ u32 hist[G * 256];
  const int sh = blockIdx.y, s = sh / p.hkv, h = sh % p.hkv;
  const size_t qh0 = size_t(s) * p.hkv * G + size_t(h) * G;
  for (int i = threadIdx.x; i < G * B * C; i += NT) bonus[i] = p.bonus[qh0 * B * C + i];
  for (int i = threadIdx.x; i < G * 256; i += NT) hist[i] = 0;
  __syncthreads();
  const u32 i = blockIdx.x * NT + threadIdx.x;
  if (i < p.len[s]) {
    const u8* ids = p.ids + (size_t(sh) * p.cap + i) * B;
    alignas(16) u8 id[B];
    if constexpr (B % 16 == 0) {
#pragma unroll
      for (int v = 0; v < B / 16; ++v) *reinterpret_cast<uint4*>(&id[16 * v]) = reinterpret_cast<const uint4*>(ids)[v];
    } else {
#pragma unroll
      for (int b = 0; b < B; ++b) id[b] = ids[b];
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      u32 sc = 0;
#pragma unroll
      for (int b = 0; b < B; ++b) sc += bonus[(g * B + b) * C + id[b]];
      p.scores[(qh0 + g) * p.cap + i] = u8(sc);
      // Warp-aggregated: scores crowd a few values, so lanes with equal scores add once.
      const u32 peers = __match_any_sync(__activemask(), sc);
      if ((threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[g * 256 + sc], u32(__popc(peers)));
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < G * 256; j += NT)
    if (hist[j]) atomicAdd(&p.score_hist[(qh0 + j / 256) * 256 + j % 256], hist[j]);
}

// Threshold score t and how many keys scoring exactly t to keep: the reference's top-C rule.
__device__ __forceinline__ void bucket_threshold(const u32* hist, u32 n, u32 want, u32& t, u32& room) {
  if (want >= n) {
    t = 0;
    room = n;
    return;
  }
  u32 above = 0;
  int b = 255;
  while (b > 0 && above + hist[b] < want) above += hist[b--];
  t = u32(b);
  room = want - above;
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

constexpr int BUCKET_PER_THREAD = 16;

// Counts, per chunk, the keys above and at the threshold. Grid (chunks, S * Hq).
template <int NT>
__device__ void bucket_count_kernel(const BucketParams& p) {
  constexpr int CHUNK = NT * BUCKET_PER_THREAD;
  __shared__ u32 red[NT / 32];
  const int sh = blockIdx.y, s = sh / p.hq;
  const u32 n = p.n[s], want = cmin(p.want[s], p.stride);
  u32 t, room;
  bucket_threshold(p.hist + size_t(sh) * 256, n, want, t, room);
  const u8* sc = p.scores + size_t(sh) * p.cap;
  u32 gt = 0, eq = 0;
  const u32 lo = blockIdx.x * CHUNK, hi = min(lo + CHUNK, n);
  for (u32 i = lo + threadIdx.x; i < hi; i += NT) {
    const u32 v = sc[i];
    gt += v > t;
    eq += v == t;
  }
  gt = block_sum<NT>(gt, red);
  eq = block_sum<NT>(eq, red);
  if (threadIdx.x == 0) {
    p.chunk_gt[size_t(sh) * p.chunks + blockIdx.x] = gt;
    p.chunk_eq[size_t(sh) * p.chunks + blockIdx.x] = eq;
  }
}

// Writes the candidates of each chunk at their index-order positions. Grid (chunks, S * Hq).
template <int NT>
__device__ void bucket_emit_kernel(const BucketParams& p) {
  constexpr int CHUNK = NT * BUCKET_PER_THREAD;
  __shared__ u32 red[NT / 32];
  const int sh = blockIdx.y, s = sh / p.hq;
  const u32 n = p.n[s], want = cmin(p.want[s], p.stride);
  u32 t, room;
  bucket_threshold(p.hist + size_t(sh) * 256, n, want, t, room);
  if (blockIdx.x == 0 && threadIdx.x == 0) p.out_count[sh] = min(want, n);
  const u32 lo = blockIdx.x * CHUNK;
  if (lo >= n) return;
  u32 gt_before = 0, eq_before = 0;
  for (u32 c = threadIdx.x; c < blockIdx.x; c += NT) {
    gt_before += p.chunk_gt[size_t(sh) * p.chunks + c];
    eq_before += p.chunk_eq[size_t(sh) * p.chunks + c];
  }
  gt_before = block_sum<NT>(gt_before, red);
  eq_before = block_sum<NT>(eq_before, red);
  u32 emitted = gt_before + min(eq_before, room), eq_seen = eq_before;
  const u8* sc = p.scores + size_t(sh) * p.cap;
  u32* out = p.out + size_t(sh) * p.stride;
  const u32 hi = min(lo + CHUNK, n);
#pragma unroll 1
  for (u32 base = lo; base < hi; base += NT) {
    const u32 i = base + threadIdx.x;
    const u32 v = i < hi ? u32(sc[i]) : 0u;
    const u32 gt = i < hi && v > t, eq = i < hi && v == t;
    u32 eq_total, emit_total;
    const u32 eq_rank = eq_seen + block_exclusive_scan<NT>(eq, red, eq_total);
    const u32 emit = gt || (eq && eq_rank < room);
    const u32 pos = emitted + block_exclusive_scan<NT>(emit, red, emit_total);
    if (emit) out[pos] = i;
    eq_seen += eq_total;
    emitted += emit_total;
  }
}

// Integer-bucket top-C of the collision scores: one CTA of NT threads per (sequence, query
// head); candidates ascending by key index.
template <int NT>
__device__ void select_kernel(const SelectParams& p) {
  const int sh = blockIdx.x, s = sh / p.hq;
  const u8* sc = p.scores + size_t(sh) * p.cap;
  u32* out = p.out + size_t(sh) * p.stride;
  const u32 n = p.n[s];
  const u32 got = block_select<NT, 8>([&](u32 i) { return u32(sc[i]); }, n, cmin(p.want[s], p.stride), out);
  if (threadIdx.x == 0) p.out_count[sh] = got;
}

// Rerank (eq. 10): est = |q| sum_b w_b sum_j l[c_j] q_bj for every candidate. Grid
// (ceil(cmax / NT), S * Hq), one thread per candidate.
template <int D, int M, int G, int NT>
__device__ void rerank_kernel(const RerankParams& p) {
  constexpr int B = D / M;
  __shared__ float lut[D * 16];
  const int sh = blockIdx.y, s = sh / p.hq, h = (sh % p.hq) / G;
  for (int i = threadIdx.x; i < D * 16; i += NT) lut[i] = p.levels[i % 16] * p.qrot[size_t(sh) * D + i / 16];
  __syncthreads();
  const u32 c = blockIdx.x * NT + threadIdx.x;
  if (c >= p.count[sh]) return;
  const size_t key = size_t(s * p.ix.hkv + h) * p.ix.cap + p.cand[size_t(sh) * p.cmax + c];
  const uint4* row = reinterpret_cast<const uint4*>(p.ix.codes + key * (D / 2));
  const __half* w = p.ix.weights + key * B;
  float acc = 0.f, dot = 0.f;
#pragma unroll
  for (int v = 0; v < D / 32; ++v) {
    const uint4 r = row[v];
    const u32 words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      const int ch = v * 32 + k;
      dot += lut[ch * 16 + ((words[k / 8] >> (4 * (k % 8))) & 15u)];
      if ((ch + 1) % M == 0) {
        acc += __half2float(w[ch / M]) * dot;
        dot = 0.f;
      }
    }
  }
  p.est[size_t(sh) * p.cmax + c] = p.qnorm[sh] * acc;
}

// Top-k of the rerank estimates: one CTA per (sequence, query head); writes key indices.
// STAGED first copies the row's estimates into dynamic shared memory (cmax floats), so the
// radix passes and the emission read shared rather than global memory.
template <int NT, bool STAGED>
__device__ void topk_kernel(const SelectParams& p) {
  extern __shared__ float staged[];
  __shared__ u32 pos[1024];
  const int sh = blockIdx.x, s = sh / p.hq;
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

// ---------------------------------------------------------------------------------------------
// Fetch: the k retrieved K/V rows from pinned host memory (UVA) into device staging. One CTA of
// NT threads per (sequence, query head), 16-byte loads.
template <int D, int G, int NT>
__device__ void fetch_kernel(const FetchParams& p) {
  constexpr int V = D * 2 / 16;  // uint4 per row
  const int sh = blockIdx.x, s = sh / p.hq, h = (sh % p.hq) / G;
  const u32 k = p.top_count[sh];
  for (u32 i = threadIdx.x; i < k * V; i += NT) {
    const u32 r = i / V, v = i % V, t = p.top[size_t(sh) * p.kmax + r];
    if (t >= p.len[s]) {
      atomicOr(p.error_flags, ERR_TOP_RANGE);
      continue;
    }
    const size_t src = (size_t(s * p.hkv + h) * p.host_cap + t) * V + v, dst = (size_t(sh) * p.kmax + r) * V + v;
    reinterpret_cast<uint4*>(p.k_out)[dst] = reinterpret_cast<const uint4*>(p.host_k)[src];
    reinterpret_cast<uint4*>(p.v_out)[dst] = reinterpret_cast<const uint4*>(p.host_v)[src];
  }
}

// Attention over the dense rows (sinks + local + update buffer) and the k retrieved rows with
// one softmax. One CTA of NT threads per (sequence, query head); dynamic shared memory holds
// dense_cap + kmax logits. FUSED reads the retrieved rows from host memory through `top`.
template <int D, int G, int NT, bool FUSED>
__device__ void attend_kernel(const AttendParams& p) {
  extern __shared__ float logit[];
  __shared__ float q[D];
  __shared__ float red[NT / 32];
  __shared__ float acc[NT / D > 0 ? NT / D : 1][D];
  const int sh = blockIdx.x, s = sh / p.hq, h = (sh % p.hq) / G;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int c = threadIdx.x; c < D; c += NT) q[c] = __half2float(p.q[size_t(sh) * D + c]) * p.scale;
  __syncthreads();
  const u32 nd = p.dense_len[s], nk = p.top_count[sh], n = nd + nk;
  auto krow = [&](u32 r) -> const __half* {
    if (r < nd) return p.dense_k + (size_t(s * p.hkv + h) * p.dense_cap + r) * D;
    if (FUSED) return p.host_k + (size_t(s * p.hkv + h) * p.host_cap + p.top[size_t(sh) * p.kmax + r - nd]) * D;
    return p.k_rows + (size_t(sh) * p.kmax + r - nd) * D;
  };
  auto vrow = [&](u32 r) -> const __half* {
    if (r < nd) return p.dense_v + (size_t(s * p.hkv + h) * p.dense_cap + r) * D;
    if (FUSED) return p.host_v + (size_t(s * p.hkv + h) * p.host_cap + p.top[size_t(sh) * p.kmax + r - nd]) * D;
    return p.v_rows + (size_t(sh) * p.kmax + r - nd) * D;
  };
  for (u32 r = warp; r < n; r += NT / 32) {
    const __half* k = krow(r);
    float d = 0.f;
    for (int c = lane; c < D; c += 32) d += q[c] * __half2float(k[c]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
    if (lane == 0) logit[r] = d;
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
  // NT / D row groups, each thread one channel of its group's rows.
  constexpr int GROUPS = NT / D > 0 ? NT / D : 1;
  const int c = threadIdx.x % D, grp = threadIdx.x / D;
  float o = 0.f;
  if (grp < GROUPS)
    for (u32 r = grp; r < n; r += GROUPS) o += logit[r] * __half2float(vrow(r)[c]);
  if (grp < GROUPS) acc[grp][c] = o;
  __syncthreads();
  if (threadIdx.x < D) {
    float t = 0.f;
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) t += acc[g][threadIdx.x];
    p.out[size_t(sh) * D + threadIdx.x] = n > 0 ? t / sum : 0.f;
  }
  if (threadIdx.x == 0) p.lse[sh] = n > 0 ? mx + __logf(sum) : NEG_INF;
}

}  // namespace paris
}  // namespace kvforge

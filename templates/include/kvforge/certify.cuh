// Certified decode (seed 004) on the device: the selector and the certificate of one step,
// launched between and after the two decodes so that no host round trip separates them.
//
// Both mirror host reference code of kvforge-rt, which the GPU tests compare them against:
//  * cert_select  = certified/select.rs: integer arithmetic only (fixed-point page weights from
//    a shared polynomial, u64 sums), so the device picks bit for bit the pages the host picks;
//  * cert_bound   = certified/checks.rs + bound.rs: f64; its sums run in another order than
//    the host's, so the two agree to rounding (the tests state the tolerance). The score,
//    ranking and boundary checks compare products rounded once (__dmul_rn: no contraction),
//    exactly as the host does.
// The selector runs one CTA per (sequence, kv head) (coverage is over all its query heads), the
// certificate one CTA per query head. Units are 16-token blocks throughout.
#pragma once
#include "common.cuh"
#include "kvforge/params.cuh"

namespace kvforge {

// Columns of CertBoundParams::head_f64 / head_u32 (CF_*, CERT_F64, CU_*, CERT_U32) and the
// selector's block states (PAGE_*) are params.cuh's, rendered from kvforge-gen params.rs with
// the host's copy.
// The heaviest page of a query head weighs 2^CERT_WEIGHT_BITS.
constexpr int CERT_WEIGHT_BITS = 32;
constexpr double CERT_LN2 = 0.6931471805599453;
#define CERT_POS_INF (__int_as_float(0x7f800000u))

// 2^f for f in [0, 1): Taylor polynomial of degree 12, Horner with fused multiply-adds. The
// coefficient bits are params.cuh's (kvforge-gen params.rs EXP2_COEFFS, the host's too).
__device__ __forceinline__ double cert_exp2_unit(double f) {
  const u64 c[13] = {KVF_CERT_EXP2_COEFFS};
  double r = __longlong_as_double(c[12]);
#pragma unroll
  for (int k = 11; k >= 0; --k) r = fma(r, f, __longlong_as_double(c[k]));
  return r;
}

// W = floor(2^(l - m) * 2^32): select.rs' block_weight.
__device__ __forceinline__ u64 cert_weight(float l, float m) {
  if (isnan(l) || l == CERT_POS_INF) return 1ull << CERT_WEIGHT_BITS;
  if (l == NEG_INF) return 0;
  const double x = __dsub_rn(double(l), double(m));
  if (!(x >= -double(CERT_WEIGHT_BITS + 1))) return 0;
  const double n = floor(x);
  const double scale = __longlong_as_double((long long)(1023 + CERT_WEIGHT_BITS + int(n)) << 52);
  return (u64)floor(__dmul_rn(cert_exp2_unit(__dsub_rn(x, n)), scale));
}

// ---- block reductions over GQA values at once (NT threads, NT / 32 warps) ----

template <int GQA, int NT, class T, class Op>
__device__ __forceinline__ void cert_block_reduce(T (&v)[GQA], T (*scratch)[GQA], Op op) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int h = 0; h < GQA; ++h) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v[h] = op(v[h], __shfl_xor_sync(0xffffffffu, v[h], o));
  }
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < GQA; ++h) scratch[warp][h] = v[h];
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < GQA; ++h) {
    v[h] = scratch[0][h];
    for (int w = 1; w < NT / 32; ++w) v[h] = op(v[h], scratch[w][h]);
  }
  __syncthreads();
}

// Exclusive prefix sums over the threads of the block (thread order), GQA columns at once.
template <int GQA, int NT>
__device__ __forceinline__ void cert_block_exclusive_scan(u64 (&v)[GQA], u64 (*scratch)[GQA]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  u64 inc[GQA];
#pragma unroll
  for (int h = 0; h < GQA; ++h) {
    u64 x = v[h];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const u64 y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    inc[h] = x;
  }
  if (lane == 31) {
#pragma unroll
    for (int h = 0; h < GQA; ++h) scratch[warp][h] = inc[h];
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < GQA; ++h) {
    u64 base = 0;
    for (int w = 0; w < warp; ++w) base += scratch[w][h];
    v[h] = base + inc[h] - v[h];
  }
  __syncthreads();
}

// Block i of a group whose pages' entries start at `pinfo` (B blocks per page): whether its page
// is quantised (quantised pages are full: every block holds tokens), and its tokens.
__device__ __forceinline__ bool cert_block_quantised(const u32* pinfo, int B, int i) { return (pinfo[i / B] & 0xffu) != 0; }
__device__ __forceinline__ u32 cert_block_tokens(const u32* pinfo, int B, int i) {
  return u32(min(max(int((pinfo[i / B] >> 8) & 0xff) - (i % B) * CERT_BLOCK, 0), CERT_BLOCK));
}

// ---- the selector: one CTA of NT threads per (sequence, kv head) group ----
//
// Dynamic shared memory: the sort buffer, 8 B per page of the largest group rounded up to a
// power of two (the launch passes it).

template <int GQA, int NT>
__device__ void cert_select(const CertSelectParams& p) {
  constexpr int NW = NT / 32;
  extern __shared__ __align__(16) u8 cert_sort_smem[];
  u64* keys = reinterpret_cast<u64*>(cert_sort_smem);
  __shared__ float fscratch[NW][GQA];
  __shared__ u64 uscratch[NW][GQA];
  __shared__ u32 kcov_s;
  const int g = blockIdx.x, tid = threadIdx.x;
  if (g >= p.groups) return;
  // Pages [first, first + np) of the group; its blocks (units of promotion) [first·B, (first + np)·B).
  const int B = p.blocks_per_page;
  const u32 first = p.page_indptr[g];
  const int np = int(p.page_indptr[g + 1] - first), n = np * B;
  const float* lse = p.block_head_lse + size_t(first) * B * GQA;
  const u32* pinfo = p.page_info + first;
  const u64* offsets = p.page_offsets + first;
  const u64* orig = p.orig_offsets + first;
  u8* state = p.block_state + size_t(first) * B;
  u64* out_offsets = p.out_page_offsets + first;
  u32* out_info = p.out_page_info + first;
  u64* out_promoted = p.out_promoted_offsets + first;
  u64* wts = p.weights + size_t(first) * B * GQA;  // [block][GQA], written once in step 2
  auto quantised = [&](int i) { return cert_block_quantised(pinfo, B, i); };

  if (p.force_exact != nullptr && p.force_exact[g] != 0) {
    // Rungs 3 and 4: every quantised block from tier 2.
    for (int i = tid; i < n; i += NT) state[i] = quantised(i) ? PAGE_PROMOTED : PAGE_QUANTISED;
  } else {
    // 1. Per head: the largest finite log2 mass M_h.
    float mx[GQA];
#pragma unroll
    for (int h = 0; h < GQA; ++h) mx[h] = NEG_INF;
    for (int i = tid; i < n; i += NT) {
#pragma unroll
      for (int h = 0; h < GQA; ++h) {
        const float l = lse[i * GQA + h];
        if (isfinite(l)) mx[h] = fmaxf(mx[h], l);
      }
    }
    cert_block_reduce<GQA, NT>(mx, fscratch, [](float a, float b) { return fmaxf(a, b); });

    // 2. Weights, totals T_h and the exact (tail-tier) pages' share E_h, in u64: order-free.
    u64 tot[GQA], exact[GQA];
#pragma unroll
    for (int h = 0; h < GQA; ++h) tot[h] = exact[h] = 0;
    u32 nq_local = 0;
    for (int i = tid; i < n; i += NT) {
      const bool quant = quantised(i);
      nq_local += quant;
#pragma unroll
      for (int h = 0; h < GQA; ++h) {
        const u64 w = cert_weight(lse[i * GQA + h], mx[h]);
        wts[i * GQA + h] = w;
        tot[h] += w;
        if (!quant) exact[h] += w;
      }
    }
    cert_block_reduce<GQA, NT>(tot, uscratch, [](u64 a, u64 b) { return a + b; });
    cert_block_reduce<GQA, NT>(exact, uscratch, [](u64 a, u64 b) { return a + b; });
    u64 nqv[1] = {nq_local};
    cert_block_reduce<1, NT>(nqv, reinterpret_cast<u64(*)[1]>(uscratch), [](u64 a, u64 b) { return a + b; });
    const u32 nq = u32(nqv[0]);

    // 3. Sort keys: largest normalised share descending, then block index (ascending key).
    // A group's quantised blocks usually come first (its tail-tier page is its last): then
    // only they are sorted, else every block (the others' keys sort last).
    u64 endq[1] = {0};
    for (int i = tid; i < n; i += NT) endq[0] = quantised(i) ? max(endq[0], u64(i + 1)) : endq[0];
    cert_block_reduce<1, NT>(endq, reinterpret_cast<u64(*)[1]>(uscratch), [](u64 a, u64 b) { return a > b ? a : b; });
    const int m = endq[0] == nq ? int(nq) : n;
    int ns = 1;  // sort slots
    while (ns < m) ns <<= 1;
    for (int i = tid; i < ns; i += NT) {
      u64 key = ~0ull;
      if (i < m && quantised(i)) {
        u64 share = 0;
#pragma unroll
        for (int h = 0; h < GQA; ++h) {
          const u64 w = wts[i * GQA + h];
          const u64 s = tot[h] > 0 ? (w << 31) / tot[h] : 0;
          share = s > share ? s : share;
        }
        key = (u64(0xffffffffu - u32(share)) << 32) | u32(i);
      }
      keys[i] = key;
    }
    __syncthreads();
    // Bitonic sort, ascending; a thread takes pairs (i, i + j), i with bit j clear.
    for (int k = 2; k <= ns; k <<= 1) {
      for (int j = k >> 1; j > 0; j >>= 1) {
        for (int t = tid; t < ns / 2; t += NT) {
          const int i = ((t & ~(j - 1)) << 1) | (t & (j - 1)), ij = i + j;
          const u64 a = keys[i], b = keys[ij];
          if ((a > b) == ((i & k) == 0)) { keys[i] = b; keys[ij] = a; }
        }
        __syncthreads();
      }
    }

    // 4. K_cov: the least prefix of the order with every head covered (with E_h).
    auto covered = [&](const u64 (&c)[GQA]) {
      bool all = true;
#pragma unroll
      for (int h = 0; h < GQA; ++h) all = all && double(c[h]) >= __dmul_rn(p.coverage, double(tot[h]));
      return all;
    };
    if (tid == 0) kcov_s = covered(exact) ? 0u : nq;
    const int chunk = (int(nq) + NT - 1) / NT;
    const int lo = min(int(nq), tid * chunk), hi = min(int(nq), lo + chunk);
    u64 pre[GQA];
#pragma unroll
    for (int h = 0; h < GQA; ++h) pre[h] = 0;
    for (int j = lo; j < hi; ++j) {
      const int i = int(keys[j] & 0xffffffffu);
#pragma unroll
      for (int h = 0; h < GQA; ++h) pre[h] += wts[i * GQA + h];
    }
    cert_block_exclusive_scan<GQA, NT>(pre, uscratch);
    u64 c[GQA];
#pragma unroll
    for (int h = 0; h < GQA; ++h) c[h] = exact[h] + pre[h];
    for (int j = lo; j < hi; ++j) {
      const int i = int(keys[j] & 0xffffffffu);
#pragma unroll
      for (int h = 0; h < GQA; ++h) c[h] += wts[i * GQA + h];
      if (covered(c)) { atomicMin(&kcov_s, u32(j + 1)); break; }
    }
    for (int i = tid; i < n; i += NT) state[i] = PAGE_QUANTISED;
    __syncthreads();

    // 5. Clamp to [K_min, K_max] and the quantised pages; promote the first k.
    const u32 k = min(min(max(kcov_s, p.min_blocks), p.max_blocks), nq);
    for (u32 j = tid; j < k; j += NT) state[keys[j] & 0xffffffffu] = PAGE_PROMOTED;
    __syncthreads();

    // 6. Exploration: systematic sample of the unpromoted quantised pages with a random start.
    const u32 tail = nq - k;
    const u32 want = u32(ceil(__dmul_rn(p.explore, double(nq))));
    const u64 cnt = want < tail ? want : tail;
    if (cnt > 0) {
      const int ch = (n + NT - 1) / NT;
      const int a = min(n, tid * ch), z = min(n, a + ch);
      u64 rank[1] = {0};
      for (int i = a; i < z; ++i) rank[0] += quantised(i) && state[i] == PAGE_QUANTISED;
      cert_block_exclusive_scan<1, NT>(rank, reinterpret_cast<u64(*)[1]>(uscratch));
      const u64 t = tail, s = p.group_seeds[g] % t;
      u64 r = rank[0];
      for (int i = a; i < z; ++i) {
        if (!quantised(i) || state[i] != PAGE_QUANTISED) continue;
        if ((r * cnt + s) / t != ((r + 1) * cnt + s) / t) state[i] = PAGE_EXPLORED;
        ++r;
      }
    }
  }
  __syncthreads();

  // Phase 2's page table: a page whose every block is served becomes a tail-format page at its
  // original (staged like any page); one served in part keeps its quantised page and carries
  // the mask of served blocks, which the decode reads from the original in place.
  for (int i = tid; i < np; i += NT) {
    u32 mask = 0;
    for (int b = 0; b < B; ++b) mask |= u32(state[i * B + b] != PAGE_QUANTISED) << b;
    const bool whole = mask == (1u << B) - 1u;
    out_offsets[i] = whole ? orig[i] : offsets[i];
    out_info[i] = whole ? (pinfo[i] & ~0xffu) : (pinfo[i] | mask << 16);
    out_promoted[i] = orig[i];
  }
}

// ---- the certificate: one CTA of NT threads per query head ----
//
// CTA r serves query head h = r mod GQA of group g = r / GQA (its [block][GQA] entries are
// read with stride GQA). The sums of the certificate, the score checks, the counts and the
// first ranking round share one pass over the blocks (after one for the maximum); deeper
// ranking rounds and the boundary check take one pass each. A CTA per head rather than per
// group: a step's certificate is batch × q heads CTAs wide, not batch × kv heads.

// checks.rs' total_order_key: f32::total_cmp's order as an unsigned key.
__device__ __forceinline__ u32 cert_order_key(float x) {
  const int s = __float_as_int(x);
  return u32(s ^ int(u32(s >> 31) >> 1)) ^ 0x80000000u;
}

// Packed ranking key of page i: total order of its log-mass, then the complement of its index,
// so the largest key is the page a descending, index-ascending sort puts first.
__device__ __forceinline__ u64 cert_rank_key(float l, int i) { return (u64(cert_order_key(l)) << 32) | (0xffffffffu - u32(i)); }
__device__ __forceinline__ int cert_rank_page(u64 key) { return int(0xffffffffu - u32(key & 0xffffffffu)); }

// bound.rs' total_variation.
__device__ __forceinline__ double cert_total_variation(double delta, double alpha) {
  if (alpha <= 0.0) return 0.0;
  if (!isfinite(delta)) return __longlong_as_double(0x7ff0000000000000ll);
  const double lo = 1.0 - alpha * (1.0 - exp(-delta));
  const double hi = 1.0 + alpha * expm1(delta);
  const double exact_part = fmax(1.0 - 1.0 / hi, 1.0 / lo - 1.0);
  const double tail_part = fmax(1.0 - exp(-delta) / hi, exp(delta) / lo - 1.0);
  return fmin((1.0 - alpha) * exact_part + alpha * tail_part, 2.0 * tanh(delta / 2.0));
}

template <int GQA, class QT, int NT>
__device__ void cert_bound(const CertBoundParams& p) {
  constexpr int NW = NT / 32;
  const double NEG_INF64 = __longlong_as_double(0xfff0000000000000ll);
  __shared__ double dscratch[NW][3];
  __shared__ u64 uscratch[NW][2];
  __shared__ u32 wscratch[NW][5];
  __shared__ double onorm_s;
  const int row = blockIdx.x, g = row / GQA, h = row % GQA, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  if (g >= p.groups) return;
  if (row == 0 && tid == 0 && p.flags_out != nullptr) *p.flags_out = *p.error_flags;
  // The group's blocks [first·B, (first + np)·B), the units of promotion and of the bound.
  const int B = p.blocks_per_page;
  const u32 first = p.page_indptr[g];
  const int n = int(p.page_indptr[g + 1] - first) * B;
  const size_t fb = size_t(first) * B;
  const float* l1 = p.block_head_lse + fb * GQA + h;
  const float* d1 = p.block_delta + fb * GQA + h;
  const float* l2 = p.block_head_lse2 + fb * GQA + h;
  const u32* pinfo = p.page_info + first;
  const u8* state = p.block_state + fb;
  const double* eta = p.block_eta + fb;
  auto quantised = [&](int i) { return cert_block_quantised(pinfo, B, i); };
  // The exact set F: blocks served from tier 2 and blocks of tail-tier pages.
  auto exact = [&](int i) { return !quantised(i) || state[i] != PAGE_QUANTISED; };
  auto dmax_op = [](double a, double b) { return fmax(a, b); };
  auto dsum_op = [](double a, double b) { return a + b; };
  auto umax_op = [](u64 a, u64 b) { return a > b ? a : b; };

  // Pass 1: the largest phase-2 log2 mass.
  double mx[1] = {NEG_INF64};
  for (int i = tid; i < n; i += NT) mx[0] = fmax(mx[0], double(l2[i * GQA]));
  cert_block_reduce<1, NT>(mx, reinterpret_cast<double(*)[1]>(dscratch), dmax_op);

  // Pass 2: Σ 2^(ℓ² − max) over all blocks (ρ's denominator) and over the blocks left
  // quantised (α̂, and with η_b E_val), Δ over them, score checks of the served blocks, the
  // counts (tokens, promoted, explored, exact-set size, failed score checks), and the first
  // ranking round: the exact set's largest packed key by ℓ² and by ℓ¹.
  double sums[3] = {0.0, 0.0, 0.0};  // total, quantised, quantised · η
  double delta[1] = {0.0};
  u32 cnt[5] = {0, 0, 0, 0, 0};
  u64 top[2] = {0, 0};  // by ℓ², by ℓ¹
  for (int i = tid; i < n; i += NT) {
    const double e = exp2(double(l2[i * GQA]) - mx[0]);
    sums[0] += e;
    cnt[0] += cert_block_tokens(pinfo, B, i);
    if (!exact(i)) {
      sums[1] += e;
      sums[2] += e * eta[i];
      delta[0] = fmax(delta[0], double(d1[i * GQA]));
      continue;
    }
    ++cnt[3];
    if (quantised(i)) {
      const u8 st = state[i];
      cnt[1] += st == PAGE_PROMOTED;
      cnt[2] += st == PAGE_EXPLORED;
      const double a = __dmul_rn(double(l1[i * GQA]), CERT_LN2), b = __dmul_rn(double(l2[i * GQA]), CERT_LN2);
      if (!(fabs(__dsub_rn(a, b)) <= __dadd_rn(double(d1[i * GQA]), p.guard))) ++cnt[4];
    }
    const u64 k2 = cert_rank_key(l2[i * GQA], i), k1 = cert_rank_key(l1[i * GQA], i);
    top[0] = k2 > top[0] ? k2 : top[0];
    top[1] = k1 > top[1] ? k1 : top[1];
  }
  cert_block_reduce<3, NT>(sums, dscratch, dsum_op);
  cert_block_reduce<1, NT>(delta, reinterpret_cast<double(*)[1]>(dscratch), dmax_op);
  cert_block_reduce<5, NT>(cnt, wscratch, [](u32 a, u32 b) { return a + b; });
  cert_block_reduce<2, NT>(top, uscratch, umax_op);
  const double alpha = sums[1] / sums[0], e_val = sums[2] / sums[0];

  // Ranking consistency (eq. 17, ties within ε_guard allowed) and boundary (eq. 18) over the
  // exact set: round j's keys are the largest below round j − 1's.
  u32 ranking = 0, boundary = 0;
  if (p.rank_depth > 0) {
    const int rounds = min(p.rank_depth, int(cnt[3]));
    double lr = NEG_INF64;
    u64 prev[2] = {0, 0};
    for (int j = 0; j < rounds; ++j) {
      u64 b[2] = {top[0], top[1]};
      if (j > 0) {
        b[0] = b[1] = 0;
        for (int i = tid; i < n; i += NT) {
          if (!exact(i)) continue;
          const u64 k2 = cert_rank_key(l2[i * GQA], i), k1 = cert_rank_key(l1[i * GQA], i);
          if (k2 < prev[0] && k2 > b[0]) b[0] = k2;
          if (k1 < prev[1] && k1 > b[1]) b[1] = k1;
        }
        cert_block_reduce<2, NT>(b, uscratch, umax_op);
      }
      const double at_b = __dmul_rn(double(l2[cert_rank_page(b[0]) * GQA]), CERT_LN2);
      const double at_a = __dmul_rn(double(l2[cert_rank_page(b[1]) * GQA]), CERT_LN2);
      if (at_a < __dsub_rn(at_b, p.guard)) ranking = 1;
      if (j == p.rank_depth - 1) lr = at_b;
      prev[0] = b[0];
      prev[1] = b[1];
    }
    u32 bc[1] = {0};
    for (int i = tid; i < n; i += NT) {
      if (!exact(i) && __dadd_rn(__dmul_rn(double(l1[i * GQA]), CERT_LN2), double(d1[i * GQA])) > lr) ++bc[0];
    }
    cert_block_reduce<1, NT>(bc, reinterpret_cast<u32(*)[1]>(wscratch), [](u32 a, u32 c) { return a + c; });
    boundary = bc[0];
  }

  // ‖Ô‖₂ of the head's phase-2 output row (warp 0).
  if (warp == 0) {
    const QT* o = reinterpret_cast<const QT*>(p.out) + size_t(row) * p.head_dim;
    double sq = 0.0;
    for (int c = lane; c < p.head_dim; c += 32) {
      const double x = double(to_float(o[c]));
      sq += x * x;
    }
#pragma unroll
    for (int o2 = 16; o2 > 0; o2 >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o2);
    if (lane == 0) onorm_s = sqrt(sq);
  }
  __syncthreads();

  if (tid == 0) {
    // bound.rs' certificate().
    const double v_max = p.group_v_max[g];
    const double u = 1.0 / 2048.0;
    const double e_key = v_max * cert_total_variation(delta[0], alpha);
    const double e_round = u / (1.0 - u) * onorm_s + (double(cnt[0]) / 8.0 + 128.0) * 5.9604644775390625e-08 * v_max;
    double* f = p.head_f64 + size_t(row) * CERT_F64;
    f[CF_DELTA] = delta[0];
    f[CF_ALPHA] = alpha;
    f[CF_VMAX] = v_max;
    f[CF_EKEY] = e_key;
    f[CF_EVAL] = e_val;
    f[CF_EROUND] = e_round;
    f[CF_BOUND] = e_key + e_val + e_round;
    f[CF_ONORM] = onorm_s;
    u32* w = p.head_u32 + size_t(row) * CERT_U32;
    w[CU_DETECT] = cnt[4];
    w[CU_BOUNDARY] = boundary;
    w[CU_RANKING] = ranking;
    w[CU_PROMOTED] = cnt[1];
    w[CU_EXPLORED] = cnt[2];
  }
}

}  // namespace kvforge

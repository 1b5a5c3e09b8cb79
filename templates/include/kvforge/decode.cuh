// Paged decode attention over tier-homogeneous pages of one (sequence, kv head).
//
// One CTA serves one (split, kv head, sequence) and all GQA query heads of the kv head, so K
// and V are read once per group. Per page: the header picks the tier (dispatch per page,
// never per element); the page's segment is staged into shared memory with 16-byte cp.async
// while the previous page is computed; scores use the tier's key codec, an fp32 online
// softmax (log2 domain) updates the running max/sum, and the value codec's 8-channel loads
// feed per-thread accumulators.
#pragma once
#include "codecs.cuh"
#include "kvforge/params.cuh"

namespace kvforge {

template <class... Ts> struct TierList {};

template <class A, class B> struct same_type { static constexpr bool value = false; };
template <class A> struct same_type<A, A> { static constexpr bool value = true; };

template <class... Ts> __host__ __device__ constexpr int max_seg(TierList<Ts...>) { int m = 0; ((m = cmax(m, Ts::SEG_BYTES)), ...); return m; }
template <int GQA, class... Ts> __host__ __device__ constexpr int max_prep(TierList<Ts...>) { int m = 0; ((m = cmax(m, GQA * Ts::Key::PREP_FLOATS_PER_HEAD)), ...); return m; }
template <int GQA, class... Ts> __host__ __device__ constexpr int sum_lut(TierList<Ts...>) { return (0 + ... + (GQA * Ts::Key::LUT_FLOATS_PER_HEAD)); }

// Shared-memory plan of one decode variant (bytes). The generated Rust bindings carry the
// same number, and the generated .cu static_asserts that they agree.
template <class Cfg>
struct DecodeSmem {
  static constexpr int Q = 0;
  static constexpr int LUT = Q + align16(Cfg::GQA * Cfg::D * 4);
  static constexpr int PREP = LUT + align16(sum_lut<Cfg::GQA>(typename Cfg::Tiers{}) * 4);
  static constexpr int SCORES = PREP + align16(max_prep<Cfg::GQA>(typename Cfg::Tiers{}) * 4);
  static constexpr int STATS = SCORES + align16(Cfg::GQA * Cfg::P * 4);
  static constexpr int OUT = STATS + align16(4 * Cfg::GQA * 4);
  static constexpr int STAGE = OUT + align16(Cfg::GQA * Cfg::D * 4);
  static constexpr int STAGE_BYTES = align16(max_seg(typename Cfg::Tiers{}));
  static constexpr int TOTAL = STAGE + 2 * STAGE_BYTES;
};

template <class Cfg>
struct DecodeCta {
  static constexpr int D = Cfg::D, GQA = Cfg::GQA, P = Cfg::P, NT = Cfg::NTHREADS;
  static constexpr int TPT = NT / P > 0 ? (NT / P > 32 ? 32 : NT / P) : 1;  // threads per token (scores)
  static constexpr int TSTRIDE = NT / TPT;                                 // tokens in flight (scores)
  static constexpr int NC8 = D / 8;                                        // 8-channel chunks (values)
  static constexpr int TG = NT / NC8;                                      // token groups (values)
  using QT = typename Cfg::QT;
  using Smem = DecodeSmem<Cfg>;

  u8* smem;
  const DecodeParams& p;
  int kvh;
  float acc[GQA][8];

  __device__ float* q_s() { return reinterpret_cast<float*>(smem + Smem::Q); }
  __device__ float* lut_s() { return reinterpret_cast<float*>(smem + Smem::LUT); }
  __device__ float* prep_s() { return reinterpret_cast<float*>(smem + Smem::PREP); }
  __device__ float* scores_s() { return reinterpret_cast<float*>(smem + Smem::SCORES); }
  __device__ float* m_s() { return reinterpret_cast<float*>(smem + Smem::STATS); }
  __device__ float* l_s() { return m_s() + GQA; }
  __device__ float* alpha_s() { return m_s() + 2 * GQA; }
  __device__ float* plse_s() { return m_s() + 3 * GQA; }
  __device__ u8* stage(int i) { return smem + Smem::STAGE + i * Smem::STAGE_BYTES; }

  // Offset of tier T's LUT among the spherical tiers of this variant.
  template <class T, class... Ts> __device__ static constexpr int lut_offset(TierList<Ts...>) {
    int off = 0; bool found = false;
    ((found = found || same_type<T, Ts>::value, off += found ? 0 : GQA * Ts::Key::LUT_FLOATS_PER_HEAD), ...);
    return off;
  }

  template <class... Ts>
  __device__ void build_luts(TierList<Ts...>) {
    (build_lut<Ts>(), ...);
  }
  template <class T>
  __device__ void build_lut() {
    if constexpr (T::Key::SPHERICAL) {
      constexpr int NG = T::Key::NG, E = T::Key::E, GROUP = D / NG;
      const float* cb = p.codebooks[T::id] + size_t(kvh) * NG * E * GROUP;
      const float* rs = p.radius_scales[T::id] + size_t(kvh) * NG;
      T::Key::template build_lut<GQA, NT>(lut_s() + lut_offset<T>(typename Cfg::Tiers{}), q_s(), cb, rs);
    }
  }

  // Stages the segment of a page whose tier is `tier` into buffer `buf`. Returns false when
  // the tier is not served by this variant.
  template <class... Ts>
  __device__ bool stage_page(TierList<Ts...>, int tier, const u8* page, int buf) {
    return ((tier == Ts::id ? (stage_async<NT>(stage(buf), page + HEADER_BYTES, align16(Ts::SEG_BYTES)), true) : false) || ...);
  }

  template <class... Ts>
  __device__ void compute_page(TierList<Ts...>, int tier, int buf, int len, float* mass) {
    ((tier == Ts::id ? (compute<Ts>(stage(buf), len, mass), true) : false) || ...);
  }

  template <class T>
  __device__ void compute(const u8* seg, int len, float* mass) {
    using K = typename T::Key;
    using V = typename T::Value;
    const int tid = threadIdx.x;
    K::template prep_page<GQA, NT>(seg, q_s(), prep_s());
    if (K::PREP_FLOATS_PER_HEAD > 0) __syncthreads();
    float* sc = scores_s();
    const float* lut = lut_s() + lut_offset<T>(typename Cfg::Tiers{});
    // Scores: TPT threads per token; tokens beyond `len` are masked.
    for (int t0 = 0; t0 < P; t0 += TSTRIDE) {
      const int t = t0 + tid / TPT, part = tid % TPT;
      float s[GQA];
#pragma unroll
      for (int h = 0; h < GQA; ++h) s[h] = 0.f;
      if (t < len) K::template score<GQA, TPT>(seg, t, part, q_s(), prep_s(), lut, s);
#pragma unroll
      for (int h = 0; h < GQA; ++h) s[h] = group_sum<TPT>(s[h]);
      if (part == 0 && t < P) {
#pragma unroll
        for (int h = 0; h < GQA; ++h) sc[h * P + t] = t < len ? s[h] : NEG_INF;
      }
    }
    __syncthreads();
    // Online softmax: one warp per head.
    const int warp = tid / 32, lane = tid % 32;
    for (int h = warp; h < GQA; h += NT / 32) {
      float mx = NEG_INF;
      for (int t = lane; t < P; t += 32) mx = fmaxf(mx, sc[h * P + t]);
      mx = warp_max(mx);
      const float m_old = m_s()[h];
      const float m_new = fmaxf(m_old, mx);
      float sum = 0.f;
      for (int t = lane; t < P; t += 32) {
        const float e = exp2f(sc[h * P + t] - m_new);
        sc[h * P + t] = e;
        sum += e;
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        const float alpha = exp2f(m_old - m_new);  // m_old = -inf gives 0
        alpha_s()[h] = alpha;
        plse_s()[h] = m_new + log2f(sum);
        l_s()[h] = l_s()[h] * alpha + sum;
        m_s()[h] = m_new;
      }
    }
    __syncthreads();
    if (mass != nullptr && tid == 0) {
      float mx = NEG_INF;
      for (int h = 0; h < GQA; ++h) mx = fmaxf(mx, plse_s()[h]);
      float sum = 0.f;
      for (int h = 0; h < GQA; ++h) sum += exp2f(plse_s()[h] - mx);
      *mass = mx + log2f(sum);
    }
    // Values: thread owns channels [c8*8, c8*8+8) of token group tg.
    const int c8 = tid % NC8, tg = tid / NC8;
#pragma unroll
    for (int h = 0; h < GQA; ++h) {
      const float a = alpha_s()[h];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[h][i] *= a;
    }
    for (int t = tg; t < len; t += TG) {
      float v[8];
      V::load8(seg, t, c8, v);
#pragma unroll
      for (int h = 0; h < GQA; ++h) {
        const float w = sc[h * P + t];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[h][i] = fmaf(w, v[i], acc[h][i]);
      }
    }
    __syncthreads();
  }

  __device__ void run(int seq, int split) {
    const int tid = threadIdx.x;
    const int hq0 = kvh * GQA;
    const int num_hq = p.num_kv_heads * GQA;
    // Queries, pre-scaled into the log2 domain.
    const float qscale = p.sm_scale * 1.4426950408889634f;
    const QT* q = reinterpret_cast<const QT*>(p.q) + (size_t(seq) * num_hq + hq0) * D;
    for (int i = tid; i < GQA * D; i += NT) q_s()[i] = to_float(q[i]) * qscale;
    if (tid < GQA) { m_s()[tid] = NEG_INF; l_s()[tid] = 0.f; }
    __syncthreads();
    build_luts(typename Cfg::Tiers{});
#pragma unroll
    for (int h = 0; h < GQA; ++h)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[h][i] = 0.f;

    const u32 first = p.page_indptr[seq * p.num_kv_heads + kvh];
    const u32 last = p.page_indptr[seq * p.num_kv_heads + kvh + 1];
    const int n = int(last - first);
    const int per = (n + p.num_splits - 1) / p.num_splits;
    const int lo = min(n, split * per), hi = min(n, lo + per);

    // Prologue: stage the first page.
    int cur_tier = -1, cur_len = 0;
    if (lo < hi) {
      const u8* page = p.arena + p.page_offsets[first + lo];
      const PageHeader hd = load_header(page);
      cur_tier = hd.tier;
      cur_len = int(hd.length);
      if (hd.magic != PAGE_MAGIC) { if (tid == 0) atomicOr(p.error_flags, ERR_BAD_MAGIC); cur_tier = -1; }
      if (cur_len > P) { if (tid == 0) atomicOr(p.error_flags, ERR_BAD_LENGTH); cur_tier = -1; }
      if (cur_tier >= 0 && !stage_page(typename Cfg::Tiers{}, cur_tier, page, 0)) {
        if (tid == 0) atomicOr(p.error_flags, ERR_UNKNOWN_TIER);
        cur_tier = -1;
      }
    }
    cp_async_commit();
    __syncthreads();  // build_luts done before any compute

    for (int i = lo; i < hi; ++i) {
      const int buf = (i - lo) & 1;
      int next_tier = -1, next_len = 0;
      if (i + 1 < hi) {
        const u8* page = p.arena + p.page_offsets[first + i + 1];
        const PageHeader hd = load_header(page);
        next_tier = hd.tier;
        next_len = int(hd.length);
        if (hd.magic != PAGE_MAGIC) { if (tid == 0) atomicOr(p.error_flags, ERR_BAD_MAGIC); next_tier = -1; }
        if (next_len > P) { if (tid == 0) atomicOr(p.error_flags, ERR_BAD_LENGTH); next_tier = -1; }
        if (next_tier >= 0 && !stage_page(typename Cfg::Tiers{}, next_tier, page, buf ^ 1)) {
          if (tid == 0) atomicOr(p.error_flags, ERR_UNKNOWN_TIER);
          next_tier = -1;
        }
      }
      cp_async_commit();
      cp_async_wait<1>();
      __syncthreads();
      if (cur_tier >= 0 && cur_len > 0) {
        float* mass = p.page_lse ? p.page_lse + first + i : nullptr;
        compute_page(typename Cfg::Tiers{}, cur_tier, buf, cur_len, mass);
      }
      cur_tier = next_tier;
      cur_len = next_len;
    }
    cp_async_wait<0>();

    // Reduce the token groups' accumulators in shared memory.
    float* out_s = reinterpret_cast<float*>(smem + Smem::OUT);
    for (int i = tid; i < GQA * D; i += NT) out_s[i] = 0.f;
    __syncthreads();
    const int c8 = tid % NC8;
#pragma unroll
    for (int h = 0; h < GQA; ++h)
#pragma unroll
      for (int i = 0; i < 8; ++i) atomicAdd(&out_s[h * D + c8 * 8 + i], acc[h][i]);
    __syncthreads();
    for (int i = tid; i < GQA * D; i += NT) {
      const int h = i / D, c = i % D;
      const float l = l_s()[h];
      const float o = l > 0.f ? out_s[i] / l : 0.f;
      const size_t row = size_t(seq) * num_hq + hq0 + h;
      if (p.num_splits == 1) {
        reinterpret_cast<QT*>(p.out)[row * D + c] = from_float<QT>(o);
      } else {
        p.partial_out[(size_t(split) * p.batch * num_hq + row) * D + c] = o;
      }
      if (c == 0 && p.partial_lse != nullptr) {
        const float m = m_s()[h];
        p.partial_lse[size_t(split) * p.batch * num_hq + row] = l > 0.f ? (m + log2f(l)) * 0.6931471805599453f : NEG_INF;
      }
    }
  }
};

template <class Cfg>
__device__ void decode_kernel(const DecodeParams& p) {
  extern __shared__ __align__(16) u8 smem[];
  DecodeCta<Cfg> cta{smem, p, int(blockIdx.y)};
  cta.run(int(blockIdx.z), int(blockIdx.x));
}

}  // namespace kvforge

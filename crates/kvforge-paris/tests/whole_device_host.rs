//! The Whole64 device code of `templates/include/kvforge/paris.cuh` (`encode_whole_kernel` in
//! both modes, `rerank_whole_kernel`, `rerank_whole_hmax_kernel` and their helpers) run on the
//! host against this crate's f64 reference: the header's parameter structs and Whole64 section
//! are compiled verbatim with the system C++ compiler (C++20), each CTA emulated by one thread per
//! CUDA thread (barriers for `__syncthreads` / `__syncwarp`, per-warp slots for the shuffles and
//! ballots, `_Float16` for fp16; `hmax_entry`'s shared load and the dynamic shared memory are
//! replaced by an arena at a misaligned start). Two appends per sequence as the runtime's
//! (`scale_whole` over the first), two kv heads, odd key counts (partial CTAs), a zero key and
//! keys past the prefill's largest weight; the rows are compared byte for byte with
//! `WholeRow::pack` of the reference's codes, and the estimates with `CompactQuery::estimate`
//! on the codes the device wrote. Skipped (with a message) where no C++20 compiler is found.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;

use half::f16;
use kvforge_paris::{group_query, CompactKeys, CompactQuery, CompactSummaries, Layout, LogGrid, ParisConfig, Query, Summaries};

const HEADER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../templates/include/kvforge/paris.cuh");
const HADAMARD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../templates/include/kvforge/hadamard.cuh");

const PRELUDE: &str = r#"
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>
#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) alignas(n)
using std::isfinite;
using std::isinf;
using std::llround;
using std::log2;
using std::sqrt;
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
struct Dim { unsigned x, y, z; };
thread_local Dim threadIdx, blockIdx;
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct float2 { float x, y; };
struct __half { _Float16 v; };
struct alignas(4) __half2 { _Float16 x, y; };
inline float __half2float(__half h) { return float(h.v); }
inline __half __float2half_rn(float f) { return __half{_Float16(f)}; }
inline __half2 __floats2half2_rn(float a, float b) { return __half2{_Float16(a), _Float16(b)}; }
inline float2 __half22float2(__half2 h) { return float2{float(h.x), float(h.y)}; }
inline __half2 __hadd2(__half2 a, __half2 b) { return __half2{_Float16(a.x + b.x), _Float16(a.y + b.y)}; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
// One CTA: a barrier for the block, one per warp, shuffle slots in two phases (a lane reaches
// the next-but-one collective only after every lane has read this one's slots: one barrier each).
struct Cta {
  std::barrier<>* all;
  std::barrier<>* warp[32];
  unsigned long long slot[2][32][32];
};
thread_local Cta* cta;
thread_local int phase;
inline void __syncthreads() { cta->all->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { cta->warp[threadIdx.x / 32]->arrive_and_wait(); }
template <class T> T __shfl_xor_sync(unsigned, T v, int o) {
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  auto& s = cta->slot[phase ^= 1][w];
  std::memcpy(&s[l], &v, sizeof v);
  __syncwarp();
  T r;
  std::memcpy(&r, &s[l ^ o], sizeof r);
  return r;
}
inline unsigned __ballot_sync(unsigned, bool p) {
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  auto& s = cta->slot[phase ^= 1][w];
  s[l] = p;
  __syncwarp();
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= unsigned(s[i] != 0) << i;
  return r;
}
inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
inline int atomicMax(int* p, int v) {
  std::atomic_ref<int> a(*p);
  int o = a.load();
  while (o < v && !a.compare_exchange_weak(o, v)) {}
  return o;
}
// Dynamic shared memory and the shared window: an arena, addresses relative to it.
alignas(4096) static unsigned char g_arena[1 << 17];
inline unsigned __cvta_generic_to_shared(const void* p) { return unsigned((const unsigned char*)p - g_arena); }
// Runs `f` over a grid of CTAs of nt threads, one CTA at a time, on the same nt threads (a
// barrier between CTAs; a kernel returns early only past its last __syncthreads).
template <class F> void launch(Dim grid, int nt, F f) {
  Cta c;
  std::barrier<> all(nt);
  c.all = &all;
  for (int w = 0; w < nt / 32; ++w) c.warp[w] = new std::barrier<>(32);
  std::vector<std::thread> ts;
  for (int t = 0; t < nt; ++t)
    ts.emplace_back([&, t] {
      cta = &c;
      phase = 0;
      threadIdx = Dim{unsigned(t), 0, 0};
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) {
          blockIdx = Dim{x, y, 0};
          f();
          all.arrive_and_wait();
        }
    });
  for (auto& t : ts) t.join();
  for (int w = 0; w < nt / 32; ++w) delete c.warp[w];
}
namespace kvforge {
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }
"#;

/// `text` from the line holding `start` up to (not including) the line holding `end`.
fn between<'a>(text: &'a str, start: &str, end: &str) -> &'a str {
    let a = text.find(start).unwrap_or_else(|| panic!("marker {start:?} not in the header"));
    let a = text[..a].rfind('\n').map_or(0, |i| i + 1);
    let b = a + text[a..].find(end).unwrap_or_else(|| panic!("marker {end:?} not in the header"));
    let b = text[..b].rfind('\n').map_or(0, |i| i + 1);
    &text[a..b]
}

fn compiler() -> Option<String> {
    [std::env::var("CXX").ok(), Some("c++".into()), Some("g++".into()), Some("clang++".into())].into_iter().flatten().find(|c| Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success()))
}

/// The C++ source: prelude, the header's pieces, and a driver per `(d, g)` reading the inputs
/// the test writes (`in_{d}_{g}.bin`) and writing the outputs (`out_{d}_{g}.bin`).
fn source(configs: &[(usize, usize)]) -> String {
    let hdr = std::fs::read_to_string(HEADER).unwrap();
    let had = std::fs::read_to_string(HADAMARD).unwrap();
    let mut s = String::from(PRELUDE);
    s.push_str(between(&had, "__device__ __forceinline__ float hadamard_sign", "// Whether a decode configuration rotates"));
    s.push_str("namespace paris {\n");
    s.push_str(between(&hdr, "struct Index {", "constexpr u32 ERR_TOP_RANGE"));
    s.push_str(between(&hdr, "constexpr int EST_BITS", "// Block helpers"));
    s.push_str(between(&hdr, "__device__ __forceinline__ u32 float_key", "// Radix-select step"));
    s.push_str(between(&hdr, "template <int D, int NT, int ROWS, class Acc>", "template <int D, int M, int NT>\n__device__ void encode_kernel"));
    s.push_str(between(&hdr, "constexpr int RERANK_CHUNK", "// The direction codes (D / 2 bytes"));
    let mut hmax = between(&hdr, "__host__ __device__ constexpr int hmax_pairs", "template <int D, int M, int G, int NT>\n__device__ void rerank_hmax_kernel").to_string();
    let (a, b) = (hmax.find("  if constexpr (P == 1)\n    asm").expect("hmax_entry's loads"), hmax.find("  return e;").unwrap());
    hmax.replace_range(a..b, "  std::memcpy(&e, g_arena + addr, sizeof e);\n");
    s.push_str(&hmax);
    let whole = between(&hdr, "template <int D>\nstruct Whole {", "// Top-k of the rerank estimates");
    assert!(whole.contains("extern __shared__ __align__(16) u32 hmax_lut[];"));
    s.push_str(&whole.replace("extern __shared__ __align__(16) u32 hmax_lut[];", "u32* hmax_lut = reinterpret_cast<u32*>(g_arena + 16);"));
    s.push_str("}  // namespace paris\n}  // namespace kvforge\nusing namespace kvforge;\nusing namespace kvforge::paris;\n");
    // The parameter structs as the runtime's #[repr(C)] mirrors assert them.
    s.push_str("static_assert(sizeof(Index) == 56 && offsetof(Index, wtop) == 48);\n");
    s.push_str("static_assert(sizeof(EncodeParams) == 184 && offsetof(EncodeParams, levels) == 88 && offsetof(EncodeParams, low) == 152);\n");
    s.push_str("static_assert(sizeof(RerankParams) == 232 && offsetof(RerankParams, seed) == 128 && offsetof(RerankParams, levels) == 132 && offsetof(RerankParams, low) == 196);\n");
    s.push_str(
        r#"template <class T> static std::vector<T> take(FILE* f, size_t n) { std::vector<T> v(n); if (fread(v.data(), sizeof(T), n, f) != n) { fprintf(stderr, "short input\n"); std::exit(2); } return v; }
template <class T> static void put(FILE* f, const std::vector<T>& v) { fwrite(v.data(), sizeof(T), v.size(), f); }
"#,
    );
    for &(d, g) in configs {
        write!(
            s,
            r#"
static void run_{d}_{g}(const char* dir) {{
  constexpr int D = {d}, G = {g}, B = D / 8, ROW = 3 * D / 8;
  char path[4096];
  snprintf(path, sizeof path, "%s/in_{d}_{g}.bin", dir);
  FILE* f = fopen(path, "rb");
  const auto hdr = take<int>(f, 4);  // n, prefill, hkv, cand count
  const int n = hdr[0], pre = hdr[1], hkv = hdr[2], nc = hdr[3];
  const auto seed = take<u32>(f, 1)[0];
  const auto levels = take<float>(f, 16);
  const auto low = take<float>(f, 8);
  const auto keys = take<u16>(f, size_t(n) * hkv * D);       // [n][hkv][D] fp16
  const auto qrot = take<float>(f, size_t(hkv) * D);         // [hkv][D] summed query, rotated
  const auto qnorm = take<float>(f, hkv);
  const auto q = take<u16>(f, size_t(hkv) * G * D);          // [hkv][G][D] fp16
  const auto cand = take<u32>(f, size_t(hkv) * nc);          // [hkv][nc]
  fclose(f);
  const int cap = n + 3;
  std::vector<u8> ids(size_t(hkv) * cap * B, 0xee), rows(size_t(hkv) * cap * ROW, 0xee);
  std::vector<u32> hist(size_t(hkv) * B * 256, 0), len(1, n);
  std::vector<int> wtop(hkv, WTOP_NONE);
  Index ix{{ids.data(), rows.data(), nullptr, hist.data(), len.data(), cap, hkv, wtop.data()}};
  // Two appends, as ParisIndex::append: scale_whole over the first, encode_whole over both.
  for (int part = 0; part < 2; ++part) {{
    const int r0 = part == 0 ? 0 : pre, rn = part == 0 ? pre : n - pre;
    if (rn == 0) continue;
    std::vector<u32> seq_of(rn, 0), pos_of(rn);
    for (int r = 0; r < rn; ++r) pos_of[r] = r0 + r;
    EncodeParams p{{ix, reinterpret_cast<const __half*>(keys.data()) + size_t(r0) * hkv * D, seq_of.data(), pos_of.data(), rn, seed, {{}}, {{}}}};
    std::memcpy(p.levels, levels.data(), sizeof p.levels);
    std::memcpy(p.low, low.data(), sizeof p.low);
    const Dim grid{{unsigned((rn + 3) / 4), unsigned(hkv), 1}};
    if (part == 0) launch(grid, 128, [&] {{ encode_whole_kernel<D, 8, 128, true>(p); }});
    launch(grid, 128, [&] {{ encode_whole_kernel<D, 8, 128, false>(p); }});
  }}
  // Reranks: one retrieval row per kv head (S 1, RG 1), chunks of 96 candidates.
  std::vector<u32> count(hkv, nc), est_hist(size_t(hkv) * EST_BINS, 0);
  std::vector<float> est(size_t(hkv) * nc, -1.f), est_max(size_t(hkv) * nc, -1.f);
  RerankParams r{{ix, qrot.data(), qnorm.data(), cand.data(), count.data(), est.data(), est_hist.data(), reinterpret_cast<const __half*>(q.data()), nc, hkv, 1, 96, seed, {{}}, {{}}}};
  std::memcpy(r.levels, levels.data(), sizeof r.levels);
  std::memcpy(r.low, low.data(), sizeof r.low);
  const Dim rgrid{{unsigned((nc + 95) / 96 + 1), unsigned(hkv), 1}};
  launch(rgrid, 256, [&] {{ rerank_whole_kernel<D, 8, 256>(r); }});
  r.est = est_max.data();
  launch(rgrid, 256, [&] {{ rerank_whole_hmax_kernel<D, 8, G, 256>(r); }});
  snprintf(path, sizeof path, "%s/out_{d}_{g}.bin", dir);
  f = fopen(path, "wb");
  put(f, ids); put(f, rows); put(f, hist); put(f, wtop); put(f, est); put(f, est_max);
  fclose(f);
}}
"#
        )
        .unwrap();
    }
    s.push_str("int main(int argc, char** argv) {\n");
    for &(d, g) in configs {
        writeln!(s, "  run_{d}_{g}(argv[1]);").unwrap();
    }
    s.push_str("  return argc > 1 ? 0 : 1;\n}\n");
    s
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
    fn gauss(&mut self) -> f64 {
        let (a, b) = (self.next().max(1e-300), self.next());
        (-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()
    }
}

fn bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data slices (u16, u32, i32, f32) viewed as their bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

fn read<T: Copy + Default>(b: &[u8], at: &mut usize, n: usize) -> Vec<T> {
    let sz = std::mem::size_of::<T>();
    let mut v = vec![T::default(); n];
    // SAFETY: `n` values of `T` (plain old data) from the driver's output.
    unsafe { std::ptr::copy_nonoverlapping(b[*at..*at + n * sz].as_ptr(), v.as_mut_ptr().cast::<u8>(), n * sz) };
    *at += n * sz;
    v
}

#[test]
fn whole64_device_code_matches_the_reference() {
    let Some(cxx) = compiler() else {
        eprintln!("no C++ compiler: Whole64 host test skipped");
        return;
    };
    let configs = [(64usize, 3usize), (128, 8), (256, 2)];
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("whole_device_host");
    std::fs::create_dir_all(&dir).unwrap();
    let (cpp, exe) = (dir.join("t.cpp"), dir.join("t"));
    std::fs::write(&cpp, source(&configs)).unwrap();
    let c = Command::new(&cxx).args(["-std=c++20", "-O1", "-pthread", "-Wno-unknown-pragmas", "-o"]).arg(&exe).arg(&cpp).output().unwrap();
    if !c.status.success() && String::from_utf8_lossy(&c.stderr).contains("barrier") {
        eprintln!("no C++20 <barrier>: Whole64 host test skipped\n{}", String::from_utf8_lossy(&c.stderr));
        return;
    }
    assert!(c.status.success(), "{}", String::from_utf8_lossy(&c.stderr));
    let hkv = 2;
    let mut want = Vec::new();
    for &(d, g) in &configs {
        let cfg = ParisConfig::default_for(d);
        let layout = Layout::whole_eighth();
        let (n, pre) = (58, 21);
        let mut rng = Rng(d as u64 * 31 + g as u64);
        // [n][hkv][D]: a mean and a spread of norms; key 5 of head 0 zero; the second append's
        // keys of head 1 larger than the prefill's (weights past the grid's top clamp).
        let keys: Vec<f16> = (0..n * hkv * d)
            .map(|i| {
                let (t, h, c) = (i / (hkv * d), i / d % hkv, i % d);
                let scale = (1.0 + (t % 7) as f64 * 0.4) * if h == 1 && t >= pre { 3.0 } else { 1.0 };
                let v = if t == 5 && h == 0 { 0.0 } else { scale * (rng.gauss() + 1.2 * (c as f64 * 0.37).sin()) };
                f16::from_f64(v)
            })
            .collect();
        let heads: Vec<f16> = (0..hkv * g * d).map(|_| f16::from_f64(rng.gauss() + 0.5)).collect();
        let mut qrot = Vec::new();
        let mut qnorm = Vec::new();
        for h in 0..hkv {
            let hq: Vec<f64> = heads[h * g * d..(h + 1) * g * d].iter().map(|v| v.to_f64()).collect();
            let qq = Query::new(&cfg, &group_query(&hq, d)).unwrap();
            qrot.extend(qq.rotated.iter().map(|&v| v as f32));
            qnorm.push(qq.norm as f32);
        }
        // Candidates: every key but a few, in a scrambled order.
        let nc = n - 4;
        let cand: Vec<u32> = (0..hkv).flat_map(|h| (0..nc).map(move |i| ((i * 17 + h * 5) % n) as u32)).collect();
        let lv = kvforge_spec::codecs::rotated::levels::levels;
        let mut input = Vec::new();
        input.extend_from_slice(bytes(&[n as i32, pre as i32, hkv as i32, nc as i32]));
        input.extend_from_slice(bytes(&[cfg.seed]));
        input.extend_from_slice(bytes(&lv(d, 4).levels_f32));
        input.extend_from_slice(bytes(&lv(d, 3).levels_f32));
        input.extend_from_slice(bytes(&keys.iter().map(|v| v.to_bits()).collect::<Vec<u16>>()));
        input.extend_from_slice(bytes(&qrot));
        input.extend_from_slice(bytes(&qnorm));
        input.extend_from_slice(bytes(&heads.iter().map(|v| v.to_bits()).collect::<Vec<u16>>()));
        input.extend_from_slice(bytes(&cand));
        std::fs::write(dir.join(format!("in_{d}_{g}.bin")), input).unwrap();
        want.push((d, g, cfg, layout, n, pre, nc, keys, heads, cand));
    }
    let run = Command::new(&exe).arg(&dir).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    for (d, g, cfg, layout, n, pre, nc, keys, heads, cand) in want {
        let out = std::fs::read(dir.join(format!("out_{d}_{g}.bin"))).unwrap();
        let (b, rb, cap) = (d / 8, 3 * d / 8, n + 3);
        let mut at = 0;
        let ids: Vec<u8> = read(&out, &mut at, hkv * cap * b);
        let rows: Vec<u8> = read(&out, &mut at, hkv * cap * rb);
        let hist: Vec<u32> = read(&out, &mut at, hkv * b * 256);
        let wtop: Vec<i32> = read(&out, &mut at, hkv);
        let est: Vec<f32> = read(&out, &mut at, hkv * nc);
        let est_max: Vec<f32> = read(&out, &mut at, hkv * nc);
        assert_eq!(at, out.len());
        for h in 0..hkv {
            let x: Vec<f32> = keys.chunks_exact(hkv * d).flat_map(|r| r[h * d..(h + 1) * d].iter().map(|v| v.to_f32())).collect();
            let seed = Summaries::encode(cfg, &x).unwrap();
            let prek = CompactKeys::encode(cfg, layout, &x[..pre * d]).unwrap();
            let grid = LogGrid::fit(layout.steps(), prek.weights.iter().copied());
            let refc = CompactSummaries::on_grid(CompactKeys::encode(cfg, layout, &x).unwrap(), grid);
            let tag = format!("d {d} gqa {g} head {h}");
            assert_eq!(wtop[h] - 255, grid.base, "{tag}: the prefill's grid");
            let dids = &ids[h * cap * b..(h * cap + n) * b];
            let drows = &rows[h * cap * rb..(h * cap + n) * rb];
            assert!(ids[(h * cap + n) * b..(h + 1) * cap * b].iter().all(|&v| v == 0xee), "{tag}: ids past the keys written");
            assert!(rows[(h * cap + n) * rb..(h + 1) * cap * rb].iter().all(|&v| v == 0xee), "{tag}: rows past the keys written");
            // Codes may differ from the reference's where the f32 rotations disagree on a
            // threshold; none did for these keys, so everything is compared exactly.
            assert_eq!(dids, &seed.ids[..], "{tag}: ids");
            assert_eq!(&hist[h * b * 256..(h + 1) * b * 256], &seed.hist[..], "{tag}: occupancy");
            let got = CompactSummaries::from_whole_rows(cfg, dids, drows, LogGrid { steps: 32, base: wtop[h] - 255 }).unwrap();
            assert_eq!(got.codes, refc.codes, "{tag}: codes");
            assert_eq!(got.weights, refc.weights, "{tag}: weight codes");
            assert_eq!(drows, &refc.whole_rows().unwrap()[..], "{tag}: rows byte for byte");
            if h == 1 {
                assert!(got.weights[pre..].contains(&255), "{tag}: later keys clamp");
            }
            // Estimates on the codes the device wrote.
            let hq: Vec<f64> = heads[h * g * d..(h + 1) * g * d].iter().map(|v| v.to_f64()).collect();
            let summed = CompactQuery::new(&Query::new(&cfg, &group_query(&hq, d)).unwrap(), layout).unwrap();
            let per: Vec<CompactQuery> = hq.chunks_exact(d).map(|q| CompactQuery::new(&Query::new(&cfg, q).unwrap(), layout).unwrap()).collect();
            for c in 0..nc {
                let i = cand[h * nc + c] as usize;
                let norm = x[i * d..(i + 1) * d].iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
                let e = summed.estimate(&got, i);
                let scale = summed.estimate(&got, i).abs().max(norm * hq.chunks_exact(d).map(|q| q.iter().map(|v| v * v).sum::<f64>().sqrt()).sum::<f64>() * 1e-2);
                assert!((f64::from(est[h * nc + c]) - e).abs() <= 1e-4 * scale + 1e-6, "{tag}: candidate {c} (key {i}): summed {} vs {e}", est[h * nc + c]);
                let m = per.iter().map(|p| p.estimate(&got, i)).fold(f64::NEG_INFINITY, f64::max);
                let qmax = hq.chunks_exact(d).map(|q| q.iter().map(|v| v * v).sum::<f64>().sqrt()).fold(0.0, f64::max);
                assert!((f64::from(est_max[h * nc + c]) - m).abs() <= 2e-3 * norm * qmax + 1e-6, "{tag}: candidate {c} (key {i}): group max {} vs {m}", est_max[h * nc + c]);
            }
        }
    }
}

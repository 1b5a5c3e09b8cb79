//! The rotated codec's register-only level lookup (templates/include/kvforge/codecs/rotated_lut.cuh)
//! run on the host: the header is compiled with the system C++ compiler and an emulation of
//! PTX `prmt.b32` (sign replication included, so a selector nibble with bit 3 set would show),
//! fed random code streams (every 3-bit group and 2-bit word is valid) at every bit width and
//! head dim the rotated spec builds, slices that are part of a group at every position, and its
//! fp16 pairs compared with the levels of kvforge-spec rounded to fp16; 3-bit configurations
//! also compare the kernels' group packing with kvforge-spec's. Skipped (with a message) where
//! no C++ compiler is found.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;

use kvforge_spec::codecs::rotated::levels::INT8_GRID_BITS;
use kvforge_spec::codecs::rotated::{group3_nibbles, group3_pack, levels, GROUP3_CHANNELS};

const HEADER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../templates/include/kvforge/codecs/rotated_lut.cuh");

const PRELUDE: &str = r#"
#include <cstdint>
#include <cstdio>
#define __host__
#define __device__
#define __forceinline__ inline
namespace kvforge {
typedef unsigned char u8;
typedef unsigned int u32;
}
// PTX prmt.b32 (default mode): byte n = byte (c >> 4n) & 7 of {b, a}, or, with bit 3 of the
// nibble set, that byte's sign bit replicated.
static inline kvforge::u32 __byte_perm(kvforge::u32 a, kvforge::u32 b, kvforge::u32 c) {
  const unsigned long long x = (unsigned long long)b << 32 | a;
  kvforge::u32 r = 0;
  for (int n = 0; n < 4; ++n) {
    const unsigned s = (c >> (4 * n)) & 0xf;
    unsigned byte = (x >> (8 * (s & 7))) & 0xff;
    if (s & 8) byte = (byte & 0x80) ? 0xff : 0;
    r |= byte << (8 * n);
  }
  return r;
}
// One output line's head: tag, bits, head dim, the value streams `a | b` and the slice position.
template <int N>
static void streams(const char* tag, int bits, int d, const kvforge::u32 (&a)[N], const kvforge::u32 (&b)[N], int pos) {
  printf("%s %d %d", tag, bits, d);
  for (auto x : a) printf(" %08x", x);
  printf(" |");
  for (auto x : b) printf(" %08x", x);
  printf(" @ %d :", pos);
}
"#;

fn compiler() -> Option<String> {
    [std::env::var("CXX").ok(), Some("c++".into()), Some("g++".into()), Some("clang++".into())].into_iter().flatten().find(|c| Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success()))
}

/// Code streams per configuration.
const CASES: usize = 400;

/// 3-bit configurations also check the kernels' group packing against kvforge-spec's.
const GROUP_CHECK: &str = r#"for (int c = 0; c < {CASES}; ++c) {
      kvforge::u32 n[4], g[3];
      for (auto& x : n) x = next() & kvforge::ROTATED_NIB3;
      kvforge::rotated_group3_pack(n, g);
      printf("G 3 {d} %08x %08x %08x %08x : %08x %08x %08x\n", n[0], n[1], n[2], n[3], g[0], g[1], g[2]);
    }"#;

/// Integer keys (up to 3 bits): the int8 levels of the same key slice, with the grid exponent.
const INT8_KEYS: &str = r#"kvforge::u32 oi[2 * {kch}];
        Lut::adjacent_int8<{kch}>(Lut::opaque<Lut::WORD_I0>(), s, oi);
        printf("I {bits} {d}");
        for (auto x : w) printf(" %08x", x);
        printf(" @ %d :", pos);
        printf(" %08x", (kvforge::u32)Lut::GRID);
        for (auto x : oi) printf(" %08x", x);
        printf("\n");"#;

/// Integer values (up to 3 bits): the biased pairs of the same value slices, with −bias.
const INT8_VALUES: &str = r#"kvforge::u32 ob[{vp}];
        Lut::transposed_int8<{vch}>(sa, sb, ob);
        streams("W", {bits}, {d}, a, b, pos);
        printf(" %08x %08x", (kvforge::u32)Lut::GRID, Lut::VBIAS_H2);
        for (auto x : ob) printf(" %08x", x);
        printf("\n");"#;

/// One configuration: `bits`, head dim `d`; key slices of d/32 chunks, value slices of d/64.
/// 3-bit slices of fewer than 4 chunks are a part of one group (2-bit slices of one chunk of
/// one word): the driver draws the whole group and the part's position, builds the words the
/// kernels load with `form` and prints the group and the position (`@ pos`); other slices
/// print their stream and `@ 0`.
fn driver(bits: u32, d: usize, lv: &[u32]) -> String {
    let lvs = lv.iter().map(|l| format!("{l:#010x}u")).collect::<Vec<_>>().join(", ");
    let kch = d / 32;
    let vch = d / 64;
    // Chunks and words of a group (3 bits) or word (2 bits).
    let (gch, gw) = if bits == 3 { (4, 3) } else { (2, 1) };
    let part = |nch: usize| bits != 4 && nch < gch;
    let words = |nch: usize| if part(nch) { gw } else { (nch * bits as usize).div_ceil(4) };
    // Input words `src` of one slice to the Lut's stream `dst` at position `pos`.
    let load = |nch: usize, src: &[&str], dst: &[&str]| {
        let mut o = if part(nch) { format!("int pos = next() % {};", gch / nch) } else { "int pos = 0;".to_string() };
        for (s, t) in src.iter().zip(dst) {
            if part(nch) {
                write!(o, " kvforge::u32 {t}[{fw}]; Lut::form<{nch}>({s}[pos * {nch} / 2 % {gw}], {s}[{gw} - 1], pos, {t});", fw = gw.min(2)).unwrap();
            } else {
                write!(o, " kvforge::u32 (&{t})[{w}] = {s};", w = words(nch)).unwrap();
            }
        }
        o
    };
    format!(
        r#"
  {{
    using Lut = kvforge::RotatedLut<{bits}, {lvs}>;
    for (int c = 0; c < {CASES}; ++c) {{
      {{
        kvforge::u32 w[{kw}], out[{kp}];
        for (auto& x : w) x = next();
        {kload}
        Lut::adjacent<{kch}>(s, out);
        printf("K {bits} {d}");
        for (auto x : w) printf(" %08x", x);
        printf(" @ %d :", pos);
        for (auto x : out) printf(" %08x", x);
        printf("\n");
        {int8}
      }}
      {{
        kvforge::u32 a[{vw}], b[{vw}], o[{vp}];
        for (auto& x : a) x = next();
        for (auto& x : b) x = next();
        {vload}
        Lut::transposed<{vch}>(sa, sb, o);
        streams("V", {bits}, {d}, a, b, pos);
        for (auto x : o) printf(" %08x", x);
        printf("\n");
        {int8v}
      }}
    }}
    {group}
  }}
"#,
        int8v = if bits <= INT8_GRID_BITS {
            INT8_VALUES.replace("{vch}", &vch.to_string()).replace("{vp}", &(8 * vch).to_string()).replace("{bits}", &bits.to_string()).replace("{d}", &d.to_string())
        } else {
            String::new()
        },
        int8 = if bits <= INT8_GRID_BITS { INT8_KEYS.replace("{kch}", &kch.to_string()).replace("{bits}", &bits.to_string()).replace("{d}", &d.to_string()) } else { String::new() },
        kw = words(kch),
        kp = 4 * kch,
        vw = words(vch),
        vp = 8 * vch,
        kload = load(kch, &["w"], &["s"]),
        vload = load(vch, &["a", "b"], &["sa", "sb"]),
        group = if bits == 3 { GROUP_CHECK.replace("{d}", &d.to_string()).replace("{CASES}", &CASES.to_string()) } else { String::new() },
    )
}

fn hex(s: &str) -> Vec<u32> {
    s.split_whitespace().map(|x| u32::from_str_radix(x, 16).unwrap()).collect()
}

/// Code of channel `c` of a stream of `bits`-bit codes (docs/LAYOUT.md): 4 bits one chunk per
/// word, code k in nibble k; 2 bits two chunks per word, at bits 0-1 and 2-3 of the nibbles;
/// 3 bits groups of 3 words (kvforge-spec's `group3_nibbles`).
fn code(w: &[u32], bits: u32, c: usize) -> usize {
    match bits {
        3 => {
            let g = c / GROUP3_CHANNELS;
            let n = group3_nibbles([w[3 * g], w[3 * g + 1], w[3 * g + 2]]);
            ((n[(c / 8) % 4] >> (4 * (c % 8))) & 7) as usize
        }
        2 => ((w[c / 16] >> (4 * (c % 8) + 2 * ((c / 8) % 2))) & 3) as usize,
        _ => ((w[c / 8] >> (4 * (c % 8))) & 15) as usize,
    }
}

#[test]
fn lookup_matches_levels_rounded_to_fp16() {
    let Some(cxx) = compiler() else {
        eprintln!("no C++ compiler: rotated_lut host test skipped");
        return;
    };
    let mut src = String::from(PRELUDE);
    writeln!(src, "#include \"{HEADER}\"").unwrap();
    src.push_str(
        "static unsigned long long st = 0x9E3779B97F4A7C15ull;\nstatic kvforge::u32 next() { st = st * 6364136223846793005ull + 1442695040888963407ull; return (kvforge::u32)(st >> 32); }\nint main() {\n",
    );
    let configs: Vec<(u32, usize)> = [2u32, 3, 4].iter().flat_map(|&b| [64usize, 128, 256].map(move |d| (b, d))).collect();
    for &(bits, d) in &configs {
        let lv: Vec<u32> = levels(d, bits).levels_f32.iter().map(|l| l.to_bits()).collect();
        src.push_str(&driver(bits, d, &lv));
    }
    src.push_str("  return 0;\n}\n");
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("rotated_lut");
    std::fs::create_dir_all(&dir).unwrap();
    let cpp = dir.join("t.cpp");
    let exe = dir.join("t");
    std::fs::write(&cpp, &src).unwrap();
    let c = Command::new(&cxx).args(["-std=c++17", "-O1", "-Wno-unknown-pragmas", "-o"]).arg(&exe).arg(&cpp).output().unwrap();
    assert!(c.status.success(), "{}", String::from_utf8_lossy(&c.stderr));
    let run = Command::new(&exe).output().unwrap();
    assert!(run.status.success());
    let out = String::from_utf8(run.stdout).unwrap();
    let mut checked = 0;
    let mut int8_checked = 0;
    for line in out.lines() {
        let mut it = line.splitn(4, ' ');
        let side = it.next().unwrap();
        let bits: u32 = it.next().unwrap().parse().unwrap();
        let d: usize = it.next().unwrap().parse().unwrap();
        let body = it.next().unwrap();
        let half = |c: usize| half::f16::from_f32(levels(d, bits).levels_f32[c]).to_bits() as u32;
        let (input, got) = body.split_once(':').unwrap();
        let got = hex(got);
        if side == "G" {
            // The kernels' encode packs a group as kvforge-spec does.
            let n = hex(input);
            assert_eq!(got, group3_pack([n[0], n[1], n[2], n[3]]), "group of {n:08x?}");
            continue;
        }
        let (input, pos) = input.split_once('@').unwrap();
        let pos: usize = pos.trim().parse().unwrap();
        if side == "I" {
            // Byte k of word 2j (2j + 1) is channel 8j + k (8j + 4 + k) of the slice, as the
            // int8 n with n·2^−GRID the stored level; GRID is kvforge-spec's grid_log2.
            let w = hex(input);
            let table = levels(d, bits);
            assert_eq!(Some(got[0]), table.grid_log2, "grid exponent, {bits} bits, d {d}");
            let c0 = pos * d / 4;
            for (i, &word) in got[1..].iter().enumerate() {
                for k in 0..4 {
                    let c = c0 + 8 * (i / 2) + 4 * (i % 2) + k;
                    let n = f64::from((word >> (8 * k)) as u8 as i8);
                    let want = f64::from(table.levels_f32[code(&w, bits, c)]);
                    assert_eq!(n / f64::from(1u32 << got[0]), want, "int8 keys, {bits} bits, d {d}, channel {c}, stream {w:08x?} at {pos}");
                }
            }
            int8_checked += 1;
            continue;
        }
        if side == "W" {
            // Pair k: channel c0 + k of tokens a, b as (ℓ + bias) in fp16, exactly, with
            // bias = 1152·2^−GRID and the printed −bias pair its negation in both halves.
            let (a, b) = input.split_once('|').unwrap();
            let (a, b) = (hex(a), hex(b));
            let table = levels(d, bits);
            assert_eq!(Some(got[0]), table.grid_log2, "grid exponent, {bits} bits, d {d}");
            let bias = 1152.0 / f64::from(1u32 << got[0]);
            let h = |x: u32| f64::from(half::f16::from_bits(x as u16).to_f32());
            assert_eq!((h(got[1]), h(got[1] >> 16)), (-bias, -bias), "value bias, {bits} bits, d {d}");
            let c0 = pos * d / 8;
            for (k, &g) in got[2..].iter().enumerate() {
                let want = |w: &[u32]| f64::from(table.levels_f32[code(w, bits, c0 + k)]) + bias;
                assert_eq!((h(g), h(g >> 16)), (want(&a), want(&b)), "biased values, {bits} bits, d {d}, channel {k}, streams {a:08x?} {b:08x?} at {pos}");
            }
            int8_checked += 1;
            continue;
        }
        if side == "K" {
            let w = hex(input);
            let c0 = pos * d / 4;
            for (e, &g) in got.iter().enumerate() {
                let want = half(code(&w, bits, c0 + 2 * e)) | half(code(&w, bits, c0 + 2 * e + 1)) << 16;
                assert_eq!(g, want, "keys, {bits} bits, d {d}, pair {e}, stream {w:08x?} at {pos}");
            }
        } else {
            let (a, b) = input.split_once('|').unwrap();
            let (a, b) = (hex(a), hex(b));
            let c0 = pos * d / 8;
            for (k, &g) in got.iter().enumerate() {
                let want = half(code(&a, bits, c0 + k)) | half(code(&b, bits, c0 + k)) << 16;
                assert_eq!(g, want, "values, {bits} bits, d {d}, channel {k}, streams {a:08x?} {b:08x?} at {pos}");
            }
        }
        checked += 1;
    }
    assert_eq!(checked, 2 * CASES * configs.len());
    assert_eq!(int8_checked, 2 * CASES * configs.iter().filter(|c| c.0 <= INT8_GRID_BITS).count());
}

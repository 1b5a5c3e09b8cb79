#!/usr/bin/env python3
"""Static SASS of the per-warp decode's token loop (issue 25: an instruction count per token
without a GPU).

Compiles generated decode kernels (kernels-generated/<spec>/decode_*.cu) with NVRTC to a cubin
(the runtime's flags, headers from templates/include and kernels-generated/include), disassembles
the plain entry with nvdisasm, and finds the innermost loops (a backward branch) that hold
HMMA: compute_warp's token loop, once per tier of the variant (integer keys score with IMMA, counted apart). For each it prints the static
instruction count of the loop body, the count on the common path (the loop without the two
rare regions a guarded forward branch skips: the rescale after a new maximum and the
tail-page mask), the tokens per iteration (8 per D/16 HMMA.1688), those per token, and the
opcodes. Also ptxas' registers and spills (`--ptxas-options=-v`). Full pages of a coded tier
(`compute_warp<T, true>`, NOTES v18) run one unrolled round per warp inside the page loop: those
rows ("full page") count the straight-line path from the round's setup to its last value mma.

Usage (NVRTC 13 from /work/venv; see docs/perf/NOTES.md v13):
  CU13=$(/work/venv/bin/python -c 'import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],"cu13"))')
  LD_LIBRARY_PATH=$CU13/lib python3 benches/sass_loop.py [--arch sm_90] [--json out.json] [substr ...]
Default variants: rdkv b8/b4/b2 and rotated r4/r3/r2 at d128 gqa4.
"""
import argparse
import collections
import ctypes
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = [
    "rdkv/decode_kint8c64f16_vint8g32f16_d128_g4_",
    "rdkv/decode_kint4c64f16_vint4g32f16_d128_g4_",
    "rdkv/decode_kint2c64f16_vint2g32f16_d128_g4_",
    "rotated/decode_krot4_vrot4_d128_g4_",
    "rotated/decode_krot3_vrot3_d128_g4_",
    "rotated/decode_krot2_vrot2_d128_g4_",
]


def cu13():
    try:
        import nvidia  # noqa: F401

        return os.path.join(list(nvidia.__path__)[0], "cu13")
    except ImportError:
        out = subprocess.check_output(["/work/venv/bin/python", "-c", "import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],'cu13'))"])
        return out.decode().strip()


def nvrtc_cubin(lib, name, src, arch, inc):
    prog = ctypes.c_void_p()
    r = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None)
    assert r == 0, f"nvrtcCreateProgram {r}"
    opts = ["-std=c++17", "-default-device", "-lineinfo", f"--gpu-architecture={arch}", "--ptxas-options=-v"] + [f"-I{d}" for d in inc]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    log = log.value.decode(errors="replace")
    if rc != 0:
        sys.exit(f"{name}: NVRTC failed\n{log}")
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw, log


INSN = re.compile(r"^\s*(?:/\*([0-9a-f]{4,})\*/)\s+(.*?);")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")


def parse_functions(sass):
    """{function: [(addr, text, labels_here)]} from nvdisasm output."""
    funcs = {}
    cur = None
    pending = []
    for line in sass.splitlines():
        m = re.match(r"^\s*\.text\.(\S+):", line)
        if m:
            cur = m.group(1)
            funcs[cur] = []
            pending = []
            continue
        if cur is None:
            continue
        m = LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = INSN.match(line)
        if m:
            funcs[cur].append((int(m.group(1), 16), m.group(2).strip(), pending))
            pending = []
    return funcs


def opcode(text):
    t = re.sub(r"^@!?U?P[T0-9]+\s+", "", text)
    return t.split()[0] if t else ""


def loops(insns):
    """Innermost backward-branch loops holding HMMA: (start index, end index)."""
    at = {}
    for i, (_, _, labels) in enumerate(insns):
        for l in labels:
            at[l] = i
    found = []
    for i, (_, text, _) in enumerate(insns):
        m = re.search(r"\bBRA\b.*?(\.L_x_\d+)", text)
        if m and m.group(1) in at and at[m.group(1)] <= i:
            s = at[m.group(1)]
            if any(opcode(insns[k][1]).startswith("HMMA") for k in range(s, i + 1)):
                found.append((s, i))
    inner = [(s, e) for (s, e) in found if not any((s2, e2) != (s, e) and s <= s2 and e2 <= e for (s2, e2) in found)]
    return inner


def common_path(insns, s, e):
    """Instructions of [s, e] on the path that takes every forward branch inside the loop that is
    guarded by a predicate and stays inside the loop (a skipped rare region), and falls through
    unconditional ones' targets as the layout puts them."""
    at = {}
    for i, (_, _, labels) in enumerate(insns):
        for l in labels:
            at[l] = i
    skip = [False] * len(insns)
    for i in range(s, e):
        text = insns[i][1]
        m = re.search(r"\bBRA\b.*?(\.L_x_\d+)", text)
        if not m or m.group(1) not in at:
            continue
        t = at[m.group(1)]
        region = [insns[k][1] for k in range(i + 1, t)]
        # Rare regions only: the rescale after a new maximum (its SHFL.IDX of alpha) and the
        # tail-page mask (LOP3 ANDs with one mask). Other guarded regions (a divergent branch
        # on the head lanes, say) are issued by the warp all the same.
        rescale = any(opcode(x) == "SHFL.IDX" for x in region)
        mask = sum(1 for x in region if opcode(x) == "LOP3.LUT" and x.endswith("0xc0, !PT")) * 2 >= len(region) > 0
        if i < t <= e + 1 and text.startswith("@") and (rescale or mask):
            for k in range(i + 1, t):
                skip[k] = True
    return [i for i in range(s, e + 1) if not skip[i]]


def analyse(path, arch, lib, inc):
    src = open(path).read()
    name = os.path.basename(path)
    cubin, log = nvrtc_cubin(lib, name, src, arch, inc)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        tmp = f.name
    try:
        sass = subprocess.check_output([os.path.join(cu13(), "bin", "nvdisasm"), "-c", tmp]).decode()
        if os.environ.get("SASS_DUMP"):
            open(os.environ["SASS_DUMP"], "w").write(sass)
    finally:
        os.unlink(tmp)
    funcs = parse_functions(sass)
    plain = [f for f in funcs if "_decode_" in f and not f.endswith("_tracked") and not f.endswith("_certified")]
    assert len(plain) == 1, plain
    fn = plain[0]
    insns = funcs[fn]
    # ptxas -v: the plain entry's registers and spills.
    regs = spill = None
    for m in re.finditer(r"Compiling entry function '(\w+)'.*?Used (\d+) registers.*?(?:(\d+) bytes spill stores)?", log, re.S):
        pass
    blocks = re.split(r"(?=ptxas info\s*: Compiling entry function)", log)
    for b in blocks:
        m = re.search(r"Compiling entry function '(\w+)'", b)
        if m and m.group(1) == fn:
            r = re.search(r"Used (\d+) registers", b)
            sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", b)
            regs = int(r.group(1)) if r else None
            spill = (int(sp.group(1)), int(sp.group(2))) if sp else (0, 0)
    out = []
    for s, e in loops(insns):
        body = [insns[i][1] for i in range(s, e + 1)]
        hot = [insns[i][1] for i in common_path(insns, s, e)]
        n1688 = sum(1 for t in body if opcode(t).startswith("HMMA.1688"))
        n16816 = sum(1 for t in body if opcode(t).startswith("HMMA.16816"))
        nimma = sum(1 for t in body if opcode(t).startswith("IMMA"))
        out.append({"static": len(body), "common": len(hot), "hmma16816": n16816, "hmma1688": n1688, "imma": nimma,
                    "ops": collections.Counter(opcode(t) for t in hot)})
    # Full pages (decode.cuh compute_warp<T, true>): with one octet round per warp and page the
    # loop unrolls into the page loop, so the hot path of a full page is straight-line code
    # outside every inner loop: from the label before its first score mma (IMMA or
    # HMMA.16816) to the last value HMMA.1688 before the next unconditional branch, the rare
    # regions skipped as in a loop. "kind": "full page" (setup of the page's round included).
    inner = set(i for s, e in loops(insns) for i in range(s, e + 1))
    score = [i for i, (_, t, _) in enumerate(insns) if i not in inner and (opcode(t).startswith("IMMA") or opcode(t).startswith("HMMA.16816"))]
    while score:
        s = score[0]
        while s > 0 and not insns[s][2]:
            s -= 1
        e, k = None, score[0]
        while k < len(insns) and not re.match(r"^BRA\b", insns[k][1]):
            if opcode(insns[k][1]).startswith("HMMA.1688"):
                e = k
            k += 1
        score = [i for i in score if i > k]
        if e is None:
            continue
        body = [insns[i][1] for i in range(s, e + 1)]
        hot = [insns[i][1] for i in common_path(insns, s, e)]
        out.append({"static": len(body), "common": len(hot), "kind": "full page",
                    "hmma16816": sum(1 for t in body if opcode(t).startswith("HMMA.16816")),
                    "hmma1688": sum(1 for t in body if opcode(t).startswith("HMMA.1688")),
                    "imma": sum(1 for t in body if opcode(t).startswith("IMMA")),
                    "ops": collections.Counter(opcode(t) for t in hot)})
    return fn, regs, spill, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="*", help="substrings of kernels-generated/<spec>/<file> (default: rdkv b8/b4/b2, rotated r4/r3/r2 at d128 g4)")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--json")
    ap.add_argument("--ops", action="store_true", help="print the common path's opcode histogram")
    ap.add_argument("--root", default=ROOT, help="tree holding templates/ and kernels-generated/ (e.g. `git archive e5cf01c templates kernels-generated | tar -x -C DIR`)")
    a = ap.parse_args()
    root = a.root
    lib = ctypes.CDLL(os.path.join(cu13(), "lib", "libnvrtc.so.13"))
    # One include tree, as the runtime writes it (decode.cuh includes "codecs.cuh" beside it).
    tree = tempfile.mkdtemp(prefix="sass_loop-")
    shutil.copytree(os.path.join(root, "templates/include"), tree, dirs_exist_ok=True)
    shutil.copytree(os.path.join(root, "kernels-generated/include"), tree, dirs_exist_ok=True)
    inc = [tree, os.path.join(cu13(), "include")]
    files = sorted(glob.glob(os.path.join(root, "kernels-generated/*/decode_*.cu")))
    rows = []
    for sub in a.variants or DEFAULT:
        hits = [f for f in files if sub in os.path.relpath(f, os.path.join(root, "kernels-generated"))]
        if len(hits) != 1:
            sys.exit(f"{sub}: {len(hits)} variants match")
        fn, regs, spill, ls = analyse(hits[0], a.arch, lib, inc)
        for k, l in enumerate(ls):
            # Tokens per iteration: every octet takes D/16 value mmas (m16n8k8, one per 16 channels).
            d = int(re.search(r"_d(\d+)_", hits[0]).group(1))
            # 8 tokens per D/16 value HMMA.1688; biased value pairs (rotated codes on the int8
            # grid) add one per octet for the bias, which the floor division leaves out.
            tokens = 8 * (l["hmma1688"] // (d // 16))
            row = {"variant": sub, "arch": a.arch, "regs": regs, "spill_bytes": spill, "loop": k, "kind": l.get("kind", "loop"), "tokens": tokens,
                   **{x: l[x] for x in ("static", "common", "hmma16816", "hmma1688", "imma")}}
            row["per_token_common"] = round(l["common"] / tokens, 2) if tokens else None
            row["per_token_static"] = round(l["static"] / tokens, 2) if tokens else None
            rows.append(row)
            print(f"{sub:50s} {a.arch} regs {regs} spill {spill} {row['kind']} {k}: {l['static']} static / {l['common']} common per {tokens} tokens "
                  f"= {row['per_token_static']} / {row['per_token_common']} per token (HMMA {l['hmma16816']}+{l['hmma1688']}, IMMA {l['imma']})")
            if a.ops:
                print("   ", " ".join(f"{o}:{c}" for o, c in l["ops"].most_common()))
    shutil.rmtree(tree)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""NVRTC compile check of templates/paris.cu.tera + kvforge/paris.cuh on a machine without a GPU
(the ParisKV kernels are not yet a kvforge-gen family, so `kvforge precompile` does not see them).

    CU13=$(/work/venv/bin/python -c 'import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],"cu13"))')
    LD_LIBRARY_PATH=$CU13/lib /work/venv/bin/python benches/paris/nvrtc_check.py .

Renders the template for (head_dim, subspace dim, tiers, GQA) in CONFIGS and compiles each for
sm_90 with ptxas' resource report; any diagnostic, or any entry that spills, fails.
"""
import ctypes, os, sys, nvidia
cu13 = os.path.join(list(nvidia.__path__)[0], "cu13")
lib = ctypes.CDLL(os.path.join(cu13, "lib", "libnvrtc.so.13"))
root = sys.argv[1] if len(sys.argv) > 1 else "."
tpl = open(os.path.join(root, "templates/paris.cu.tera")).read()
fails = 0
CONFIGS = [(128, 8, 6, 4), (64, 8, 6, 3), (128, 4, 3, 1), (256, 8, 6, 4), (128, 8, 6, 8)]
for d, m, t, g in CONFIGS:
    src = tpl.replace("{{ banner }}", "// test").replace("{{ symbol }}", f"paris_d{d}_m{m}_t{t}_g{g}")
    for k, v in {"d": d, "m": m, "tiers": t, "gqa": g}.items():
        src = src.replace("{{ %s }}" % k, str(v))
    src = src.replace("{{ subspaces }}", str(d // m))
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"paris.cu", 0, None, None) == 0
    opts = [b"--gpu-architecture=sm_90", b"--std=c++17", b"-default-device", b"--ptxas-options=-v", ("-I" + os.path.join(root, "templates/include")).encode(), ("-I" + os.path.join(cu13, "include")).encode()]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, buf)
    log = buf.value.decode()
    # ptxas -v: "Compiling entry function 'X'" then "N bytes stack frame, S bytes spill stores, L
    # bytes spill loads" and "Used R registers".
    lines = log.splitlines()
    report = [l for l in lines if "spill" in l or "Used" in l or "Compiling entry" in l]
    spills = [l for l in lines if "spill" in l and not l.strip().startswith("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")]
    spills = [l for l in spills if " 0 bytes spill stores, 0 bytes spill loads" not in l]
    other = [l for l in lines if l not in report and l.strip() and not l.startswith("ptxas info")]
    print(f"d{d} m{m} t{t} g{g}: rc {rc}, {len(spills)} spilling entries")
    if "-v" in sys.argv:
        print("\n".join(report))
    if rc or other or spills:
        print("\n".join(other + spills)[:4000])
    fails += rc != 0 or bool(spills) or bool(other)
sys.exit(1 if fails else 0)

#!/usr/bin/env python3
"""Slim the flashinfer-python wheel down to what paged batch decode needs.

Usage: slim_wheel.py IN.whl OUT_DIR

What is kept (everything else is dropped):
  * every flashinfer/*.py module in the *static* import closure of
    flashinfer/__init__.py, following every `import` / `from ... import`
    anywhere in a module (module level AND inside functions, so lazy imports
    on the decode / prefill / JIT paths are kept) plus
    importlib.import_module("literal") calls; plus the whole flashinfer/jit
    and flashinfer/cudnn packages.  `import flashinfer` executes a very wide
    __init__ (MoE, GEMM, KDA, ...), so modules it imports cannot be deleted,
    but the ~70 MB of Python that nothing imports statically (experimental
    CuTe-DSL kernels, MoE kernel sources, ...) goes.
  * non-.py files outside data/ only in directories that keep a .py module.
  * data/include (the whole flashinfer header tree), every top-level file of
    data/csrc (batch_decode*, batch_prefill*, page*, tvm_ffi_utils.h, jinja
    templates, ...; the subdirectories of csrc hold MoE/GEMM/KDA/... sources
    and are dropped, except csrc/xqa: the XQA decode kernels (mha.cu,
    mha_sm90.cu, tensorMap.cpp and their headers) that gen_xqa_module
    compiles; its MLA-only mla_sm120.* go), data/cutlass/include, data/cutlass/tools/util/include,
    data/spdlog/include, data/cccl/{cub,thrust,libcudacxx/include} (the JIT
    puts all of these on the include path), data/*.py, and *.dist-info.

The output is a valid wheel: RECORD is rewritten with sha256 hashes of the
files that remain, entries are sorted and time-stamped 1980-01-01, so the
output is byte-for-byte deterministic for a given input.
"""
import ast
import base64
import hashlib
import os
import shutil
import sys
import tempfile
import zipfile

PKG = "flashinfer"

DATA_KEEP_PREFIXES = (
    "data/include/",
    "data/cutlass/include/",
    "data/cutlass/tools/util/include/",
    "data/spdlog/include/",
    "data/cccl/cub/",
    "data/cccl/thrust/",
    "data/cccl/libcudacxx/include/",
)
EXTRA_SEED_DIRS = ("jit", "cudnn")
# csrc subdirectories kept whole (minus CSRC_SUBDIR_DROP): flashinfer/jit/xqa.py
# gen_xqa_module compiles xqa/{mha.cu,mha_sm90.cu,tensorMap.cpp,xqa_wrapper.cu},
# which include only headers of the same directory and ../tvm_ffi_utils.h
CSRC_KEEP_SUBDIRS = ("xqa",)
CSRC_SUBDIR_DROP = ("xqa/mla_sm120.cu", "xqa/mla_sm120.cuh")  # gen_xqa_module_mla (SM120) only


def _modfile(root, mod):
    parts = mod.split(".")[1:]
    base = os.path.join(root, *parts)
    if os.path.isfile(base + ".py"):
        return os.path.relpath(base + ".py", root)
    init = os.path.join(base, "__init__.py")
    if os.path.isfile(init):
        return os.path.relpath(init, root)
    return None


def _modname(rel):
    p = rel[:-3].split("/")
    if p[-1] == "__init__":
        p = p[:-1]
    return ".".join([PKG] + p)


def _resolve_rel(name, is_pkg, level, module):
    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
    pkg = pkg[: len(pkg) - (level - 1)]
    return ".".join(pkg + ([module] if module else []))


def import_closure(root, seeds):
    keep, todo = set(), list(seeds)
    while todo:
        rel = todo.pop()
        if rel in keep:
            continue
        keep.add(rel)
        d = os.path.dirname(rel)
        while d:
            init = os.path.join(d, "__init__.py")
            if os.path.isfile(os.path.join(root, init)) and init not in keep:
                todo.append(init)
            d = os.path.dirname(d)
        name, is_pkg = _modname(rel), rel.endswith("__init__.py")
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError, ValueError) as e:
            print(f"warning: cannot parse {rel}: {e}", file=sys.stderr)
            continue
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = (
                    _resolve_rel(name, is_pkg, node.level, node.module)
                    if node.level
                    else (node.module or "")
                )
                targets = [base] + [base + "." + a.name for a in node.names]
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", ""))
                == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                m = node.args[0].value
                if m.startswith("."):
                    lvl = len(m) - len(m.lstrip("."))
                    m = _resolve_rel(name, is_pkg, lvl, m.lstrip("."))
                targets = [m]
            for t in targets:
                if t == PKG or t.startswith(PKG + "."):
                    f = _modfile(root, t)
                    if f and f not in keep:
                        todo.append(f)
    return keep


def record_hash(data):
    d = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(d).rstrip(b"=").decode()


def main():
    src, out_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(src) as z:
            names = z.namelist()
            z.extractall(tmp)
        root = os.path.join(tmp, PKG)
        seeds = ["__init__.py"]
        for d in EXTRA_SEED_DIRS:
            for dp, _, fns in os.walk(os.path.join(root, d)):
                seeds += [
                    os.path.relpath(os.path.join(dp, f), root)
                    for f in fns
                    if f.endswith(".py")
                ]
        py_keep = import_closure(root, seeds)
        py_dirs = {os.path.dirname(p) for p in py_keep}

        def keep(arc):
            if arc.endswith("/"):
                return False
            top = arc.split("/", 1)[0]
            if top.endswith(".dist-info"):
                return not arc.endswith("/RECORD")
            if top != PKG:  # b12x/, build_backend.py, build_utils.py (tiny)
                return True
            rel = arc[len(PKG) + 1 :]
            if rel.startswith("data/"):
                if rel.count("/") == 1:  # data/*.py
                    return True
                if rel.startswith("data/csrc/"):
                    sub = rel[len("data/csrc/") :]
                    if sub.count("/") == 0:  # top-level csrc files
                        return True
                    return sub.count("/") == 1 and sub.split("/")[0] in CSRC_KEEP_SUBDIRS and sub not in CSRC_SUBDIR_DROP
                return rel.startswith(DATA_KEEP_PREFIXES)
            if rel.endswith(".py"):
                return rel in py_keep
            return os.path.dirname(rel) in py_dirs

        kept = sorted(n for n in names if keep(n))
        dist_info = sorted({n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")})
        assert len(dist_info) == 1, dist_info
        record_name = dist_info[0] + "/RECORD"
        out = os.path.join(out_dir, os.path.basename(src))
        rec_lines = []
        with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zo:
            for n in kept:
                with open(os.path.join(tmp, n), "rb") as f:
                    data = f.read()
                zi = zipfile.ZipInfo(n, date_time=(1980, 1, 1, 0, 0, 0))
                zi.compress_type = zipfile.ZIP_DEFLATED
                zi.external_attr = 0o644 << 16
                zo.writestr(zi, data, compresslevel=9)
                rec_lines.append(f"{n},{record_hash(data)},{len(data)}")
            rec_lines.append(f"{record_name},,")
            zi = zipfile.ZipInfo(record_name, date_time=(1980, 1, 1, 0, 0, 0))
            zi.compress_type = zipfile.ZIP_DEFLATED
            zi.external_attr = 0o644 << 16
            zo.writestr(zi, "\n".join(rec_lines) + "\n", compresslevel=9)
        n_py = sum(1 for n in names if n.endswith(".py"))
        print(
            f"{os.path.basename(src)}: kept {len(kept)}/{len(names)} files "
            f"({len(py_keep)}/{n_py} .py), {os.path.getsize(src)/2**20:.1f} MiB -> "
            f"{os.path.getsize(out)/2**20:.1f} MiB"
        )


if __name__ == "__main__":
    main()

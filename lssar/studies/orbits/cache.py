"""The orbits experiment's cache: every stage's output is stored under a key (a hash of what
it depends on) and written atomically; :func:`load_if` returns it only when the key matches, so
a change of settings recomputes exactly the stages it invalidates and a damaged file is never
trusted.

This is a different job from a training run's checkpoint (:mod:`lssar.train.checkpoint`:
resume a loop at its step, refuse another config): a stage here is short and is redone whole,
and another setting is not refused but recomputed. The models it stores are checkpoints of
that format all the same (:func:`save_torch`).
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from lssar.runio import atomic_write
from lssar.train.checkpoint import load_checkpoint, save_checkpoint


def key_of(obj: Any) -> str:
    """A 16-hex-digit hash of ``obj`` (JSON with sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def save_torch(path: Path, obj: dict[str, Any]) -> None:
    """``obj`` (a state dict under ``"state"``, counters, a curve) as a checkpoint."""
    save_checkpoint(path, **obj)


def save_npz(path: Path, **arrays: Any) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write(path, buf.getvalue())


def save_json(path: Path, obj: Any) -> None:
    atomic_write(path, (json.dumps(obj, indent=1, default=_jsonable) + "\n").encode())


def _jsonable(o: Any) -> Any:
    if isinstance(o, (np.floating, np.integer, np.bool_)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def load_if(path: Path, key: str) -> Any:
    """The cached object at ``path`` if it was made with ``key``, else None (stale/damaged)."""
    if not path.exists():
        return None
    try:
        if path.suffix == ".json":
            obj = json.loads(path.read_text())
        elif path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                obj = {k: z[k] for k in z.files}
            obj["key"] = str(obj["key"])
        else:
            obj = load_checkpoint(path)
            obj = {k: v for k, v in obj.items() if k not in ("format", "version")}
    except Exception:  # a damaged cache file is recomputed, never trusted
        return None
    return obj if isinstance(obj, dict) and obj.get("key") == key else None

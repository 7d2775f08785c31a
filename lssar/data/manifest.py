"""The on-disk dataset format: its constants, the manifest and file checksums."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "lssar-tokens"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
_PARTIAL = re.compile(r"^(\..+\.\d+\.tmp|(train|val)_\d+\.bin)$")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(data_dir: str | Path, verify: bool = False) -> dict[str, Any]:
    """The manifest of a prepared dataset; shard sizes are checked, sha256 too if ``verify``."""
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"no {MANIFEST} in {data_dir}: run prepare / `lssar prepare`")
    try:
        m = json.loads(path.read_text("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is corrupt ({e}): delete {data_dir} and prepare again") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{path} is not an lssar dataset manifest")
    if m.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format version {m.get('version')} != {FORMAT_VERSION}, prepare again"
        )
    itemsize = np.dtype(m["dtype"]).itemsize
    for split in SPLITS:
        for shard in m["splits"][split]["shards"]:
            f, redo = Path(data_dir) / shard["file"], f"delete {data_dir} and prepare again"
            if not f.is_file():
                raise FileNotFoundError(f"shard {f} is missing: {redo}")
            if f.stat().st_size != shard["tokens"] * itemsize:
                raise ValueError(f"shard {f} has the wrong size: {redo}")
            if verify and _sha256_file(f) != shard["sha256"]:
                raise ValueError(f"shard {f} fails its sha256 check: {redo}")
    return m

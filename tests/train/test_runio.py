"""Tests for lssar.runio: atomic writes on a full disk, stale temp files, directory locks held by
other processes (live and dead), names that must stay inside their parent."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lssar.cli import main
from lssar.runio import (
    LOCK_FILE,
    DiskFullError,
    LockedError,
    atomic_write,
    child_path,
    exclusive_lock,
    remove_stale_temps,
)

_HOLDER = """
import sys
from lssar.runio import exclusive_lock
with exclusive_lock(sys.argv[1], "test"):
    print("locked", flush=True)
    sys.stdin.readline()
"""


@contextlib.contextmanager
def lock_held_elsewhere(directory: Path) -> Iterator[subprocess.Popen]:
    """Another process holding ``directory``'s lock until the block ends (then it releases
    it and exits)."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
    )
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield proc
    finally:
        if proc.poll() is None:
            proc.stdin.write("\n")
            proc.stdin.flush()
        proc.wait(timeout=60)


def test_atomic_write_on_a_full_disk_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    atomic_write(path, b"old checkpoint")

    def write(f):  # the disk fills halfway through the new content
        f.write(b"new ch")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskFullError, match=r"no space left .*ckpt\.pt.*intact.*free some space"):
        atomic_write(path, write)
    assert path.read_bytes() == b"old checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # no temp file left
    with pytest.raises(OSError) as e:
        atomic_write(path, write)
    assert e.value.errno == errno.ENOSPC  # still an OSError for code that checks errno


def test_remove_stale_temps_removes_only_atomic_write_temps(tmp_path: Path) -> None:
    keep = ["latest.pt", ".latest.pt.tmp", "x.123.tmp", ".notes"]
    stale = [".latest.pt.4242.tmp", ".log.jsonl.7.tmp"]
    for name in keep + stale:
        (tmp_path / name).write_bytes(b"x" * 100)
    assert sorted(p.name for p in remove_stale_temps(tmp_path)) == sorted(stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep)


def test_lock_names_a_live_holder_and_is_taken_over_when_it_dies(tmp_path: Path) -> None:
    d = tmp_path / "run"
    with lock_held_elsewhere(d) as holder:
        with pytest.raises(LockedError) as e:
            with exclusive_lock(d, "run"):
                pass
        msg = str(e.value)
        assert f"run {d} is in use by pid {holder.pid} on host {socket.gethostname()}" in msg
        holder.send_signal(signal.SIGKILL)  # killed: its lock file stays, naming a dead pid
        holder.wait(timeout=60)
        assert json.loads((d / LOCK_FILE).read_text())["pid"] == holder.pid
        with exclusive_lock(d, "run"):  # a lock whose process is gone is taken over
            assert json.loads((d / LOCK_FILE).read_text())["pid"] == os.getpid()
    with exclusive_lock(d, "run"):  # released at the end of the block
        with pytest.raises(LockedError, match=r"already locked by this process \(\d+\)"):
            with exclusive_lock(d, "run"):
                pass


def test_lock_wait_names_the_holder_then_takes_the_lock(tmp_path: Path, monkeypatch) -> None:
    d = tmp_path / "data"
    said: list[str] = []
    waiting = threading.Event()

    class Stderr:  # sees the waiting message, whichever thread prints it
        def write(self, s: str) -> None:
            said.append(s)
            if "waiting for" in s:
                waiting.set()

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Stderr())
    got: list[int] = []

    def take() -> None:
        with exclusive_lock(d, "dataset", wait=True):
            got.append(json.loads((d / LOCK_FILE).read_text())["pid"])

    with lock_held_elsewhere(d) as holder:
        t = threading.Thread(target=take)
        t.start()
        assert waiting.wait(timeout=120)  # a bound on a hang, not a timing assertion
        assert not got  # it waits while the holder lives
        assert f"waiting for pid {holder.pid} on host" in "".join(said)
    t.join(timeout=120)
    assert got == [os.getpid()]


@pytest.mark.parametrize("name", ["..", ".", "", "/tmp/x", "a/b", "../x", " x", "a\\b"])
def test_child_path_refuses_names_that_leave_the_parent(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match=r"--tag=.* must be a plain name"):
        child_path(tmp_path, name, "--tag")


def test_child_path_accepts_a_plain_name(tmp_path: Path) -> None:
    assert child_path(tmp_path, "lssar_p15", "--tag") == tmp_path / "lssar_p15"


def test_cli_reports_a_run_failure_in_one_line(monkeypatch, capsys) -> None:
    import lssar.cli

    def busy(argv):
        raise LockedError("run runs/x is in use by pid 1 on host h: wait for it")

    monkeypatch.setitem(lssar.cli.COMMANDS, "busy", ("tests.train.test_runio:_busy", ""))
    monkeypatch.setattr(sys.modules[__name__], "_busy", busy, raising=False)
    assert main(["busy"]) == 1
    err = capsys.readouterr().err
    assert err == "error: run runs/x is in use by pid 1 on host h: wait for it\n"

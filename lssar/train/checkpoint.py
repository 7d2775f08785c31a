"""Run directories and checkpoints: one format for every training loop in the project (the
language-model loop, the recall and orbits studies, fine-tuning any ``nn.Module``).

A run directory holds::

    config.json    what the run depends on; a resume with another config is refused
    env.json       code version, library versions, hardware, command (lssar.runio.environment)
    log.jsonl      one JSON record per event, each with an integer "step"
    ckpt/latest.pt the last checkpoint (model, optimizer, scheduler, data position, counters)
    ckpt/final.pt  the finished model (a hard link to the last latest.pt)
    DONE           a JSON summary, written last: the run is complete

Every file is written atomically (:func:`lssar.runio.atomic_write`) and the directory is held
by one process at a time (:func:`lssar.runio.exclusive_lock`), so a run killed at any moment,
SIGKILL included, resumes from whole files: temp files of the killed write are removed, a torn
last log line is dropped, and the log is cut back to the checkpoint's step. A checkpoint is a
dict of data only (tensors, numbers, strings, lists, dicts; read back with ``weights_only``)
stamped with :data:`FORMAT` and :data:`VERSION`.

A single-process loop uses :func:`open_run`::

    with open_run(run_dir, config) as run:     # lock, clean-up, config check
        if run.done is not None:
            return                             # finished earlier
        state = run.resume(model, optimizer)   # None: a fresh start
        step = 0 if state is None else state["step"]
        run.start(step, env=environment())     # config.json, env.json, log cut to step
        while step < total:
            ...; step += 1
            run.log(step=step, loss=loss)
            if step % every == 0:
                run.save(step, model, optimizer, data={"epoch": epoch, "index": i})
        run.save(step, model, optimizer)
        run.finish(step=step, loss=loss)

The language-model loop (DDP: rank 0 writes) calls the functions below directly.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from lssar.runio import (
    atomic_write,
    disk_full,
    exclusive_lock,
    load_data,
    no_space,
    one_line,
    remove_stale_temps,
)

FORMAT = "lssar-ckpt"
# 2: "version" stored; 1: the same layout without it (read as 1)
VERSION = 2
CONFIG, ENV, LOG, DONE = "config.json", "env.json", "log.jsonl", "DONE"
LATEST, FINAL = Path("ckpt/latest.pt"), Path("ckpt/final.pt")


def write_json(path: str | Path, obj: Any) -> None:
    atomic_write(path, lambda f: f.write((json.dumps(obj, indent=2) + "\n").encode()))


def jsonable(obj: Any) -> Any:
    """``obj`` as it reads back from JSON (tuples become lists, keys strings): what a stored
    config is compared with."""
    return json.loads(json.dumps(obj, default=str))


# ------------------------------------------------------------------------------- checkpoints

# (resolved path, size, mtime_ns, inode) -> sha256: a checkpoint is hashed once per process
_DIGESTS: dict[tuple[str, int, int, int], str] = {}


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file (a checkpoint), remembered while its size and mtime are unchanged."""
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def save_checkpoint(path: str | Path, **state: Any) -> None:
    """Write ``state`` (state dicts, counters, configs: data only) atomically to ``path``."""
    atomic_write(path, lambda f: torch.save({"format": FORMAT, "version": VERSION, **state}, f))


def load_checkpoint(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """A checkpoint written by :func:`save_checkpoint` (any version up to :data:`VERSION`);
    ``ValueError`` saying what to do for a damaged file, another file or a newer format."""
    try:
        ckpt = load_data(path, map_location)
    except ValueError as e:
        raise ValueError(f"checkpoint {path} is corrupt ({e}): delete it or start a new run") from e
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(
            f"checkpoint {path} is not an lssar checkpoint: delete it or start a new run"
        )
    if (version := ckpt.get("version", 1)) > VERSION:
        raise ValueError(
            f"checkpoint {path} has format version {version}, this lssar reads up to "
            f"{VERSION}: upgrade lssar"
        )
    return ckpt


def load_state(
    obj: Any,
    state: dict[str, Any],
    path: str | Path,
    what: str = "model",
    hint: str = "its shape or settings differ; start a new run",
) -> None:
    """``obj.load_state_dict(state)`` (a module, optimizer or scheduler); a mismatch is a
    ``ValueError`` naming the checkpoint, ending in ``hint``."""
    try:
        obj.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError) as e:
        what = f"checkpoint {path} does not fit this {what}"
        raise ValueError(f"{what} ({one_line(e)}): {hint}") from e


# ------------------------------------------------------------------------------ the run dir


def read_json(path: str | Path) -> Any:
    """A JSON file of a run, or None if it does not exist."""
    path = Path(path)
    return json.loads(path.read_text()) if path.is_file() else None


def config_diff(
    stored: dict[str, Any],
    now: dict[str, Any],
    ignore: Sequence[str] = (),
    defaults: dict[str, Any] | None = None,
) -> list[str]:
    """``"key: stored (run) != now (now)"`` for each key of ``now`` (not in ``ignore``) whose
    value differs; a key ``stored`` lacks (a setting added since) counts as its value in
    ``defaults`` (what that run did), or as missing."""
    defaults = defaults or {}
    stored, now = jsonable(stored), jsonable(now)
    missing = object()
    out = []
    for k, v in now.items():
        was = stored.get(k, defaults.get(k, missing))
        if k not in ignore and was != v:
            out.append(f"{k}: {'(absent)' if was is missing else repr(was)} (run) != {v!r} (now)")
    return out


def check_config(
    stored: dict[str, Any],
    now: dict[str, Any],
    run_dir: str | Path,
    hint: str = "use another run directory, or start this one over",
    ignore: Sequence[str] = (),
    defaults: dict[str, Any] | None = None,
) -> None:
    """``ValueError`` if ``now`` differs from the run's ``stored`` config (:func:`config_diff`)."""
    if diff := config_diff(stored, now, ignore, defaults):
        raise ValueError(
            f"{run_dir} was started with a different config ({'; '.join(diff)}): {hint}"
        )


def read_log(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``run_dir/log.jsonl`` (none if it does not exist).

    A torn last line (a run killed, or a disk that filled, in the middle of appending it) is
    dropped with a warning naming the file; a damaged line before it is a ``ValueError`` naming
    the file and the line.
    """
    path = Path(run_dir) / LOG
    if not path.is_file():
        return []
    lines = path.read_bytes().split(b"\n")
    if lines and not lines[-1].strip():
        lines.pop()  # the newline that ends the last record
    records = []
    for i, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError("not a record with an integer step")
        except (ValueError, UnicodeDecodeError) as e:
            if i == len(lines):
                print(f"warning: {path}: dropped a torn last line ({one_line(e, 80)})")
                break
            raise ValueError(
                f"{path} line {i} is damaged ({one_line(e, 80)}): delete that line, or start "
                "the run over with --no-resume"
            ) from None
        records.append(rec)
    return records


def init_run_dir(run_dir: Path, step: int, config: dict[str, Any], env: dict[str, Any]) -> None:
    """Write config/env; keep the log up to ``step`` (the curve continues, no duplicates).

    Call it holding the run's lock (:func:`lssar.runio.exclusive_lock`).
    """
    run_dir = Path(run_dir)
    (run_dir / "ckpt").mkdir(parents=True, exist_ok=True)
    if step == 0:  # a fresh start: nothing of an earlier attempt may be resumed later
        for stale in (LATEST, FINAL, DONE):
            (run_dir / stale).unlink(missing_ok=True)
    kept = [r for r in read_log(run_dir) if r["step"] <= step] if step > 0 else []
    text = "".join(json.dumps(r) + "\n" for r in kept)
    atomic_write(run_dir / LOG, lambda f: f.write(text.encode()))
    write_json(run_dir / CONFIG, config)
    write_json(run_dir / ENV, env | {"start_step": step})


def append_log(run_dir: str | Path, record: dict[str, Any]) -> None:
    """Append one record (one ``write``: a kill leaves at most a torn last line, which
    :func:`read_log` drops)."""
    path = Path(run_dir) / LOG
    try:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:
        if no_space(e):
            raise disk_full(path) from e
        raise


def finish_run(run_dir: str | Path, summary: dict[str, Any]) -> None:
    """``ckpt/final.pt`` (the last ``latest.pt``) and the ``DONE`` marker holding ``summary``."""
    latest = Path(run_dir) / LATEST
    final = Path(run_dir) / FINAL
    final.unlink(missing_ok=True)
    try:  # final.pt is the last latest.pt: a hard link saves writing it twice
        os.link(latest, final)
    except OSError:
        with open(latest, "rb") as src:
            atomic_write(final, lambda f: shutil.copyfileobj(src, f))
    write_json(Path(run_dir) / DONE, summary)


def remove_stale_files(run_dir: str | Path) -> None:
    """Delete (and name) the temp files of writes a kill interrupted, in the run dir and its
    ``ckpt/``. Call it holding the run's lock: then no live writer owns one."""
    for d in (Path(run_dir), Path(run_dir) / "ckpt"):
        for stale in remove_stale_temps(d):
            print(f"{run_dir}: removed {stale.name}, left by a write that was interrupted")


class RunDir:
    """A run directory this process holds (made by :func:`open_run`)."""

    def __init__(self, path: Path, config: dict[str, Any] | None, resume: bool) -> None:
        self.path, self.config, self.resuming = path, config, resume

    @property
    def done(self) -> dict[str, Any] | None:
        """The ``DONE`` summary of a finished run (None: unfinished, or started over)."""
        return read_json(self.path / DONE) if self.resuming else None

    def resume(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        map_location: Any = "cpu",
    ) -> dict[str, Any] | None:
        """Load ``ckpt/latest.pt`` into ``model``, ``optimizer`` and ``scheduler`` (those given)
        and return the checkpoint (``step`` and what :meth:`save` was given); None when there
        is none (or the run is started over)."""
        path = self.path / LATEST
        if not self.resuming or not path.is_file():
            return None
        ckpt = load_checkpoint(path, map_location)
        for obj, key in ((model, "model"), (optimizer, "optimizer"), (scheduler, "scheduler")):
            if obj is not None and key not in ckpt:
                raise ValueError(f"checkpoint {path} holds no {key} state: start the run over")
            if obj is not None:
                load_state(obj, ckpt[key], path, key)
        return ckpt

    def start(self, step: int, env: dict[str, Any] | None = None) -> None:
        """Write ``config.json`` and ``env.json`` and cut the log back to ``step`` (0: a fresh
        start removes the checkpoints and ``DONE`` of an earlier attempt)."""
        init_run_dir(self.path, step, self.config or {}, env or {})

    def log(self, **record: Any) -> None:
        """Append ``record`` (with an integer ``step``) to ``log.jsonl``."""
        append_log(self.path, record)

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        **extra: Any,
    ) -> None:
        """Write ``ckpt/latest.pt``: the state dicts of those given, ``step`` and ``extra``
        (data only: a data position, counters, a loss curve, ``torch.get_rng_state()`` for a
        loop whose randomness is not a function of the step)."""
        state: dict[str, Any] = {"step": step, "model": model.state_dict()}
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        if scheduler is not None:
            state["scheduler"] = scheduler.state_dict()
        save_checkpoint(self.path / LATEST, **state, **extra)

    def finish(self, **summary: Any) -> None:
        """``ckpt/final.pt`` (the last :meth:`save`) and ``DONE`` holding ``summary``."""
        finish_run(self.path, summary)


@contextlib.contextmanager
def open_run(
    path: str | Path,
    config: dict[str, Any] | None = None,
    *,
    resume: bool = True,
    what: str = "run",
    hint: str = "use another run directory, or start this one over",
) -> Iterator[RunDir]:
    """Hold the run directory ``path`` for the block: its lock (another live process holding it
    is :class:`lssar.runio.LockedError`), the temp files of a killed write removed, and, when
    resuming a run that has a ``config.json``, ``config`` checked against it (``hint`` ends the
    refusal). ``resume=False`` starts the run over at :meth:`RunDir.start`. A directory this
    call created that holds nothing but its lock when the block fails is removed again."""
    path = Path(path)
    new_dir = not path.exists()
    with exclusive_lock(path, what) as lock:
        try:
            remove_stale_files(path)
            stored = read_json(path / CONFIG) if resume else None
            if stored is not None and config is not None:
                check_config(stored, config, path, hint)
            yield RunDir(path, None if config is None else jsonable(config), resume)
        except BaseException:
            if new_dir and {p.name for p in path.iterdir()} == {lock.name}:
                lock.unlink()
                path.rmdir()
            raise

"""What every study shares: how an arm is declared, the shape of a study (presets -> units ->
run a unit -> write the report), its command line, how a report is written.

A study (``lssar reproduce``, ``lssar recall``, ``lssar orbits``) declares its arms once, as an
:func:`arm_table` of :class:`Arm` values, and its presets in its ``presets`` module; its runner
(``<study>/study.py``) is a :class:`Study`: a preset resolves to units (one training run and the
arms evaluated on it, per seed: :func:`units_by_run`), each unit runs on its own (in worker
processes with ``--jobs``: :func:`run_units`), and the results go to its ``report`` module,
which writes them with :func:`write_report`. Every study's command line is built by
:func:`study_parser`. Labels live in :mod:`lssar.studies.labels`. Definitions flow one way:
presets -> runner -> report; a report never imports its runner.
"""

from __future__ import annotations

import abc
import argparse
import functools
import hashlib
import json
import multiprocessing as mp
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, NamedTuple

import torch

from lssar import clihelp
from lssar.positions import RopeScaling, check_pos, with_pos
from lssar.runio import RunFailure, atomic_write
from lssar.spec import AttentionSpec
from lssar.train.checkpoint import read_json


@dataclass(frozen=True)
class EvalRule:
    """A rule applied to a trained model at evaluation only: an attention switch (the paper's
    fine-tuning-free re-weighting: ``AttentionSpec("lssar", {"p": 15.0})`` on an LSSA model),
    a RoPE scaling (``RopeScaling("yarn")``: YaRN at factor = the length multiple), or both.
    Its :attr:`label` is what a result's label adds after ``->``."""

    attention: AttentionSpec | None = None
    rope: RopeScaling | None = None

    def __post_init__(self) -> None:
        if self.attention is None and self.rope is None:
            raise ValueError("an eval rule needs an attention switch, a RoPE scaling, or both")

    @property
    def label(self) -> str:
        """``"lssar p=15"``, ``"yarn auto"``, ``"lssar p=15 + yarn auto"``."""
        parts = [x.label for x in (self.attention, self.rope) if x is not None]
        return " + ".join(parts)

    def slug(self, sep: str = "-") -> str:
        """``"lssar-p15"``, ``"yarn-auto"``: for cache file names."""
        parts = [] if self.attention is None else [self.attention.slug(sep)]
        return sep.join(parts + ([] if self.rope is None else [self.rope.slug(sep)]))


@dataclass(frozen=True)
class Arm:
    """One arm of a study: the attention its model is trained with and how it is evaluated.

    ``name`` is the arm's key in ``--arms`` and in the study's tables. ``attention`` is the
    trained rule (``None``: an arm without a model, e.g. the orbits oracle). ``window`` makes the
    arm the locality control: every query sees only its last keys (how many, and whether
    training sees the window, is the study's setting; a window of the training length trains
    exactly as the full model, so such an arm shares that model's run). ``evals`` are
    :class:`EvalRule` values applied to the trained model at evaluation only (an
    :class:`AttentionSpec` stands for the rule that switches to it). ``pos`` is the trained
    model's position rule (``rope``, ``alibi``, ``nope``: :mod:`lssar.positions`).
    ``own_rule=False`` makes an arm of eval-only rules on a run another arm trains and evaluates
    (the RoPE scalings of the softmax runs): it adds its ``evals`` and nothing else. Studies
    that need more per arm subclass it (orbits: ``pretrained``).
    """

    name: str
    attention: AttentionSpec | None
    summary: str = ""
    window: bool = False
    evals: tuple[EvalRule, ...] = ()
    pos: str = "rope"
    own_rule: bool = True

    def __post_init__(self) -> None:
        rules = tuple(EvalRule(e) if isinstance(e, AttentionSpec) else e for e in self.evals)
        object.__setattr__(self, "evals", rules)
        if self.attention is not None:
            check_pos(self.pos, self.attention.name)
        if not self.own_rule and not self.evals:
            raise ValueError(f"arm {self.name!r} has no rule of its own and no eval-only rules")

    @property
    def trained_label(self) -> str:
        """The trained rule with the positions: ``"softmax"``, ``"softmax + alibi"``."""
        return with_pos("" if self.attention is None else self.attention.label, self.pos)


def arm_table(*arms: Arm) -> dict[str, Arm]:
    """``name -> arm`` in declaration order (the order of every table); names are unique."""
    table: dict[str, Arm] = {}
    for a in arms:
        if a.name in table:
            raise ValueError(f"arm {a.name!r} is declared twice")
        table[a.name] = a
    return table


def select_arms(table: dict[str, Arm], names: Iterable[str]) -> list[str]:
    """``names`` checked against ``table`` (order kept, repeats dropped); ``ValueError`` names
    the unknown ones and the valid choices."""
    names = list(dict.fromkeys(names))
    bad = [n for n in names if n not in table]
    if bad or not names:
        raise ValueError(
            f"unknown arm(s) {', '.join(map(repr, bad)) or '(none given)'}; "
            f"valid arms: {', '.join(table)}"
        )
    return names


def units_by_run(
    arms: Sequence[str], seeds: Sequence[int], run_of: Callable[[str, int], str]
) -> list[tuple[int, tuple[str, ...]]]:
    """``(seed, arms)`` per training run, seeds outermost, arms in their given order: arms whose
    ``run_of(arm, seed)`` is the same run (softmax, its window control, its RoPE scalings) form
    one unit, so the run trains once and no two workers train it at the same time."""
    out: dict[tuple[int, str], list[str]] = {}
    for seed in seeds:
        for a in arms:
            out.setdefault((seed, run_of(a, seed)), []).append(a)
    return [(seed, tuple(group)) for (seed, _), group in out.items()]


class WorkerTraceback(Exception):
    """The traceback of an exception raised in a worker (its ``__cause__`` in this process)."""


def _worker(conn: Connection, fn: Callable[..., Any], unit: tuple[Any, ...]) -> None:
    """One unit in a spawned process of one torch thread: ``(True, result, "")`` or ``(False,
    exception, its traceback)`` back through ``conn`` (an exception that does not pickle goes
    as a ``RuntimeError`` with its text)."""
    torch.set_num_threads(1)
    # tqdm's default lock is a multiprocessing lock, whose semaphores a killed worker leaves to
    # the parent's resource tracker ("leaked semaphore objects"); one process needs a thread's
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    try:
        reply: tuple[bool, Any, str] = (True, fn(*unit), "")
    except Exception as e:
        reply = (False, e, traceback.format_exc())
    try:
        conn.send(reply)
    except Exception:  # an unpicklable result or exception
        conn.send((False, RuntimeError(f"{type(reply[1]).__name__}: {reply[1]}"), reply[2]))
    conn.close()


def _died(name: str, exitcode: int | None) -> RunFailure:
    how = (
        f"was killed by signal {-exitcode} ({signal.Signals(-exitcode).name})"
        if exitcode is not None and exitcode < 0 and -exitcode in signal.valid_signals()
        else f"exited with code {exitcode}"
    )
    return RunFailure(
        f"the worker running {name} {how} (killed by hand or for memory?); rerun the same "
        "command to resume: finished runs are reused and unfinished ones continue from their "
        "last checkpoint"
    )


def run_units(
    fn: Callable[..., Any],
    units: Sequence[tuple[Any, ...]],
    jobs: int = 1,
    on_done: Callable[[int, Any], None] | None = None,
    check: Callable[..., None] | None = None,
    names: Sequence[str] | None = None,
) -> list[Any]:
    """``[fn(*unit) for unit in units]``, in that order, with ``jobs`` worker processes.

    ``check(*unit)`` runs for every unit before any starts (a resumed run's config against the
    new one): a refusal then leaves every run as it was. ``jobs > 1`` runs each unit in a
    spawned process of one torch thread (tiny models use one core far better than two threads
    on a shared machine; fork after torch has threads can deadlock), so ``fn`` and its arguments
    must be picklable; results do not depend on ``jobs``. The first unit that fails stops the
    others (their runs resume on a rerun) and its exception is raised; a worker that dies
    (killed, out of memory) is a :class:`RunFailure` naming its unit (``names[i]``, default the
    unit's index). ``on_done(i, result)`` is called as each unit finishes (progress)."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if check is not None:
        for unit in units:
            check(*unit)
    results: list[Any] = [None] * len(units)
    if jobs == 1 or len(units) <= 1:
        for i, unit in enumerate(units):
            results[i] = fn(*unit)
            if on_done is not None:
                on_done(i, results[i])
        return results
    ctx = mp.get_context("spawn")
    todo = list(range(len(units)))
    running: dict[int, tuple[Any, Connection]] = {}  # unit -> (process, its end of the pipe)
    try:
        while todo or running:
            while todo and len(running) < jobs:
                i = todo.pop(0)
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker, args=(send, fn, units[i]), name=f"unit-{i}")
                proc.start()
                send.close()  # the child holds the only writer: its death reads as EOF
                running[i] = (proc, recv)
            ready = wait([c for _, c in running.values()])
            for i in [i for i, (_, c) in running.items() if c in ready]:
                proc, conn = running.pop(i)
                try:
                    ok, payload, trace = conn.recv()
                except EOFError:  # the process ended without a reply
                    proc.join()
                    raise _died(names[i] if names else f"unit {i}", proc.exitcode) from None
                proc.join()
                if not ok:
                    raise payload from WorkerTraceback(trace)
                results[i] = payload
                if on_done is not None:
                    on_done(i, payload)
    finally:  # the first failure (or Ctrl-C) stops the rest; their runs resume on a rerun
        for proc, conn in running.values():
            proc.terminate()
            proc.join()
            conn.close()
    return results


class StudyRun(NamedTuple):
    """What :meth:`Study.run` did: the report directory, every unit's result, the seconds the
    units took."""

    report: Path
    results: list[Any]
    seconds: float


UNITS = "units"  # the report directory's folder of carried unit results


class Study(abc.ABC):
    """The shape of every study: :meth:`units` (what the resolved preset trains and evaluates,
    one tuple per training run), :meth:`run_unit` (one unit: train or reuse the run, evaluate its
    arms), :meth:`write_report` (every unit's result, in unit order -> the report directory).
    :meth:`run` is that flow. With ``jobs > 1`` the units run in spawned workers, so a study
    and its units must pickle.

    A study whose units have a :meth:`unit_key` carries each finished unit's result in its
    report directory (``out/units/<unit_file>``, with the key): the report directory is small
    enough to commit, so a study longer than one machine's life continues on another, where the
    same ``--out`` reuses every carried unit whose key still matches, without its runs. Each
    result keeps the environment it was made in (commit, dirty flag), which a report counts."""

    out: Path  # the report directory

    def unit_key(self, *unit: Any) -> dict[str, Any] | None:
        """What ``unit``'s result depends on, without this machine's paths (JSON values); a
        carried result is reused only while its key matches. ``None`` (the default): the
        study's units are not carried."""
        return None

    def unit_file(self, *unit: Any) -> str:
        """The file name of ``unit``'s carried result in ``out/units/`` (with a key only)."""
        raise NotImplementedError(f"{type(self).__name__} has unit keys but no unit_file")

    def carried(self, *unit: Any) -> Any | None:
        """``unit``'s result carried in the report directory, if its key still matches (a
        damaged or outdated file: ``None``, and the unit runs again)."""
        key = self.unit_key(*unit)
        return None if key is None else self._carried_with(key, unit)

    def _carried_with(self, key: dict[str, Any], unit: tuple[Any, ...]) -> Any | None:
        try:
            prev = read_json(self.out / UNITS / self.unit_file(*unit))
        except ValueError:  # a damaged file
            return None
        return prev.get("results") if isinstance(prev, dict) and prev.get("key") == key else None

    def _run_or_carry(self, *unit: Any) -> Any:
        """The unit's carried result, or :meth:`run_unit`'s, carried from now on (as it reads
        back from JSON: a carried and a fresh result are the same values)."""
        if (key := self.unit_key(*unit)) is None:
            return self.run_unit(*unit)
        if (done := self._carried_with(key, unit)) is not None:
            return done
        text = json.dumps({"key": key, "results": self.run_unit(*unit)}, default=str)
        atomic_write(self.out / UNITS / self.unit_file(*unit), text)
        return json.loads(text)["results"]

    @abc.abstractmethod
    def units(self) -> list[tuple[Any, ...]]:
        """The units, in the order their results reach :meth:`write_report`."""

    @abc.abstractmethod
    def run_unit(self, *unit: Any) -> Any:
        """Train (or reuse, or resume) one unit's run and evaluate its arms."""

    @abc.abstractmethod
    def write_report(self, results: list[Any], seconds: float) -> Path:
        """Write the report of ``results`` (one per unit); return its directory."""

    def check_unit(self, *unit: Any) -> None:  # noqa: B027 (a hook: nothing by default)
        """Raise if ``unit`` cannot start (its run exists with another config); :meth:`run`
        checks every unit before any starts. Nothing to check by default."""

    def unit_name(self, *unit: Any) -> str:
        """``unit`` in words, for a message about it (a worker that died running it)."""
        return f"the unit {unit!r:.80}"

    def run(self, jobs: int = 1, on_done: Callable[[int, Any], None] | None = None) -> StudyRun:
        """Check every unit (:meth:`check_unit`), run them (``jobs`` worker processes;
        ``on_done(i, result)`` as unit ``i`` finishes), then write the report."""
        started = time.time()
        units = self.units()
        names = [self.unit_name(*u) for u in units]
        check = lambda *u: None if self.carried(*u) is not None else self.check_unit(*u)  # noqa: E731
        results = run_units(self._run_or_carry, units, jobs, on_done, check, names)
        seconds = time.time() - started
        return StudyRun(self.write_report(results, seconds), results, seconds)


class _Renamed(argparse.Action):
    """An old spelling of a flag: stores into the new one's ``dest`` and says so on stderr."""

    def __init__(self, *args: Any, new: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.new = new

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        print(f"note: {option} is deprecated, use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def study_parser(
    prog: str,
    description: str | None,
    presets: Mapping[str, Any],
    arms: Iterable[str],
    runs: str,
    out: str,
    renamed: Mapping[str, str] | None = None,
) -> argparse.ArgumentParser:
    """The command line every study shares: ``--preset --arms --seeds --jobs --runs --out
    --no-progress`` (``runs``/``out``: their defaults, as help text; ``None`` in the parsed
    arguments stands for them). ``renamed`` maps a study's old spellings to these (``{"--runs-dir":
    "--runs"}``): still accepted, with a note. Every option is described
    (:mod:`lssar.clihelp`); the epilog lists the presets, and a study appends to it. A study
    adds its own flags to the parser; :func:`study_args` reads the shared ones."""
    ap = clihelp.parser(prog, description)
    ap.epilog = clihelp.add_preset(ap, presets)
    ap.add_argument(
        "--arms", help=f"comma-separated subset of: {', '.join(arms)}; none: the preset's"
    )
    ap.add_argument("--seeds", help="comma-separated seeds, e.g. 0,1,2; none: the preset's")
    ap.add_argument(
        "--jobs",
        type=int,
        help="units trained and evaluated at once, in worker processes of one torch thread "
        "each; none: the preset's, else 1; results do not depend on it",
    )
    ap.add_argument("--runs", help=f"where the run directories live; none: {runs}")
    ap.add_argument("--out", help=f"the report directory; none: {out}")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars or lines")
    for old, new in (renamed or {}).items():
        dest = new.lstrip("-").replace("-", "_")
        ap.add_argument(old, dest=dest, action=_Renamed, new=new, help=argparse.SUPPRESS)
    return ap


def study_args(args: argparse.Namespace) -> tuple[list[str] | None, list[int] | None]:
    """The ``--arms`` and ``--seeds`` of :func:`study_parser`'s arguments as lists (None: the
    preset's); ``ValueError`` for seeds that are not integers."""
    arms = None if args.arms is None else [a.strip() for a in args.arms.split(",") if a.strip()]
    try:
        seeds = None if args.seeds is None else [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        raise ValueError(f"--seeds {args.seeds!r}: expected integers like 0,1,2") from None
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs {args.jobs}: need at least 1 worker")
    return arms, seeds


@functools.cache
def code_digest(sources: tuple[str, ...]) -> str:
    """A 12-hex-digit digest of the package files ``sources`` (paths relative to ``lssar/``; a
    folder stands for its ``.py`` and ``.cpp`` files): stored with a cached result, so a result
    made by other code is recomputed."""
    root = Path(__file__).resolve().parents[1]  # the lssar package
    h = hashlib.sha256()
    for name in sources:
        path = root / name
        files = (
            sorted(f for f in path.rglob("*") if f.suffix in (".py", ".cpp"))
            if path.is_dir()
            else [path]
        )
        for f in files:
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def provenance_head(envs: Sequence[dict[str, Any]], report_env: dict[str, Any]) -> str:
    """The first sentence of a report: built from committed code, or how many of its results
    (``envs``: the environments of the runs and evaluations behind them) came from a dirty
    checkout, and whether the report itself was written from one."""
    dirty = sum(bool(e.get("git_dirty")) for e in envs)
    if not dirty and not report_env.get("git_dirty"):
        return "Built from committed code."
    return (
        f"**Built from uncommitted code**: {dirty} of {len(envs)} results were trained or "
        "evaluated in a dirty checkout"
        + (", and this report was written from one." if report_env.get("git_dirty") else ".")
    )


def conditions(envs: Sequence[dict[str, Any]]) -> str:
    """A sentence on how results were made, from their environments: the commands (the project's
    own, ``lssar ...``, or which other drivers), torch threads per process and the CPU ISA. An
    environment without these fields (older results) is counted as unrecorded."""
    own, other, missing = set(), set(), 0
    for e in envs:
        argv = e.get("argv")
        if not argv:
            missing += 1
        elif Path(argv[0]).name == "lssar" or argv[0].endswith("lssar/__main__.py"):
            own.add(" ".join(["lssar", *argv[1:]]))
        else:
            other.add(" ".join(argv))
    fields = lambda k: ", ".join(sorted({str(e[k]) for e in envs if e.get(k) is not None}))  # noqa: E731
    quoted = lambda cmds: f"`{'`, `'.join(sorted(cmds))}`"  # noqa: E731
    head = (
        "Trained and evaluated by the project's own commands only"
        if not other
        else f"**Not only the project's commands**: also {quoted(other)}"
    )
    cmds = (f" ({quoted(own)})" if not other else f"; the project's: {quoted(own)}") if own else ""
    gap = f"; {missing} of {len(envs)} results do not record their command" if missing else ""
    return (
        f"{head}{cmds}{gap}. Torch threads per process: {fields('threads') or 'not recorded'}; "
        f"CPU ISA: {fields('cpu_isa') or 'not recorded'}."
    )


def environment_section(env: dict[str, Any], title: str = "## Environment") -> list[str]:
    """A report's last section: ``title`` and the environment ``env`` as a JSON block."""
    return [title, "", "```", json.dumps(env, indent=1), "```", ""]


def write_report(
    out: Path,
    lines: Sequence[str],
    results: dict[str, Any],
    report: str = "REPORT.md",
    data: str = "results.json",
) -> Path:
    """``out/REPORT.md`` (``lines``) and ``out/results.json`` (``results``), each written
    atomically, the data first: a report on disk always has the data it was built from."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / data, json.dumps(results, indent=1, default=str))
    atomic_write(out / report, "\n".join(lines))
    return out

"""The recall study's settings: its arms (:data:`ARMS`), :class:`StudyConfig` and presets
(:data:`PRESETS`); what a study depends on, nothing that runs. The runner is
:mod:`lssar.studies.recall.study`, the report :mod:`lssar.studies.recall.report`.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any

from lssar.positions import ROPE_SCALINGS, RopeScaling
from lssar.spec import AttentionSpec
from lssar.studies.common import Arm, EvalRule, arm_table, select_arms
from lssar.studies.recall.task import RecallTask

EVAL_SEED = 1_000_003  # evaluation sequences: task.batch((EVAL_SEED, multiple, chunk), ...)


EVAL_PS = (1.0, 2.0, 3.0, 5.0, 8.0, 15.0)


def _lssar(ps: tuple[float, ...]) -> tuple[AttentionSpec, ...]:
    return tuple(AttentionSpec("lssar", {"p": p}) for p in ps)


# The window arm trains exactly as softmax (a window of L at the training length is the whole
# causal context), so it shares softmax's run and differs only at evaluation.
ARMS = arm_table(
    Arm("softmax", AttentionSpec("softmax")),
    Arm("softmax-qknorm-logn", AttentionSpec("softmax-qknorm-logn")),
    Arm("ssmax", AttentionSpec("ssmax")),
    Arm("lssa", AttentionSpec("lssa"), evals=_lssar(EVAL_PS)),
    Arm("lssar p=15", AttentionSpec("lssar", {"p": 15.0})),
    Arm("lssar p=3", AttentionSpec("lssar", {"p": 3.0})),
    Arm("window", AttentionSpec("softmax"), window=True),
    # the practitioner's alternatives: positions trained in, and RoPE rescaled at
    # evaluation only (factor = the length multiple) on the softmax runs
    Arm("softmax + alibi", AttentionSpec("softmax"), pos="alibi"),
    Arm("softmax + nope", AttentionSpec("softmax"), pos="nope"),
    Arm("lssar p=15 + nope", AttentionSpec("lssar", {"p": 15.0}), pos="nope"),
    *(
        Arm(
            f"softmax -> {kind} auto",
            AttentionSpec("softmax"),
            evals=(EvalRule(rope=RopeScaling(kind)),),
            own_rule=False,
        )
        for kind in ROPE_SCALINGS
    ),
)
PAPER_ARMS = tuple(list(ARMS)[:7])  # the paper's arms and the window control
ALTERNATIVE_ARMS = tuple(list(ARMS)[7:])


def train_p(arm: Arm) -> float | None:
    """The trained rule's p (None: a rule without re-weighting)."""
    return arm.attention.options.get("p")


def _reweights(rule: EvalRule) -> bool:
    """An eval-only re-weighting: the switch to lssar at some p, and nothing else."""
    return rule.rope is None and rule.attention is not None and rule.attention.name == "lssar"


def eval_ps(arm: Arm) -> tuple[float, ...]:
    """The p of each of the arm's eval-only re-weighting rules."""
    return tuple(e.attention.options["p"] for e in arm.evals if _reweights(e))


def eval_rules(arm: Arm, ps: tuple[float, ...] | None = None) -> list[EvalRule]:
    """The arm's eval-only rules; ``ps`` (``StudyConfig.eval_ps``) replaces its re-weighting
    sweep, if it has one."""
    rules = list(arm.evals)
    if ps is not None and any(_reweights(r) for r in rules):
        rules = [r for r in rules if not _reweights(r)]
        rules = [EvalRule(AttentionSpec("lssar", {"p": p})) for p in ps] + rules
    return rules


@dataclass(frozen=True)
class StudyConfig:
    """Everything a study depends on (the task, the model, the optimisation, the evaluation)."""

    # L = 32, 6 pairs, 4 queries (n > m: with n = m the last query is answerable by elimination),
    # 16 keys, 16 values, 8 fillers; the pilot (PILOT.md) sized the model and the steps
    task: RecallTask = field(
        default_factory=lambda: RecallTask(
            train_len=32, n_pairs=6, n_queries=4, n_keys=16, n_values=16, n_filler=8
        )
    )
    arms: tuple[str, ...] = ("softmax", "lssa", "lssar p=15", "window")
    seeds: tuple[int, ...] = (0,)
    multiples: tuple[int, ...] = (1, 2, 4, 8, 16)
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    token_shift: bool = True  # see lssar/recall/model.py: without it softmax never learned
    steps: int = 1500
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    eval_seqs: int = 100  # per length: >= 200 queries per bucket when n_queries = 4
    eval_batch: int = 20
    eval_ps: tuple[float, ...] | None = None  # None = each arm's own sweep
    ckpt_every: int = 100
    jobs: int = 1  # worker processes (one thread each); does not change any result

    def __post_init__(self) -> None:
        select_arms(ARMS, self.arms)
        if not self.seeds:
            raise ValueError("seeds: need at least one seed")
        for m in self.multiples:
            if not isinstance(m, int) or m < 1:
                raise ValueError(f"multiples: {m!r} is not a positive integer")
        for name in (
            "n_layer",
            "n_head",
            "n_embd",
            "steps",
            "batch_size",
            "eval_seqs",
            "eval_batch",
            "ckpt_every",
            "jobs",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise ValueError(f"lr={self.lr} must be a finite number > 0, e.g. 1e-3")
        if not math.isfinite(self.weight_decay) or self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay} must be a finite number >= 0")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} must be >= 0")

    def train_dict(self) -> dict[str, Any]:
        """The settings a trained model depends on (hashed into the run name)."""
        d = dataclasses.asdict(self)
        for k in (
            "arms",
            "seeds",
            "multiples",
            "eval_seqs",
            "eval_batch",
            "eval_ps",
            "ckpt_every",
            "jobs",
        ):
            d.pop(k)
        return d


@dataclass(frozen=True)
class Preset:
    description: str
    config: StudyConfig
    budget: str


PRESETS = {
    "quick": Preset(
        "softmax, lssa (+ eval-time re-weighting sweep), lssar p=15 and the window control; 1 seed",
        StudyConfig(jobs=2),
        "<= 10 min on 2 CPU cores",
    ),
    "cpu": Preset(
        "every arm of the paper's comparison and the window control, 5 seeds",
        StudyConfig(arms=PAPER_ARMS, seeds=(0, 1, 2, 3, 4), jobs=2),
        "<= 75 min on 2 CPU cores",
    ),
    # the practitioner's alternatives beside softmax and LSSAR p=15: the same runs directory,
    # so softmax's and LSSAR's models and evaluations come from the cpu preset when it ran
    "cpu-baselines": Preset(
        "LSSAR p=15 and softmax against ALiBi, NoPE (softmax and LSSAR) and PI, NTK, dynamic "
        "NTK and YaRN at the length multiple on the softmax models, 5 seeds",
        StudyConfig(
            arms=("softmax", "lssar p=15", *ALTERNATIVE_ARMS), seeds=(0, 1, 2, 3, 4), jobs=2
        ),
        # 15 new models of ~1-1.6 min each (1 thread), 2 workers; the RoPE scalings cost seconds
        "<= 30 min on 2 CPU cores (~15 min after cpu, whose softmax and LSSAR models it reuses)",
    ),
}


def preset_config(name: str, **overrides: Any) -> StudyConfig:
    """The named preset's config with ``overrides`` (``task`` may be a dict of task fields)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    base = PRESETS[name].config
    if isinstance(overrides.get("task"), dict):
        overrides["task"] = dataclasses.replace(base.task, **overrides["task"])
    return dataclasses.replace(base, **overrides)


# One line per `--set` key for `lssar recall --help` (tests/test_cli_help.py checks them all).
SET_HELP: dict[str, str] = {
    "multiples": "evaluation lengths as multiples of task.train_len, e.g. (1, 2, 4)",
    "n_layer": "transformer blocks of the recall model",
    "n_head": "attention heads",
    "n_embd": "model width",
    "token_shift": "add the previous token's embedding at each position (without it softmax "
    "never learned the task in the pilot)",
    "steps": "training steps per arm and seed",
    "batch_size": "sequences per training step",
    "lr": "peak learning rate (AdamW, warmup then cosine)",
    "warmup": "linear warmup steps",
    "weight_decay": "AdamW weight decay",
    "eval_seqs": "evaluation sequences per length (>= 200 queries per bucket with 4 queries)",
    "eval_batch": "sequences per evaluation batch",
    "eval_ps": "re-weighting powers p tried at evaluation on every arm, e.g. (1.0, 15.0); none: "
    "each arm's own sweep",
    "ckpt_every": "steps between checkpoints (a re-run resumes)",
    "jobs": "worker processes, one thread each (does not change any result)",
}
TASK_HELP: dict[str, str] = {
    "train_len": "training sequence length in tokens (queries beyond it are 'beyond')",
    "n_pairs": "key-value pairs stored in each sequence (<= n_keys, n_values)",
    "n_queries": "keys asked at the end of each sequence (<= n_pairs)",
    "n_keys": "key tokens in the vocabulary",
    "n_values": "value tokens in the vocabulary",
    "n_filler": "distractor tokens in the vocabulary",
    "pair_order": "kv (key then value) or vk (value then key)",
}
SET_SKIP = ("task", "arms", "seeds")  # arms and seeds have flags of their own


def parse_set(items: list[str]) -> dict[str, Any]:
    """``--set`` items (``field=value``, ``task.field=value``) parsed to the types of
    :class:`StudyConfig` and :class:`RecallTask` fields; ``ValueError`` names an unknown key."""
    from lssar.train.config import parse_overrides, parse_value

    fields = typing.get_type_hints(StudyConfig)
    task_fields = typing.get_type_hints(RecallTask)
    out: dict[str, Any] = {}
    task: dict[str, Any] = {}
    for key, value in parse_overrides(items).items():
        name = key.removeprefix("task.")
        known = task_fields if key.startswith("task.") else fields
        if name not in known or key in SET_SKIP:
            valid = [f for f in fields if f not in SET_SKIP]
            raise ValueError(
                f"--set {key}: unknown setting; valid: {', '.join(valid)}, task.<"
                f"{'|'.join(task_fields)}> (arms and seeds have flags of their own)"
            )
        (task if key.startswith("task.") else out)[name] = parse_value(key, value, known[name])
    if task:
        out["task"] = task
    return out

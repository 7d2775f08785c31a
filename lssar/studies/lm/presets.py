"""The language-model study's arms (:data:`ARMS`) and presets (:data:`PRESETS`): what a
``lssar reproduce`` run depends on, nothing that runs (the runner is :mod:`.reproduce`, the
report :mod:`.report`).

An arm's name is its trained rule's label (``"lssar p=15"``, ``"softmax + alibi"``); the
evaluation results, and so the report's rows, carry the label
:func:`lssar.studies.labels.label_of` gives them (``"softmax, sliding window 128"``,
``"lssa -> lssar p=15 (eval only)"``, ``"softmax -> yarn auto (eval only)"``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lssar.positions import ROPE_SCALINGS, RopeScaling, with_pos
from lssar.spec import AttentionSpec
from lssar.studies.common import Arm, EvalRule, arm_table, select_arms
from lssar.studies.labels import run_label
from lssar.studies.lm.passkey import PasskeySettings

SOFTMAX, SIGMOID, RELU = AttentionSpec("softmax"), AttentionSpec("sigmoid"), AttentionSpec("relu")
SOFTPLUS_L1, LSSA = AttentionSpec("softplus-l1"), AttentionSpec("lssa")
LSSAR3, LSSAR15 = AttentionSpec("lssar", {"p": 3.0}), AttentionSpec("lssar", {"p": 15.0})
QKNORM, SSMAX = AttentionSpec("softmax-qknorm-logn"), AttentionSpec("ssmax")
# the decomposition of softmax-qknorm-logn and LSSA: each differs from a neighbour in
# one thing. The constant-scale variants freeze ln d ln n at n = the training length: the runner
# sets n from the run's seq_len (:func:`lssar.studies.lm.study.at_training_length`), so
# their trained labels read "softmax-qknorm-const n=128"
QK_CONST = AttentionSpec("softmax-qknorm-const")
QK_LEARNED = AttentionSpec("softmax-qknorm-learned")
LSSA_CONST = AttentionSpec("lssa-const")
QKNORM15 = AttentionSpec("softmax-qknorm-logn", {"p": 15.0})
# LSSAR with head dim 64's ln d in its scale, for a head-dim-32 model: changes only ln d
LSSAR15_LND64 = AttentionSpec("lssar", {"p": 15.0, "scale_dim": 64})
# the paper's fine-tuning-free mode: re-weighting applied to the LSSA model at evaluation only
EVAL_REWEIGHT = tuple(AttentionSpec("lssar", {"p": p}) for p in (1.0, 3.0, 8.0, 15.0))
# the practitioner's training-free RoPE scalings, each at factor = the length multiple (auto)
ROPE_EVALS = {kind: EvalRule(rope=RopeScaling(kind)) for kind in ROPE_SCALINGS}
ROPE_SUMMARY = {
    "linear": "position interpolation (PI): frequencies / s",
    "ntk": "NTK-aware scaling: base * s^(d/(d-2))",
    "dynamic-ntk": "dynamic NTK: the NTK base from each input's length",
    "yarn": "YaRN: NTK-by-parts + attention temperature 0.1 ln s + 1",
}

WINDOW = "window"
_PAPER = (
    Arm(SOFTMAX.label, SOFTMAX, "softmax(q·k/√d) with RoPE: the standard baseline"),
    # the window is the training length: at that length it is the causal mask, so the control
    # trains exactly as softmax and shares its run
    Arm(WINDOW, SOFTMAX, "softmax, every query limited to its last L keys", window=True),
    Arm(SIGMOID.label, SIGMOID, "sigmoid(q·k/√d − ln N), no normalisation"),
    Arm(RELU.label, RELU, "ReLU(q·k/√d) / N"),
    Arm(SOFTPLUS_L1.label, SOFTPLUS_L1, "softplus(q·k/√d), l1: no length scale"),
    Arm(LSSA.label, LSSA, "LSSA: softplus of the length-scaled cosine, l1", evals=EVAL_REWEIGHT),
    Arm(LSSAR3.label, LSSAR3, "LSSA + re-weighting p = 3"),
    Arm(LSSAR15.label, LSSAR15, "LSSA + re-weighting p = 15 (the paper's long-context arm)"),
    Arm(QKNORM.label, QKNORM, "softmax of the length-scaled cosine (LSSA's scale)"),
    Arm(SSMAX.label, SSMAX, "Scalable-Softmax: learned s_h · ln N"),
)
_DECOMPOSITION = (
    Arm(
        QK_CONST.label,
        QK_CONST,
        "softmax of the cosine at LSSA's scale frozen at the training length, ln d ln L",
    ),
    Arm(
        QK_LEARNED.label,
        QK_LEARNED,
        "softmax of the cosine with a learned per-head scale s_h ln d ln L (s_h from 1)",
    ),
    Arm(LSSA_CONST.label, LSSA_CONST, "LSSA with its scale frozen at the training length"),
    Arm(QKNORM15.label, QKNORM15, "softmax-qknorm-logn + re-weighting p = 15"),
)
# the factorial's ln d arm (the cpu-cell-d32-* presets)
_LN_D = Arm(
    LSSAR15_LND64.label,
    LSSAR15_LND64,
    "LSSAR p=15 with ln 64 ln N_i as its scale whatever the head dim (on head dim 32: only ln d "
    "changes)",
)
_ALTERNATIVES = (
    # what a practitioner would use instead: positions trained in...
    Arm("softmax + alibi", SOFTMAX, "softmax with ALiBi instead of RoPE", pos="alibi"),
    Arm("softmax + nope", SOFTMAX, "softmax without position encoding (NoPE)", pos="nope"),
    Arm("lssar p=15 + nope", LSSAR15, "LSSAR p=15 without position encoding", pos="nope"),
    # ...and RoPE rescaled at evaluation only, on the softmax runs (no run of their own)
    *(
        Arm(f"softmax -> {kind} auto", SOFTMAX, ROPE_SUMMARY[kind], evals=(r,), own_rule=False)
        for kind, r in ROPE_EVALS.items()
    ),
)
ARMS = arm_table(*_PAPER, *_DECOMPOSITION, _LN_D, *_ALTERNATIVES)
# the arms the paper compares (docs/method.md section 6), and the window control
PAPER_ARMS = [a.name for a in _PAPER]
# the arms that separate QK-norm, the ln N growth, Softplus-l1 and re-weighting (with the cpu arms
# they are compared with)
DECOMPOSITION_ARMS = [a.name for a in _DECOMPOSITION]
# the practitioner's alternatives, as arms and as the labels of their results (the report's
# "LSSAR against the practitioner's alternatives" section)
ALTERNATIVE_ARMS = [a.name for a in _ALTERNATIVES]
ALTERNATIVES = [
    with_pos(SOFTMAX.label, "alibi"),
    with_pos(SOFTMAX.label, "nope"),
    with_pos(LSSAR15.label, "nope"),
    *(run_label(SOFTMAX, SOFTMAX, r.rope.label) for r in ROPE_EVALS.values()),
]


@dataclass
class Preset:
    description: str
    train_preset: str
    arms: list[str]  # names in ARMS, in report order
    seeds: list[int] = field(default_factory=lambda: [0])
    multiples: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    eval_tokens: int = 32768
    passkey: PasskeySettings | None = None
    passkey_arms: list[str] | None = None  # None: every trained arm
    budget: str = ""
    # RUN/eval/<eval_folder>/ (default: the preset's name): a preset that adds arms to another
    # with the same evaluation settings shares its evaluations, so both report the same numbers
    eval_folder: str | None = None
    # training settings over the train preset's (before the command line's --key=value)
    train: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        select_arms(ARMS, self.arms)
        select_arms(ARMS, self.passkey_arms or self.arms)


# One-digit keys: a byte tokenizer spends a token per digit, and copying several in a row needs an
# induction circuit this 450-step model lacks (pilot: 2 digits, 600 fine-tuning steps, <= 23% at
# 1x); one digit learned to 100% within 200 steps. The paper's 5-digit keys are 1-2 GPT-2 tokens.
# Every arm gets the same 600 steps (3x what the pilot needed; the early-stopping checks of
# earlier reports stopped arms after 100-500), warmed up over the first 60.
PASSKEY_CPU = PasskeySettings(
    steps=600, warmup_steps=60, lr=3e-3, batch_size=32, digits=1, trials=20
)

PRESETS = {
    "quick": Preset(
        "softmax, lssa (+ eval-time re-weighting p = 1, 3, 8, 15), lssar p=15 and the "
        "sliding-window control; loss to 16x; entropy and first-token mass; 1 seed",
        "tiny-cpu",
        [SOFTMAX.label, WINDOW, LSSA.label, LSSAR15.label],
        eval_tokens=16384,
        budget="about 10-15 min on an idle 2-core machine, longer on a busy one",
    ),
    "cpu": Preset(
        "every variant of the paper, the sliding-window control and eval-time re-weighting "
        "p = 1, 3, 8, 15, 3 seeds, passkey and numerical health",
        "tiny-cpu",
        PAPER_ARMS,
        seeds=[0, 1, 2],
        eval_tokens=32768,
        passkey=PASSKEY_CPU,
        # the window control too: beyond L it cannot see the key, so it bounds what "retrieves
        # beyond the training length" can mean at chance
        passkey_arms=[SOFTMAX.label, WINDOW, LSSA.label, LSSAR15.label, QKNORM.label],
        # ~100 min measured with early-stopped passkey (100-500 steps, 4 arms); 600 fixed steps
        # for 5 arms x 3 seeds add ~5,400 fine-tuning steps, each about a tiny-cpu training
        # step (0.4-1 s at one thread, by load): +20-45 min with two workers
        budget="~120-150 min on 2 CPU cores with --jobs 2",
    ),
    # the practitioner's alternatives beside softmax and LSSAR p=15, on the cpu
    # preset's runs and evaluations (same runs directory, same evaluation settings: its softmax
    # and LSSAR results are reused, not recomputed); its own preset keeps cpu's budget
    "cpu-baselines": Preset(
        "LSSAR p=15 and softmax against the practitioner's alternatives: ALiBi, NoPE (softmax "
        "and LSSAR), and PI, NTK, dynamic NTK and YaRN at factor = the length multiple on the "
        "softmax runs, 3 seeds",
        "tiny-cpu",
        [SOFTMAX.label, LSSAR15.label, *ALTERNATIVE_ARMS],
        seeds=[0, 1, 2],
        eval_tokens=32768,
        passkey=PASSKEY_CPU,
        passkey_arms=[SOFTMAX.label, LSSAR15.label],
        # estimated from tiny-cpu step times measured against softmax (ALiBi 0.9x, NoPE 1.1x,
        # LSSAR + NoPE as LSSAR) and an evaluation's wall time (about 1 min at cpu's settings)
        budget="~45 min on 2 CPU cores after cpu (reuses its softmax and LSSAR p=15 runs and "
        "evaluations), ~80 min on its own (79 min measured with --jobs 2 on shared cores)",
        eval_folder="cpu",
    ),
    # the decomposition beside the cpu arms it is measured against, on cpu's runs and
    # evaluations (same runs directory, evaluation folder and passkey arms: its softmax,
    # softmax-qknorm-logn, lssa and lssar p=15 results are reused, not recomputed)
    "cpu-decomposition": Preset(
        "what each ingredient does, one change at a time: QK-norm with a constant scale "
        "(ln d ln L) and with a learned per-head scale, the ln N growth given QK-norm, "
        "Softplus-l1 given each scale, and re-weighting p = 15 on softmax-qknorm-logn, 3 seeds",
        "tiny-cpu",
        [
            SOFTMAX.label,
            QK_CONST.label,
            QK_LEARNED.label,
            QKNORM.label,
            LSSA_CONST.label,
            LSSA.label,
            QKNORM15.label,
            LSSAR15.label,
        ],
        seeds=[0, 1, 2],
        eval_tokens=32768,
        passkey=PASSKEY_CPU,
        passkey_arms=[SOFTMAX.label, LSSA.label, LSSAR15.label, QKNORM.label],
        # 12 new runs (4 arms x 3 seeds). Measured at one thread on the 2-core machine under a
        # load of ~6: 30 tiny-cpu steps at 0.65 (learned), 0.87 (lssa-const), 1.07 (softmax,
        # standing in for softmax-qknorm-const) and 1.33 s/step (softmax-qknorm-logn p=15), so
        # ~26 min of training per seed; evaluations at cpu's settings 52 s (softmax), 199 s
        # (lssa-const) and 303 s (p=15), both of the last on the materialised reference at 16x:
        # ~10 min per seed. ~110 min at one thread, ~55 min with two workers
        budget="~55 min on 2 CPU cores with --jobs 2 after cpu (reuses its softmax, "
        "softmax-qknorm-logn, lssa and lssar p=15 runs and evaluations)",
        eval_folder="cpu",
    ),
    # the paper's head dimension (d = 64) within CPU reach: the decisive arms, trained
    # 4x longer than cpu, on their own runs (another training preset: another runs directory)
    "cpu-paper-regime": Preset(
        "the paper's head dimension d = 64 (4 layers x 2 heads x 128 wide, 1,800 steps): "
        "softmax, its sliding-window control, softmax-qknorm-logn, lssa, lssar p=15 and the "
        "practitioner's ALiBi, 3 seeds, passkey on softmax, its window control and lssar p=15",
        "paper-regime-cpu",
        [SOFTMAX.label, WINDOW, QKNORM.label, LSSA.label, LSSAR15.label, "softmax + alibi"],
        seeds=[0, 1, 2],
        eval_tokens=32768,
        passkey=PASSKEY_CPU,
        passkey_arms=[SOFTMAX.label, WINDOW, LSSAR15.label],
        # measured: 30 steps of paper-regime-cpu at one thread on the 2-core machine while
        # another experiment ran (load 3-6), with warm-up: 0.55 (softmax), 0.53 (lssa), 0.60
        # (lssar p=15), 0.67 (softmax-qknorm-logn) and 0.30 s/step (softmax + alibi, at a quieter
        # moment): ~80 min of training per seed, ~240 min for 3 seeds at one thread, ~120 min
        # with two workers; plus evaluations (~1-2 min per result, 18 results) and 9 passkey
        # fine-tunings of 600 steps (~4-5 min each): ~2.5-3 h wall in all; an idle machine is
        # faster
        budget="~2.5-3 h on 2 CPU cores with --jobs 2 (estimated from 30 measured steps per "
        "arm at one thread)",
    ),
    # the headline without bf16 autocast: the paper-regime runs train under bf16 autocast, whose
    # kernels differ between hosts (a sibling host gave 16x/1x 1.103 for the committed 1.038 at
    # the same seed, config and data); fp32 training on 5 seeds, each arm with its own-window
    # control and the copy probe (its runs: runs/reproduce-paper-regime-cpu-dtype-fp32); the
    # d = 64 / 1,800-step cell of the factorial below
    "cpu-paper-regime-fp32": Preset(
        "the paper-regime headline trained in fp32 (no bf16 autocast): softmax, its "
        "sliding-window control and lssar p=15 at d = 64 (4 layers x 2 heads x 128 wide, 1,800 "
        "steps), 5 seeds, each with its own-window control and the copy probe; no passkey",
        "paper-regime-cpu",
        [SOFTMAX.label, WINDOW, LSSAR15.label],
        seeds=[0, 1, 2, 3, 4],
        eval_tokens=32768,
        # measured: 0.39-0.40 s per fp32 step (softmax and lssar p=15) at one thread on an idle
        # 2-core machine, about 0.6 s with two workers; the committed report's 10 runs and their
        # evaluations took 81 min with --jobs 2 (beside light other work)
        budget="~80-90 min on 2 CPU cores with --jobs 2 (81 min measured)",
        train={"dtype": "fp32"},
    ),
    "paper": Preset(
        "GPT-2 124M on FineWeb 10B tokens at T=1024 (the paper's setting): a GPU cluster job",
        "gpt2-124m-fineweb",
        PAPER_ARMS,
        passkey=PasskeySettings(),
        eval_tokens=1 << 21,
        budget="per arm ~3-4 h on 8xH100 (softmax; LSSAR kernels ~1.5x slower): ~1.5 days for "
        "all 9 arms",
    ),
}


def _cell(head_dim: int, steps: int) -> Preset:
    """One cell of the head dim x steps factorial, in fp32: the width-128 model of tiny-cpu
    (450 steps, warmup 50) or of paper-regime-cpu (1,800 steps, warmup 100) with 128 / head_dim
    heads; softmax, its window control and lssar p=15 (at head dim 32 also lssar p=15 with head
    dim 64's ln d: the cell's ln d arm), 3 seeds, no passkey."""
    base = {450: "tiny-cpu", 1800: "paper-regime-cpu"}[steps]
    runs = 3 * (2 + (head_dim == 32))  # softmax (its window shares the run), lssar, ln d arm
    return Preset(
        f"one cell of the head dim x steps factorial, in fp32: head dim {head_dim} "
        f"({128 // head_dim} heads x 128 wide, 4 layers), {steps:,} steps ({base}'s schedule); "
        "softmax, its sliding-window control and lssar p=15"
        + (" (and lssar p=15 with head dim 64's ln d in its scale)" if head_dim == 32 else "")
        + ", 3 seeds, each with its own-window control and the copy probe; no passkey",
        base,
        [SOFTMAX.label, WINDOW, LSSAR15.label] + ([LSSAR15_LND64.label] if head_dim == 32 else []),
        seeds=[0, 1, 2],
        eval_tokens=32768,
        # from cpu-paper-regime-fp32's measured 0.39 s per fp32 step at one thread (idle), and
        # about 0.7 s with two workers on the 2 cores (two runs at once), plus evaluations
        budget=f"~{round(runs * steps * 0.7 / 120 + 10, -1):.0f} min on 2 CPU cores with --jobs 2",
        train={"dtype": "fp32", "n_head": 128 // head_dim},
    )


# The paper-regime preset changes head dim (32 -> 64, so heads 4 -> 2), steps (450 -> 1,800) and
# warmup together; its factorial, in fp32, changes one at a time: cpu-paper-regime-fp32 is the
# d = 64 / 1,800-step cell, these the other three
PRESETS.update({f"cpu-cell-d{d}-{n}": _cell(d, n) for d, n in ((32, 450), (64, 450), (32, 1800))})

SMOKE_STEPS = 3


def smoke(preset: Preset) -> Preset:
    """``lssar reproduce --smoke``: ``preset``'s arms on its first seed for :data:`SMOKE_STEPS`
    steps of 4 windows, evaluated on two windows at 1x and 2x (passkey: 2 steps, 1 probe): it
    checks that an install runs the preset end to end in about a minute per arm, and measures
    nothing. Its runs and report live apart from the preset's (``runs/reproduce-smoke-*``,
    ``reports/<preset>-smoke-<date>``), its evaluations in ``RUN/eval/smoke/``."""
    from lssar.train.config import load_config

    seq_len = load_config(preset.train_preset, preset.train).seq_len
    tokens = 2 * seq_len
    steps = {"max_steps": SMOKE_STEPS, "warmup_steps": 1, "eval_every": SMOKE_STEPS}
    return dataclasses.replace(
        preset,
        description=f"SMOKE TEST, not a result ({SMOKE_STEPS} training steps per arm) of: "
        + preset.description,
        seeds=preset.seeds[:1],
        multiples=[1, 2],
        eval_tokens=tokens,
        passkey=None
        if preset.passkey is None
        else PasskeySettings(steps=2, warmup_steps=1, trials=1, digits=preset.passkey.digits),
        budget="about a minute per arm on 2 CPU cores",
        eval_folder="smoke",
        train={
            **preset.train,
            **steps,
            "batch_size": 4,
            "ckpt_every": SMOKE_STEPS,
            "log_every": 1,
            "eval_tokens": tokens,
        },
    )


def get_preset(name: str, smoke_test: bool = False) -> Preset:
    """Preset ``name`` of :data:`PRESETS` (``ValueError`` naming the choices), or its
    :func:`smoke` test."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return smoke(PRESETS[name]) if smoke_test else PRESETS[name]

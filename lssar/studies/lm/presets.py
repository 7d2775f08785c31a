"""The language-model study's arms (:data:`ARMS`) and presets (:data:`PRESETS`): what a
``lssar reproduce`` run depends on, nothing that runs (the runner is :mod:`.reproduce`, the
report :mod:`.report`).

An arm's name is its trained rule's label (``"lssar p=15"``, ``"softmax + alibi"``); the
evaluation results, and so the report's rows, carry the label
:func:`lssar.studies.lm.figures.label_of` gives them (``"softmax, sliding window 128"``,
``"lssa -> lssar p=15 (eval only)"``, ``"softmax -> yarn auto (eval only)"``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lssar.positions import ROPE_SCALINGS, RopeScaling, with_pos
from lssar.spec import AttentionSpec, run_label
from lssar.studies.common import Arm, EvalRule, arm_table, select_arms
from lssar.studies.lm.evaluate import PasskeySettings

SOFTMAX, SIGMOID, RELU = AttentionSpec("softmax"), AttentionSpec("sigmoid"), AttentionSpec("relu")
SOFTPLUS_L1, LSSA = AttentionSpec("softplus-l1"), AttentionSpec("lssa")
LSSAR3, LSSAR15 = AttentionSpec("lssar", {"p": 3.0}), AttentionSpec("lssar", {"p": 15.0})
QKNORM, SSMAX = AttentionSpec("softmax-qknorm-logn"), AttentionSpec("ssmax")
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
_ALTERNATIVES = (
    # what a practitioner would use instead (issue #24): positions trained in...
    Arm("softmax + alibi", SOFTMAX, "softmax with ALiBi instead of RoPE", pos="alibi"),
    Arm("softmax + nope", SOFTMAX, "softmax without position encoding (NoPE)", pos="nope"),
    Arm("lssar p=15 + nope", LSSAR15, "LSSAR p=15 without position encoding", pos="nope"),
    # ...and RoPE rescaled at evaluation only, on the softmax runs (no run of their own)
    *(
        Arm(f"softmax -> {kind} auto", SOFTMAX, ROPE_SUMMARY[kind], evals=(r,), own_rule=False)
        for kind, r in ROPE_EVALS.items()
    ),
)
ARMS = arm_table(*_PAPER, *_ALTERNATIVES)
# the arms the paper compares (METHOD.md section 6), and the window control
PAPER_ARMS = [a.name for a in _PAPER]
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

    def __post_init__(self) -> None:
        select_arms(ARMS, self.arms)
        select_arms(ARMS, self.passkey_arms or self.arms)


# One-digit keys: a byte tokenizer spends a token per digit, and copying several in a row needs an
# induction circuit this 450-step model lacks (pilot: 2 digits, 600 fine-tuning steps, <= 23% at
# 1x); one digit learned to 100% within 200 steps. The paper's 5-digit keys are 1-2 GPT-2 tokens.
PASSKEY_CPU = PasskeySettings(
    max_steps=1000, check_every=100, lr=3e-3, batch_size=32, digits=1, trials=20
)

PRESETS = {
    "quick": Preset(
        "softmax, lssa (+ eval-time re-weighting p = 1, 3, 8, 15), lssar p=15 and the "
        "sliding-window control; loss to 16x; entropy and first-token mass; 1 seed",
        "tiny-cpu",
        [SOFTMAX.label, WINDOW, LSSA.label, LSSAR15.label],
        eval_tokens=16384,
        budget="<= 15 min on 2 CPU cores",
    ),
    "cpu": Preset(
        "every variant of the paper, the sliding-window control and eval-time re-weighting "
        "p = 1, 3, 8, 15, 3 seeds, passkey and numerical health",
        "tiny-cpu",
        PAPER_ARMS,
        seeds=[0, 1, 2],
        eval_tokens=32768,
        passkey=PASSKEY_CPU,
        passkey_arms=[SOFTMAX.label, LSSA.label, LSSAR15.label, QKNORM.label],
        budget="~100 min on 2 CPU cores",
    ),
    # the practitioner's alternatives (issue #24) beside softmax and LSSAR p=15, on the cpu
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
        "evaluations), ~80 min on its own",
        eval_folder="cpu",
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

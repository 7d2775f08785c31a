"""The conversion study's arms (:data:`ARMS`) and presets (:data:`PRESETS`): a pretrained model
fine-tuned to each attention rule with one recipe, then evaluated far past the conversion length.

Every trained arm is fine-tuned from the same pretrained weights with the same data order (the
seed), steps, schedule and trainable parameters; ``softmax`` is the control (fine-tuning alone
changes a model). Each arm is also evaluated with its own ``L``-key window plus the document's
first tokens (what the keys beyond the conversion length are worth to it); on the softmax arm
that window is the sliding-window control, and YaRN (eval only, factor = the evaluated length
over the model's pretrained positions) is the practitioner's training-free extension.
``original`` is the pretrained model as shipped (transformers' SDPA), evaluated once: the
reference the fine-tuned arms move from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lssar.positions import RopeScaling
from lssar.spec import AttentionSpec
from lssar.studies.common import Arm, EvalRule, arm_table, select_arms

SOFTMAX, LSSA = AttentionSpec("softmax"), AttentionSpec("lssa")
LSSAR15, QKNORM = AttentionSpec("lssar", {"p": 15.0}), AttentionSpec("softmax-qknorm-logn")
YARN = EvalRule(rope=RopeScaling("yarn"))
ORIGINAL = "original"

ARMS = arm_table(
    Arm(
        SOFTMAX.label, SOFTMAX, "fine-tuned with softmax (SDPA's rule): the control", evals=(YARN,)
    ),
    Arm(LSSAR15.label, LSSAR15, "converted to LSSAR p=15 (the paper's long-context rule)"),
    Arm(LSSA.label, LSSA, "converted to LSSA (no re-weighting)"),
    Arm(QKNORM.label, QKNORM, "converted to softmax of the length-scaled cosine (LSSA's scale)"),
    Arm(ORIGINAL, None, "the pretrained model as shipped, not fine-tuned (transformers' SDPA)"),
)


@dataclass(frozen=True)
class Preset:
    """A conversion study: the model and corpus, the fine-tuning recipe (the keys of
    :class:`lssar.integrations.finetune.FinetuneConfig`), and the evaluation.

    Evaluation: ``documents`` held-out documents of at least ``max(multiples) * seq_len`` tokens,
    one forward each (loss at every length from the per-position loss); ``long_multiples`` are
    scored on ``long_documents`` documents for ``long_arms`` only (lengths past the model's own
    pretrained positions cost minutes per document); the copy probe at ``copy_multiples`` of
    ``seq_len`` with ``copy_probes`` probes per distance. The own-window rows keep the document's
    first ``sink_tokens`` tokens visible (StreamingLLM's attention sinks): every fine-tuning window
    starts a document or restarts its positions, so its queries always saw their first tokens; a
    window without them measures the loss of the sink, not of the context beyond L (seed 0 of
    ``smollm2`` without them, positions 257-512: +3.8 nats with LSSAR, +0.8 with softmax)."""

    name: str
    summary: str
    model: str
    data: str
    seq_len: int
    steps: int
    warmup: int
    lr: float
    batch_size: int
    arms: tuple[str, ...]
    seeds: tuple[int, ...]
    multiples: tuple[int, ...]
    documents: int
    long_multiples: tuple[int, ...] = ()
    long_documents: int = 0
    long_arms: tuple[str, ...] = ()
    copy_multiples: tuple[int, ...] = (2, 4, 8, 16)
    copy_probes: int = 8
    sink_tokens: int = 4
    grad_accum: int = 1
    trainable: str = "attention"
    val_fraction: float = 0.25
    eval_every: int = 25
    eval_windows: int = 16
    dtype: str = "auto"
    budget: str = ""
    tags: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        select_arms(ARMS, self.arms)
        if not set(self.long_arms) <= set(self.arms):
            raise ValueError(f"preset {self.name}: long_arms must be among its arms")

    @property
    def description(self) -> str:
        """What the preset runs, as every study's ``--help`` lists its presets."""
        return self.summary

    def recipe(self) -> dict:
        """The fine-tuning keys every arm and seed share."""
        return dict(
            model=self.model, data=self.data, seq_len=self.seq_len, steps=self.steps,
            warmup=self.warmup, lr=self.lr, batch_size=self.batch_size,
            grad_accum=self.grad_accum, trainable=self.trainable, val_fraction=self.val_fraction,
            eval_every=self.eval_every, eval_windows=self.eval_windows, dtype=self.dtype,
            ckpt_every=self.eval_every,
        )  # fmt: skip


TINY = "tiny-llama"  # a random Llama made by the study itself (lssar.studies.convert.study)

PRESETS = {
    p.name: p
    for p in (
        Preset(
            name="quick",
            summary="a tiny random Llama on Shakespeare: the whole pipeline in minutes (tests)",
            model=TINY,
            data="shakespeare",
            seq_len=32,
            steps=6,
            warmup=2,
            lr=1e-3,
            batch_size=2,
            arms=(SOFTMAX.label, LSSAR15.label, ORIGINAL),
            seeds=(0, 1),
            multiples=(1, 2, 4),
            documents=2,
            long_multiples=(8,),
            long_documents=1,
            long_arms=(SOFTMAX.label, LSSAR15.label),
            copy_multiples=(2, 4),
            copy_probes=2,
            eval_every=3,
            eval_windows=2,
            dtype="fp32",
            val_fraction=0.4,
            budget="about 2 min",
        ),
        Preset(
            name="smollm2",
            summary="SmolLM2-135M-Instruct (Q4_1, dequantised) converted at L = 256 on Debian's "
            "documentation (python3.11-doc, linux-doc-6.1), evaluated to 16K tokens",
            model="smollm2",
            data="debian-docs",
            seq_len=256,
            steps=100,
            warmup=10,
            lr=3e-4,
            batch_size=4,
            arms=(SOFTMAX.label, LSSAR15.label, LSSA.label, QKNORM.label, ORIGINAL),
            seeds=(0, 1, 2),
            multiples=(1, 2, 4, 8, 16),
            documents=6,
            long_multiples=(32, 64),
            long_documents=1,
            long_arms=(SOFTMAX.label, LSSAR15.label),
            copy_multiples=(2, 4, 16),
            copy_probes=6,
            budget="about 6 h on 2 idle cores (2 jobs), resumable across invocations",
        ),
    )
}

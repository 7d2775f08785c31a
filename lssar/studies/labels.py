"""Arm and result labels: the one home of the names that tables, claims, findings and figures
use as keys. A committed report's labels are what its ``findings`` markers look up, so no label
here changes spelling.

* :func:`run_label`: a trained rule and what it was evaluated with (``"lssar p=15"``, ``"lssa ->
  lssar p=15 (eval only)"``, ``"softmax -> yarn auto (eval only)"``);
* :func:`label_of` / :func:`group`: a language-model result's arm (with positions and the window
  control: ``"softmax + alibi"``, ``"softmax, sliding window 128"``) and results by arm;
* :func:`eval_label`: a recall row's arm (its spelling: ``"window"``, ``"lssa -> lssar p=15
  (eval)"``);
* :func:`key`: any study's spelling of an arm mapped onto the language-model label (recall's
  ``"window"``, orbits' ``"lssar"`` and ``"softmax-local"``), for one colour per arm.
"""

from __future__ import annotations

import re
from typing import Any

from lssar.positions import with_pos
from lssar.spec import AttentionSpec

EVAL_ONLY = "(eval only)"
SOFTMAX, LSSAR15, WINDOW = "softmax", "lssar p=15", "window"
WINDOW_PREFIX = "softmax, sliding window"  # the LM window control (label_of adds the size)
# other studies' names of the same arms
ALIASES = {"lssar": LSSAR15, "lssar-p3": "lssar p=3", "softmax-local": WINDOW}


def run_label(
    trained: AttentionSpec | str,
    evaluated: AttentionSpec | str | None = None,
    rope_scaling: str | None = None,
) -> str:
    """The label of a result: the trained rule's, or ``"lssa -> lssar p=15 (eval only)"`` when
    it was evaluated with another rule, ``"softmax -> yarn auto (eval only)"`` with a RoPE
    scaling (``rope_scaling``: its label), ``"lssa -> lssar p=15 + yarn x4 (eval only)"`` with
    both. Accepts specs or their labels (as results store them)."""
    t = trained.label if isinstance(trained, AttentionSpec) else trained
    e = evaluated.label if isinstance(evaluated, AttentionSpec) else evaluated
    if rope_scaling:
        switched = rope_scaling if e is None or e == t else f"{e} + {rope_scaling}"
        return f"{t} -> {switched} {EVAL_ONLY}"
    return t if e is None or e == t else f"{t} -> {e} {EVAL_ONLY}"


def label_of(r: dict[str, Any]) -> str:
    """The arm of a language-model result: the trained rule (``"softmax + alibi"`` with its
    positions), ``"lssa -> lssar p=15 (eval only)"`` for a rule switched after training,
    ``"softmax -> yarn auto (eval only)"`` for a RoPE scaling, ``"softmax, sliding window 128"``
    for the window control."""
    label = run_label(r["trained_attention"], r["evaluated_attention"], r.get("rope_scaling"))
    if not r.get("window"):
        return label
    sinks = f" + {r['sink_tokens']} sinks" if r.get("sink_tokens") else ""
    return f"{label}, sliding window {r['window']}{sinks}"


def group(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Arm label -> its results (one per seed), in first-seen order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        out.setdefault(label_of(r), []).append(r)
    return out


def eval_label(arm: Any, rule: Any = None) -> str:
    """A recall row's label: the arm's name, ``"lssa -> lssar p=X (eval)"`` for an eval-only
    re-weighting (``rule`` an :class:`~lssar.studies.common.EvalRule`, or that p),
    ``"softmax -> yarn auto (eval)"`` for a RoPE scaling."""
    if rule is None:
        return arm.name
    if isinstance(rule, (int, float)):
        rule_label = AttentionSpec("lssar", {"p": float(rule)}).label
    else:
        rule_label = rule.label
    return f"{with_pos(arm.attention.label, arm.pos)} -> {rule_label} (eval)"


def key(label: str) -> str:
    """The arm a label names, spelled as the language-model study spells it: ``"softmax,
    sliding window 128"`` and recall's ``"window"`` -> ``"window"``, ``"... (eval)"`` -> ``"...
    (eval only)"``, a constant-scale arm without its ``n=128``, orbits' ``"lssar"`` ->
    ``"lssar p=15"``."""
    k = re.sub(r" n=\d+", "", label)
    k = re.sub(r" \(eval\)$", f" {EVAL_ONLY}", k)
    if re.fullmatch(rf"{WINDOW_PREFIX}( \d+)?", k):
        return WINDOW
    return ALIASES.get(k, k)

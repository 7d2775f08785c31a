"""``lssar convert-study``: convert a pretrained model to each attention rule of a preset by
fine-tuning, evaluate every arm far past the conversion length, and write the report.

A unit is one (arm, seed): its fine-tuning run (``lssar finetune``'s run directory, resumable)
and its evaluations (each a JSON file in the run's ``eval/``, reused while its settings, the
model's weights and the evaluation code are unchanged). The study is resumable at every level:
rerun the same command after a kill and it continues where it stopped.

A finished unit's results are also carried in the report directory (``units/<arm>-s<seed>.json``,
with the unit's settings as its key: :class:`lssar.studies.common.Study`), so a study longer than
one machine's life continues on another (``--arms``/``--seeds`` run a part of it; the same
``--out`` later reuses every carried unit whose settings match, without its runs).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path
from typing import Any

from lssar import data
from lssar.integrations import finetune as ft
from lssar.integrations.pretrained import resolve_source, save_model
from lssar.studies.common import Study, select_arms, study_args, study_parser
from lssar.studies.convert.presets import ARMS, ORIGINAL, PRESETS, SOFTMAX, TINY, Preset
from lssar.studies.lm.evaluate_hf import evaluate_model
from lssar.train.checkpoint import CONFIG, DONE, check_config, read_json, read_log


def tiny_llama(out: Path, corpus: str = "shakespeare", seed: int = 0) -> Path:
    """A tiny random Llama (2 layers, GQA, head dim 16, 128 positions) with a BPE tokenizer
    trained on ``corpus``, saved once as an HF directory: the quick preset's "pretrained"
    model."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    texts = [t for _, t in data.iter_documents(corpus, max_docs=4)]
    tmp = out.with_name(f".{out.name}.bpe.json")
    data.train_bpe(texts, 320, tmp)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tmp), eos_token=data.EOT_TEXT)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
    )  # fmt: skip
    save_model(LlamaForCausalLM(cfg).eval(), tok, out, {"note": "a tiny random Llama"})
    tmp.unlink()
    return out


def _model_source(p: Preset, runs: Path) -> str:
    return str(tiny_llama(runs / TINY)) if p.model == TINY else p.model


def finetune_config(p: Preset, arm: str, seed: int, runs: Path) -> ft.FinetuneConfig:
    """The fine-tuning run of ``arm`` and ``seed``: the preset's recipe, the arm's rule."""
    spec = ARMS[arm].attention
    return ft.FinetuneConfig(
        **(p.recipe() | {"model": _model_source(p, runs)}),
        attn=spec.name,
        p=spec.options.get("p"),
        seed=seed,
        data_root=str(runs / "data"),
        out_dir=str(runs),
        run_name=f"{p.name}-{ARMS[arm].attention.slug()}-s{seed}",
    )


def unit_rules(p: Preset, arm: str) -> list[tuple[dict[str, Any], bool]]:
    """``(rule, long)`` of every evaluation of an arm: full context and its own ``L``-key window
    at the preset's lengths, its eval-only rules (YaRN on softmax); for ``long_arms`` full
    context and the eval-only rules at the long lengths too (minutes per document)."""
    evals = [{"window": None, "rope": r.rope.kind} for r in ARMS[arm].evals if r.rope is not None]
    own = {"window": p.seq_len, "sink_tokens": p.sink_tokens}
    base = [{"window": None}] + ([] if arm == ORIGINAL else [own])
    out = [(r, False) for r in base + evals]
    if arm in p.long_arms and p.long_multiples:
        out += [(r, True) for r in [{"window": None}] + evals]
    return out


def evaluate(
    model_dir: Path,
    ds: Path,
    p: Preset,
    rule: dict[str, Any],
    long: bool,
    cache: Path,
    progress: bool = False,
) -> dict[str, Any]:
    """One evaluation of a model directory under ``rule`` (:func:`evaluate_model`): the
    preset's lengths and the copy probe, or the long lengths alone when ``long``."""
    mult = p.long_multiples if long else p.multiples
    return evaluate_model(
        model_dir,
        ds,
        [m * p.seq_len for m in mult],
        p.long_documents if long else p.documents,
        rule["window"],
        rule.get("rope"),
        [] if long else [m * p.seq_len for m in p.copy_multiples],
        p.copy_probes,
        p.dtype,
        cache,
        progress,
        sink_tokens=rule.get("sink_tokens", 0),
    )


def run_unit(
    p: Preset, arm: str, seed: int, runs: Path, progress: bool = False
) -> list[dict[str, Any]]:
    """Fine-tune (or reuse) ``arm`` at ``seed`` and run its evaluations; the ``original`` arm
    is the pretrained model, evaluated once (seed 0)."""
    src = resolve_source(_model_source(p, runs))
    if arm == ORIGINAL:
        model_dir = ft.source_dir(src, runs)
        run_dir, curve, seed = runs / f"{p.name}-original", None, 0
        ds = ft.dataset_dir(finetune_config(p, SOFTMAX.label, 0, runs), model_dir)
    else:
        run_dir = ft.finetune(finetune_config(p, arm, seed, runs), progress=progress)
        model_dir = run_dir / "model"
        ds = Path(read_json(run_dir / "env.json")["dataset"])
        curve = [r for r in read_log(run_dir) if "val_loss" in r]
    return [
        _result(p, arm, seed, rule, long, run_dir, curve,
                evaluate(model_dir, ds, p, rule, long, run_dir / "eval", progress))
        for rule, long in unit_rules(p, arm)
    ]  # fmt: skip


_KEPT = ("lengths", "loss", "loss_band", "loss_by_document", "band_by_document",
         "tokens_per_length", "documents", "position_buckets", "loss_by_position", "copy",
         "eval_env")  # fmt: skip


def _result(
    p: Preset,
    arm: str,
    seed: int,
    rule: dict[str, Any],
    long: bool,
    run_dir: Path,
    curve: list[dict[str, Any]] | None,
    r: dict[str, Any],
) -> dict[str, Any]:
    """A result in the LM reports' form: :func:`lssar.studies.labels.label_of` names its arm
    (``"softmax, sliding window 256"``, ``"softmax -> yarn auto (eval only)"``)."""
    spec = ARMS[arm].attention
    trained = ORIGINAL if spec is None else spec.label
    env = read_json(run_dir / "env.json") or {}
    return {
        "arm": arm,
        "trained_attention": trained,
        "evaluated_attention": trained,
        "rope_scaling": f"{rule['rope']} auto" if rule.get("rope") else None,
        "window": rule["window"],
        "sink_tokens": rule.get("sink_tokens", 0),
        "long": long,
        "config": {"seed": seed},
        "train_len": p.seq_len,
        "run": str(run_dir),
        "curve": curve,
        "train_seconds": (read_json(run_dir / DONE) or {}).get("seconds"),
        "env": env,
        **{k: r[k] for k in _KEPT if k in r},
    }


def unit_key(p: Preset, arm: str, seed: int) -> dict[str, Any]:
    """What a unit's results depend on, without this machine's paths: the fine-tuning recipe,
    the arm's rule and seed, and every evaluation setting (a carried unit is reused only while
    its key matches)."""
    spec = ARMS[arm].attention
    evals = ("multiples", "documents", "long_multiples", "long_documents", "copy_multiples",
             "copy_probes", "sink_tokens", "dtype")  # fmt: skip
    return json.loads(json.dumps({
        "recipe": p.recipe(),
        "attention": None if spec is None else spec.label,
        "seed": seed,
        "rules": unit_rules(p, arm),
        "eval": {k: getattr(p, k) for k in evals},
    }))  # fmt: skip


def unit_file(arm: str, seed: int) -> str:
    spec = ARMS[arm].attention
    return f"{ORIGINAL if spec is None else spec.slug()}-s{seed}.json"


@dataclasses.dataclass
class ConvertStudy(Study):
    """``lssar convert-study``: one unit per (arm, seed) (the ``original`` arm once), each
    fine-tuned (or reused) and evaluated by :func:`run_unit`; the report is
    :mod:`lssar.studies.convert.report`."""

    preset: Preset
    runs: Path
    out: Path
    progress: bool = True  # inside a unit (one unit at a time only)

    def units(self) -> list[tuple[Any, ...]]:
        p = self.preset
        return [(a, s) for s in p.seeds for a in p.arms if a != ORIGINAL or s == p.seeds[0]]

    def unit_key(self, arm: str, seed: int) -> dict[str, Any]:
        return unit_key(self.preset, arm, seed)

    def unit_file(self, arm: str, seed: int) -> str:
        return unit_file(arm, seed)

    def run_unit(self, arm: str, seed: int) -> list[dict[str, Any]]:
        return run_unit(self.preset, arm, seed, self.runs, self.progress)

    def check_unit(self, arm: str, seed: int) -> None:
        """Refuse a unit whose fine-tuning run exists with another config, before any unit
        starts (a pool that found it while running would have fine-tuned other arms with the
        new config meanwhile)."""
        if arm == ORIGINAL:  # no run of its own to check
            return
        cfg = finetune_config(self.preset, arm, seed, self.runs)
        run_dir = Path(cfg.out_dir) / cfg.name  # as ft.finetune finds it
        if (stored := read_json(run_dir / CONFIG)) is not None:
            check_config(stored, dataclasses.asdict(cfg), run_dir)

    def unit_name(self, arm: str, seed: int) -> str:
        return f"arm {arm} (seed {seed})"

    def write_report(self, results: list[Any], seconds: float) -> Path:
        from lssar.studies.convert.report import write

        return write(self.preset, [r for rs in results for r in rs], self.out)


def default_out(p: Preset) -> Path:
    return Path("reports") / f"convert-{p.name}-{datetime.date.today().isoformat()}"


def run_study(
    preset: str,
    arms: list[str] | None = None,
    seeds: list[int] | None = None,
    runs: str | Path = "runs",
    out: str | Path | None = None,
    jobs: int = 1,
    progress: bool = True,
) -> Path:
    """Run every unit of ``preset`` (resuming what exists) and write the report; returns its
    directory."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    p = PRESETS[preset]
    if arms is not None:
        chosen = tuple(select_arms(ARMS, arms))
        p = dataclasses.replace(
            p, arms=chosen, long_arms=tuple(a for a in p.long_arms if a in chosen)
        )
    if seeds is not None:
        p = dataclasses.replace(p, seeds=tuple(seeds))
    runs = Path(runs) / f"convert-{p.name}"
    study = ConvertStudy(p, runs, Path(out) if out else default_out(p), progress and jobs == 1)
    if any(study.carried(*u) is None for u in study.units()):
        # the model as an HF directory and its dataset, made once before any worker needs them
        model_dir = ft.source_dir(resolve_source(_model_source(p, runs)), runs)
        ft.dataset_dir(finetune_config(p, SOFTMAX.label, p.seeds[0], runs), model_dir)
    return study.run(jobs).report


def cli(argv: list[str]) -> int:
    ap = study_parser(
        "lssar convert-study",
        __doc__,
        PRESETS,
        ARMS,
        runs="runs (the study's runs go to runs/convert-PRESET)",
        out="reports/convert-PRESET-DATE",
    )
    a = ap.parse_args(argv)
    arms, seeds = study_args(a)
    out = run_study(a.preset, arms, seeds, a.runs or "runs", a.out, a.jobs or 1, not a.no_progress)
    print(f"report: {out / 'REPORT.md'}")
    return 0

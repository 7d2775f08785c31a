"""lm-evaluation-harness for lssar runs: an offline ``LM`` over our GPT, and local tasks.

``lssar lm-eval RUN --tasks lssar_passkey,lssar_heldout_ppl`` evaluates a run's checkpoint with
``lm_eval.simple_evaluate``. The model is :class:`LssarLM` (registered in lm-eval as ``"lssar"``),
which scores and generates with :class:`lssar.model.GPT` and the run's own tokenizer, so nothing
is downloaded. The local tasks are written on demand by :func:`write_local_tasks` (YAML + JSONL,
read with ``TaskManager(include_path=...)``), into a fresh temporary directory at every call,
from the run's held-out split:

- ``lssar_heldout_ppl``: ``loglikelihood_rolling`` perplexity (word/byte perplexity, bits per byte)
  of held-out documents;
- ``lssar_passkey``: multiple choice, which 5-digit pass key was stated in the filler text;
- ``lssar_passkey_gen``: the same probe answered by greedy generation (exact match).

The harness's own tasks (``arc_easy,hellaswag,piqa,sciq``: the paper's downstream set) also run
through :class:`LssarLM` on a machine that can download their datasets.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM

from lssar import data
from lssar.data.passkey import QUESTION, passkey_probe
from lssar.model import GPT, KVCache
from lssar.runio import atomic_write

LOCAL_TASKS = ("lssar_heldout_ppl", "lssar_passkey", "lssar_passkey_gen")
N_DISTRACTORS = 3


class LssarLM(LM):
    """lm-eval ``LM`` over a :class:`GPT` and an lssar tokenizer (greedy generation only).

    Either ``run`` (a run directory: model, tokenizer and ``max_length`` = its training length)
    or ``model`` + ``tokenizer`` + ``max_length``. ``attn`` / ``attn_p`` switch the attention
    rule (e.g. ``attn_p=15`` on an LSSA run: the paper's fine-tuning-free re-weighting),
    ``rope_scaling`` / ``rope_factor`` rescale RoPE from the training length ``train_len`` (a
    run's own; else ``max_length``), by the one rule of :meth:`GPT.switch`.
    Requests longer than ``max_length`` tokens keep their last ``max_length`` tokens. Batches are
    right-padded, which is exact for a causal model: real tokens never see the padding.
    """

    def __init__(
        self,
        run: str | None = None,
        model: GPT | None = None,
        tokenizer: data.Tokenizer | None = None,
        max_length: int | None = None,
        attn: str | None = None,
        attn_p: float | None = None,
        batch_size: int = 8,
        device: str = "cpu",
        which: str = "final",
        rope_scaling: str | None = None,
        rope_factor: Any = None,
        train_len: int | None = None,
    ) -> None:
        super().__init__()
        if (run is None) == (model is None):
            raise ValueError("pass either run=<run dir> or model=<GPT> (with tokenizer)")
        if run is not None:
            from lssar.train.runs import load_run

            model, cfg, meta = load_run(run, map_location=device, which=which)
            tokenizer = data.get_tokenizer(cfg.tokenizer, corpus_dir=meta["data_dir"])
            max_length = max_length or cfg.seq_len
            train_len = train_len or cfg.seq_len
        if tokenizer is None or not max_length or int(max_length) < 2:
            raise ValueError("a model needs a tokenizer and max_length >= 2")
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        p = None if attn_p is None else float(attn_p)
        model.switch(attn, p, rope_scaling, rope_factor, train_len or int(max_length))
        self.model = model.to(device).eval()
        self.tok, self.max_length, self.batch_size = tokenizer, int(max_length), int(batch_size)
        self._device = torch.device(device)
        # What precedes a document: the eot token, or the blank line byte-level corpora use.
        self.prefix = tokenizer.doc_separator

    @property
    def tokenizer_name(self) -> str:
        return self.tok.name

    def get_model_info(self) -> dict[str, Any]:
        spec = self.model.attn_spec
        return {
            "lssar_attn": spec.name,
            "lssar_attn_options": dict(spec.options),
            "lssar_rope_scaling": getattr(self.model.rope_scaling, "label", None),
            "max_length": self.max_length,
        }

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of context and continuation as they tokenize together (HFLM's rule:
        trailing spaces of the context move to the continuation)."""
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        if not context:
            return list(self.prefix), self.tok.encode(continuation)
        whole, ctx = self.tok.encode(context + continuation), self.tok.encode(context)
        return ctx, whole[len(ctx) :]

    @torch.inference_mode()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """``(sum log p(continuation | context), greedy?)`` per pair, in the input order."""
        out: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
        rows = []
        for i, (ctx, cont) in enumerate(pairs):
            if cont:
                seq = (ctx + cont)[-(self.max_length + 1) :]
                n = min(len(cont), len(seq) - 1)  # a longer continuation keeps its last tokens
                rows.append((i, seq[:-1], seq[-n:]))
        rows.sort(key=lambda r: -len(r[1]))  # similar lengths share a batch
        for s in range(0, len(rows), self.batch_size):
            batch = rows[s : s + self.batch_size]
            width = len(batch[0][1])
            x = torch.zeros(len(batch), width, dtype=torch.long)
            for j, (_, inp, _) in enumerate(batch):
                x[j, : len(inp)] = torch.tensor(inp)
            logits, _ = self.model(x.to(self._device))
            logp = F.log_softmax(logits.float(), dim=-1)  # (B, T, V)
            for j, (i, inp, cont) in enumerate(batch):
                rows_lp = logp[j, len(inp) - len(cont) : len(inp)]  # (n_cont, V)
                target = torch.tensor(cont, device=rows_lp.device)
                lp = rows_lp.gather(-1, target[:, None]).sum().item()
                out[i] = (lp, bool((rows_lp.argmax(-1) == target).all()))
        return out

    def loglikelihood(
        self, requests: list[Any], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        return self._score([self._encode_pair(*r.args) for r in requests])

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for r in requests:
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    self.tok.encode(r.args[0]), self.prefix[-1], self.max_length, 1
                )
            ]
            out.append(sum(lp for lp, _ in self._score(windows)))
        return out

    @torch.inference_mode()
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each context until a stop string, eot or ``max_gen_toks``."""
        eot_text = self.tok.decode([self.tok.eot]) if self.tok.eot is not None else "\n\n"
        out = []
        for r in requests:
            context, kw = r.args
            kw = dict(kw or {})
            if kw.get("do_sample") or kw.get("temperature", 0.0) > 0:
                raise ValueError("LssarLM generates greedily only (do_sample=False)")
            until = kw.get("until") or [eot_text]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.get("max_gen_toks", 256))
            ids = self.tok.encode(context) or list(self.prefix)
            ids = ids[-max(1, self.max_length - max_new) :]
            cache = KVCache(self.model.cfg.n_layer)
            logits, _ = self.model(torch.tensor([ids], device=self._device), cache=cache)
            new: list[int] = []
            text = ""
            for _ in range(max_new):
                nxt = int(logits[0, -1].argmax())
                if nxt == self.tok.eot:
                    break
                new.append(nxt)
                text = self.tok.decode(new)
                if any(u in text for u in until):
                    break
                logits, _ = self.model(torch.tensor([[nxt]], device=self._device), cache=cache)
            for u in until:
                text = text.split(u)[0]
            out.append(text)
        return out


def register_lm() -> None:
    """Register :class:`LssarLM` as lm-eval model ``"lssar"`` (``--model lssar``); idempotent."""
    from lm_eval.api.registry import register_model

    try:
        register_model("lssar")(LssarLM)
    except ValueError:  # already registered (same name, e.g. after a module reload)
        pass


# ------------------------------------------------------------------------------ local tasks


def _dataset(path: Path, cache: Path) -> dict[str, Any]:
    # A local JSONL through datasets' packaged "json" builder: offline; cache kept beside it.
    return {
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(path)}, "cache_dir": str(cache)},
        "test_split": "test",
    }


def _passkey_docs(
    text: str, tok: data.Tokenizer, n: int, length: int, rng: random.Random
) -> list[dict[str, Any]]:
    """``n`` probes of about ``length`` tokens: filler, the key at a random depth, the question."""
    filler = tok.encode(text)
    question = QUESTION.rstrip()  # the answer " 12345" carries its own space (BPE-friendly)

    def place(n_fill: int) -> tuple[int, int]:
        start = rng.randrange(0, len(filler) - n_fill)
        return start, rng.randrange(0, n_fill + 1)

    docs = []
    for _ in range(n):
        keys = rng.sample(range(10000, 100000), 1 + N_DISTRACTORS)
        ids, _ = passkey_probe(tok, filler, length, str(keys[0]), place, question, f" {keys[0]}")
        context = tok.decode(ids)
        choices = [f" {k}" for k in keys]
        rng.shuffle(choices)
        docs.append(
            {
                "context": context,
                "choices": choices,
                "label": choices.index(f" {keys[0]}"),
                "key": str(keys[0]),
            }
        )
    return docs


def _text_docs(text: str, n: int, chars: int) -> list[dict[str, str]]:
    """Up to ``n`` consecutive chunks of about ``chars`` characters, cut at whitespace."""
    docs, pos = [], 0
    while len(docs) < n and pos < len(text):
        end = min(len(text), pos + chars)
        if end < len(text):
            end = max(text.rfind(" ", pos, end), text.rfind("\n", pos, end), pos + 1)
        if chunk := text[pos:end].strip():
            docs.append({"text": chunk})
        pos = end
    return docs


def write_local_tasks(
    out_dir: str | Path,
    text: str,
    tokenizer: data.Tokenizer | None = None,
    n_docs: int = 50,
    doc_chars: int = 2000,
    passkey_length: int = 256,
    seed: int = 0,
) -> list[str]:
    """Write the local tasks (YAML + JSONL) into ``out_dir``; return their names.

    ``text`` is held-out text (the run's validation split); ``passkey_length`` is counted in
    tokens of ``tokenizer`` (default bytes). Deterministic in ``seed``; rewriting is safe.
    """
    import yaml

    if n_docs < 1 or doc_chars < 1:
        raise ValueError(f"need n_docs >= 1 and doc_chars >= 1, got {n_docs=} {doc_chars=}")
    if not text.strip():
        raise ValueError("write_local_tasks needs non-empty held-out text")
    tok = tokenizer or data.ByteTokenizer()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cache = out / ".hf_datasets_cache"
    docs = {
        "heldout": _text_docs(text, n_docs, doc_chars),
        "passkey": _passkey_docs(text, tok, n_docs, passkey_length, random.Random(seed)),
    }
    for name, rows in docs.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), "utf-8")
    common = {"tag": ["lssar_local"], "metadata": {"version": 1.0}}
    passkey = {**_dataset(out / "passkey.jsonl", cache), "doc_to_text": "{{context}}"}
    configs = {
        "lssar_heldout_ppl": {
            **_dataset(out / "heldout.jsonl", cache),
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "text",
            "metric_list": [
                {"metric": m, "aggregation": agg, "higher_is_better": False}
                for m, agg in (
                    ("word_perplexity", "weighted_perplexity"),
                    ("byte_perplexity", "weighted_perplexity"),
                    ("bits_per_byte", "bits_per_byte"),
                )
            ],
        },
        "lssar_passkey": {
            **passkey,
            "output_type": "multiple_choice",
            "doc_to_choice": "choices",
            "doc_to_target": "label",
            "target_delimiter": "",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        },
        "lssar_passkey_gen": {
            **passkey,
            "output_type": "generate_until",
            "doc_to_target": "key",
            "generation_kwargs": {"until": ["\n", "."], "max_gen_toks": 8, "do_sample": False},
            "filter_list": [
                {
                    "name": "key",
                    "filter": [
                        {"function": "regex", "regex_pattern": r"(\d{5})"},
                        {"function": "take_first"},
                    ],
                }
            ],
            "metric_list": [
                {"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}
            ],
        },
    }
    for name, cfg in configs.items():
        body = yaml.safe_dump({"task": name, **cfg, **common}, sort_keys=False)
        (out / f"{name}.yaml").write_text(body, "utf-8")
    return list(configs)


# -------------------------------------------------------------------------------- evaluate


def evaluate(
    lm: LssarLM,
    tasks: list[str],
    tasks_dir: str | Path | None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    bootstrap_iters: int = 100000,
) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` of ``lm`` on ``tasks`` (local ones read from ``tasks_dir``).

    ``tasks_dir`` becomes lm-eval's include path, and a task YAML there can import Python
    (``!function``): pass only a directory this process has just written with
    :func:`write_local_tasks` (``lssar lm-eval`` uses a fresh temporary one), or None.
    """
    import lm_eval
    from lm_eval.tasks import TaskManager

    register_lm()
    # Indexing the harness's ~10^4 task YAMLs takes seconds: skip it when only lssar_* tasks run.
    manager = TaskManager(
        include_path=None if tasks_dir is None else str(tasks_dir),
        include_defaults=not all(t.startswith("lssar_") for t in tasks),
    )
    if unknown := [t for t in tasks if t not in manager.all_tasks]:
        raise ValueError(
            f"unknown lm-eval task(s) {', '.join(map(repr, unknown))}; local tasks: "
            f"{', '.join(LOCAL_TASKS)} (tag lssar_local); `lm-eval ls tasks` lists the harness's"
        )
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        bootstrap_iters=bootstrap_iters,
        log_samples=False,
    )
    if results is None:
        raise ValueError("lm-eval returned no results")
    return results


def cli(argv: list[str]) -> int:
    """``lssar lm-eval RUN --tasks T1,T2 [--attn NAME --attn-p P] [--limit N] [--out DIR]``."""
    ap = argparse.ArgumentParser(
        prog="lssar lm-eval",
        description="Evaluate a run with lm-evaluation-harness. Local tasks (offline): "
        f"{', '.join(LOCAL_TASKS)} (tag lssar_local); harness tasks such as "
        "arc_easy,hellaswag,piqa,sciq need their datasets (an online machine or the HF cache).",
    )
    ap.add_argument("run", help="run directory")
    ap.add_argument("--tasks", required=True, help="comma-separated task names")
    ap.add_argument("--attn", help="evaluate with another attention variant")
    ap.add_argument("--attn-p", type=float, help="re-weighting power p (e.g. 15)")
    ap.add_argument("--rope-scaling", help="rescale RoPE: linear, ntk, dynamic-ntk, yarn")
    ap.add_argument("--rope-factor", help="its factor: a number, or auto (the default)")
    ap.add_argument("--limit", type=int, help="documents per task (quick checks)")
    ap.add_argument("--num-fewshot", type=int)
    ap.add_argument("--out", help="output directory (default RUN/lm_eval)")
    ap.add_argument("--max-length", type=int, help="context window (default: training length)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--which", default="final", choices=("final", "latest"))
    ap.add_argument("--passkey-length", type=int, help="passkey probe tokens (default max-length)")
    ap.add_argument("--n-docs", type=int, default=50, help="documents per local task")
    ap.add_argument("--bootstrap-iters", type=int, default=100000)
    a = ap.parse_args(argv)
    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--tasks needs at least one task name")
    if a.limit is not None and a.limit < 1:
        raise ValueError(f"--limit={a.limit} must be >= 1")
    from lssar.train.runs import load_run

    model, cfg, meta = load_run(a.run, map_location=a.device, which=a.which)
    tok = data.get_tokenizer(cfg.tokenizer, corpus_dir=meta["data_dir"])
    lm = LssarLM(
        model=model,
        tokenizer=tok,
        max_length=a.max_length or cfg.seq_len,
        attn=a.attn,
        attn_p=a.attn_p,
        batch_size=a.batch_size,
        device=a.device,
        rope_scaling=a.rope_scaling,
        rope_factor=a.rope_factor,
        train_len=cfg.seq_len,
    )
    out = Path(a.out) if a.out else Path(a.run) / "lm_eval"
    # The local tasks are written afresh into a new private directory for this call alone: an
    # include path that already held files (RUN/lm_eval/tasks/ once) would let a planted YAML
    # import a planted Python file.
    with tempfile.TemporaryDirectory(prefix="lssar-lm-eval-tasks-") as fresh:
        tasks_dir = None
        if {*LOCAL_TASKS, "lssar_local"} & set(tasks):
            val = tok.decode(data.load_split(meta["data_dir"], "val").tolist())
            length = a.passkey_length or lm.max_length
            write_local_tasks(fresh, val, tok, a.n_docs, passkey_length=length)
            tasks_dir = fresh
        results = evaluate(lm, tasks, tasks_dir, a.limit, a.num_fewshot, a.bootstrap_iters)
    rope = lm.model.rope_scaling
    path = (
        out
        / f"results-{lm.model.attn_spec.slug()}{'' if rope is None else '-' + rope.slug('-')}.json"
    )
    atomic_write(path, json.dumps(results, indent=2, default=str) + "\n")
    from lm_eval.utils import make_table

    print(make_table(results))
    print(f"wrote {path}")
    return 0

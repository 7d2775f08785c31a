"""Pretrained HF models: loading, the hf:<dir> tokenizer, packing, fine-tuning with exact resume,
and the shared evaluation path, on a tiny random Llama made here (no download)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM  # noqa: E402

from lssar import data  # noqa: E402
from lssar.integrations import finetune as ft  # noqa: E402
from lssar.integrations.hf_lm import HFCausalLM  # noqa: E402
from lssar.integrations.pretrained import (  # noqa: E402
    load_model,
    resolve_source,
    save_model,
    set_attention,
)
from lssar.studies.lm.context import copy_probe, long_documents, loss_in_documents  # noqa: E402

TEXT = (Path(data.default_corpus_files()[0])).read_text("utf-8", errors="replace")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (GQA, head dim 16, 256 positions) with a BPE tokenizer of its own,
    saved as an ordinary HF directory."""
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tiny")
    tok_file = data.train_bpe([TEXT[:200_000]], 320, root / "bpe.json")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_file), eos_token=data.EOT_TEXT)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    return save_model(model, tok, root / "model", {"note": "tiny random llama"})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Six documents of real text, two of them long."""
    root = tmp_path_factory.mktemp("corpus")
    for i, (a, b) in enumerate([(0, 6000), (6000, 7000), (7000, 30000), (30000, 31000),
                                (31000, 60000), (60000, 61000)]):  # fmt: skip
        (root / f"doc{i}.txt").write_text(TEXT[a:b])
    return root


def _dataset(tiny_dir: Path, corpus: Path, tmp_path: Path) -> Path:
    return data.prepare(str(corpus), f"hf:{tiny_dir}", tmp_path / "ds", val_fraction=0.4,
                        progress=False)  # fmt: skip


def test_sources_are_resolved_offline_with_a_clear_error(tiny_dir, tmp_path):
    assert resolve_source(tiny_dir) == tiny_dir.resolve()
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        resolve_source("HuggingFaceTB/SmolLM2-135M")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_source(tmp_path / "empty")


def test_a_converted_directory_loads_back_with_its_attention(tiny_dir, tmp_path):
    model, info = load_model(tiny_dir, "lssar", 15.0)
    assert info["kind"] == "hf" and model.config._attn_implementation == "lssar"
    out = save_model(model, _tok(tiny_dir), tmp_path / "conv", {"attn": "lssar", "p": 15.0})
    again, _ = load_model(out)
    assert again.config._attn_implementation == "lssar" and again.config.lssar_p == 15.0
    x = torch.randint(0, 300, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=x).logits, model(input_ids=x).logits)


def _tok(d):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(d)


def test_unknown_variant_and_unswitchable_models_are_refused(tiny_dir):
    model, _ = load_model(tiny_dir)
    with pytest.raises(ValueError, match="unknown"):
        set_attention(model, "no-such-attention")

    class Plain(torch.nn.Module):
        config = model.config

    with pytest.raises(ValueError, match="does not dispatch attention"):
        set_attention(Plain(), "lssar")


def test_hf_tokenizer_datasets_keep_their_own_copy(tiny_dir, corpus, tmp_path):
    ds = _dataset(tiny_dir, corpus, tmp_path)
    m = data.read_manifest(ds)
    assert m["tokenizer"] == f"hf:{tiny_dir.resolve()}" and "tokenizer_sha256" in m
    tok = data.get_tokenizer(m["tokenizer"], corpus_dir=ds)
    assert tok.eot == _tok(tiny_dir).eos_token_id
    assert tok.decode(tok.encode("Hello world")) == "Hello world"
    with pytest.raises(ValueError, match="no tokenizer.json"):
        data.get_tokenizer(f"hf:{tmp_path}")


def test_packed_rows_do_not_attend_across_documents(tiny_dir):
    model, _ = load_model(tiny_dir, "lssar", 15.0)
    eot = _tok(tiny_dir).eos_token_id
    torch.manual_seed(1)
    docs = [torch.randint(1, 300, (n,)) for n in (9, 14, 6)]
    window = torch.cat([torch.cat([d, torch.tensor([eot])]) for d in docs])[None]  # (1, 32)
    batch = ft.packed_batch(window, eot, DataCollatorWithFlattening(return_tensors="pt"))
    assert batch["position_ids"].tolist()[0] == [*range(10), *range(15), *range(7)]
    with torch.no_grad():
        packed = model(**batch).logits[0]
        alone = [model(input_ids=torch.cat([d, torch.tensor([eot])])[None]).logits[0] for d in docs]
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=1e-5)


def _cfg(tiny_dir, corpus, tmp_path, **kw):
    base = dict(
        model=str(tiny_dir), attn="lssar", data=str(corpus), data_root=str(tmp_path / "data"),
        val_fraction=0.4, seq_len=32, batch_size=2, steps=6, warmup=2, lr=1e-3,
        ckpt_every=2, eval_every=3, eval_windows=2, out_dir=str(tmp_path / "runs"), threads=1,
        dtype="fp32",
    )  # fmt: skip
    return ft.FinetuneConfig(**(base | kw))


def _final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "model" / "model.safetensors")


def test_finetune_resumes_exactly(tiny_dir, corpus, tmp_path):
    whole = ft.finetune(_cfg(tiny_dir, corpus, tmp_path, run_name="whole"), progress=False)
    part = _cfg(tiny_dir, corpus, tmp_path, run_name="part")
    ft.finetune(part, progress=False, stop_after=3)
    assert not (tmp_path / "runs" / "part" / "DONE").exists()
    ft.finetune(part, progress=False)
    a, b = _final_state(whole), _final_state(tmp_path / "runs" / "part")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log = [json.loads(x) for x in (whole / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "val_loss" in r] == [0, 3, 6]  # the recovery curve
    trained = {k for k in a if not torch.equal(a[k], _final_state_of(tiny_dir)[k])}
    assert trained and all(any(s in k for s in ft._ATTENTION_PARTS) for k in trained)
    assert Path(json.loads((whole / "model" / "lssar.json").read_text())["dataset"]).is_dir()
    back, _ = load_model(whole / "model")
    assert back.config._attn_implementation == "lssar"


def _final_state_of(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(d / "model.safetensors")


def test_finetune_resumes_exactly_after_sigkill(tiny_dir, corpus, tmp_path):
    cfg = _cfg(tiny_dir, corpus, tmp_path, run_name="killed", steps=8, ckpt_every=1)
    code = (
        "import sys, json; from lssar.integrations import finetune as ft;"
        "ft.finetune(ft.FinetuneConfig(**json.loads(sys.argv[1])), progress=False)"
    )
    from dataclasses import asdict

    proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(asdict(cfg))],
                            cwd=Path(__file__).parents[2])  # fmt: skip
    log = tmp_path / "runs" / "killed" / "log.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if log.is_file() and sum(1 for _ in log.open()) >= 4:  # mid-run, checkpoints on disk
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    ft.finetune(cfg, progress=False)
    whole = ft.finetune(_cfg(tiny_dir, corpus, tmp_path, run_name="unkilled", steps=8,
                             ckpt_every=1), progress=False)  # fmt: skip
    a, b = _final_state(whole), _final_state(tmp_path / "runs" / "killed")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_finetune_refuses_bad_input(tiny_dir, corpus, tmp_path):
    with pytest.raises(ValueError, match="seq_len 512 is above the 256 positions"):
        ft.finetune(_cfg(tiny_dir, corpus, tmp_path, seq_len=512), progress=False)
    with pytest.raises(FileNotFoundError, match="not found"):
        ft.finetune(_cfg(tiny_dir, corpus, tmp_path, model="/no/such/model"), progress=False)
    with pytest.raises(ValueError, match="unknown"):
        ft.finetune(_cfg(tiny_dir, corpus, tmp_path, attn="nope"), progress=False)
    with pytest.raises(ValueError, match="--steps must be"):
        _cfg(tiny_dir, corpus, tmp_path, steps=0)
    with pytest.raises(ValueError, match="unknown recipe"):
        ft.load_recipe("no-such-recipe")


def test_evaluation_interface_matches_the_model(tiny_dir, corpus, tmp_path):
    model, _ = load_model(tiny_dir)
    lm = HFCausalLM(model)
    x = torch.randint(0, 300, (2, 50))
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(
            model(input_ids=x[:, :-1]).logits.transpose(1, 2), x[:, 1:], reduction="none"
        )
        _, loss = lm(x[:, :-1], x[:, 1:], reduction="none")
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
        weights: list = []
        _, windowed = lm(x[:, :-1], x[:, 1:], reduction="none", window=8, weights=weights)
        assert len(weights) == 2 and weights[0].shape == (2, 4, 49, 49)
        assert int((weights[0][0, 0, -1] > 0).sum()) == 8  # the last row sees its last 8 keys
        torch.testing.assert_close(windowed[:, :8], loss[:, :8], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(windowed[:, 20:], loss[:, 20:])
        # sink tokens: the first keys stay visible beside the window (each row: 8 + 2 keys)
        weights = []
        _, sunk = lm(x[:, :-1], x[:, 1:], reduction="none", window=8, sink_tokens=2,
                     weights=weights)  # fmt: skip
        row = weights[0][0, 0, -1] > 0
        assert int(row.sum()) == 10 and bool(row[:2].all()) and not bool(row[2:-8].any())
        torch.testing.assert_close(sunk[:, :10], loss[:, :10], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(sunk[:, 20:], windowed[:, 20:])
        # as many sinks as positions: every key visible again, the full-context loss
        _, every = lm(x[:, :-1], x[:, 1:], reduction="none", window=8, sink_tokens=49)
        torch.testing.assert_close(every, loss, atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="needs config.lssar_window"):
            lm(x[:, :-1], x[:, 1:], reduction="none", sink_tokens=2)


def test_documents_protocol_equals_separate_windows(tiny_dir, corpus, tmp_path):
    ds = _dataset(tiny_dir, corpus, tmp_path)
    val = data.load_split(ds, "val")
    docs = long_documents(val, data.read_manifest(ds)["eot"], 64, 2)
    lm = HFCausalLM(load_model(tiny_dir, "lssar")[0])
    r = loss_in_documents(lm, docs, [16, 64], progress=False)
    ids = [torch.as_tensor(d[None, :17].astype(np.int64)) for d in docs]
    with torch.no_grad():  # the first 16 positions of each 64-token window = a 16-token window
        sep = [float(lm(x[:, :-1], x[:, 1:])[1]) for x in ids]
    assert r["loss"]["16"] == pytest.approx(np.mean(sep), rel=1e-5)
    assert r["tokens_per_length"] == {"16": 32, "64": 128}
    with pytest.raises(ValueError, match="larger --val-fraction"):
        long_documents(val, data.read_manifest(ds)["eot"], 10**6, 2)


def test_copy_probe_sees_the_copy_only_within_its_window(tiny_dir, corpus, tmp_path):
    """A model that copies exactly (an induction oracle) scores the second copy near 0 when the
    first is visible, and as the first copy when the window hides it."""
    ds = _dataset(tiny_dir, corpus, tmp_path)
    val = np.asarray(data.load_split(ds, "val"))

    class Copier(torch.nn.Module):
        def forward(self, x, y, reduction="none", window=None):
            b, t = x.shape
            loss = torch.full((b, t), 5.0)
            for i in range(b):
                for j in range(t):
                    lo = 0 if window is None else max(0, j - window + 1)
                    prev = [k for k in range(lo, j) if x[i, k] == x[i, j]]
                    if any(x[i, k + 1] == y[i, j] for k in prev):  # an oracle of copying
                        loss[i, j] = 0.0
            return None, loss

    full = copy_probe(Copier(), val, [96], n=2, segment=16, progress=False)
    local = copy_probe(Copier(), val, [96], n=2, segment=16, window=32, progress=False)
    assert full["second"]["96"] < 1.0 < local["second"]["96"]


def test_lssar_eval_on_a_model_directory_is_cached(tiny_dir, corpus, tmp_path, capsys):
    from lssar.cli import main

    ds = _dataset(tiny_dir, corpus, tmp_path)
    argv = ["eval", str(tiny_dir), "--data", str(ds), "--lengths", "16,64", "--documents", "2",
            "--window", "16", "--copy", "64", "--copy-probes", "2", "--dtype", "fp32"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| 64 | 128 |" in out and "| copy distance |" in out
    cached = tiny_dir / "eval" / "window16_to64.json"
    first = json.loads(cached.read_text())
    assert main(argv) == 0  # reused: the same result, not recomputed
    assert json.loads(cached.read_text())["eval_env"] == first["eval_env"]


def test_the_quick_conversion_study_end_to_end(tmp_path):
    from lssar.studies.convert.study import run_study

    # seed 0 first, as two machines' shares (a subset of arms too: softmax's long evaluations
    # drop out with it); its units are carried in the report directory
    kw = dict(seeds=[0], runs=tmp_path / "runs", out=tmp_path / "report", progress=False)
    run_study("quick", arms=["original"], **kw)  # no fine-tuned arm: the data still prepared
    run_study("quick", arms=["lssar p=15"], **kw)
    first = run_study("quick", **kw)
    carried = json.loads((first / "units" / "lssar-p15-s0.json").read_text())["results"]
    assert (
        "**Part of the study**: arms softmax, lssar p=15, original of"
        in (first / "REPORT.md").read_text()
    )
    claims = json.loads((first / "results.json").read_text())["claims"]
    assert claims and all(c["note"] == "one seed: no test" for c in claims)
    # another machine (no runs) continues with the same report directory: seed 0 is reused
    import shutil

    shutil.rmtree(tmp_path / "runs")
    out = run_study("quick", runs=tmp_path / "runs", out=tmp_path / "report", progress=False)
    assert not list((tmp_path / "runs" / "convert-quick").glob("*-s0"))  # not trained again
    again = json.loads((out / "results.json").read_text())["results"]
    assert [r for r in again if r["arm"] == "lssar p=15" and r["config"]["seed"] == 0] == carried
    report = (out / "REPORT.md").read_text()
    results = json.loads((out / "results.json").read_text())
    labels = {(r["arm"], r["window"], r["rope_scaling"], r["long"]) for r in results["results"]}
    assert ("softmax", 32, None, False) in labels  # the sliding-window control
    assert ("lssar p=15", 32, None, False) in labels  # LSSAR with its own L-key window
    assert ("softmax", None, "yarn auto", True) in labels  # YaRN past the model's positions
    assert ("original", None, None, False) in labels
    assert {r["config"]["seed"] for r in results["results"] if r["arm"] == "lssar p=15"} == {0, 1}
    assert all(c["verdict"] for c in results["claims"]) and len(results["claims"]) >= 6
    sections = ("## Recovery", "## Loss by evaluation length", "## Past the model's own",
                "## Does the model use context beyond L?", "## The declared claims")  # fmt: skip
    assert all(s in report for s in sections) and "Part of the study" not in report
    assert (out / "recovery.png").stat().st_size > 0
    # the findings checker reads the report like an LM report
    from lssar.studies.findings import quantity

    iv = quantity(out, 'loss "lssar p=15" - "softmax" @4')
    assert iv.n == 2

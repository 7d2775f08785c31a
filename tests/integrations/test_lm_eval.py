"""Tests for lssar.integrations.lm_eval: LssarLM requests, local tasks, an offline harness run."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("lm_eval")
yaml = pytest.importorskip("yaml")

from lm_eval.api.instance import Instance  # noqa: E402

from lssar.data import ByteTokenizer  # noqa: E402
from lssar.integrations.lm_eval import LOCAL_TASKS, LssarLM, write_local_tasks  # noqa: E402
from lssar.model import GPT, GPTConfig  # noqa: E402
from lssar.spec import AttentionSpec  # noqa: E402
from tests.integrations.test_hf_export import make_tiny_run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = " ".join(
    f"Line {i}: the king speaks and the queen hears the night, fair is foul." for i in range(300)
)


def tiny_lm(max_length: int = 64, batch_size: int = 3) -> LssarLM:
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, attn="lssar")).eval()
    return LssarLM(
        model=gpt, tokenizer=ByteTokenizer(), max_length=max_length, batch_size=batch_size
    )


def req(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=tuple(args), idx=0)


def logprobs(lm: LssarLM, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, from one forward."""
    logits, _ = lm.model(torch.tensor([ids[:-1]]))
    return F.log_softmax(logits[0].float(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_loglikelihood_matches_a_forward():
    lm = tiny_lm()
    pairs = [("The king ", "speaks"), ("", "Hello"), ("a" * 100, " bb"), ("x", "")]
    out = lm.loglikelihood([req("loglikelihood", c, x) for c, x in pairs])
    # Trailing spaces of the context move to the continuation (HFLM's rule).
    lp = logprobs(lm, list(b"The king speaks"))[-7:].sum().item()
    assert out[0][0] == pytest.approx(lp, abs=1e-4)
    lp = logprobs(lm, [10, 10, *b"Hello"])[-5:].sum().item()  # empty context: blank line
    assert out[1][0] == pytest.approx(lp, abs=1e-4)
    ids = list(("a" * 100 + " bb").encode())[-65:]  # left-truncated to max_length + 1
    assert out[2][0] == pytest.approx(logprobs(lm, ids)[-3:].sum().item(), abs=1e-4)
    assert out[3] == (0.0, True)
    (long,) = lm.loglikelihood([req("loglikelihood", "ab", "c" * 80)])  # > max_length tokens
    assert long[0] == pytest.approx(
        logprobs(lm, list(b"ab" + b"c" * 80)[-65:]).sum().item(), abs=1e-4
    )
    assert all(isinstance(g, bool) for _, g in out)


def test_loglikelihood_rolling_covers_every_token_once():
    lm = tiny_lm(max_length=512)
    text = "fair is foul and foul is fair"
    (total,) = lm.loglikelihood_rolling([req("loglikelihood_rolling", text)])
    expected = logprobs(lm, [10, *text.encode()]).sum().item()  # prefix token: "\n"
    assert total == pytest.approx(expected, abs=1e-4)
    short = tiny_lm(max_length=8)
    (windowed,) = short.loglikelihood_rolling([req("loglikelihood_rolling", text)])
    assert windowed < 0 and windowed != pytest.approx(total, abs=1e-3)


def test_generate_until_is_greedy_and_stops():
    lm = tiny_lm()
    ctx = "The king "
    greedy = lm.model.generate(torch.tensor([list(ctx.encode())]), 12, temperature=0)
    full = ByteTokenizer().decode(greedy[0, len(ctx) :].tolist())
    (out,) = lm.generate_until(
        [req("generate_until", ctx, {"until": ["\x00"], "max_gen_toks": 12})]
    )
    assert out == full.split("\x00")[0]
    stop = full[3]
    (cut,) = lm.generate_until([req("generate_until", ctx, {"until": [stop], "max_gen_toks": 12})])
    assert cut == full.split(stop)[0]
    with pytest.raises(ValueError, match="greedily"):
        lm.generate_until([req("generate_until", ctx, {"do_sample": True})])


def test_write_local_tasks(tmp_path):
    names = write_local_tasks(tmp_path, TEXT, n_docs=5, doc_chars=300, passkey_length=200)
    assert tuple(names) == LOCAL_TASKS
    for name in names:
        cfg = yaml.safe_load((tmp_path / f"{name}.yaml").read_text())
        assert cfg["task"] == name and Path(cfg["dataset_kwargs"]["data_files"]["test"]).is_file()
    docs = [json.loads(line) for line in (tmp_path / "passkey.jsonl").read_text().splitlines()]
    assert len(docs) == 5
    for d in docs:
        assert f"pass key is {d['key']}." in d["context"]
        assert d["choices"][d["label"]] == f" {d['key']}" and len(set(d["choices"])) == 4
        assert d["context"].endswith("The pass key is")
        assert abs(len(d["context"].encode()) + 6 - 200) <= 1
    again = tmp_path / "again"
    write_local_tasks(again, TEXT, n_docs=5, doc_chars=300, passkey_length=200)
    assert (again / "passkey.jsonl").read_text() == (tmp_path / "passkey.jsonl").read_text()
    with pytest.raises(ValueError, match="does not fit the probe"):
        write_local_tasks(tmp_path, TEXT, passkey_length=10)


def test_passkey_docs_are_the_evaluate_probes(tmp_path):
    # one builder: with the lm-eval doc's filler and key position, evaluate's probe (its answer
    # included) is byte for byte the doc's context followed by the right choice
    import numpy as np

    from lssar.data.passkey import KEY_TEMPLATE, passkey_sample

    write_local_tasks(tmp_path, TEXT, n_docs=4, doc_chars=300, passkey_length=200)
    tok = ByteTokenizer()
    for line in (tmp_path / "passkey.jsonl").read_text().splitlines():
        d = json.loads(line)
        statement = KEY_TEMPLATE.format(key=d["key"])
        before, after = (
            d["context"].removesuffix(" What is the pass key? The pass key is").split(statement)
        )
        fill = (before + after).encode()
        filler = np.frombuffer(fill + b"!", dtype=np.uint8)  # one spare token: start 0 only
        depth = len(before.encode()) / len(fill)
        ids, _ = passkey_sample(tok, filler, 200, depth, d["key"], np.random.default_rng(0))
        assert ids == tok.encode(d["context"] + d["choices"][d["label"]])


def test_lm_eval_cli_offline_on_a_run(tmp_path):
    """The harness end to end, offline: a tiny run, the three local tasks, 3 documents each."""
    from lssar.cli import main

    run = make_tiny_run(tmp_path)
    out = tmp_path / "eval"
    argv = ["lm-eval", str(run), "--tasks", ",".join(LOCAL_TASKS), "--limit", "3"]
    argv += ["--attn-p", "15", "--attn", "lssar", "--out", str(out), "--bootstrap-iters", "0"]
    argv += ["--n-docs", "4", "--max-length", "128"]  # the run trained at 32: too short a probe
    assert main(argv) == 0
    results = json.loads((out / "results-lssar-p15.json").read_text())["results"]
    ppl = results["lssar_heldout_ppl"]
    assert {"word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"} <= set(ppl)
    assert 1.0 < ppl["byte_perplexity,none"] < 256.0
    assert 0.0 <= results["lssar_passkey"]["acc,none"] <= 1.0
    assert 0.0 <= results["lssar_passkey_gen"]["exact_match,key"] <= 1.0
    assert main(["lm-eval", str(run), "--tasks", " , "]) == 2
    lm = LssarLM.create_from_arg_string(f"run={run},attn=lssar,attn_p=3,batch_size=2")
    assert lm.model.attn_spec == AttentionSpec("lssar", {"p": 3.0}) and lm.max_length == 32
    assert main(["lm-eval", str(run), "--tasks", "lssar_nope", "--out", str(out)]) == 2
    assert main(["lm-eval", str(run), "--tasks", "lssar_passkey", "--limit", "0"]) == 2


def test_planted_task_files_in_the_run_dir_are_never_imported(tmp_path):
    """RUN/lm_eval/tasks/ was once the include path as found: a planted YAML there, in the
    tag the user asks for, imported a planted Python file."""
    from lssar.cli import main

    run = make_tiny_run(tmp_path)
    planted = run / "lm_eval" / "tasks"
    planted.mkdir(parents=True)
    marker = tmp_path / "code-ran"
    (planted / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').close()\ndef doc_to_text(doc):\n    return ''\n"
    )
    (planted / "evil.yaml").write_text(
        "task: lssar_zz_planted\ntag: [lssar_local]\ndataset_path: json\n"
        f"dataset_kwargs: {{data_files: {{test: {planted / 'x.jsonl'}}}}}\ntest_split: test\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: !function evil.doc_to_text\n"
        "doc_to_target: text\n"
    )
    (planted / "x.jsonl").write_text('{"text": "hello"}\n')
    argv = ["lm-eval", str(run), "--tasks", "lssar_local", "--limit", "1", "--n-docs", "2"]
    argv += ["--bootstrap-iters", "0", "--max-length", "128"]
    assert main(argv) == 0
    assert not marker.exists()
    results = json.loads((run / "lm_eval" / "results-lssa.json").read_text())["results"]
    assert "lssar_zz_planted" not in results and "lssar_passkey" in results

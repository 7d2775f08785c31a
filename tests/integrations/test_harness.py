"""``python -m lssar.harness``: lm-eval's own command line (``--model hf``) on a tiny local Llama,
offline, with lssar's attention chosen by ``attn_implementation``."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

from lssar import harness  # noqa: E402
from lssar.integrations.hf_gpt import hf_tokenizer  # noqa: E402
from lssar.integrations.lm_eval import write_local_tasks  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = " ".join(f"Line {i}: the king speaks and the queen hears, fair is foul." for i in range(60))


def _tiny_llama(out: Path) -> Path:
    """A randomly initialised 2-layer Llama with a byte-level tokenizer, saved as a model
    directory (what ``pretrained=`` names)."""
    tok = hf_tokenizer("byte")
    tok.add_special_tokens({"eos_token": "<|endoftext|>"})
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _run(model_dir: Path, tasks_dir: Path, out: Path, attn: str) -> dict:
    """The harness on the local held-out perplexity task; its results.json."""
    argv = [
        "--model",
        "hf",
        "--model_args",
        f"pretrained={model_dir},attn_implementation={attn},dtype=float32",
        "--tasks",
        "lssar_heldout_ppl",
        "--include_path",
        str(tasks_dir),
        "--device",
        "cpu",
        "--batch_size",
        "2",
        "--limit",
        "3",
        "--output_path",
        str(out),
    ]
    assert harness.main(argv) == 0
    (found,) = out.rglob("results*.json")
    return json.loads(found.read_text())


def test_harness_runs_lm_eval_with_lssar_attention(tmp_path):
    model = _tiny_llama(tmp_path / "llama")
    tasks = tmp_path / "tasks"
    write_local_tasks(tasks, TEXT, n_docs=3, doc_chars=300)

    def ppl(attn: str) -> float:
        res = _run(model, tasks, tmp_path / f"out-{attn}", attn)
        assert res["config"]["model_args"]["attn_implementation"] == attn
        return res["results"]["lssar_heldout_ppl"]["word_perplexity,none"]

    eager, softmax, lssar = ppl("eager"), ppl("softmax"), ppl("lssar")
    # lssar's softmax is the model's own attention; LSSAR (p = 15) is another rule
    assert softmax == pytest.approx(eager, rel=1e-4)
    assert abs(lssar - eager) > 1e-3 * eager

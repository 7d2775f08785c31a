"""Decode benchmark: one KV-cache step per attention, and ``generate()`` tokens/s, beside SDPA.

Table 1 (per-token latency): ``T_q`` new queries (1, and 8 as for speculative or batched
decoding) against a cache of ``T_k`` keys (1K, 2K, 4K, ... up to ``--max-cache``), causal
(bottom-right aligned), B=1 H=8 D=64. For each attention x implementation the median time of
one step (ms), its ratio to SDPA softmax measured in the same run (the cases are interleaved
round by round, so a slow spell of a shared machine hits them alike) and the peak extra memory
of one step. Without a gradient to record, ``cpu`` runs a step on the fused kernel's decode
entry (the cache read in place, bf16 / fp16 converted in registers; the keys normalised as they
are read, or, in the "cached key norms" rows, read from ``key_norms`` as a KV cache keeps them).
Beside each step, the time to read its K and V once (``read K and V once``, a sum over their
bytes: the memory-bandwidth floor of a step) and each case's ``floor / time``, the fraction of
that limit it reaches. ``--clock cpu`` times with process CPU time (see benchmarks/attention.py).

Table 2 (``generate()``): the project's GPT (a preset's shape, random init) with softmax, lssa
and lssar p=15, and an HF Llama (a ``LlamaConfig`` of the same shape, random init, no download)
with its eager and SDPA attention and with lssa / lssar through :mod:`lssar.integrations.hf`.
Greedy decoding of ``--new-tokens`` after a random prompt; a forward hook timestamps each of
``generate()``'s model calls, so prefill (the prompt's forward, the first token) and decode (the
rest, per token, sampling included) come from the same call.

    python benchmarks/decode.py                         # T_k = 1K..64K, T_q = 1 and 8, fp32
    python benchmarks/decode.py --quick                 # tiny (tests/test_benchmarks.py)
    python benchmarks/decode.py --max-cache 16384 --threads 1
    python benchmarks/decode.py --tables step --tq 1 --lengths 4096 65536 --threads 1 --clock cpu
    python benchmarks/decode.py --tables step --tq 1 --impls sdpa cpu --padding
    python benchmarks/decode.py --tables generate --prompts 1024 4096

``--padding`` gives every step a key-padding mask ``[B, 1, 1, T_k]`` (the first T_k / 8 keys
masked). FlexAttention compiles once per shape (tens of seconds on CPU, excluded from the
times: the first call of each case is a warm-up); ``--quick`` leaves it out. On a machine with
CUDA the cases run on the GPU with the Triton kernels and FlexAttention in place of the CPU
implementations; without one the GPU rows are listed as waiting for a device.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import attention as base  # benchmarks/ is on sys.path when run as a script
import torch
from attention import CLOCKS, machine, peak_mib, set_clock

import lssar
from lssar.model import GPT
from lssar.ops import registry
from lssar.train.config import load_config, model_config

# (label, variant, impl); the first is the baseline of the ratios
CPU_CASES = [
    ("softmax (SDPA)", "softmax", "sdpa"),
    ("softmax-qknorm-logn (SDPA)", "softmax-qknorm-logn", "sdpa"),
    ("lssa cpu (fused C++)", "lssa", "cpu"),
    ("lssar p=15 cpu (fused C++)", "lssar", "cpu"),
    ("lssa cpu, cached key norms", "lssa", "cpu+norms"),
    ("lssar p=15 cpu, cached key norms", "lssar", "cpu+norms"),
    ("lssa chunked", "lssa", "chunked"),
    ("lssar p=15 chunked", "lssar", "chunked"),
    ("lssa reference", "lssa", "reference"),
    ("lssar p=15 reference", "lssar", "reference"),
    ("lssa flex (compiled)", "lssa", "flex"),
    ("lssar p=15 flex (compiled)", "lssar", "flex"),
    ("lssar p=15 auto", "lssar", "auto"),
]
GPU_CASES = [
    ("softmax (SDPA)", "softmax", "sdpa"),
    ("softmax-qknorm-logn (SDPA)", "softmax-qknorm-logn", "sdpa"),
    ("lssa triton", "lssa", "triton"),
    ("lssar p=15 triton", "lssar", "triton"),
    ("lssa flex", "lssa", "flex"),
    ("lssar p=15 flex", "lssar", "flex"),
    ("lssar p=15 auto", "lssar", "auto"),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# generate(): (label, attn, impl) for the GPT; (label, attn_implementation) for the HF Llama
GPT_ARMS = [
    ("softmax", "softmax", "auto"),
    ("lssa", "lssa", "auto"),
    ("lssar p=15", "lssar", "auto"),
    ("lssar p=15 (cpu)", "lssar", "cpu"),
]
HF_ARMS = [("eager", "eager"), ("sdpa", "sdpa"), ("lssa", "lssa"), ("lssar p=15", "lssar")]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str) -> float:
    """Seconds of one call of ``fn`` (GPU work included)."""
    _sync(device)
    t0 = base.clock()
    fn()
    _sync(device)
    return base.clock() - t0


def peak(fn: Callable[[], object], device: str) -> float:
    """Peak extra memory (MiB) of one call: resident growth on CPU, allocated on CUDA."""
    if device != "cuda":
        return peak_mib(fn)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


FLOOR = "read K and V once (floor)"


def read_once(k: torch.Tensor, v: torch.Tensor) -> Callable[[], object]:
    """A sum over the bytes of K and V (as float32 words: one vectorised read each, whatever
    their dtype): the memory-bandwidth floor of a step that reads its cache once."""
    words = [t.view(torch.float32) if t.element_size() < 4 else t for t in (k, v)]
    return lambda: [w.sum() for w in words]


def runs_on(variant: str, impl: str, q: torch.Tensor, k: torch.Tensor) -> str:
    """The implementation that really runs the case (auto's pick; the cpu kernel or its
    eager fallback)."""
    name = registry.resolve(variant, impl.partition("+")[0], q, k, 0.0, {}).impl
    if name == "cpu" and q.dtype != torch.float64:
        from lssar.ops.cpu.build import kernel

        if kernel() is None:
            return "chunked (no C++ kernel here)"
        from lssar.ops import decode_applies

        with torch.no_grad():
            if decode_applies(q, k, k):
                return "cpu decode entry"
    return name


def step_fn(variant: str, impl: str, q, k, v, mask) -> Callable[[], torch.Tensor]:
    """One decode step of a case on shared inputs (no autograd); ``+norms``: with the keys'
    inverse norms computed beforehand, as a KV cache keeps them."""
    impl, _, extra = impl.partition("+")
    kw = {}
    if extra == "norms":
        from lssar.ops import key_inverse_norms

        kw["key_norms"] = key_inverse_norms(k)

    def call():
        return lssar.attention(q, k, v, mask, is_causal=True, variant=variant, impl=impl, **kw)

    return call


def run_steps(cases, t_q: int, t_k: int, dtype: torch.dtype, args) -> dict[str, dict]:
    """Every case at one (T_q, T_k): two warm-up calls each (compiles), then ``repeats`` rounds
    in which every case runs once, in a shuffled order; the median per case and the peak memory
    of one more call."""
    g = torch.Generator().manual_seed(0)
    b, h, d = args.batch, args.heads, args.head_dim
    q = torch.randn(b, h, t_q, d, generator=g).to(args.device, dtype)
    k, v = (torch.randn(b, h, t_k, d, generator=g).to(args.device, dtype) for _ in range(2))
    mask = None
    if args.padding:
        mask = torch.ones(b, 1, 1, t_k, dtype=torch.bool, device=args.device)
        mask[..., : t_k // 8] = False
    fns = {label: step_fn(variant, impl, q, k, v, mask) for label, variant, impl in cases}
    runs = {label: runs_on(variant, impl, q, k) for label, variant, impl in cases}
    fns[FLOOR], runs[FLOOR] = read_once(k, v), "memory"
    times: dict[str, list[float]] = {label: [] for label in fns}
    with torch.no_grad():
        for fn in fns.values():
            fn()
            fn()
        order = list(fns)
        for r in range(args.repeats):
            # a new order each round: a case that follows a memory-hungry one finds the heap
            # returned to the OS and pays its page faults again (on a VM, more than its work)
            random.Random(r).shuffle(order)
            for label in order:
                times[label].append(timed(fns[label], args.device))
        return {
            label: {
                "ms": 1e3 * statistics.median(times[label]),
                "mib": peak(fn, args.device),
                "runs": runs[label],
            }
            for label, fn in fns.items()
        }


def fraction(x: float) -> str:
    """``x`` with two decimals, or two significant digits below 0.1 (a slow case's share of
    the floor is small, not zero)."""
    return f"{x:.2f}" if x >= 0.1 else f"{x:.2g}"


def step_table(args) -> list[str]:
    cases = GPU_CASES if args.device == "cuda" else CPU_CASES
    if args.impls:
        cases = cases[:1] + [c for c in cases[1:] if c[2].partition("+")[0] in args.impls]
    available = set(registry.IMPLS) | {"auto"}
    cases = [c for c in cases if c[2].partition("+")[0] in available]
    if args.quick:
        cases = [c for c in cases if c[2] != "flex"]
    rows = [
        "| dtype | T_q | T_k | attention | runs | ms / step | x SDPA | MiB | floor / time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n" + "\n".join(rows), flush=True)
    for dname in args.dtypes:
        for t_q in args.tq:
            for t_k in args.lengths:
                results = run_steps(cases, t_q, t_k, DTYPES[dname], args)
                sdpa, floor = results[cases[0][0]]["ms"], results[FLOOR]["ms"]
                for label, r in results.items():
                    rows.append(
                        f"| {dname} | {t_q} | {t_k} | {label} | {r['runs']} | {r['ms']:.3f} | "
                        f"{r['ms'] / sdpa:.2f} | {r['mib']:.0f} | {fraction(floor / r['ms'])} |"
                    )
                    print(rows[-1], flush=True)
    return rows


def _gpt(preset: str, attn: str, impl: str, device: str) -> GPT:
    cfg = load_config(preset, {"attn": attn, "attn_impl": impl})
    torch.manual_seed(0)
    return GPT(model_config(cfg, 256)).to(device).eval()


def _llama(preset: str, attn: str, max_len: int, device: str, kv_heads: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = load_config(preset)
    llama = LlamaConfig(
        vocab_size=256,
        hidden_size=cfg.n_embd,
        intermediate_size=4 * cfg.n_embd,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_len,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(llama, attn_implementation=attn).to(device).eval()


def _stamped(model) -> list[float]:
    """Timestamps of ``model``'s forward calls (a pre-hook): ``generate()`` calls it once for
    the prompt, then once per further token."""
    stamps: list[float] = []
    model.register_forward_pre_hook(lambda *_: stamps.append(time.perf_counter()))
    return stamps


def _gpt_gen(model: GPT, ids: torch.Tensor, n: int) -> Callable[[], object]:
    return lambda: model.generate(ids, n, temperature=0.0)


def _hf_gen(model, ids: torch.Tensor, n: int) -> Callable[[], object]:
    return lambda: model.generate(
        ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
    )


def timed_generate(gen: Callable[[], object], stamps: list[float], device: str):
    """``(prefill s, decode s per token)`` of one ``generate()`` call: prefill = from the call to
    its second forward (the prompt's forward and the first token); decode = the rest, per
    forward after the first (each samples one token)."""
    stamps.clear()
    _sync(device)
    t0 = time.perf_counter()
    gen()
    _sync(device)
    end = time.perf_counter()
    if len(stamps) < 2:
        raise ValueError("generate() made fewer than 2 forward calls: ask for >= 2 new tokens")
    return stamps[1] - t0, (end - stamps[1]) / (len(stamps) - 1)


def generate_table(args) -> list[str]:
    """Prefill time and decode time per token of greedy ``generate()``, GPT and HF Llama arms,
    interleaved round by round (in a shuffled order)."""
    arms = {}  # (model, attention) -> (the model, its generate() maker, its forward stamps)
    for label, attn, impl in GPT_ARMS:
        if impl == "auto" or impl in registry.IMPLS:
            model = _gpt(args.preset, attn, impl, args.device)
            arms["GPT", label] = (model, _gpt_gen, _stamped(model))
    note = ""
    try:
        import transformers

        from lssar.integrations import hf

        hf.register(["lssa", "lssar"])
        transformers.logging.set_verbosity_error()
    except (ImportError, ValueError) as e:
        note = f"\nHF Llama rows skipped: {e}"
    if not note:
        longest = max(args.prompts) + args.new_tokens + 1
        for label, attn in HF_ARMS:
            model = _llama(args.preset, attn, longest, args.device, args.kv_heads)
            arms["HF Llama", label] = (model, _hf_gen, _stamped(model))
    rows = [
        "| model | attention | prompt | prefill ms | decode ms / token | decode tokens/s | "
        "x softmax (sdpa) |",
        "|---|---|---|---|---|---|---|",
    ]
    print(note + "\n" + "\n".join(rows), flush=True)
    for prompt in args.prompts:
        ids = torch.randint(1, 256, (1, prompt), generator=torch.Generator().manual_seed(1))
        ids = ids.to(args.device)
        gens = {arm: make(model, ids, args.new_tokens) for arm, (model, make, _) in arms.items()}
        pre: dict[tuple, list[float]] = {arm: [] for arm in gens}
        dec: dict[tuple, list[float]] = {arm: [] for arm in gens}
        order = list(gens)
        with torch.no_grad():
            for gen in gens.values():
                gen()
            for r in range(args.gen_repeats):
                random.Random(r).shuffle(order)
                for arm in order:
                    p, d = timed_generate(gens[arm], arms[arm][2], args.device)
                    pre[arm].append(p)
                    dec[arm].append(d)
        token_s = {arm: statistics.median(dec[arm]) for arm in gens}
        for (model, label), tok in token_s.items():
            base = token_s[("GPT", GPT_ARMS[0][0]) if model == "GPT" else ("HF Llama", "sdpa")]
            rows.append(
                f"| {model} | {label} | {prompt} | {statistics.median(pre[model, label]) * 1e3:.1f}"
                f" | {tok * 1e3:.2f} | {1 / tok:.1f} | {tok / base:.2f} |"
            )
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny run (no flex): for the tests")
    ap.add_argument(
        "--tables", nargs="+", default=["step", "generate"], choices=["step", "generate"]
    )
    ap.add_argument("--max-cache", type=int, default=65536, help="largest T_k of table 1")
    ap.add_argument("--lengths", type=int, nargs="+", help="T_k values (default 1K, 2K, .. max)")
    ap.add_argument("--tq", type=int, nargs="+", default=[1, 8], help="new queries per step")
    ap.add_argument("--dtypes", nargs="+", default=["fp32"], choices=list(DTYPES))
    ap.add_argument("--impls", nargs="+", help="only these impls (SDPA, the baseline, always runs)")
    ap.add_argument("--padding", action="store_true", help="a key-padding mask on every step")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--preset", default="small-cpu", help="generate(): the models' shape")
    ap.add_argument("--kv-heads", type=int, default=2, help="generate(): the Llama's KV heads")
    ap.add_argument("--prompts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--gen-repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    ap.add_argument(
        "--clock", choices=list(CLOCKS), default="wall", help="wall time or process CPU time"
    )
    ap.add_argument("--out", type=Path, help="also write the tables to this Markdown file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    set_clock(args.clock)
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        args.lengths, args.tq, args.repeats = [256], [1, 8], 1
        args.preset, args.kv_heads, args.prompts = "tiny-cpu", 2, [16]
        args.new_tokens, args.gen_repeats = 4, 1
    if args.lengths is None:
        args.lengths = [
            1024 << i for i in range(int(math.log2(max(args.max_cache, 1024) // 1024)) + 1)
        ]
    # FlexAttention compiles per shape; past dynamo's recompile limit it would silently run eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    warnings.filterwarnings("ignore", message=".*recompile.*")

    gpu = (
        "GPU rows: run on this device (triton, flex)."
        if args.device == "cuda"
        else "GPU rows (triton, flex on CUDA) wait for a device: torch.cuda.is_available() is "
        "False here."
    )
    header = (
        f"Decode: B={args.batch} H={args.heads} D={args.head_dim}, causal (bottom-right), "
        f"{'key-padding mask (first T_k/8 keys masked), ' if args.padding else ''}"
        f"no autograd, device {args.device}. ms / step = median of {args.repeats} rounds, every "
        "case once per round in a shuffled order; x SDPA = time / SDPA softmax time in the same "
        "run; MiB = peak extra memory of one step; runs = the implementation that ran; floor / "
        "time = the time to read the step's K and V once over the case's time. "
        "generate(): greedy, "
        f"{args.new_tokens} new tokens, preset {args.preset} (random init; the Llama of the same "
        f"shape with {args.kv_heads} KV heads), median of {args.gen_repeats} rounds; "
        "prefill = the prompt's forward and first token, decode = the rest of the generate() "
        "call per token (forward hooks). " + gpu + "\n\nMachine: " + machine()
    )
    print(header, flush=True)
    tables = []
    if "step" in args.tables:
        tables.append("\n".join(step_table(args)))
    if "generate" in args.tables:
        tables.append("\n".join(generate_table(args)))
    text = header + "\n\n" + "\n\n".join(tables) + "\n"
    if args.out:
        args.out.write_text(text)
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

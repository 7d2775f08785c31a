"""Training: one loop for a single process, ``torchrun`` DDP and FSDP, with exact resume.

A run is the directory ``out_dir/run_name`` (its files and checkpoints:
:mod:`lssar.train.checkpoint`). The data order is a pure function of ``(seed, step, micro_step,
rank)`` (:func:`lssar.data.get_batch`) and the LR a function of the step, so resuming from a
checkpoint replays exactly the steps an uninterrupted run takes: no RNG state is saved.
``batch_size`` is per rank; a step sees
``world_size * batch_size * grad_accum`` windows. ``--fsdp`` shards the model, gradients and
optimizer state over the ranks and writes sharded checkpoints (:mod:`lssar.train.fsdp`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from lssar import clihelp, data
from lssar.model import GPT
from lssar.runio import (
    LOCK_FILE,
    DiskFullError,
    LockedError,
    RunFailure,
    child_path,
    cpu_has_native_bf16,
    environment,
    exclusive_lock,
)
from lssar.train import fsdp
from lssar.train.checkpoint import (
    DONE,
    FINAL,
    LATEST,
    append_log,
    finish_run,
    init_run_dir,
    load_checkpoint,
    remove_stale_files,
    save_checkpoint,
    write_json,
)
from lssar.train.config import (
    KEY_HELP,
    TrainConfig,
    default_run_name,
    key_choices,
    list_presets,
    load_config,
    model_config,
    parse_overrides,
    validate,
)
from lssar.train.runs import check_same_config, load_model_state, load_run, stored_train_config
from lssar.train.schedule import warmup_cosine


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from ``lr`` to ``min_lr`` at the end
    (:func:`lssar.train.schedule.warmup_cosine`)."""
    return warmup_cosine(
        step, total=cfg.max_steps, peak=cfg.lr, warmup=cfg.warmup_steps, floor=cfg.min_lr
    )


# ----------------------------------------------------------------------------------- training


class _Dist(NamedTuple):
    rank: int
    world: int
    device: torch.device


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _setup_distributed(device_opt: str, sharded: bool) -> tuple[_Dist, bool]:
    """Rank, world size and device from torchrun's env; True if this call made the group
    (``sharded``: FSDP needs one even in a single process)."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    name = ("cuda" if torch.cuda.is_available() else "cpu") if device_opt == "auto" else device_opt
    device = torch.device(name)
    if device.type == "cuda":
        if world > 1 and device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # for the fp32 matmuls outside autocast
    created = (world > 1 or sharded) and not dist.is_initialized()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if created and world > 1:
        dist.init_process_group(backend)
    elif created:  # one process: a group of one, in memory
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return _Dist(rank, world, device), created


def _use_bf16(dtype: str, device: torch.device) -> bool:
    """Whether to train under bf16 autocast: ``"auto"`` picks it where it is fast (CUDA with
    bf16, a CPU with native bf16), ``"bf16"`` insists (emulated on other CPUs), ``"fp32"`` never.
    """
    ok = device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_bf16_supported())
    if dtype == "bf16" and not ok:
        raise ValueError(f"bf16 autocast is not supported on {device}: use --dtype=fp32")
    if dtype == "auto" and device.type == "cpu":
        ok = cpu_has_native_bf16()
    return dtype != "fp32" and ok


def _resolve_data(cfg: TrainConfig, master: bool, progress: bool) -> tuple[Path, dict]:
    """The dataset dir (prepared by rank 0 if ``data_dir`` is None) and its checked manifest.

    Rank 0 verifies the shards' checksums first (remembered beside the manifest), so the other
    ranks do not hash the same files again.
    """
    if cfg.data_dir is not None:
        path = Path(cfg.data_dir)
        if master:
            data.read_manifest(path, verify=True)
        _barrier()
    else:  # rank 0 prepares; the others then find the complete dataset and reuse it
        if master:
            path = data.prepare(cfg.corpus, cfg.tokenizer, progress=progress)
            data.read_manifest(path, verify=True)
        _barrier()
        if not master:
            path = data.prepare(cfg.corpus, cfg.tokenizer, progress=False)
    m = data.read_manifest(path)
    if m["tokenizer"] != cfg.tokenizer:
        raise ValueError(
            f"dataset {path} is tokenized with {m['tokenizer']!r}, the config asks for "
            f"{cfg.tokenizer!r}: set --tokenizer={m['tokenizer']} or another --data_dir"
        )
    for split in ("val", "train"):
        if (n := m["splits"][split]["tokens"]) < cfg.seq_len + 1:
            raise ValueError(
                f"the {split} split of {path} has {n} tokens, seq_len={cfg.seq_len} needs "
                f"{cfg.seq_len + 1}: use a shorter --seq_len or a larger corpus"
            )
    return path.resolve(), m


def _doc_eot(cfg: TrainConfig, manifest: dict[str, Any]) -> int | None:
    """The EOT id that cuts batches into documents (``doc_mask``), or None without it."""
    if not cfg.doc_mask:
        return None
    if manifest.get("eot") is None:
        raise ValueError(
            f"doc_mask needs the dataset's EOT token; its manifest names none (tokenizer "
            f"{manifest['tokenizer']!r}): prepare it again with gpt2 or bpe-<N>"
        )
    return int(manifest["eot"])


def _documents(x: torch.Tensor, eot: int | None) -> dict[str, torch.Tensor]:
    """The model's keyword arguments for ``x``'s documents: none without ``doc_mask``, so the
    default call is exactly ``model(x, y)``."""
    return {} if eot is None else {"cu_seqlens": data.eot_documents(x, eot)}


@torch.no_grad()
def _evaluate(
    model: GPT, tokens: np.ndarray, cfg: TrainConfig, bf16: bool, d: _Dist, eot: int | None
) -> float:
    """Mean loss over the first ``eval_tokens`` of the val split; ranks share the windows.

    Every rank runs the same number of forward passes (FSDP's are collective): a rank left
    without a window in the last round runs one again and does not count it."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=d.device)  # (loss sum, tokens)
    windows = list(data.iter_eval_windows(tokens, cfg.seq_len, cfg.eval_tokens, cfg.batch_size))
    for i in range(d.rank, -(-len(windows) // d.world) * d.world, d.world):
        x, y = windows[min(i, len(windows) - 1)]
        x = x.to(d.device)
        with torch.autocast(d.device.type, dtype=torch.bfloat16, enabled=bf16):
            _, loss = model(x, y.to(d.device), **_documents(x, eot))
        if i < len(windows):
            total += torch.stack([loss.double() * y.numel(), total.new_tensor(y.numel())])
    if d.world > 1:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def _train_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    cfg: TrainConfig,
    tokens: np.ndarray,
    step: int,
    bf16: bool,
    d: _Dist,
    eot: int | None = None,
) -> torch.Tensor:
    """One optimizer step (all micro-steps); returns this rank's mean loss, on the device.
    ``eot``: attend within the documents it separates (``doc_mask``)."""
    if cfg.dropout > 0:  # dropout masks become a function of the step too: exact resume
        torch.manual_seed(
            int(np.random.SeedSequence([cfg.seed, step, d.rank]).generate_state(1)[0])
        )
    for group in opt.param_groups:
        group["lr"] = lr_at(step, cfg)
    loss_sum = torch.zeros((), device=d.device)
    for micro in range(cfg.grad_accum):
        x, y = data.get_batch(
            tokens, step, micro, cfg.batch_size, cfg.seq_len, cfg.seed, d.rank, d.world
        )
        last = micro == cfg.grad_accum - 1
        x, y = x.to(d.device, non_blocking=True), y.to(d.device, non_blocking=True)
        with _sync_grads(model, last, d):
            with torch.autocast(d.device.type, dtype=torch.bfloat16, enabled=bf16):
                _, loss = model(x, y, **_documents(x, eot))
            (loss / cfg.grad_accum).backward()
        loss_sum += loss.detach()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss_sum / cfg.grad_accum


def _sync_grads(model: torch.nn.Module, last: bool, d: _Dist) -> contextlib.AbstractContextManager:
    """Gradient accumulation reduces gradients over the ranks once, at its last micro-step."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP: reduce-scatter or not
        model.set_requires_gradient_sync(last)
        return nullcontext()
    return model.no_sync() if d.world > 1 and not last else nullcontext()


def train(
    cfg: TrainConfig, resume: bool = True, progress: bool = True, *, _stop_after: int | None = None
) -> Path:
    """Train ``cfg`` in ``out_dir/run_name`` (resuming it if ``resume``); return the run dir.

    A finished run (``DONE``) is left as is. ``resume=False`` starts the run over, replacing its
    log and checkpoints. Under ``torchrun`` every rank calls this; only rank 0 writes.
    ``_stop_after`` (tests) checkpoints and stops after that many steps, as ``max_time_s`` does.
    """
    validate(cfg)
    cfg = dataclasses.replace(cfg, run_name=cfg.run_name or default_run_name(cfg))
    d, created = _setup_distributed(cfg.device, cfg.fsdp)
    try:
        return _train(cfg, resume, progress and d.rank == 0, d, _stop_after)
    finally:
        if created:
            dist.destroy_process_group()


class DivergedError(RunFailure):
    """The training loss (or the model's weights) stopped being finite."""


def _agree(ok: bool, d: _Dist) -> bool:
    """Whether ``ok`` holds on every rank (one all-reduce under DDP)."""
    if d.world == 1:
        return ok
    flag = torch.tensor(float(not ok), device=d.device)
    dist.all_reduce(flag)
    return flag.item() == 0


def _train(
    cfg: TrainConfig, resume: bool, progress: bool, d: _Dist, stop_after: int | None
) -> Path:
    """Hold the run's lock (rank 0; every rank stops if it cannot) around :func:`_train_locked`.

    A run directory this call created and left holding nothing but the lock (a data error
    before the run started) is removed again: a failed start leaves nothing to refuse later.
    """
    run_dir, master = child_path(cfg.out_dir, cfg.run_name, "run_name"), d.rank == 0
    new_dir = not run_dir.exists()
    with contextlib.ExitStack() as stack:
        refused: LockedError | None = None
        if master:
            try:
                stack.enter_context(exclusive_lock(run_dir, "run"))
            except LockedError as e:
                refused = e
        if not _agree(refused is None, d):
            raise refused or LockedError(f"rank 0 could not lock the run {run_dir}")
        try:
            return _train_locked(cfg, resume, progress, d, stop_after, run_dir)
        except DiskFullError as e:
            latest = run_dir / (fsdp.POINTER if cfg.fsdp else LATEST)
            kept = (
                f"{latest} holds the last complete checkpoint: the same command resumes from it"
                if latest.is_file()
                else "no checkpoint was written yet"
            )
            raise DiskFullError(errno.ENOSPC, f"{e}; {kept}") from e
        except BaseException:
            if master and new_dir and {p.name for p in run_dir.iterdir()} == {LOCK_FILE}:
                (run_dir / LOCK_FILE).unlink()
                run_dir.rmdir()
            raise


def _train_locked(
    cfg: TrainConfig,
    resume: bool,
    progress: bool,
    d: _Dist,
    stop_after: int | None,
    run_dir: Path,
) -> Path:
    master = d.rank == 0
    latest = run_dir / (fsdp.POINTER if cfg.fsdp else LATEST)
    if master:  # temp files of a writer killed mid-write (no live writer: we hold the lock)
        remove_stale_files(run_dir)
        if cfg.fsdp:  # and, starting over, every sharded checkpoint of the earlier attempt
            fsdp.remove_stale(run_dir, fresh=not resume)
    _barrier()
    if resume and (stored := stored_train_config(run_dir)) is not None:
        if cfg.fsdp:  # DCP reshards: another world size resumes with the same global batch
            stored = fsdp.rebatched(stored, run_dir, cfg.batch_size, d.world)
        check_same_config(stored, cfg, run_dir)
        if (run_dir / "DONE").is_file():
            if master:
                print(f"{run_dir} is complete: nothing to do")
            return run_dir
    data_dir, manifest = _resolve_data(cfg, master, progress)
    train_tokens, val_tokens = data.load_split(data_dir, "train"), data.load_split(data_dir, "val")
    eot = _doc_eot(cfg, manifest)
    mcfg = model_config(cfg, manifest["vocab_size"])
    torch.manual_seed(cfg.seed)  # every attention arm with the same seed starts from one init
    raw = GPT(mcfg).to(d.device)
    n_params = raw.num_params()
    bf16 = _use_bf16(cfg.dtype, d.device)
    if cfg.activation_checkpointing:
        fsdp.checkpoint_blocks(raw.blocks)
    sharding = fsdp.shard(raw, raw.blocks, bf16) if cfg.fsdp else None
    params = list(raw.parameters())  # weight decay on matrices only (not norms)
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = d.device.type == "cuda"
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused)
    step, tokens, history = 0, 0, []
    if resume and cfg.fsdp:
        if (ckpt := fsdp.load(run_dir, raw, opt)) is not None:
            step, tokens, history = ckpt["step"], ckpt["tokens"], ckpt["val_history"]
    elif resume and latest.is_file():
        ckpt = load_checkpoint(latest, d.device)
        load_model_state(raw, ckpt, latest)
        opt.load_state_dict(ckpt["optimizer"])
        step, tokens, history = ckpt["step"], ckpt["tokens"], ckpt["val_history"]
    _barrier()  # every rank has read the run dir before rank 0 rewrites it
    if master:
        dataset = {k: manifest[k] for k in ("corpus", "tokenizer", "total_tokens")}
        config = {
            "train": asdict(cfg),
            "model": asdict(mcfg),
            "params": n_params,
            "data_dir": str(data_dir),
            "dataset": dataset,
            "autocast": "bf16" if bf16 else "fp32",  # what dtype="auto" resolved to here
            "world_size": d.world,
            "fsdp": sharding,  # None, or its world size and mixed precision
        }
        env = environment(d.device, config["autocast"], world_size=d.world)
        init_run_dir(run_dir, step, config, env)
        print(
            f"{cfg.run_name}: {n_params / 1e6:.2f}M params, {cfg.attn} attention, "
            f"{d.device} x{d.world}{' FSDP' if cfg.fsdp else ''}, data {data_dir}, "
            f"step {step}/{cfg.max_steps}"
        )

    def log(**record: Any) -> None:
        if master:
            append_log(run_dir, record)

    saved = step if step > 0 else None  # the step of the last good checkpoint (resumed from)

    def kept() -> str:
        if saved is None:
            return "no checkpoint was written yet"
        return f"the last good checkpoint {latest} (step {saved}) is kept"

    def diverged(what: str) -> DivergedError:
        log(event="error", step=step, error=what)
        return DivergedError(
            f"{run_dir}: {what} at step {step}; {kept()}. Lower --lr (or raise --warmup_steps, "
            "set --grad_clip) and start over with --no-resume"
        )

    def evaluate() -> None:
        history.append([step, _evaluate(raw, val_tokens, cfg, bf16, d, eot)])
        if not math.isfinite(history[-1][1]):
            raise diverged(f"the validation loss is {history[-1][1]}")
        log(event="eval", step=step, tokens=tokens, val_loss=history[-1][1])

    def meta() -> dict[str, Any]:  # what a checkpoint holds besides the weights
        return dict(
            step=step,
            tokens=tokens,
            val_history=history,
            config=asdict(cfg),
            gpt_config=asdict(mcfg),
            data_dir=str(data_dir),
            tokenizer=cfg.tokenizer,
            corpus=manifest["corpus"],
        )

    def save() -> None:  # rank 0 writes (FSDP: every rank its shards); a non-finite model never
        nonlocal saved
        finite = torch.stack([torch.isfinite(fsdp.local(p)).all() for p in raw.parameters()])
        if not _agree(bool(finite.all()), d):
            raise diverged("the weights are no longer finite")
        if cfg.fsdp:
            fsdp.save(run_dir, raw, opt, meta() | {"world_size": d.world})
        elif master:
            save_checkpoint(latest, model=raw.state_dict(), optimizer=opt.state_dict(), **meta())
        saved = step
        _barrier()

    model: torch.nn.Module = torch.compile(raw) if cfg.compile else raw
    if d.world > 1 and not cfg.fsdp:
        model = DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    per_step = d.world * cfg.batch_size * cfg.seq_len * cfg.grad_accum
    bar = tqdm(
        total=cfg.max_steps,
        initial=step,
        disable=not progress,
        unit="step",
        desc=cfg.run_name,
        dynamic_ncols=True,
    )
    if step == 0:
        evaluate()
    start = t0 = time.perf_counter()
    window = 0  # tokens trained since t0: tokens/s counts training only, not eval or saving
    # a step's loss stays on the device; whether any was non-finite is read at the next sync
    nonfinite = torch.zeros((), dtype=torch.bool, device=d.device)
    while step < cfg.max_steps:
        loss = _train_step(model, opt, cfg, train_tokens, step, bf16, d, eot)
        nonfinite |= ~torch.isfinite(loss)
        lr = lr_at(step, cfg)
        step, tokens, window = step + 1, tokens + per_step, window + per_step
        bar.update()
        end = step == cfg.max_steps
        sync = end or any(step % k == 0 for k in (cfg.log_every, cfg.eval_every, cfg.ckpt_every))
        if sync and not _agree(not bool(nonfinite), d):
            raise diverged("the training loss became non-finite (nan or inf)")
        if step % cfg.log_every == 0 or end:
            if d.world > 1:
                dist.all_reduce(loss)
            loss_val, rate = loss.item() / d.world, window / (time.perf_counter() - t0)
            log(event="train", step=step, loss=loss_val, lr=lr, tokens=tokens, tokens_per_s=rate)
            bar.set_postfix_str(f"loss {loss_val:.4f}, val {history[-1][1]:.4f}, {rate:,.0f} tok/s")
            t0, window = time.perf_counter(), 0
        stop = not end and (
            step == stop_after
            or (cfg.max_time_s is not None and time.perf_counter() - start > cfg.max_time_s)
        )
        if d.world > 1 and cfg.max_time_s is not None:  # every rank stops when rank 0 does
            flag = torch.tensor(float(stop), device=d.device)
            dist.broadcast(flag, 0)
            stop = bool(flag.item())
        if step % cfg.eval_every == 0 or end:
            evaluate()
        if step % cfg.ckpt_every == 0 or end or stop:
            save()
        if step % cfg.eval_every == 0 or step % cfg.ckpt_every == 0:
            t0, window = time.perf_counter(), 0
        if stop:
            break
    bar.close()
    if step < cfg.max_steps:
        if master:
            print(f"{run_dir}: stopped at step {step}/{cfg.max_steps}; run again to resume")
    elif cfg.fsdp:  # final.pt: the full model, as every other run's (a collective gather)
        full = fsdp.consolidate(raw)
        if master:
            save_checkpoint(run_dir / FINAL, model=full, **meta())
            summary = {"step": step, "tokens": tokens, "val_loss": history[-1][1]}
            write_json(run_dir / DONE, summary)
    elif master:
        finish_run(run_dir, {"step": step, "tokens": tokens, "val_loss": history[-1][1]})
    if step == cfg.max_steps and master:
        print(f"{run_dir}: done, {step} steps, val loss {history[-1][1]:.4f}")
    _barrier()
    return run_dir


# ---------------------------------------------------------------------------------------- CLI


def train_cli(argv: list[str]) -> int:
    """``lssar train [--preset NAME] [--resume/--no-resume] [--key=value ...]``."""
    keys = clihelp.keys_help(TrainConfig, KEY_HELP, choices=key_choices(), skip=["preset"])
    ap = clihelp.parser(
        "lssar train",
        "Train a GPT (under torchrun: DDP). Config: defaults < preset < --key=value\n"
        "(also --key value; a bare --flag sets a boolean; --max-steps = --max_steps).",
        epilog=f"config keys (--key=value):\n{keys}",
    )
    ap.add_argument(
        "--preset",
        help=f"a shipped preset ({', '.join(list_presets())}) or a path to a .toml file",
    )
    ap.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="continue an unfinished run (--no-resume: start it over)",
    )
    ap.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="show a progress bar (--no-progress: only the log lines)",
    )
    args, rest = ap.parse_known_args(argv)
    cfg = load_config(args.preset, parse_overrides(rest, cli=True))
    train(cfg, resume=args.resume, progress=args.progress)
    return 0


def sample(
    model: GPT,
    tokenizer: data.Tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
) -> list[int]:
    """``max_new_tokens`` ids sampled after ``prompt`` (an empty prompt starts a document).

    ``temperature`` 0 is greedy; ``top_k`` 0 or None samples from the whole vocabulary.
    """
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k={top_k} must be >= 0 (0: no top-k)")
    ids = tokenizer.encode(prompt) or tokenizer.doc_separator
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(
        torch.tensor([ids], device=device),
        max_new_tokens,
        temperature,
        top_k or None,
        generator=gen,
    )
    return out[0, len(ids) :].tolist()


def sample_cli(argv: list[str]) -> int:
    """``lssar sample RUN --prompt "..." [--max-new-tokens N ...]``: print prompt + sample."""
    ap = argparse.ArgumentParser(prog="lssar sample", description="Generate text from a run.")
    ap.add_argument("run", help="run directory")
    ap.add_argument("--prompt", default="")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=50, help="0 = no top-k")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attn", help="evaluate with another attention variant")
    ap.add_argument("--attn-p", type=float, help="re-weighting power p (e.g. 15)")
    ap.add_argument("--rope-scaling", help="rescale RoPE: linear, ntk, dynamic-ntk, yarn")
    ap.add_argument("--rope-factor", help="its factor: a number, or auto (the default)")
    ap.add_argument("--which", default="final", choices=("final", "latest"))
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    if a.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens={a.max_new_tokens} must be >= 0")
    model, cfg, meta = load_run(a.run, map_location=a.device, which=a.which)
    model.switch(a.attn, a.attn_p, a.rope_scaling, a.rope_factor, cfg.seq_len)
    tok = data.get_tokenizer(meta["tokenizer"], corpus_dir=meta["data_dir"])
    ids = sample(model, tok, a.prompt, a.max_new_tokens, a.temperature, a.top_k, a.seed)
    print(a.prompt + tok.decode(ids))
    return 0

"""Training past one process's memory: FSDP2 and sharded checkpoints (``--fsdp``).

:func:`shard` applies ``torch.distributed.fsdp.fully_shard`` to each transformer block and then
to the model, so each rank holds ``1 / world_size`` of the parameters, gradients and optimizer
state and gathers one block's parameters at a time; with bf16 (the run's ``dtype``) the blocks
compute in bf16 and gradients are reduced in float32 (``MixedPrecisionPolicy``). Optional
activation checkpointing (:func:`checkpoint_blocks`, any run) recomputes each block's
activations in the backward pass instead of keeping them.

Checkpoints are ``torch.distributed.checkpoint`` (DCP) directories: every rank writes its own
shards, in parallel, with no full copy anywhere. They are committed atomically::

    ckpt/sharded/step-00000200-<nonce>/   DCP files of one save (every rank's shards, .metadata)
    ckpt/latest.json                      which of them is the checkpoint, and the run's counters

A save writes a new directory, then rank 0 replaces ``latest.json`` (an atomic rename) and only
then deletes the directory it named before: a kill at any moment leaves ``latest.json`` naming a
complete checkpoint, and the directories it does not name (an interrupted save, one not yet
deleted) are removed when the run is next opened (:func:`remove_stale`). DCP reshards on load,
so a run resumes on another number of ranks (the loop keeps the global batch, ``world_size x
batch_size``, equal). A finished run also gets ``ckpt/final.pt``, the full model in the format
of every other run (:func:`consolidate`), so evaluation, export and sampling read it unchanged.
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lssar.train.checkpoint import CONFIG, read_json, write_json

FORMAT = "lssar-dcp"
POINTER = Path("ckpt/latest.json")
SHARDS = Path("ckpt/sharded")


def checkpoint_blocks(blocks: nn.ModuleList) -> None:
    """Activation checkpointing per block: its activations are recomputed in the backward pass
    (the RNG state replayed, so dropout masks are the same); parameter names are unchanged."""
    from torch.distributed._composable import checkpoint

    for block in blocks:
        checkpoint(block)


def shard(model: nn.Module, blocks: nn.ModuleList, bf16: bool) -> dict[str, Any]:
    """``fully_shard`` each of ``blocks``, then ``model`` (its embeddings, final norm and tied
    head); bf16 parameters for compute and float32 gradient reduction when ``bf16``. Needs the
    process group. Returns what was applied (for the run's config)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32
    )
    for block in blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return {
        "world_size": dist.get_world_size(),
        "param_dtype": "bf16" if bf16 else "fp32",
        "reduce_dtype": "fp32",
    }


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (a DTensor), or ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


# -------------------------------------------------------------------------------- checkpoints


def pointer(run_dir: Path) -> dict[str, Any] | None:
    """The run's ``ckpt/latest.json`` (None if it has no sharded checkpoint)."""
    path = Path(run_dir) / POINTER
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
        if meta.get("format") != FORMAT or not (Path(run_dir) / meta["dir"]).is_dir():
            raise ValueError("not an lssar sharded checkpoint, or its directory is missing")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path} is damaged ({e}): delete {Path(run_dir) / 'ckpt'} or start the run over "
            "with --no-resume"
        ) from None
    return meta


def remove_stale(run_dir: Path, fresh: bool) -> None:
    """Rank 0, holding the run's lock: delete the sharded directories ``latest.json`` does not
    name (interrupted or superseded saves); ``fresh``: every sharded checkpoint (a run started
    over)."""
    run_dir = Path(run_dir)
    if fresh:
        (run_dir / POINTER).unlink(missing_ok=True)
    meta = pointer(run_dir)
    keep = None if meta is None else (run_dir / meta["dir"]).name
    folder = run_dir / SHARDS
    for d in sorted(folder.iterdir()) if folder.is_dir() else []:
        if d.name != keep:
            print(f"{run_dir}: removed {d.relative_to(run_dir)}, a sharded checkpoint not in use")
            shutil.rmtree(d)


def rebatched(stored: dict[str, Any], run_dir: Path, batch_size: int, world: int) -> dict[str, Any]:
    """The run's stored train config, its ``batch_size`` replaced by this one when the run was
    trained on another number of ranks with the same global batch (``world_size x batch_size``
    rows a micro-step, so the data order is the run's); ``ValueError`` when the global batch
    would change. A run from before ``world_size`` was recorded is returned as it is."""
    then = read_json(Path(run_dir) / CONFIG).get("world_size")
    if then is None or then == world:
        return stored
    rows = stored["batch_size"] * then
    if batch_size * world != rows:
        fix = (
            f"--batch_size={rows // world} keeps it"
            if rows % world == 0
            else f"{world} ranks cannot split it evenly: use a number of ranks that divides {rows}"
        )
        raise ValueError(
            f"{run_dir} was trained on {then} ranks x batch_size={stored['batch_size']} = {rows} "
            f"rows a micro-step; {world} x {batch_size} would change its global batch: {fix}"
        )
    return stored | {"batch_size": batch_size}


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, opt)
    return {"model": model_state, "optim": optim_state}


def save(run_dir: Path, model: nn.Module, opt: torch.optim.Optimizer, meta: dict[str, Any]) -> None:
    """Every rank: write this rank's shards of ``model`` and ``opt`` into a new directory, then
    (rank 0) commit it in ``latest.json`` with ``meta`` (step, counters, configs) and delete the
    checkpoint it replaces. Collective."""
    import torch.distributed.checkpoint as dcp

    run_dir = Path(run_dir)
    nonce = [f"{time.time_ns():x}"]
    dist.broadcast_object_list(nonce, src=0)  # one directory name on every rank
    name = SHARDS / f"step-{meta['step']:08d}-{nonce[0]}"
    dcp.save(_state(model, opt), checkpoint_id=run_dir / name)
    dist.barrier()  # every rank's files are written (and synced) before the commit
    if dist.get_rank() == 0:
        old = pointer(run_dir)
        body = {"format": FORMAT, "version": 1, "dir": str(name), **meta}
        write_json(run_dir / POINTER, body)  # the commit point: an atomic rename
        if old is not None:
            shutil.rmtree(run_dir / old["dir"], ignore_errors=True)
    dist.barrier()


def load(run_dir: Path, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any] | None:
    """Every rank: load the committed checkpoint into the sharded ``model`` and ``opt`` (DCP
    reshards it when it was written by another number of ranks); its ``latest.json`` (None
    when there is none). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    meta = pointer(run_dir)
    if meta is None:
        return None
    state = _state(model, opt)
    try:
        dcp.load(state, checkpoint_id=Path(run_dir) / meta["dir"])
    except Exception as e:  # DCP wraps every rank's failure in its own exception type
        raise ValueError(
            f"sharded checkpoint {Path(run_dir) / meta['dir']} does not fit this model "
            f"({str(e).strip().splitlines()[-1][:300]}): the config's model shape differs; use "
            "a new --run_name"
        ) from e
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return meta


def consolidate(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full model state dict, gathered on rank 0's CPU (empty on the others). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def read_full(run_dir: Path, meta: dict[str, Any], model: nn.Module) -> None:
    """One process, no process group: load the model of the sharded checkpoint that ``meta``
    (its :func:`pointer`) names into the unsharded ``model``, whatever number of ranks wrote
    it."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=Path(run_dir) / meta["dir"], no_dist=True)
    model.load_state_dict(state["model"])

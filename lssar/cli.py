"""The ``lssar`` command: one entry point, a thin wrapper per subcommand.

Each subcommand lives beside the function it wraps (``module:function`` below takes the remaining
argv and returns an exit code), so ``lssar --help`` imports nothing heavy. Bad input raises
``ValueError`` / ``FileNotFoundError`` inside; here it becomes one ``error:`` line and exit code 2.
A failure of the environment (:class:`lssar.runio.RunFailure`: a directory locked by another
process, a full disk, a run whose loss stopped being finite) is one ``error:`` line and exit 1.

OpenMP threads wait passively (``OMP_WAIT_POLICY=PASSIVE``) unless the environment says
otherwise: with torch's default, threads spin while they wait for each other, and on a machine
busy with other work a tiny-cpu training step took 9-22 s with both cores' threads spinning
against 1.2-1.7 s with them sleeping (``benchmarks/threads.py``, docs/environment.md). OpenMP reads
the variable once, when torch loads, so it is set here, before any command imports torch.
"""

from __future__ import annotations

import importlib
import os
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "variants": ("lssar.cli:variants_cli", "list the attention variants, options and impls"),
    "data": ("lssar.data:cli", "prepare token shards: lssar data prepare --corpus --tokenizer"),
    "train": ("lssar.train:train_cli", "train a GPT: lssar train --preset tiny-cpu --attn=lssar"),
    "sample": ("lssar.train:sample_cli", "generate text from a run: lssar sample RUN --prompt"),
    "eval": ("lssar.studies.lm.evaluate:cli", "loss vs length, passkey, diagnostics for a run"),
    "reproduce": (
        "lssar.studies.lm.study:cli",
        "train + evaluate every variant, write a report",
    ),
    "orbits": ("lssar.studies.orbits.study:cli", "the orbital world-model experiment"),
    "lm-eval": ("lssar.integrations.hf:lm_eval_cli", "lm-evaluation-harness on a run's checkpoint"),
    "export-hf": (
        "lssar.integrations.hf:export_cli",
        "save a run as a transformers model directory",
    ),
    "convert": (
        "lssar.integrations.finetune:convert_cli",
        "save a pretrained model (a .gguf dequantised) as an HF directory",
    ),
    "finetune": (
        "lssar.integrations.finetune:cli",
        "convert a pretrained HF model to lssar attention by fine-tuning",
    ),
    "convert-study": (
        "lssar.studies.convert.study:cli",
        "convert a pretrained model to each rule, evaluate at length, report",
    ),
    "recall": (
        "lssar.studies.recall.study:cli",
        "associative-recall length study: lssar recall --preset quick",
    ),
}


def variants_cli(argv: list[str]) -> int:
    import lssar

    for v in lssar.variants():
        opts = ", ".join(f"{k}={val!r}" for k, val in v["options"].items()) or "-"
        print(
            f"{v['name']:<21} {v['summary']}\n{'':<21} options: {opts}; impls: "
            f"{', '.join(v['impls'])}"
        )
    return 0


def _usage() -> str:
    lines = ["usage: lssar COMMAND [ARGS]  (lssar COMMAND --help for each)", "", "commands:"]
    lines += [f"  {name:<10} {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func = COMMANDS[name][0].split(":")
    if "torch" not in sys.modules:  # in a process of its own (not a test calling main())
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        fn = getattr(importlib.import_module(module), func)
        return int(fn(rest) or 0)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from lssar.runio import RunFailure  # imported only now: `lssar --help` stays light

        if not isinstance(e, RunFailure):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

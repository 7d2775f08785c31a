"""``python -m lssar.harness``: lm-evaluation-harness's command line with lssar's attention
registered in transformers, so any Hugging Face model runs it by name.

    python -m lssar.harness --model hf \\
        --model_args pretrained=DIR,attn_implementation=lssar --tasks hellaswag

Every argument is lm-eval's (``lm_eval --help``); before lm-eval parses them, every lssar variant
(``lssar``, ``lssa``, ``softmax``, ...) is registered in ``transformers.AttentionInterface``
(:func:`lssar.integrations.hf.register`), so ``attn_implementation=<variant>`` loads the model with
that attention, and ``lssar-gpt`` directories load through the Auto classes. The variant's options
come from the model's config (``lssar_p``, ``lssar_options``, ``lssar_impl`` in ``config.json``).
``lssar lm-eval RUN`` evaluates a training run directly instead (:mod:`lssar.integrations.lm_eval`).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Register lssar's attention, then run lm-eval's CLI on ``argv`` (default: the command
    line)."""
    from lm_eval.__main__ import cli_evaluate

    from lssar.integrations.hf import register

    register()
    args = sys.argv[1:] if argv is None else list(argv)
    saved = sys.argv
    sys.argv = ["lssar.harness", *args]  # lm-eval reads sys.argv itself
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())

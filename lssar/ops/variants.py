"""The attention variants of the paper as data: a normaliser (stage 1) plus optional sharpening.

A variant is the math; an implementation (``reference``, ``chunked``, ``sdpa``, ``triton``,
``flex``) is the kernel. Every variant is ``weights = sharpen_p(normalise(scores))`` where

- scores ``s_ij = c_i * q_i . k_j`` with ``q, k`` optionally L2-normalised and ``c_i`` one of
  ``scale`` (default ``1/sqrt(d)``), ``ln(d) ln(N_i)`` (LSSA's length scale),
  ``s_h ln(N_i) scale`` (Scalable-Softmax) or the constant ``ln(d) ln(n)``: LSSA's scale frozen at
  one length ``n`` (the training length, an option), times a learned per-head ``s_h`` for the
  variants that take ``s`` (the decomposition arms that separate QK-norm from the ``ln N_i``
  growth);
- ``phi`` maps scores to non-negative weights (exp, softplus, relu, sigmoid), optionally
  l1-normalised per row;
- sharpening (re-weighting, docs/method.md section 4) with power ``p`` applies to l1-normalised
  rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from lssar.ops.common import finite

PHIS = ("exp", "softplus", "relu", "sigmoid")

SCALINGS = ("sdpa", "log_n", "ssmax", "const")
# The re-weighting powers p the kernels compute r^p with (r in [0, 1], float32), checked by what
# they compute: below float32's smallest normal p flushes to 0 on a GPU (r^0 = 1: every weight,
# masked ones too), and r rounded up to 1 + 2^-22 overflows beyond about 3.7e8 (measured: wrong
# weights or NaN on chunked / cpu / triton from p = 3e9, none up to 1e9)
P_RANGE = (2.0**-126, 2.0**28)


@dataclass(frozen=True)
class Variant:
    """One attention rule. ``options`` maps each keyword option to its default."""

    name: str
    summary: str
    phi: str
    l1: bool
    scaling: str = "sdpa"
    qk_norm: bool = False
    divide_by_n: bool = False
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def softplus_l1(self) -> bool:
        """The family the fused kernels run: softplus, l1-normalised, a row scale ``c_i``."""
        return self.phi == "softplus" and self.l1 and self.scaling in ("sdpa", "log_n")

    @property
    def lssa_family(self) -> bool:
        """LSSA's rule with any ``p``: softplus, l1, ``c_i = ln(d) ln(N_i)`` on cosines."""
        return (
            self.phi == "softplus"
            and self.l1
            and self.scaling == "log_n"
            and self.qk_norm
            and not self.divide_by_n
        )

    def const_scale(self, d: int, options: dict[str, Any]) -> float:
        """``ln(d) ln(n)``: the ``const`` scaling's row scale (before any learned ``s_h``)."""
        if self.scaling != "const":
            raise ValueError(f"variant {self.name!r} has no constant scale")
        return math.log(d) * math.log(options["n"])

    def scale_dim(self, d: int, options: dict[str, Any]) -> int:
        """The ``d`` of the length scale ``ln(d) ln(N_i)``: the head dim, unless the option
        ``scale_dim`` sets another (an ablation that changes only ``ln d``)."""
        return options.get("scale_dim") or d

    def softplus_scale(
        self, d: int, scale: float | None, options: dict[str, Any] | None = None
    ) -> tuple[float, bool]:
        """``(c, log_n)`` for the fused kernels: ``c_i = c ln(N_i)`` if ``log_n`` else ``c``."""
        if self.scaling == "log_n":
            return math.log(self.scale_dim(d, options or {})), True
        return (1.0 / math.sqrt(d) if scale is None else float(scale)), False

    def resolve(self, options: dict[str, Any]) -> dict[str, Any]:
        """Defaults overlaid with ``options``; raises ``ValueError`` for unknown or bad values."""
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            valid = ", ".join(f"{k}={v!r}" for k, v in self.options.items()) or "none"
            raise ValueError(
                f"variant {self.name!r} takes no option {', '.join(map(repr, unknown))}; "
                f"its options are: {valid}"
            )
        resolved = {**self.options, **options}
        p = resolved.get("p")
        if p is not None and not (
            isinstance(p, (int, float))
            and not isinstance(p, bool)
            and P_RANGE[0] <= p <= P_RANGE[1]
        ):
            raise ValueError(
                f"p must be a float in [2^-126, 2^28] (or None for no re-weighting), got {p!r}: "
                "the kernels raise r in [0, 1] to it in float32, where a smaller p flushes to 0 "
                "(every weight 1) and a larger one overflows r rounded up to 1 + 2^-22"
            )
        bias = resolved.get("bias")
        if bias is not None and not (isinstance(bias, (int, float)) and finite(bias)):
            raise ValueError(f"bias must be a finite float or None, got {bias!r}")
        n = resolved.get("n")
        if "n" in self.options and not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
            raise ValueError(
                f"n (the length whose scale ln(d) ln(n) is frozen, e.g. the training length) "
                f"must be a whole number >= 1, got {n!r}"
            )
        sd = resolved.get("scale_dim")
        if sd is not None and not (isinstance(sd, int) and not isinstance(sd, bool) and sd >= 2):
            raise ValueError(
                f"scale_dim (the d of the length scale ln(d) ln(N_i); none: the head dim) must be "
                f"a whole number >= 2, got {sd!r}"
            )
        s = resolved.get("s")
        if "s" in self.options and s is not None:
            if not isinstance(s, (torch.Tensor, int, float)):
                raise ValueError(f"s must be a float or a per-head tensor of shape [H], got {s!r}")
            if isinstance(s, torch.Tensor) and s.dim() > 1:
                raise ValueError(f"s must be a per-head tensor of shape [H], got {tuple(s.shape)}")
            if not isinstance(s, torch.Tensor):
                ok = finite(s)
            elif torch.compiler.is_compiling():
                # reading s on the host breaks the graph (a learnable s is traced): the compiled
                # graph checks it when it runs instead, raising a RuntimeError there
                torch._assert_async(torch.isfinite(s).all(), "a learned s must be finite")
                ok = True
            else:
                ok = bool(torch.isfinite(s).all())
            if isinstance(s, bool) or not ok:
                raise ValueError(f"s must be finite (a float or a per-head tensor), got {s!r}")
        return resolved


def _v(name: str, summary: str, phi: str, l1: bool, **kw: Any) -> Variant:
    opts = kw.pop("options", {})
    if l1:
        opts = {"p": kw.pop("p", None), **opts}
    if kw.get("scaling") == "log_n" and kw.get("qk_norm"):  # LSSA's scale ln(d) ln(N_i)
        opts = {**opts, "scale_dim": None}
    return Variant(name, summary, phi, l1, options=opts, **kw)


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        _v("softmax", "softmax(q.k/sqrt(d)): the standard baseline", "exp", True),
        _v(
            "lssa",
            "softplus(ln d ln N_i cos(q,k)), l1-normalised (paper stage 1)",
            "softplus",
            True,
            scaling="log_n",
            qk_norm=True,
        ),
        _v(
            "lssar",
            "LSSA + re-weighting ReLU(N_i A - 1)^p, p=15 (paper, long context)",
            "softplus",
            True,
            scaling="log_n",
            qk_norm=True,
            p=15.0,
        ),
        _v(
            "lssar-p3",
            "LSSA + re-weighting with p=3 (paper's best at training length)",
            "softplus",
            True,
            scaling="log_n",
            qk_norm=True,
            p=3.0,
        ),
        _v(
            "softplus-l1",
            "softplus(q.k/sqrt(d)), l1: ablation without the length scale",
            "softplus",
            True,
        ),
        _v("relu-l1", "ReLU(q.k/sqrt(d)), l1: ablation (dead rows give zeros)", "relu", True),
        _v(
            "sigmoid",
            "sigmoid(q.k/sqrt(d) + b), b = -ln N_i unless given; no normalisation",
            "sigmoid",
            False,
            options={"bias": None},
        ),
        _v(
            "sigmoid-l1",
            "sigmoid(q.k/sqrt(d) + b), l1 (for sigmoid + re-weighting ablations)",
            "sigmoid",
            True,
            options={"bias": None},
        ),
        _v(
            "relu",
            "ReLU(q.k/sqrt(d)) / N_i, no normalisation (Wortsman et al. 2023)",
            "relu",
            False,
            divide_by_n=True,
        ),
        _v(
            "ssmax",
            "softmax(s_h ln N_i q.k/sqrt(d)), per-head s (Scalable-Softmax)",
            "exp",
            True,
            scaling="ssmax",
            options={"s": 1.0},
        ),
        _v(
            "softmax-qknorm-logn",
            "softmax(ln d ln N_i cos(q,k)): softmax with LSSA's scale",
            "exp",
            True,
            scaling="log_n",
            qk_norm=True,
        ),
        # the decomposition of softmax-qknorm-logn and LSSA (docs/method.md section 6): QK-norm with
        # LSSA's scale frozen at one length n, so only "grows with ln N_i" separates them from
        # the log_n variants; n defaults to the paper's training length, 1024
        _v(
            "softmax-qknorm-const",
            "softmax(ln d ln n cos(q,k)): QK-norm softmax, LSSA's scale fixed at length n",
            "exp",
            True,
            scaling="const",
            qk_norm=True,
            options={"n": 1024},
        ),
        _v(
            "softmax-qknorm-learned",
            "softmax(s_h ln d ln n cos(q,k)): QK-norm softmax, a learned per-head scale "
            "(s_h from 1: at init the constant scale of length n)",
            "exp",
            True,
            scaling="const",
            qk_norm=True,
            options={"n": 1024, "s": 1.0},
        ),
        _v(
            "lssa-const",
            "softplus(ln d ln n cos(q,k)), l1: LSSA with its scale fixed at length n",
            "softplus",
            True,
            scaling="const",
            qk_norm=True,
            options={"n": 1024},
        ),
    )
}

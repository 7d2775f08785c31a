"""The attention a model runs, as one small frozen value: :class:`AttentionSpec`.

A spec is a variant name (``lssar.variants()``), that variant's explicit options (``{"p": 15.0}``;
an option left out takes the variant's default) and the implementation (``"auto"`` or a name
from the registry). It is the one place that

* validates the triple (:func:`check_attention`),
* names it: :attr:`AttentionSpec.label` (``"lssar p=15"``, the key of ``reproduce``'s tables and
  claims) and :meth:`AttentionSpec.slug` (``"lssar-p15"``, for run and file names; a result's
  label, a rule switched after training included, is :func:`lssar.studies.labels.run_label`),
* switches it after training (:meth:`AttentionSpec.override`, the rule below), and
* reads and writes the config forms stored in run directories and HF ``config.json`` files
  (:meth:`AttentionSpec.from_config`, :meth:`AttentionSpec.to_config`,
  :meth:`AttentionSpec.to_train`).

Eval-time switching (``lssar eval/sample/lm-eval --attn X --attn-p P``) is one rule:
naming a variant starts from that variant's defaults (the trained options belong to the trained
variant), giving only options changes them on top of the trained ones, and the trained
implementation is kept unless it does not run the new variant with its options, then ``"auto"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lssar.ops import IMPLS, check, get_variant


def check_attention(attn: str, options: Mapping[str, Any], impl: str = "auto") -> dict[str, Any]:
    """Validate an attention name + options + impl for use in the model; returns the resolved
    options. ``ValueError`` names what is wrong."""
    variant = get_variant(attn)
    if "s" in options:
        raise ValueError(
            f"{attn}'s `s` is a learned parameter of the model (ssmax, softmax-qknorm-learned), "
            "not an option"
        )
    resolved = variant.resolve(dict(options))
    if impl != "auto" and impl not in IMPLS:
        raise ValueError(f"unknown attn_impl {impl!r}; valid: auto, {', '.join(IMPLS)}")
    _check_runs(attn, options, impl, 0.0)
    return resolved


def _check_runs(attn: str, options: Mapping[str, Any], impl: str, dropout_p: float) -> None:
    if impl == "auto":
        return
    check(attn, impl, options, dropout_p=dropout_p)


def check_runs(spec: AttentionSpec, dropout_p: float = 0.0) -> None:
    """``ValueError`` (the registry's, naming the impls that do) unless the spec's impl runs its
    variant with its options, and with dropout when ``dropout_p > 0`` (``auto`` always does).
    It asks the registry (:func:`lssar.ops.registry.check`: the entries' declared support, no
    tensor), so ``attn="lssar", attn_impl="sdpa"`` is refused when it is configured (every spec
    is checked so on construction), not at the first training step."""
    _check_runs(spec.name, spec.options, spec.impl, dropout_p)


def impl_runs(impl: str, attn: str, options: Mapping[str, Any]) -> bool:
    """Whether implementation ``impl`` runs variant ``attn`` with ``options`` here (``auto``
    always): :func:`check_runs` as a yes or no."""
    try:
        _check_runs(attn, options, impl, 0.0)
    except ValueError:
        return False
    return True


def _fmt(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:g}"
    return str(value)


# the variant options TrainConfig holds, and the field each lives in (``--attn_p`` ...)
TRAIN_OPTION_FIELDS = {"p": "attn_p", "n": "attn_n", "scale_dim": "attn_scale_dim"}


@dataclass(frozen=True)
class AttentionSpec:
    """``(name, options, impl)``: which attention rule, with which options, by which kernel.

    Validated on construction (unknown names, options or impls raise ``ValueError``); ``options``
    holds the explicit options only, so ``AttentionSpec("lssar")`` runs the default p=15 and is
    labelled ``"lssar"``.
    """

    name: str = "softmax"
    options: Mapping[str, Any] = field(default_factory=dict)
    impl: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", dict(self.options))  # its own copy
        check_attention(self.name, self.options, self.impl)

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.options.items())), self.impl))

    @property
    def label(self) -> str:
        """``"lssar p=15"``: the name and every explicit option (sorted); the impl is not part
        of it (it does not change the math)."""
        opts = [f" {k}={_fmt(v)}" for k, v in sorted(self.options.items()) if v is not None]
        return self.name + "".join(opts)

    def slug(self, sep: str = "-") -> str:
        """``"lssar-p15"`` (``sep="_"``: ``"lssar_p15"``): the label for run and file names."""
        opts = [
            f"{sep}{k}{_fmt(v)}"
            for k, v in sorted(self.options.items())
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
        return self.name + "".join(opts)

    def override(
        self, name: str | None = None, impl: str | None = None, **options: Any
    ) -> AttentionSpec:
        """This spec switched, e.g. at evaluation; an argument that is ``None`` is not given.

        ``name`` (even the same name) starts from that variant's defaults; ``options`` are set
        on top (on top of this spec's options when no ``name`` is given). ``impl`` is kept
        unless it does not run the new variant with its options, then it becomes ``"auto"``
        (an explicit ``impl`` is used as given).
        """
        new_name = self.name if name is None else name
        opts = dict(self.options) if name is None else {}
        opts.update({k: v for k, v in options.items() if v is not None})
        if impl is None:
            check_attention(new_name, opts)  # a bad name or option fails first, clearly
            impl = self.impl if impl_runs(self.impl, new_name, opts) else "auto"
        return AttentionSpec(new_name, opts, impl)

    # ------------------------------------------------------------------------ config forms

    @classmethod
    def from_config(cls, cfg: Any) -> AttentionSpec:
        """The spec of a config object or dict in any stored form: ``attn`` + ``attn_options``
        + ``attn_impl`` (``GPTConfig``, HF ``config.json``) or ``attn`` + ``attn_p`` (+
        ``attn_n``, ``attn_scale_dim``) + ``attn_impl`` (``TrainConfig``, a run's ``config.json``);
        missing keys take the defaults (``softmax``, no options, ``auto``), as in run directories
        of every version."""
        get = cfg.get if isinstance(cfg, Mapping) else lambda k, d=None: getattr(cfg, k, d)
        options = dict(get("attn_options", None) or {})
        for option, key in TRAIN_OPTION_FIELDS.items():
            if get(key, None) is not None:
                options[option] = get(key)
        return cls(get("attn", "softmax"), options, get("attn_impl", "auto") or "auto")

    def to_config(self) -> dict[str, Any]:
        """``{"attn", "attn_options", "attn_impl"}``: the ``GPTConfig`` / HF config form."""
        return {"attn": self.name, "attn_options": dict(self.options), "attn_impl": self.impl}

    def to_train(self) -> dict[str, Any]:
        """``{"attn", "attn_p", "attn_impl"}`` (and ``"attn_n"`` / ``"attn_scale_dim"`` when the
        spec sets ``n`` / ``scale_dim``): the ``TrainConfig`` form (whose options are ``p``, ``n``
        and ``scale_dim``; ``ValueError`` for others)."""
        other = sorted(set(self.options) - set(TRAIN_OPTION_FIELDS))
        if other:
            raise ValueError(f"TrainConfig has no field for the option(s) {other} of {self.label}")
        out = {"attn": self.name, "attn_p": self.options.get("p"), "attn_impl": self.impl}
        return out | {
            f: self.options[k] for k, f in TRAIN_OPTION_FIELDS.items() if k in self.options
        }

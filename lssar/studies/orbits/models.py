"""Networks and training loops of the orbital world-model experiment.

Sequence layout (both formats, length ``L = 1 + 2T``): position 0 is a dt token, then per time
step ``t`` the planet token (index ``1 + 2t``) and the star token (index ``2 + 2t``), as in
:func:`lssar.studies.orbits.kepler.to_discrete`. The star token of step ``t`` is the first one
that has seen both bodies' positions at ``t``, so the force probe reads it.

:class:`OrbitGPT` = input embedding (continuous: ``Linear(2 -> C)`` on the coordinates, dt token
= a learned vector + ``Linear(1 -> C)`` of the standardised ``log dt``; discrete: Vafa's two tables,
a coordinate-bin table summed over x and y and a special-token table) + the transformer blocks of
:class:`lssar.model.GPT` (RoPE, attention from the registry by name) + a next-token head
(continuous: MSE on the next token's ``(x, y)``; discrete: cross-entropy on its x and y bins)
and a scalar force head (``log |F|`` standardised). The ideal-estimator arm (``sees_masses``) adds
``Linear(2 -> C)`` of the standardised true ``log (m1, m2)`` to every token, so its force head
has the masses that every other arm must infer from the motion.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from lssar.model import GPT, GPTConfig
from lssar.train.schedule import set_lr, warmup_cosine

FORMATS = ("continuous", "discrete")


def star_index(t: np.ndarray | Tensor | int) -> Any:
    """Sequence index of step ``t``'s star token (dt token at 0, then planet, star per step)."""
    return 2 + 2 * t


@dataclass
class OrbitModelConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    attn: str = "softmax"
    attn_options: dict[str, Any] = field(default_factory=dict)
    window: int | None = None  # sliding-window attention (locality control)
    fmt: str = "continuous"
    n_bins: int = 256  # discrete: coordinate bins per axis
    n_special: int = 2  # discrete: 0 = coordinate token, 1.. = dt tokens
    accel_scale: float = 1.0  # continuous: unit of the next-position head (see next_token_loss)
    sees_masses: bool = False  # the ideal estimator: true log masses added to every token

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class OrbitGPT(nn.Module):
    """Trajectory GPT. ``forward(batch) -> hidden (B, L, C)``; see the module docstring.

    ``batch``: ``x`` ``(B, L, 2)`` float coordinates (continuous) or long bin ids (discrete),
    ``special`` ``(B, L)`` long (0 = coordinate token), ``dt`` ``(B,)`` standardised ``log dt``,
    ``log_m`` ``(B, 2)`` standardised true ``log (m1, m2)`` (read only when ``cfg.sees_masses``).
    """

    def __init__(self, cfg: OrbitModelConfig) -> None:
        super().__init__()
        if cfg.fmt not in FORMATS:
            raise ValueError(f"unknown format {cfg.fmt!r}; valid: {', '.join(FORMATS)}")
        self.cfg = cfg
        trunk = GPT(
            GPTConfig(
                vocab_size=1,
                n_layer=cfg.n_layer,
                n_head=cfg.n_head,
                n_embd=cfg.n_embd,
                attn=cfg.attn,
                attn_options=cfg.attn_options,
            )
        )
        del trunk.wte, trunk.head  # token table and LM head are replaced by ours
        self.trunk = trunk  # a windowed model has exactly the weights of its unwindowed twin
        C = cfg.n_embd
        self.special = nn.Embedding(max(cfg.n_special, 2), C)
        if cfg.fmt == "continuous":
            self.coord_in = nn.Linear(2, C)
            self.dt_in = nn.Linear(1, C)
            self.next_head = nn.Linear(C, 2)
        else:
            self.coord_emb = nn.Embedding(2 * cfg.n_bins, C)  # x bins, then y bins
            self.next_head = nn.Linear(C, 2 * cfg.n_bins)
        self.force_head = nn.Linear(C, 1)
        if cfg.sees_masses:  # built last: every other weight is initialised as in the other arms
            self.mass_in = nn.Linear(2, C)

    def embed(self, batch: dict[str, Tensor]) -> Tensor:
        """Input embeddings ``(B, L, C)``."""
        is_special = (batch["special"] > 0).unsqueeze(-1)  # (B, L, 1)
        h = self.special(batch["special"])
        if self.cfg.fmt == "continuous":
            h = h + self.coord_in(batch["x"]).masked_fill(is_special, 0.0)
            h = h + self.dt_in(batch["dt"][:, None, None]) * is_special
        else:
            ids = batch["x"].clone()
            ids[..., 1] += self.cfg.n_bins
            h = h + self.coord_emb(ids).sum(-2).masked_fill(is_special, 0.0)
        if self.cfg.sees_masses:  # at every token: no attention is needed to read them
            h = h + self.mass_in(batch["log_m"]).unsqueeze(1)
        return h

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        h = self.embed(batch)
        window = self.cfg.window  # the locality control: a causal sliding window in every layer
        return self.trunk.body(h, window=None if window is None else int(window))  # (B, L, C)

    @property
    def first_target(self) -> int:
        """Index of the first token the next-token loss predicts."""
        return 5 if self.cfg.fmt == "continuous" else 2

    def next_token_loss(self, batch: dict[str, Tensor], reduction: str = "mean") -> Tensor:
        """Loss predicting token ``j`` from the tokens before it, ``j >= first_target``.

        Continuous: the head predicts the deviation of the next position from the constant-
        velocity extrapolation of the same body, ``2 x_{j-2} - x_{j-4}``, in units of
        ``accel_scale`` (the train-set rms of that deviation, i.e. of ``a dt**2``); the loss is
        the mean squared error in those units (1 = no better than constant velocity).
        Discrete: cross-entropy of the x bin plus that of the y bin (Vafa et al.).
        ``reduction="none"`` gives ``(B, L - first_target)``."""
        j0 = self.first_target
        out = self.next_head(self(batch)[:, j0 - 1 : -1])  # (B, L-j0, 2 | 2 n_bins)
        tgt = batch["x"][:, j0:]
        if self.cfg.fmt == "continuous":
            cv = 2 * batch["x"][:, j0 - 2 : -2] - batch["x"][:, j0 - 4 : -4]
            loss = ((cv + out * self.cfg.accel_scale - tgt) ** 2).mean(-1)
            loss = loss / self.cfg.accel_scale**2
        else:
            nb = self.cfg.n_bins
            lx = F.cross_entropy(
                out[..., :nb].flatten(0, 1), tgt[..., 0].flatten(), reduction="none"
            )
            ly = F.cross_entropy(
                out[..., nb:].flatten(0, 1), tgt[..., 1].flatten(), reduction="none"
            )
            loss = (lx + ly).view(tgt.shape[:2])
        return loss.mean() if reduction == "mean" else loss

    def force(self, batch: dict[str, Tensor], steps: Tensor) -> Tensor:
        """Standardised ``log |F|`` predicted at the star tokens of ``steps (K,)`` -> ``(B, K)``."""
        h = self(batch)[:, star_index(steps)]
        return self.force_head(h).squeeze(-1)


# ------------------------------------------------------------------------------- inputs
@dataclass
class Data:
    """Encoded splits: ``tokens[split]`` (the :class:`OrbitGPT` batch format, ``S`` systems),
    ``log_f[split]`` ``(S, T)`` (true ``log |F|``), ``masses[split]`` ``(S, 2)``, ``r[split]``
    ``(S, T)``; ``key`` identifies data + encoding (set by the caller), ``info`` describes it."""

    tokens: dict[str, dict[str, Tensor]]
    log_f: dict[str, np.ndarray]
    masses: dict[str, np.ndarray]
    r: dict[str, np.ndarray]
    n_steps: int
    n_special: int
    accel_scale: float
    key: str = ""
    info: dict[str, Any] = field(default_factory=dict)


def encode_splits(
    raw: dict[str, dict[str, np.ndarray]],
    fmt: str,
    n_bins: int = 256,
    coord_range: tuple[float, float] | None = None,
    device: torch.device | str = "cpu",
) -> Data:
    """Encode :func:`lssar.studies.orbits.kepler.load_split` outputs (``raw[split]``, splits train /
    probe / test) in ``fmt``. Continuous: coordinates divided by the train split's largest
    absolute coordinate. Discrete: ``n_bins`` bins over ``coord_range`` (default: +/- that
    coordinate), one dt vocabulary for all splits. The dt token carries the standardised
    ``log dt``; ``log_m`` the standardised true log masses (both with train statistics)."""
    from lssar.studies.orbits import kepler

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}")
    T = raw["train"]["positions"].shape[1]
    tokens: dict[str, dict[str, Tensor]] = {}
    info: dict[str, Any] = {"fmt": fmt}
    if fmt == "continuous":
        _, scale = kepler.to_continuous(raw["train"]["positions"])
        n_special = 2
        for s, d in raw.items():
            x = np.zeros((len(d["dt"]), 1 + 2 * T, 2), np.float32)
            x[:, 1:] = kepler.to_continuous(d["positions"], scale)[0]
            special = np.zeros(x.shape[:2], np.int64)
            special[:, 0] = 1
            tokens[s] = {"x": torch.from_numpy(x), "special": torch.from_numpy(special)}
        acc = accel_scale(tokens["train"]["x"].numpy())
        info.update(scale=scale, accel_scale=acc)
    else:
        amax = float(np.max(np.abs(raw["train"]["positions"])))
        lo, hi = (float(coord_range[0]), float(coord_range[1])) if coord_range else (-amax, amax)
        names = list(raw)
        enc = kepler.to_discrete(
            np.concatenate([raw[s]["positions"] for s in names]),
            np.concatenate([raw[s]["dt"] for s in names]),
            n_bins,
            lo,
            hi,
        )
        n_special, acc = enc["n_special"], 1.0
        info.update(
            lo=lo,
            hi=hi,
            n_bins=n_bins,
            n_clipped=enc["n_clipped"],
            dt_values=enc["dt_values"].tolist(),
        )
        start = 0
        for s in names:
            n = len(raw[s]["dt"])
            tokens[s] = {
                "x": torch.from_numpy(enc["coord_ids"][start : start + n]),
                "special": torch.from_numpy(enc["special_ids"][start : start + n]),
            }
            start += n
    log_dt = {s: np.log(d["dt"]) for s, d in raw.items()}
    mu, sd = float(log_dt["train"].mean()), float(log_dt["train"].std())
    log_m = {s: np.log(d["masses"]) for s, d in raw.items()}
    m_mu, m_sd = log_m["train"].mean(0), np.maximum(log_m["train"].std(0), 1e-12)
    for s in raw:
        z = (log_dt[s] - mu) / sd if sd > 1e-12 else np.zeros_like(log_dt[s])
        tokens[s]["dt"] = torch.from_numpy(z.astype(np.float32))
        tokens[s]["log_m"] = torch.from_numpy(((log_m[s] - m_mu) / m_sd).astype(np.float32))
        tokens[s] = {k: v.to(device) for k, v in tokens[s].items()}
    return Data(
        tokens=tokens,
        log_f={s: np.log(d["force_mag"]) for s, d in raw.items()},
        masses={s: d["masses"] for s, d in raw.items()},
        r={s: d["r"] for s, d in raw.items()},
        n_steps=T,
        n_special=n_special,
        accel_scale=acc,
        info=info,
    )


# ------------------------------------------------------------------------------- training
def _batch(tokens: dict[str, Tensor], idx: Tensor) -> dict[str, Tensor]:
    return {k: v[idx] for k, v in tokens.items()}


def _optimise(
    model: nn.Module,
    loss_fn: Any,
    n_items: int,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    desc: str,
    progress: bool,
) -> list[float]:
    """AdamW (weight decay 0.01, grad clip 1) on batches drawn by ``np.random.default_rng(
    seed)`` -- the same item order for every model given the same seed -- with a linear warmup
    over the first 10% of the steps, then a cosine to 10% of ``lr``. Returns the loss curve
    (one float per step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    rng = np.random.default_rng(seed)
    curve: list[float] = []
    model.train()
    warmup = max(1, steps // 10)
    bar = tqdm(range(steps), desc=desc, disable=not progress, leave=False, dynamic_ncols=True)
    for step in bar:
        set_lr(opt, warmup_cosine(step, total=steps, peak=lr, warmup=warmup, floor_ratio=0.1))
        idx = torch.from_numpy(rng.choice(n_items, min(batch_size, n_items), replace=False))
        loss = loss_fn(idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        curve.append(float(loss.detach()))
        if step % 10 == 0:
            bar.set_postfix(loss=f"{np.mean(curve[-10:]):.4g}")
    model.eval()
    return curve


def pretrain(
    model: OrbitGPT,
    tokens: dict[str, Tensor],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    progress: bool = False,
) -> list[float]:
    """Next-token pretraining on the train split's ``tokens``; returns the loss curve."""
    n = tokens["x"].shape[0]
    return _optimise(
        model,
        lambda idx: model.next_token_loss(_batch(tokens, idx)),
        n,
        steps,
        batch_size,
        lr,
        seed,
        "pretrain",
        progress,
    )


def finetune_force(
    model: OrbitGPT,
    tokens: dict[str, Tensor],
    target: Tensor,
    first_step: int,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    progress: bool = False,
) -> list[float]:
    """Fine-tune the whole model (trunk + force head) to predict ``target (S, T)``
    (standardised ``log |F|``) at steps ``first_step .. T-1``; MSE. Returns the loss curve."""
    ts = torch.arange(first_step, target.shape[1])

    def loss(idx: Tensor) -> Tensor:
        return F.mse_loss(model.force(_batch(tokens, idx), ts), target[idx][:, ts])

    return _optimise(
        model, loss, target.shape[0], steps, batch_size, lr, seed, "force probe", progress
    )


@torch.no_grad()
def predict_force(
    model: OrbitGPT, tokens: dict[str, Tensor], first_step: int, n_steps: int, batch_size: int = 64
) -> np.ndarray:
    """Standardised ``log |F|`` predictions ``(S, n_steps - first_step)``."""
    ts = torch.arange(first_step, n_steps)
    S = tokens["x"].shape[0]
    out = [
        model.force(_batch(tokens, torch.arange(i, min(S, i + batch_size))), ts)
        for i in range(0, S, batch_size)
    ]
    return torch.cat(out).cpu().numpy().astype(np.float64)


@torch.no_grad()
def star_hidden(
    model: OrbitGPT, tokens: dict[str, Tensor], first_step: int, n_steps: int, batch_size: int = 64
) -> np.ndarray:
    """Trunk hidden states at the star tokens of steps ``first_step..n_steps-1``:
    ``(S, n_steps - first_step, C)``."""
    idx = star_index(torch.arange(first_step, n_steps))
    S = tokens["x"].shape[0]
    out = [
        model(_batch(tokens, torch.arange(i, min(S, i + batch_size))))[:, idx]
        for i in range(0, S, batch_size)
    ]
    return torch.cat(out).cpu().numpy().astype(np.float64)


@torch.no_grad()
def next_token_eval(
    model: OrbitGPT, tokens: dict[str, Tensor], skip: int, batch_size: int = 64
) -> float:
    """Mean next-token loss on ``tokens``, over predicted tokens with index ``>= skip``."""
    S = tokens["x"].shape[0]
    parts = [
        model.next_token_loss(
            _batch(tokens, torch.arange(i, min(S, i + batch_size))), reduction="none"
        )
        for i in range(0, S, batch_size)
    ]
    return float(torch.cat(parts)[:, max(0, skip - model.first_target) :].mean())


def r2_score(y: np.ndarray, yhat: np.ndarray) -> float:
    return 1.0 - float(np.sum((y - yhat) ** 2)) / float(np.sum((y - y.mean()) ** 2))


def force_probes(
    model: OrbitGPT,
    data: Data,
    first_step: int,
    ridge_alpha: float,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    progress: bool = False,
) -> dict[str, Any]:
    """The two force probes, trained on the probe split, evaluated on the test split at steps
    ``first_step..T-1``: a ridge regression on the frozen trunk's star-token hidden states,
    then the whole model fine-tuned with its force head (``model`` is modified in place).

    Returns arrays ``log_f_pred``, ``log_f_ridge``, ``log_f_true``, ``r`` ``(S_test, K)``,
    ``m1``, ``m2`` ``(S_test,)``, ``finetune_curve`` and scores ``test_r2``, ``probe_r2``,
    ``test_rmse``, ``ridge_test_r2``, ``ridge_probe_r2`` (R^2 of ``log |F|``), ``params``,
    ``seconds``."""
    from sklearn.linear_model import Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    t0 = time.perf_counter()
    T, fs = data.n_steps, first_step
    tok = data.tokens
    h_probe, h_test = (
        star_hidden(model, tok["probe"], fs, T),
        star_hidden(model, tok["test"], fs, T),
    )
    y_probe, y_test = data.log_f["probe"][:, fs:], data.log_f["test"][:, fs:]
    ridge = make_pipeline(StandardScaler(), Ridge(alpha=ridge_alpha))
    ridge.fit(h_probe.reshape(-1, h_probe.shape[-1]), y_probe.ravel())
    ridge_test = ridge.predict(h_test.reshape(-1, h_test.shape[-1])).reshape(y_test.shape)
    ridge_probe = ridge.predict(h_probe.reshape(-1, h_probe.shape[-1])).reshape(y_probe.shape)
    mu, sd = float(data.log_f["probe"].mean()), float(data.log_f["probe"].std())
    target = torch.from_numpy(((data.log_f["probe"] - mu) / sd).astype(np.float32))
    device = tok["probe"]["x"].device
    curve = finetune_force(
        model, tok["probe"], target.to(device), fs, steps, batch_size, lr, seed, progress
    )
    pred_test = predict_force(model, tok["test"], fs, T) * sd + mu
    pred_probe = predict_force(model, tok["probe"], fs, T) * sd + mu
    return {
        "log_f_pred": pred_test,
        "log_f_ridge": ridge_test,
        "log_f_true": y_test,
        "test_r2": r2_score(y_test, pred_test),
        "probe_r2": r2_score(y_probe, pred_probe),
        "test_rmse": float(np.sqrt(np.mean((y_test - pred_test) ** 2))),
        "ridge_test_r2": r2_score(y_test, ridge_test),
        "ridge_probe_r2": r2_score(y_probe, ridge_probe),
        "m1": data.masses["test"][:, 0],
        "m2": data.masses["test"][:, 1],
        "r": data.r["test"][:, fs:],
        "params": sum(x.numel() for x in model.parameters()),
        "seconds": time.perf_counter() - t0,
        "finetune_curve": np.asarray(curve),
    }


def accel_scale(x: np.ndarray) -> float:
    """rms deviation of continuous tokens ``x (S, L, 2)`` from their constant-velocity
    extrapolation (the unit of :meth:`OrbitGPT.next_token_loss`)."""
    dev = x[:, 5:] - (2 * x[:, 3:-2] - x[:, 1:-4])
    return float(np.sqrt(np.mean(dev.astype(np.float64) ** 2))) or 1.0


def extrapolation_baselines(x: np.ndarray, skip: int, scale: float = 1.0) -> dict[str, float]:
    """Next-token MSE / ``scale**2`` of per-body polynomial extrapolation on continuous tokens
    ``x (S, L, 2)`` (over the same predicted tokens as :func:`next_token_eval`, index
    ``>= skip``, which must be >= 7 so that three earlier positions of the body exist):
    ``constant_velocity`` (``2 x_{-1} - x_{-2}``) and ``constant_acceleration`` (``3 x_{-1} -
    3 x_{-2} + x_{-3}``), where ``x_{-k}`` is the same body ``k`` steps earlier."""
    if skip < 7:
        raise ValueError("skip must be >= 7 for the extrapolation baselines")
    x = x.astype(np.float64)
    tgt = x[:, skip:]
    p1, p2, p3 = (x[:, skip - 2 * k : x.shape[1] - 2 * k] for k in (1, 2, 3))
    cv, ca = 2 * p1 - p2, 3 * p1 - 3 * p2 + p3
    return {
        "constant_velocity": float(np.mean((cv - tgt) ** 2)) / scale**2,
        "constant_acceleration": float(np.mean((ca - tgt) ** 2)) / scale**2,
    }

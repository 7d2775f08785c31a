"""The figures of every study: one colour per arm across LM, recall and orbits, distinct within a
figure, panels of at most MAX_LINES lines on one y-scale (the pointwise rules' their own), the
marks named for what they are, chance on heatmaps and recall's curves, and every figure drawn
from the committed reports' results."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import matplotlib
import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure

from lssar.positions import with_pos
from lssar.studies import style
from lssar.studies.labels import eval_label, group, key, run_label
from lssar.studies.lm import presets as lm
from lssar.studies.lm.figures import plot_results
from lssar.studies.lm.study import at_training_length
from lssar.studies.orbits import presets as orbits
from lssar.studies.recall import presets as recall
from lssar.studies.style import MAX_LINES, colour, facets, linestyle

matplotlib.use("Agg")
REPORTS = Path(__file__).resolve().parents[2] / "reports"
MIN_DELTA_E = 15.0  # CIELAB distance between any two lines of one panel


def _lab(c: str) -> np.ndarray:
    """sRGB -> CIELAB (D65)."""
    rgb = np.array(to_rgb(c))
    lin = np.where(rgb > 0.04045, ((rgb + 0.055) / 1.055) ** 2.4, rgb / 12.92)
    m = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]])
    xyz = m @ lin / np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > 0.008856, np.cbrt(xyz), 7.787 * xyz + 16 / 116)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def _lm_labels(preset: lm.Preset, train_len: int = 128) -> list[str]:
    """The result labels a preset's report has (as :func:`lssar.studies.labels.label_of`
    gives them; a constant-scale arm carries n = the training length)."""
    out = []
    for name in preset.arms:
        arm = lm.ARMS[name]
        trained = with_pos(at_training_length(arm.attention, train_len).label, arm.pos)
        if arm.window:
            out.append(f"{trained}, sliding window {train_len}")
        elif arm.own_rule:
            out.append(trained)
        for rule in arm.evals:
            rope = None if rule.rope is None else rule.rope.label
            out.append(run_label(trained, rule.attention or trained, rope))
    return out


def _recall_labels(cfg: recall.StudyConfig) -> list[str]:
    """The arm labels of a recall study's rows (its own rule, then its eval-only rules)."""
    out = []
    for name in cfg.arms:
        arm = recall.ARMS[name]
        if arm.own_rule:
            out.append(eval_label(arm, None))
        out += [eval_label(arm, r) for r in recall.eval_rules(arm, cfg.eval_ps)]
    return out


FIGURES = {
    **{f"lm {n}": _lm_labels(p) for n, p in lm.PRESETS.items()},
    **{f"recall {n}": _recall_labels(p.config) for n, p in recall.PRESETS.items()},
    **{f"orbits {n}": list(p.arms) for n, p in orbits.PRESETS.items()},
    "every LM arm": _lm_labels(lm.Preset("all", "tiny-cpu", list(lm.ARMS))),
    "every recall arm": _recall_labels(recall.StudyConfig(arms=tuple(recall.ARMS))),
}


def test_labels_are_the_reports():
    """The label helpers above give what the committed reports' results carry."""
    for report, preset in (
        ("cpu-2026-12-03", "cpu"),
        ("cpu-baselines-2026-12-03", "cpu-baselines"),
        ("cpu-paper-regime-2026-12-03", "cpu-paper-regime"),
    ):
        results = json.loads((REPORTS / report / "results.json").read_text())["results"]
        assert list(group(results)) == _lm_labels(lm.PRESETS[preset])
    for report, preset in (
        ("recall-cpu-2026-12-03", "cpu"),
        ("recall-cpu-baselines-2026-12-03", "cpu-baselines"),
    ):
        rows = json.loads((REPORTS / report / "results.json").read_text())["rows"]
        assert {r["arm"] for r in rows} == set(_recall_labels(recall.preset_config(preset)))


def test_same_arm_same_colour_in_every_study():
    twins = [
        ("softmax", "softmax", "softmax"),
        ("softmax, sliding window 128", "window", "softmax-local"),
        ("lssa", "lssa", "lssa"),
        ("lssar p=3", "lssar p=3", "lssar-p3"),
        ("lssar p=15", "lssar p=15", "lssar"),
        ("softmax-qknorm-logn", "softmax-qknorm-logn", None),
        ("ssmax", "ssmax", None),
        ("softmax + alibi", "softmax + alibi", None),
        ("softmax + nope", "softmax + nope", None),
        ("lssar p=15 + nope", "lssar p=15 + nope", None),
        ("lssa -> lssar p=15 (eval only)", "lssa -> lssar p=15 (eval)", None),
        ("lssa -> lssar p=3 (eval only)", "lssa -> lssar p=3 (eval)", None),
        ("softmax -> yarn auto (eval only)", "softmax -> yarn auto (eval)", None),
        ("softmax -> linear auto (eval only)", "softmax -> linear auto (eval)", None),
        ("softmax-qknorm-const n=128", "softmax-qknorm-const n=256", None),
    ]
    for lm_label, recall_label, orbits_arm in twins:
        assert colour(lm_label) == colour(recall_label), (lm_label, recall_label)
        assert linestyle(lm_label) == linestyle(recall_label), (lm_label, recall_label)
        if orbits_arm is not None:
            assert colour(orbits_arm) == colour(lm_label), (lm_label, orbits_arm)
    # every arm of every study has a colour of the shared palette, and no two arms share one
    for label in itertools.chain(*FIGURES.values()):
        assert key(label) in style.COLOURS, label
    assert len(set(style.COLOURS.values())) == len(style.COLOURS)


@pytest.mark.parametrize("figure", list(FIGURES))
def test_arms_are_distinct_and_panels_small(figure):
    labels = FIGURES[figure]
    looks = [(colour(a), linestyle(a)) for a in labels]
    assert len(set(looks)) == len(labels), figure
    panels = facets(labels)
    assert {a for p in panels for a in p.lines} == set(labels)  # every arm is drawn
    for p in panels:
        assert len(p.lines) <= MAX_LINES, (figure, p)
        assert p.own_scale == any(key(a) in style.POINTWISE for a in p.arms)
        for a, b in itertools.combinations(p.lines, 2):
            d = float(np.linalg.norm(_lab(colour(a)) - _lab(colour(b))))
            assert d >= MIN_DELTA_E, (figure, a, b, round(d, 1))


def test_facets_split_and_keep_references():
    sweep = [f"lssa -> lssar p={p:g} (eval)" for p in recall.EVAL_PS]
    panels = facets(["softmax", "lssa", "lssar p=15", *sweep])
    re = [p for p in panels if p.arms[0] in sweep]
    assert [len(p.arms) for p in re] == [3, 3] and all(p.refs == ("lssa", "lssar p=15") for p in re)
    assert [a for p in re for a in p.arms] == sweep  # split in order, evenly
    assert facets(["softmax", "lssar p=15", "lssa"]) == [
        style.Facet("", ("softmax", "lssar p=15", "lssa"))
    ]
    # a pointwise arm gets its own panel (and y-scale) even in a small figure
    small = facets(["softmax", "sigmoid"])
    assert [p.arms for p in small] == [("softmax",), ("sigmoid",)] and small[1].own_scale
    with pytest.raises(ValueError, match="room"):
        facets(["softmax", "lssar p=15", "sigmoid"], limit=2)
    # the positions panel names only the rules it draws (cpu-paper-regime has ALiBi, no NoPE)
    many = ["softmax", "window", "softmax-qknorm-logn", "ssmax", "lssa", "lssar p=15"]
    alibi = [p.title for p in facets([*many, "softmax + alibi"]) if "trained in" in p.title]
    assert alibi == ["ALiBi (trained in)"]
    both = facets([*many, "softmax + alibi", "softmax + nope"])
    assert [p.title for p in both if "trained in" in p.title] == ["ALiBi and NoPE (trained in)"]


def test_spread_says_what_is_shown():
    assert style.spread([1, 1]) == "one seed: no band"
    assert style.spread([3, 3]) == "mean over 3 seeds, 95% t-band"
    assert style.spread([3, 1], "interval") == (
        "mean over 3 seeds, 95% t-interval; arms with one seed: no interval"
    )


@pytest.fixture
def saved(monkeypatch) -> dict[str, Figure]:
    """File name -> the figure saved to it, kept open for inspection."""
    figs: dict[str, Figure] = {}
    real = Figure.savefig

    def savefig(fig, path, *a, **kw):
        figs[Path(path).name] = fig
        return real(fig, path, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figs


def _lines(fig: Figure) -> dict[str, list]:
    """Legend label -> its Line2D objects, over every panel."""
    out: dict[str, list] = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            out.setdefault(line.get_label(), []).append(line)
    return out


def _panels(fig: Figure) -> list:
    """The panels drawn on (not the empty slots of a grid, not a colour bar)."""
    return [ax for ax in fig.axes if ax.get_lines() and ax.get_label() != "<colorbar>"]


LM_FIGURES = {"loss_vs_length.png", "loss_by_position.png", "passkey.png"}
DIAGNOSTICS = {"entropy_sink_vs_length.png", "entropy_sink_by_row.png"}


# cpu-baselines predates the diagnostics over rows beyond the training length, so no entropy
# figure is redrawn from its results
@pytest.mark.parametrize(
    "report, figures",
    [
        ("cpu-2026-12-03", LM_FIGURES | DIAGNOSTICS),
        ("cpu-paper-regime-2026-12-03", LM_FIGURES | DIAGNOSTICS),
        ("cpu-baselines-2026-12-03", LM_FIGURES),
    ],
)
def test_lm_figures_of_the_committed_reports(report, figures, tmp_path, saved):
    results = json.loads((REPORTS / report / "results.json").read_text())["results"]
    paths = plot_results(results, tmp_path)
    assert {p.name for p in paths} == figures
    groups = group(results)
    for name in ("loss_vs_length.png", "loss_by_position.png"):
        fig = saved[name]
        assert "95% t-band" in fig.get_suptitle() and "mean over 3 seeds" in fig.get_suptitle()
        lines = _lines(fig)
        for label in groups:  # every arm drawn in its colour and style (bold or as a reference)
            drawn = lines.get(label, []) + lines.get(f"{label} (ref.)", [])
            assert drawn and {ln.get_color() for ln in drawn} == {colour(label)}, label
            assert {ln.get_linestyle() for ln in drawn} == {linestyle(label)}, label
        panels = _panels(fig)
        assert all(len(ax.get_legend().get_texts()) <= MAX_LINES for ax in panels)
        pointwise = [ax for ax in panels if ax.get_title().startswith("sigmoid")]
        shared = [ax for ax in panels if ax not in pointwise]
        assert len({ax.get_ylim() for ax in shared}) == 1  # one y-scale
        if pointwise:  # sigmoid's loss is off the shared scale, on its own
            (ax,) = pointwise
            top = max(max(ln.get_ydata()) for ln in lines["sigmoid"])
            assert shared[0].get_ylim()[1] < top <= ax.get_ylim()[1]
    # loss by position at the centres of the buckets of the longest window
    r0 = results[0]
    n, longest = len(r0["loss_by_position"]), max(int(t) for t in r0["loss"])
    centres = (np.arange(n) + 0.5) * longest / n / r0["train_len"]
    for line in itertools.chain(*_lines(saved["loss_by_position.png"]).values()):
        if line.get_label() in groups or line.get_label().endswith(" (ref.)"):
            assert np.allclose(line.get_xdata(), centres), line.get_label()
    # passkey: one colour scale with a bar that marks chance (1-digit keys 1-9: 1/9)
    pk = saved["passkey.png"]
    bars = [ax for ax in pk.axes if ax.get_label() == "<colorbar>"]
    assert len(bars) == 1
    assert "chance 11%" in [t.get_text() for t in bars[0].get_yticklabels()]
    images = [im for ax in pk.axes for im in ax.get_images()]
    assert {im.get_clim() for im in images} == {(0.0, 1.0)}


def test_lm_titles_say_what_the_marks_are(tmp_path, saved):
    from tests.studies.test_lm_report import _arm, _diag, _fake

    plot_results([_fake("softmax", "softmax", [2.0] * 5)], tmp_path / "one")
    assert saved["loss_vs_length.png"].get_suptitle() == "Loss vs length (one seed: no band)"
    results = []
    for label, ent, sink in (("softmax", 1.5, 0.3), ("lssar p=15", 0.5, 0.001), ("lssa", 2, 0.1)):
        for r in _arm(label, label, [2.0] * 5):
            r["diagnostics"] = {str(m * 16): _diag(ent, sink, m * 16) for m in (1, 2, 4, 8, 16)}
            results.append(r)
    plot_results(results, tmp_path / "three")
    assert "mean over 3 seeds, 95% t-band" in saved["loss_vs_length.png"].get_suptitle()
    for name in ("entropy_sink_vs_length.png", "entropy_sink_by_row.png"):
        fig = saved[name]
        assert "mean over 3 seeds, 95% t-band" in fig.get_suptitle()
        entropy = [ax for ax in _panels(fig) if "entropy" in ax.get_ylabel()]
        assert len({ax.get_ylim() for ax in entropy}) == 1  # one y-scale per quantity


@pytest.mark.parametrize("report", ["recall-cpu-2026-12-03", "recall-cpu-baselines-2026-12-03"])
def test_recall_figures_of_the_committed_reports(report, tmp_path, saved):
    from lssar.studies.recall.plots import plot_accuracy
    from lssar.studies.recall.report import _arms, _cells

    data = json.loads((REPORTS / report / "results.json").read_text())
    rows, n_pairs = data["rows"], data["meta"]["config"]["task"]["n_pairs"]
    names = plot_accuracy(_cells(rows), _arms(rows), tmp_path, chance=1 / n_pairs)
    assert names == ["accuracy_vs_length.png", "distance_split.png"]
    for name in names:
        fig = saved[name]
        assert "mean over 5 seeds, 95% t-interval" in fig.get_suptitle()
        panels = _panels(fig)
        for ax in panels:
            labels = ax.get_legend_handles_labels()[1]
            assert len(labels) <= MAX_LINES
            texts = [t.get_text() for t in ax.texts]
            assert f"chance {100 / n_pairs:.0f}%" in texts
            for handle, label in zip(*ax.get_legend_handles_labels()):
                assert handle.lines[0].get_color() == colour(label.removesuffix(" (ref.)"))
        assert len({ax.get_ylim() for ax in panels}) == 1


def test_recall_attention_maps_share_one_y_scale(tmp_path, saved, one_thread):
    from lssar.studies.recall.plots import plot_attention_maps
    from lssar.studies.recall.study import build_model
    from lssar.studies.recall.task import RecallTask

    task = RecallTask(train_len=16, n_pairs=2, n_queries=2, n_keys=4, n_values=4, n_filler=4)
    cfg = recall.StudyConfig(
        task=task, arms=("softmax", "lssa", "window"), multiples=(1, 2), n_layer=1, n_head=2,
        n_embd=16,
    )  # fmt: skip
    models = {a: (build_model(cfg, recall.ARMS[a]).eval(), recall.ARMS[a]) for a in cfg.arms}
    assert plot_attention_maps(models, cfg, tmp_path) == "attention_maps.png"
    fig = saved["attention_maps.png"]
    panels = _panels(fig)
    assert len(panels) == 4  # softmax, lssa, lssa with p=15 at evaluation, window
    assert len({ax.get_ylim() for ax in panels}) == 1
    for ax, label in zip(panels, ("softmax", "lssa", "lssa -> lssar p=15 (eval)", "window")):
        assert ax.get_lines()[0].get_color() == colour(label)


def test_orbits_exponents_colour_by_arm_and_say_what_is_shown(tmp_path, saved):
    from lssar.studies.orbits.plots import exponents

    def run(arm, seed, err):
        law = {"alpha": 1 + err, "beta": 1 - err, "gamma": -2 + err}
        band = {k: [v - 0.1, v + 0.1] for k, v in zip(law, (1, 1, -2))}
        return {
            "arm": arm,
            "seed": seed,
            "sr": {"power_law": law, "errors": {"max_err": abs(err)}},
            "ceiling": {"band": band, "max_err": 0.05},
        }

    arms = ["softmax", "lssar", "softmax-local", "scratch"]
    one = [run(a, 0, 0.1 * i) for i, a in enumerate(arms)]
    exponents(one, tmp_path)
    fig = saved["exponents.png"]
    assert "one seed: no interval" in [t.get_text() for t in fig.legends[0].get_texts()]
    for ax in fig.axes:
        colours = [c.lines[0].get_color() for c in ax.containers]
        assert colours == [colour(a) for a in arms]
    exponents(
        [run(a, s, 0.1 * i + 0.01 * s) for s in range(3) for i, a in enumerate(arms)], tmp_path
    )
    texts = [t.get_text() for t in saved["exponents.png"].legends[0].get_texts()]
    assert "mean over 3 seeds,\n95% t-interval" in texts

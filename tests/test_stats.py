"""t intervals and verdicts on hand-made numbers whose answer is known."""

import math

import pytest

from lssar.studies.stats import judge, mean_ci, paired_ci, t95, verdict


def test_t95_table():
    assert t95(1) == pytest.approx(12.706)
    assert t95(2) == pytest.approx(4.303)
    assert t95(30) == pytest.approx(2.042)
    assert t95(1000) == pytest.approx(1.96)
    with pytest.raises(ValueError, match="df"):
        t95(0)


def test_mean_ci_by_hand():
    # values 1, 2, 3: mean 2, sd 1, half = 4.303 / sqrt(3)
    iv = mean_ci([1.0, 2.0, 3.0])
    assert iv.mean == 2.0 and iv.n == 3
    assert iv.hi - iv.mean == pytest.approx(4.303 / math.sqrt(3))
    assert iv.lo == pytest.approx(2.0 - 4.303 / math.sqrt(3))
    one = mean_ci([0.5])
    assert one.lo is None and one.hi is None and one.mean == 0.5
    with pytest.raises(ValueError, match="values"):
        mean_ci([])


def test_verdict_supported_when_intervals_separate():
    v = verdict([0.90, 0.92, 0.91], [0.10, 0.12, 0.11], names=("lssar", "softmax"))
    assert v.label == "supported" and v.better == "a" and "lssar higher" in v.detail
    v = verdict([0.10, 0.12, 0.11], [0.90, 0.92, 0.91])
    assert v.label == "supported" and v.better == "b"


def test_verdict_within_noise_when_overlapping():
    # means differ (0.6 vs 0.5) but the seeds spread widely: intervals overlap
    v = verdict([0.4, 0.6, 0.8], [0.3, 0.5, 0.7])
    assert v.label == "within noise" and v.better is None


def test_verdict_inconclusive_below_floor_at_1x():
    v = verdict([0.9, 0.9, 0.9], [0.1, 0.1, 0.1], a_at_1x=[0.85, 0.86, 0.84], b_at_1x=[1, 1, 1])
    assert v.label == "inconclusive" and "a is at" in v.detail
    v = verdict([0.9, 0.9, 0.9], [0.1, 0.1, 0.1], a_at_1x=[1, 1, 1], b_at_1x=[0.5, 0.6, 0.7])
    assert v.label == "inconclusive"
    # at the floor exactly is fine
    v = verdict([0.9, 0.91, 0.92], [0.1, 0.11, 0.12], a_at_1x=[0.9], b_at_1x=[0.95])
    assert v.label == "supported"


def test_verdict_one_seed_never_supported():
    v = verdict([1.0], [0.0])
    assert v.label == "no interval" and v.better is None


def test_paired_ci_removes_the_shared_seed_effect():
    # seeds move both arms together: separate intervals overlap, the paired one excludes 0
    a, b = [2.0, 2.5, 3.0], [2.1, 2.6, 3.1]
    assert mean_ci(a).lo < mean_ci(b).hi  # unpaired: overlapping
    d = paired_ci(a, b)
    assert d.mean == pytest.approx(-0.1) and d.half == pytest.approx(0.0, abs=1e-12)
    # by hand: differences -1, 0, -2 -> mean -1, sd 1
    d = paired_ci([1.0, 2.0, 0.0], [2.0, 2.0, 2.0])
    assert d.mean == -1.0 and d.half == pytest.approx(4.303 / math.sqrt(3))
    with pytest.raises(ValueError, match="same seeds"):
        paired_ci([1.0, 2.0], [1.0])


@pytest.mark.parametrize(
    "values, bounds, want",
    [
        ([-0.30, -0.31, -0.29], {"hi": 0.0}, "supported"),  # clearly below 0
        ([0.30, 0.31, 0.29], {"hi": 0.0}, "contradicted"),  # clearly above 0
        ([-0.3, 0.1, -0.1], {"hi": 0.0}, "within noise"),  # straddles 0
        ([0.0, 0.0, 0.0], {"hi": 0.0}, "within noise"),  # touching the bound is not beyond it
        ([1.05, 1.06, 1.04], {"hi": 1.10}, "supported"),
        ([1.19, 1.2, 1.21], {"hi": 1.10}, "contradicted"),
        ([1.6, 1.61, 1.59], {"lo": 1.5}, "supported"),
        ([0.001, -0.002, 0.0], {"lo": -0.02, "hi": 0.02}, "supported"),
        ([0.05, 0.06, 0.04], {"lo": -0.02, "hi": 0.02}, "contradicted"),
        ([-0.5], {"hi": 0.0}, "no interval"),  # one seed: never a verdict
    ],
)
def test_judge_reads_claims_from_intervals(values, bounds, want):
    assert judge(mean_ci(values), **bounds) == want


def test_judge_rejects_an_empty_range():
    with pytest.raises(ValueError, match="empty claim range"):
        judge(mean_ci([1.0, 2.0]), lo=1.0, hi=0.0)

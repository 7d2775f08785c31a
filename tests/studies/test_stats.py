"""The studies' statistics: on hand-made numbers whose answer is known, and against scipy on
fixed inputs (the library computes Student's t itself)."""

import math

import pytest
from scipy import stats as sp

from lssar.studies.stats import (
    Claim,
    holm,
    judge,
    judge_claims,
    mean_ci,
    paired_ci,
    t95,
    t_cdf,
    t_ppf,
    t_test,
    tost,
    verdict,
)


def test_t95_table():
    assert t95(1) == pytest.approx(12.706, abs=1e-3)
    assert t95(2) == pytest.approx(4.303, abs=1e-3)
    assert t95(30) == pytest.approx(2.042, abs=1e-3)
    assert t95(1000) == pytest.approx(1.962, abs=1e-3)
    with pytest.raises(ValueError, match="df"):
        t95(0)


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7, 29, 120])
def test_student_t_matches_scipy(df):
    for x in (-12.0, -2.5, -0.3, 0.0, 0.7, 1.96, 4.0, 30.0):
        assert t_cdf(x, df) == pytest.approx(sp.t.cdf(x, df), abs=1e-13)
    for q in (1e-4, 0.025, 0.05, 0.3, 0.5, 0.9, 0.95, 0.975, 0.9995):
        assert t_ppf(q, df) == pytest.approx(sp.t.ppf(q, df), rel=1e-9, abs=1e-12)
    with pytest.raises(ValueError, match="q="):
        t_ppf(1.0, df)


# per-seed values of two arms (fixed inputs for the scipy comparisons)
A = [2.31, 2.19, 2.44, 2.27, 2.35]
B = [2.83, 2.71, 2.95, 2.79, 2.90]
C = [2.30, 2.25, 2.38, 2.31, 2.33]


def test_intervals_and_t_tests_match_scipy():
    for xs in (A, [x - y for x, y in zip(A, C)]):
        iv = mean_ci(xs)
        lo, hi = sp.t.interval(0.95, len(xs) - 1, loc=sum(xs) / len(xs), scale=sp.sem(xs))
        assert (iv.lo, iv.hi) == (pytest.approx(lo, abs=1e-12), pytest.approx(hi, abs=1e-12))
        assert iv.p == pytest.approx(sp.ttest_1samp(xs, 0.0).pvalue, rel=1e-9)
    for a, b in ((A, B), (A, C)):
        assert t_test(a, b) == pytest.approx(sp.ttest_rel(a, b).pvalue, rel=1e-9)
        assert paired_ci(a, b).p == t_test(a, b)
    iv90 = mean_ci(A, level=0.9)
    lo, hi = sp.t.interval(0.9, len(A) - 1, loc=sum(A) / len(A), scale=sp.sem(A))
    assert (iv90.lo, iv90.hi) == (pytest.approx(lo, abs=1e-12), pytest.approx(hi, abs=1e-12))
    assert t_test([1.0]) is None


@pytest.mark.parametrize("margin", [0.01, 0.05, 0.1])
def test_tost_matches_two_one_sided_scipy_tests(margin):
    d = [x - y for x, y in zip(A, C)]  # mean 0.0 ± small
    e = tost(A, C, margin=margin)
    p_low = sp.ttest_1samp(d, -margin, alternative="greater").pvalue
    p_high = sp.ttest_1samp(d, margin, alternative="less").pvalue
    assert e.p == pytest.approx(max(p_low, p_high), rel=1e-9)
    assert e.equivalent == (max(p_low, p_high) < 0.05)
    lo, hi = sp.t.interval(0.9, len(d) - 1, loc=sum(d) / len(d), scale=sp.sem(d))
    assert (e.lo, e.hi) == (pytest.approx(lo, abs=1e-12), pytest.approx(hi, abs=1e-12))
    # equivalent exactly when the 90% interval lies inside the margin
    assert e.equivalent == (-margin < e.lo and e.hi < margin)


def test_tost_never_calls_a_clear_difference_or_one_seed_equivalent():
    assert not tost(A, B, margin=0.1).equivalent  # 0.5 apart
    assert tost(A, C, margin=0.1).equivalent
    one = tost([2.0], [2.0], margin=0.1)
    assert not one.equivalent and one.p is None
    with pytest.raises(ValueError, match="margin"):
        tost(A, C, margin=0.0)


def test_holm_step_down_by_hand():
    # m = 4: thresholds 0.05/4, 0.05/3, 0.05/2, 0.05/1 on the sorted p-values
    assert holm([0.01, 0.04, 0.03, 0.005]) == [True, False, False, True]
    assert holm([0.011, 0.02, 0.04, 0.3]) == [True, False, False, False]  # 0.011 <= 0.0125
    assert holm([0.0125, 0.0166, 0.025, 0.05]) == [True, True, True, True]  # every bound met
    assert holm([0.001, 0.2, 0.01]) == [True, False, True]  # 0.01 <= 0.05/2
    # stops at the first failure even if a later p would pass its own bound
    assert holm([0.02, 0.021, 0.9]) == [False, False, False]
    assert holm([0.01, None, 0.02]) == [True, None, True]  # one seed: not in the family
    # Holm is never stricter than Bonferroni and never looser than uncorrected
    ps = [0.001, 0.013, 0.02, 0.04, 0.2]
    bonf = [p <= 0.05 / len(ps) for p in ps]
    assert all(h >= b for h, b in zip(holm(ps), bonf))
    assert all(h <= (p <= 0.05) for h, p in zip(holm(ps), ps))


def test_mean_ci_by_hand():
    # values 1, 2, 3: mean 2, sd 1, half = 4.303 / sqrt(3)
    iv = mean_ci([1.0, 2.0, 3.0])
    assert iv.mean == 2.0 and iv.n == 3
    assert iv.hi - iv.mean == pytest.approx(t95(2) / math.sqrt(3))
    assert iv.lo == pytest.approx(2.0 - t95(2) / math.sqrt(3))
    one = mean_ci([0.5])
    assert one.lo is None and one.hi is None and one.mean == 0.5
    with pytest.raises(ValueError, match="values"):
        mean_ci([])


def test_verdict_supported_when_intervals_separate():
    v = verdict([0.90, 0.92, 0.91], [0.10, 0.12, 0.11], names=("lssar", "softmax"))
    assert v.label == "supported" and v.better == "a" and "lssar higher" in v.detail
    v = verdict([0.10, 0.12, 0.11], [0.90, 0.92, 0.91])
    assert v.label == "supported" and v.better == "b"


def test_verdict_is_paired_by_seed():
    # seeds move both arms together: separate intervals overlap, the paired one excludes 0
    v = verdict([0.4, 0.6, 0.8], [0.3, 0.5, 0.7])
    assert v.label == "supported" and v.better == "a" and "+10.0 ± 0.0 points" in v.detail
    # the differences straddle 0: within noise
    v = verdict([0.4, 0.6, 0.8], [0.5, 0.4, 0.75])
    assert v.label == "within noise" and v.better is None and "includes 0" in v.detail
    with pytest.raises(ValueError, match="same seeds"):
        verdict([0.4, 0.6, 0.8], [0.5, 0.4])


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
    assert d.mean == -1.0 and d.half == pytest.approx(t95(2) / math.sqrt(3))
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


def test_claim_p_values_are_scipy_tests_against_the_criterion():
    below = Claim("a - b < 0", [-0.15, -0.20, -0.25], "criterion < 0", hi=0.0)
    assert below.raw() == (
        "supported",
        pytest.approx(sp.ttest_1samp([-0.15, -0.2, -0.25], 0).pvalue),
    )
    ratio = Claim("x <= 1.1", [1.19, 1.2, 1.21], "criterion <= 1.10", hi=1.10)
    assert ratio.raw() == (
        "contradicted",
        pytest.approx(sp.ttest_1samp([1.19, 1.2, 1.21], 1.1).pvalue),
    )
    d = [0.001, -0.002, 0.0]
    tie = Claim("a = b", d, "TOST", margin=0.02)
    p = max(
        sp.ttest_1samp(d, -0.02, alternative="greater").pvalue,
        sp.ttest_1samp(d, 0.02, alternative="less").pvalue,
    )
    assert tie.raw() == ("supported", pytest.approx(p, rel=1e-9))
    # the same mean with seeds that disagree: its 90% interval leaves the margin
    wide = Claim("a = b", [0.03, -0.04, 0.007], "TOST", margin=0.02)
    assert wide.raw()[0] == "not separable at this power"
    far = Claim("a = b", [0.05, 0.06, 0.04], "TOST", margin=0.02)
    assert far.raw() == (
        "contradicted",
        pytest.approx(sp.ttest_1samp([0.05, 0.06, 0.04], 0.02).pvalue),
    )
    assert Claim("one seed", [-0.5], "criterion < 0", hi=0.0).raw() == ("no interval", None)
    with pytest.raises(ValueError, match="exactly one of lo, hi or margin"):
        Claim("two bounds", [0.1, 0.2], "c", lo=-1.0, hi=1.0)


def test_holm_over_the_declared_claims_says_which_verdicts_change():
    marginal = Claim("marginal", [-0.15, -0.20, -0.25], "criterion < 0", hi=0.0)  # p = 0.020
    clear = Claim("clear", [-0.30, -0.31, -0.29], "criterion < 0", hi=0.0)  # p < 0.001
    noise = Claim("noise", [-0.3, 0.1, -0.1], "criterion < 0", hi=0.0)  # p = 0.48
    tie = Claim("tie", [0.011, 0.013, 0.012], "TOST", margin=0.02)  # TOST p = 0.0026
    # alone, the marginal claim keeps its verdict
    assert judge_claims([marginal]) == [
        ("supported", "supported", "p = 0.02; unchanged by Holm over the 1 declared claims")
    ]
    # Holm compares the k-th smallest of m p-values with 0.05 / (m - k + 1): with one larger p
    # after it, 0.020 is held to 0.05 / 2 = 0.025 and kept
    assert [j[1] for j in judge_claims([marginal, clear, clear, noise])] == [
        "supported",
        "supported",
        "supported",
        "within noise",
    ]
    # with two larger ones after it, to 0.05 / 3 = 0.0167: Holm drops it
    family = [marginal, clear, tie, noise, noise]
    judged = judge_claims(family)
    assert judged[0] == (
        "supported",
        "within noise",
        "p = 0.02; **Holm changes it** (raw: supported) over the 5 declared claims",
    )
    assert [j[1] for j in judged[1:]] == ["supported", "supported", "within noise", "within noise"]
    assert all("unchanged" in j[2] for j in judged[1:])
    # an equivalence claim Holm drops is "not separable", never "matches"
    weak_tie = Claim("weak tie", [0.0, 0.012, 0.006], "TOST", margin=0.02)  # TOST p = 0.028
    assert weak_tie.raw()[0] == "supported"
    assert judge_claims([weak_tie, noise, noise, noise])[0][1] == "not separable at this power"
    assert judge_claims([Claim("one", [1.0], "c", hi=0.0)]) == [
        ("no interval", "no interval", "one seed: no test")
    ]

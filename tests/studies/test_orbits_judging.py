"""Tests for lssar.studies.orbits.judging: the verdicts and the report's sentences on fixed
numbers (largest exponent errors of arms and of their noise ceilings, per seed)."""

import pytest

from lssar.studies import stats
from lssar.studies.orbits import judging

MARGIN = 0.05


def _results(errs: dict[str, list[float]], ceils: dict[str, list[float]]) -> list[dict]:
    """Minimal run results: arm -> per-seed largest error of the arm and of its ceiling."""
    return [
        {
            "arm": arm,
            "seed": s,
            "sr": {"errors": {"max_err": e}},
            "ceiling": {"max_err": ceils[arm][s]},
        }
        for arm, es in errs.items()
        for s, e in enumerate(es)
    ]


def test_versus_ceiling_labels():
    ceil = [0.05, 0.06, 0.04]
    further = judging.versus_ceiling([0.16, 0.17, 0.14], ceil, MARGIN)
    assert further["label"] == "further than its ceiling"
    assert further["diff"]["lo"] > 0 and "arm − ceiling = +0.107 ±" in further["text"]
    close = judging.versus_ceiling([0.052, 0.061, 0.039], ceil, MARGIN)
    assert close["label"] == "as close as its ceiling" and close["tost"]["equivalent"]
    noisy = judging.versus_ceiling([0.02, 0.20, 0.05], ceil, MARGIN)
    assert noisy["label"] == "not separable from its ceiling"
    assert not noisy["tost"]["equivalent"] and noisy["diff"]["lo"] < 0 < noisy["diff"]["hi"]
    assert judging.versus_ceiling([0.3], [0.05], MARGIN)["label"] == "no interval"
    # beyond noise uncorrected, but the multiplicity-corrected test does not reject: no claim
    held = judging.versus_ceiling([0.16, 0.17, 0.14], ceil, MARGIN, reject=False)
    assert held["label"] == "not separable from its ceiling" and "does not reject" in held["text"]


def test_compare_says_closer_only_beyond_noise():
    a, b = [0.10, 0.12, 0.11], [0.15, 0.16, 0.17]
    c = judging.compare(a, b, ("LSSAR", "softmax"))
    assert c["label"] == "LSSAR closer"
    assert c["text"].startswith("LSSAR is closer to Newton than softmax: ")
    assert "-0.050 ±" in c["text"] and "paired by seed" in c["text"]
    assert judging.compare(b, a, ("softmax", "LSSAR"))["label"] == "LSSAR closer"
    # LSSAR lower on average, but the interval includes 0: the committed cpu report's case
    tie = judging.compare([0.165, 0.145, 0.185], [0.179, 0.199, 0.159], ("LSSAR", "softmax"))
    assert tie["label"] == "not separable"
    assert tie["text"].startswith("LSSAR and softmax are not separable at this power: ")
    assert "closer" not in tie["text"] and "-0.014 ±" in tie["text"]
    assert judging.compare([0.1], [0.2], ("LSSAR", "softmax"))["label"] == "no interval"
    tiny = judging.compare([1e-4, 2e-4, 3e-4], [4e-4, 5e-4, 6e-4], ("a", "b"))
    assert "-3.00e-04" in tiny["text"]  # a small difference beyond noise never prints as 0.000


def _claim(lssar, softmax, ceil_l=(0.05, 0.06, 0.04), ceil_s=(0.05, 0.06, 0.04)):
    return judging.claim(
        _results({"softmax": softmax, "lssar": lssar}, {"softmax": ceil_s, "lssar": ceil_l}),
        MARGIN,
    )


def test_claim_supported_contradicted_and_within_noise():
    sup = _claim([0.051, 0.062, 0.040], [0.20, 0.22, 0.19])
    assert sup["status"] == "supported" and sup["text"].startswith("**Supported at this scale**")
    assert "LSSAR is closer to Newton than softmax" in sup["text"]
    con = _claim([0.16, 0.17, 0.14], [0.17, 0.16, 0.19])
    assert con["status"] == "contradicted"
    assert con["parts"]["lssar recovers Newton's form"] == "contradicted"
    assert "further from Newton's than its noise ceiling's" in con["text"]
    assert "not separable at this power" in con["text"]  # lssar − softmax includes 0
    soft_ok = _claim([0.10, 0.30, 0.15], [0.051, 0.062, 0.040])
    assert soft_ok["status"] == "contradicted" and soft_ok["parts"]["softmax does not"] == (
        "contradicted"
    )
    assert "softmax's exponents are as close to Newton's as its noise ceiling's" in soft_ok["text"]
    vague = _claim([0.02, 0.20, 0.05], [0.03, 0.25, 0.07])
    assert vague["status"] == "within noise"
    assert vague["text"].startswith("**Not separable at this power**")
    assert [t["test"] for t in vague["tests"]] == list(judging.CLAIM_TESTS)


def test_claim_is_holm_corrected():
    lssar, ceil = [0.12, 0.16, 0.19], [0.05, 0.06, 0.06]  # differences 0.07, 0.10, 0.13
    p = stats.paired_ci(lssar, ceil).p
    assert 0.05 / 3 < p < 0.05  # beyond noise alone, not after Holm over the three tests
    v = _claim(lssar, [0.10, 0.30, 0.15], ceil_l=ceil)
    assert v["lssar"]["label"] == "not separable from its ceiling"
    assert v["tests"][0]["holm_rejects"] is False and v["status"] == "within noise"
    alone = judging.versus_ceiling(lssar, ceil, MARGIN)
    assert alone["label"] == "further than its ceiling"


def test_claim_with_one_seed_or_a_missing_arm():
    one = judging.claim(
        _results({"softmax": [0.2], "lssar": [0.1]}, {"softmax": [0.05], "lssar": [0.05]}),
        MARGIN,
    )
    assert one["status"] == "no interval" and one["text"].startswith("**Not judged**")
    assert "closer" not in one["text"]
    miss = judging.claim(_results({"softmax": [0.2, 0.1]}, {"softmax": [0.05, 0.04]}), MARGIN)
    assert miss["status"] == "not assessed"


def test_exploratory_covers_every_model_arm():
    errs = {"softmax": [0.2, 0.21, 0.19], "lssar": [0.1, 0.12, 0.11], "lssa": [0.15, 0.3, 0.2]}
    res = _results(errs, {a: [0.05, 0.05, 0.05] for a in errs})
    res.append({"arm": "oracle", "seed": 0, "sr": {"errors": {"max_err": 0.0}}, "ceiling": None})
    ex = judging.exploratory(res, MARGIN)
    assert list(ex) == ["softmax", "lssar", "lssa"]  # the oracle has no ceiling
    assert ex["lssa"]["softmax"]["label"] == "not separable" and "lssar" in ex["lssa"]
    assert ex["lssar"]["softmax"]["label"] == "lssar closer" and "lssar" not in ex["lssar"]
    assert ex["softmax"]["ceiling"]["label"] == "further than its ceiling"


@pytest.mark.parametrize("x,out", [(0.1234, "0.123"), (-0.004, "-4.00e-03"), (0.0, "0.000")])
def test_numbers_keep_their_digits(x, out):
    assert judging.num(x) == out

"""The findings (docs/findings.md, and the README's one-line summaries) agree with the committed
reports they quote (lssar.studies.findings)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from lssar.studies import findings
from lssar.studies.findings import (
    check_page,
    check_text,
    equivalence_words,
    findings_section,
    main,
    marked_paragraphs,
    project_root,
)
from lssar.studies.labels import label_of

ROOT = Path(__file__).resolve().parents[2]
REPORT = "reports/cpu-baselines-2026-12-03"


def _one(sentence: str, marker: str) -> list:
    return check_text(f"\n- {sentence}\n  <!-- check {REPORT}: {marker} -->\n", ROOT)


@pytest.mark.parametrize("page, least", [("docs/findings.md", 100), ("README.md", 10)])
def test_every_finding_agrees_with_its_report(page, least):
    checks, words = check_page(ROOT / page)
    assert len(checks) >= least  # every bullet of the findings carries its markers
    assert [(c.line, c.expr, c.problem) for c in checks if c.problem] == []
    assert words == []
    assert main([str(ROOT / page)]) == 0


def test_the_findings_page_is_findings_from_its_title_on():
    text = "# Findings\n\nIntro.\n\n## Recall\n\nLSSAR ties ALiBi.\n"
    assert equivalence_words(findings_section(text)) == ["ties"]
    assert project_root(ROOT / "docs" / "findings.md") == ROOT


def test_a_wrong_number_a_wrong_verdict_and_an_unquoted_number_fail():
    expr = 'loss "lssar p=15" - "softmax + alibi" @16'
    ok = _one("LSSAR − ALiBi = +0.244 ± 0.054.", f"{expr} = +0.244 ± 0.054; sig")
    assert ok[0].problem is None and abs(ok[0].got.mean - 0.2438) < 1e-3
    wrong = _one("LSSAR − ALiBi = +0.254 ± 0.054.", f"{expr} = +0.254 ± 0.054; sig")
    assert "the report gives 0.24" in wrong[0].problem
    verdict = _one("LSSAR − ALiBi = +0.244 ± 0.054.", f"{expr} = +0.244 ± 0.054; ns")
    assert "excludes 0" in verdict[0].problem
    unquoted = _one("LSSAR is worse than ALiBi.", f"{expr} = +0.244 ± 0.054; sig")
    assert "not in the sentence" in unquoted[0].problem


def test_percent_ratio_and_missing_arms():
    got = _one("16x / 1x = 1.01 ± 0.00.", 'loss "softmax + alibi" @16/1 = 1.01 ± 0.00')
    assert got[0].problem is None
    rel = _one("(−4.6% ± 1.9%)", 'loss "lssar p=15" / "softmax + alibi" @1 = −4.6% ± 1.9%')
    assert abs(100 * rel[0].got.mean - (1.8657 / 1.9564 - 1) * 100) < 0.1
    missing = _one("x 1.0", 'loss "no such arm" @16 = 1.0')
    assert "not in the report" in missing[0].problem
    garbled = _one("x 1.0", "loss lssar @16 = 1.0")
    assert "cannot read the expression" in garbled[0].problem


def test_an_equivalence_marker_quotes_tost_and_an_excess_is_a_paired_difference():
    expr = 'loss "lssar p=15" - "softmax + alibi" @16'
    # TOST's 90% interval 0.207 .. 0.281: inside +-0.5, not inside +-0.02
    wide = _one("0.207 to 0.281", f"{expr} tost 0.5 = 0.207 to 0.281; equivalent")
    assert wide[0].problem is None
    narrow = _one("0.207 to 0.281", f"{expr} tost 0.02 = 0.207 to 0.281; equivalent")
    assert "says not equivalent" in narrow[0].problem
    off = _one("0.217 to 0.281", f"{expr} tost 0.02 = 0.217 to 0.281; not equivalent")
    assert "TOST's 90% interval is 0.2070" in off[0].problem
    bare = _one("0.207 to 0.281", f"{expr} = 0.207 to 0.281; equivalent")
    assert "add 'tost MARGIN'" in bare[0].problem
    # 16x - 1x, paired by seed (nats per token)
    got = _one("+0.358 ± 0.024", 'loss "lssar p=15" @16-1 = +0.358 ± 0.024; sig')
    assert got[0].problem is None and abs(got[0].got.mean - 0.3579) < 1e-3


def test_equivalence_words_are_flagged_outside_markers():
    text = "What the committed reports show\n- LSSAR matches softmax at 1x.\n## Next\nties"
    assert equivalence_words(findings_section(text)) == ["matches"]
    assert equivalence_words('- as well as <!-- check a: loss "x" @1 = 1 -->') == ["as well as"]


CPU = "reports/cpu-2026-12-03"


def _cpu(sentence: str, marker: str) -> list:
    return check_text(f"\n- {sentence}\n  <!-- check {CPU}: {marker} -->\n", ROOT)


ANCHOR = 'loss "lssar p=15" - "softmax" @16 = −0.60 ± 0.16; sig'


def _claim(claim: str, word: str) -> str | None:
    """The problem of ``claim`` judged on LSSAR − softmax at 16x, whose sentence says ``word``."""
    text = (
        f"\n- LSSAR − softmax at 16x: −0.60 ± 0.16, {word}.\n"
        f"  <!-- check {CPU}: {ANCHOR} -->\n  <!-- check {CPU}: {claim} -->\n"
    )
    return check_text(text, ROOT)[1].problem


def test_claim_markers_are_held_to_the_reports_holm_verdicts():
    assert _claim('claim "LSSAR beats softmax at" = supported', "supported") is None
    wrong = _claim('claim "LSSAR beats softmax at" = within noise', "within noise")
    assert "verdict is 'supported', not 'within noise'" in wrong
    flat = _claim('claim "LSSAR (p=15) loss stays nearly flat" = contradicted', "contradicted")
    assert flat is None
    # "equivalent" only for an equivalence claim that TOST supports
    tost = _claim('claim "LSSAR matches softmax at the training" = equivalent', "equivalent")
    assert tost is None
    directional = _claim('claim "LSSAR beats softmax at" = equivalent', "equivalent")
    assert "directional" in directional
    ambiguous = _claim('claim "Fine-tuning-free" = contradicted', "contradicted")
    assert "4 declared claims start with" in ambiguous
    assert "cannot read 'flat'" in _claim('claim "LSSAR beats softmax at" = flat', "flat")


def test_a_claim_must_be_said_of_the_quantity_it_is_judged_on():
    claim = 'claim "LSSAR beats softmax at" = supported'
    assert _claim(claim, "as the paper says") == (
        "no verdict word says 'supported' of '−0.60 ± 0.16'"
    )
    assert _claim(claim, "so LSSAR beats softmax") is None  # a direction word says it
    alone = check_text(f"\n- x\n  <!-- check {CPU}: {claim} -->\n", ROOT)[0].problem
    assert alone == "a claim marker follows the marker of the quantity it is judged on"


def test_only_a_checked_equivalence_claim_lets_a_bullet_say_matches():
    ok = 'LSSAR matches softmax at 1x. <!-- check r: claim "LSSAR matches" = equivalent -->'
    assert equivalence_words(f"- {ok}\n- softmax ties ALiBi") == ["ties"]
    other = '- LSSAR matches softmax. <!-- check r: claim "LSSAR beats" = supported -->'
    assert equivalence_words(other) == ["matches"]


def test_passkey_by_distance_and_sink_beyond_the_training_length():
    results = json.loads((ROOT / CPU / "results.json").read_text())["results"]
    soft = [r for r in results if label_of(r) == "softmax"]
    at = str(16 * soft[0]["train_len"])
    hits = [r["passkey"]["by_distance"][at]["beyond"] for r in soft]
    want = sum(h["hits"] / h["n"] for h in hits) / len(hits)
    got = _cpu("36.1 ± 23.9%", 'passkey "softmax" @16 beyond = 36.1 ± 23.9%')[0]
    assert got.problem is None and abs(got.got.mean - want) < 1e-12
    sinks = [np.mean(r["diagnostics"][at]["sink_beyond"]) for r in soft]
    uniform = [r["diagnostics"][at]["uniform_sink_beyond"] for r in soft]
    rel = _cpu("x", 'sink "softmax" / "uniform" @16 beyond = 0')[0].got
    assert abs(rel.mean - np.mean([s / u - 1 for s, u in zip(sinks, uniform)])) < 1e-12
    every_row = _cpu("x", 'sink "softmax" @16 = 0')[0].got.mean
    assert abs(every_row - np.mean([np.mean(r["diagnostics"][at]["sink"]) for r in soft])) < 1e-12


def test_own_window_and_copy_probe_quantities(tmp_path):
    """``own`` (the own-window control's loss), ``copy`` / ``firstcopy`` / ``owncopy`` (the copy
    probe) from an LM report's results, paired by seed with a quantity of another kind."""
    rep = tmp_path / "reports" / "ctx"
    rep.mkdir(parents=True)
    base = json.loads((ROOT / CPU / "results.json").read_text())["results"]
    results = [r for r in base if label_of(r) == "lssar p=15"]
    at = str(16 * results[0]["train_len"])
    for r, (full, own, second, alone) in zip(
        results, [(2.0, 1.9, 1.5, 2.3), (2.1, 1.95, 1.6, 2.2), (2.05, 1.9, 1.4, 2.25)]
    ):
        probe = lambda s: {"first": {at: 2.4}, "second": {at: s}}  # noqa: E731
        r["loss"][at], r["copy"] = full, probe(second)
        r["own_window"] = {"window": r["train_len"], "loss": {at: own}, "copy": probe(alone)}
    (rep / "results.json").write_text(json.dumps({"results": results}))
    arm = label_of(results[0])

    def got(expr):
        text = f"\n- x\n  <!-- check reports/ctx: {expr} = 0 -->\n"
        return check_text(text, tmp_path)[0].got.mean

    assert got(f'own "{arm}" @16') == pytest.approx(1.9166667)
    assert got(f'loss "{arm}" - own "{arm}" @16') == pytest.approx(0.1333333)
    assert got(f'copy "{arm}" - owncopy "{arm}" @16') == pytest.approx(1.5 - 2.25)
    assert got(f'copy "{arm}" - firstcopy "{arm}" @16') == pytest.approx(1.5 - 2.4)
    # beyond noise, "better" is said of the full context here (its loss is higher: worse)
    checks = check_text(
        f"\n- Full context is worse than its own window: +0.13 ± 0.07.\n"
        f'  <!-- check reports/ctx: loss "{arm}" - own "{arm}" @16 = +0.13 ± 0.07; sig -->\n',
        tmp_path,
    )
    assert [c.problem for c in checks] == [None]
    flipped = check_text(
        f"\n- Full context beats its own window: +0.13 ± 0.07.\n"
        f'  <!-- check reports/ctx: loss "{arm}" - own "{arm}" @16 = +0.13 ± 0.07; sig -->\n',
        tmp_path,
    )
    assert any("makes it worse" in (c.problem or "") for c in flipped)  # 'beats' said of it


def test_finding_paragraphs_of_the_studies_are_findings_too():
    text = (
        "# x\nWhat the committed reports show\n- a\n## Orbits\ntext that ties\n\n"
        "**Finding** (recall): the gain is matched by\nthe scale alone.\n\n## Next\n"
    )
    section = findings_section(text)
    assert "- a" in section and "matched by\nthe scale" in section and "text that" not in section
    assert equivalence_words(section) == ["matched"]


# ------------------------------------------------------------------ the prose held to the markers

FINDINGS = (ROOT / "docs" / "findings.md").read_text()
# every page with markers: the findings, and the README's one-line summaries of them
PAGES = [FINDINGS, (ROOT / "README.md").read_text()]
COMMENT = re.compile(r"<!--.*?-->", re.S)
# a word of the opposite verdict for each kind of VERDICT_WORDS
OPPOSITE = {
    "better": "is worse than",
    "worse": "beats",
    "holm": "beats",
    "noise": "beats",
    "sig": "within noise",
    "supported": "contradicted",
    "contradicted": "supported",
    "equivalent": "contradicted",
}


def _prose_spans(block: str, pattern: re.Pattern) -> list[re.Match]:
    """The matches of ``pattern`` in ``block`` outside its HTML comments."""
    comments = [m.span() for m in COMMENT.finditer(block)]
    return [m for m in pattern.finditer(block) if not any(a <= m.start() < b for a, b in comments)]


def _fails(block: str) -> bool:
    return any(c.problem for c in check_text(block, ROOT))


def test_the_issues_edits_of_the_findings_fail(tmp_path):
    """The five edits a hostile reader tried, each of which the marker-only checker passed
    ("110 of 110 markers agree"), on a copy of the findings page beside the same reports."""
    (tmp_path / "reports").symlink_to(ROOT / "reports")
    copy = tmp_path / "findings.md"
    copy.write_text(FINDINGS)
    assert main([str(copy)]) == 0
    for old, new in [
        ("LSSAR p=15 beats softmax+RoPE", "LSSAR p=15 is worse than softmax+RoPE"),
        ("on top of it is within noise", "on top of it beats"),
        ("against the paper's 1.04: contradicted", "against the paper's 1.04: supported"),
        ("(16x: 2.22 ± 0.05", "(16x: 12.22 ± 0.05"),
        ("difference −0.60 ± 0.16", "difference −0.60 ± 0.169"),
    ]:
        assert FINDINGS.count(old) == 1, old
        copy.write_text(FINDINGS.replace(old, new))
        assert main([str(copy)]) == 1, (old, new)


def test_every_verdict_word_of_the_findings_turned_around_fails():
    """Each verdict word of a marked paragraph, replaced by one of the opposite verdict."""
    passed = []
    for page, (start, end) in ((t, ab) for t in PAGES for ab in marked_paragraphs(t)):
        block = page[start:end]
        for m in _prose_spans(block, re.compile(findings._WORDS.pattern, re.I)):
            edited = block[: m.start()] + OPPOSITE[m.lastgroup] + block[m.end() :]
            if not _fails(edited):
                passed.append((m.group(), block[max(0, m.start() - 40) : m.end() + 40]))
    assert passed == []


@pytest.mark.parametrize(
    "edit",
    [
        lambda n: "1" + n.lstrip("+-−") if n[0] not in "+-−" else n[0] + "1" + n[1:],  # 12.22
        lambda n: n[:-1] + "9" + n[-1] if n.endswith("%") else n + "9",  # 0.169
        lambda n: ("−" + n) if n[0] not in "+-−" else ("+" if n[0] in "-−" else "−") + n[1:],
    ],
    ids=["a digit before", "a digit after", "the sign"],
)
def test_every_number_of_the_findings_edited_fails(edit):
    number = re.compile(r"(?<![\w.])[+\-−]?\d+(?:,\d{3})*(?:\.\d+)?%?")
    passed = []
    for page, (start, end) in ((t, ab) for t in PAGES for ab in marked_paragraphs(t)):
        block = page[start:end]
        for m in _prose_spans(block, number):
            n = m.group()
            if not ("." in n or n.endswith("%")):
                continue  # an integer (16x, 3 seeds, p=15): the setting, not a measurement
            edited = block[: m.start()] + edit(n) + block[m.end() :]
            if not _fails(edited):
                passed.append((n, edit(n), block[max(0, m.start() - 40) : m.end() + 40]))
    assert passed == []

"""The README's findings agree with the committed reports they quote (lssar.studies.findings)."""

from __future__ import annotations

from pathlib import Path

from lssar.studies.findings import (
    check_text,
    equivalence_words,
    findings_section,
    main,
)

ROOT = Path(__file__).resolve().parents[1]
REPORT = "reports/cpu-baselines-2026-12-03"


def _one(sentence: str, marker: str) -> list:
    return check_text(f"\n- {sentence}\n  <!-- check {REPORT}: {marker} -->\n", ROOT)


def test_every_readme_finding_agrees_with_its_report():
    text = (ROOT / "README.md").read_text()
    checks = check_text(text, ROOT)
    assert len(checks) >= 30  # every bullet of the findings carries its markers
    assert [(c.line, c.expr, c.problem) for c in checks if c.problem] == []
    assert equivalence_words(findings_section(text)) == []
    assert main([str(ROOT / "README.md")]) == 0


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


def test_equivalence_words_are_flagged_outside_markers():
    text = "What the committed reports show\n- LSSAR matches softmax at 1x.\n## Next\nties"
    assert equivalence_words(findings_section(text)) == ["matches"]
    assert equivalence_words('- as well as <!-- check a: loss "x" @1 = 1 -->') == ["as well as"]

"""Findings (``docs/findings.md``, and the README's one-line summaries), checked against the
reports they quote.

Every number a findings page states carries a marker, an HTML comment (invisible when rendered)
at the end of its bullet or paragraph::

    LSSAR − it = +0.244 ± 0.054 <!-- check reports/cpu-baselines-2026-12-03:
        loss "lssar p=15" - "softmax + alibi" @16 = +0.244 ± 0.054; sig -->

``python -m lssar.studies.findings docs/findings.md README.md`` (and ``tests/test_findings.py``)
recomputes each marker's quantity from the report's ``results.json`` with the reports' own
statistics (means and 95% t-intervals over seeds, differences paired by seed), and fails when

- the recomputed value, rounded as the quoted text is, differs from it;
- the quoted text is not in the bullet or paragraph the marker closes (so the marker vouches for
  what a reader sees; markers may follow each other at the end of a bullet);
- the marker's verdict disagrees with the interval: ``sig`` (the interval excludes 0: "beats",
  "worse", "supported") or ``ns`` (it includes 0: "within noise", "not separable");
- the findings (a page titled "# Findings", whole; elsewhere, from "What the committed reports
  show" to the next heading and every "**Finding" paragraph) use "matches", "matched", "ties"
  or "as well as", which only an equivalence test may say: such a bullet must carry a
  ``claim "..." = equivalent`` marker (below), checked true.

Quantities (``@M``: the length multiple; ``beyond`` / ``within`` / ``all``: recall's and
passkey's distance from the question, and for ``sink`` the rows past the training length):

- ``loss "A" @16``, ``loss "A" - "B" @16``, ``loss "A" / "B" @1`` (relative: A / B - 1),
  ``loss "A" @16/1`` (the 16x / 1x ratio), ``loss "A" @16-1`` (the 16x - 1x excess, nats per
  token): validation loss of the LM reports;
- ``passkey "A" @2``: passkey accuracy (mean over depths) of the LM reports; ``passkey "A" @2
  beyond``: over the probes whose key lies beyond the training length from the question;
- ``sink "A" @16``: first-token attention mass (mean over layers) of the LM reports, ``sink "A"
  @16 beyond`` over the rows past the training length; the arm ``"uniform"`` is uniform
  attention's mass over the same rows (``sink "lssa" / "uniform" @16 beyond``: how far above
  uniform);
- ``recall "A" @16 beyond``, ``recall "A" - "B" @16 beyond``: recall accuracy.

A declared claim of an LM report (its "The paper's claims" list) is checked by its verdict after
Holm's correction, recomputed from ``results.json``: ``claim "LSSAR beats softmax at" =
supported`` names the one claim whose text starts so; the verdict is ``supported``,
``contradicted``, ``within noise`` or ``not separable at this power``, or ``equivalent`` for an
equivalence claim (TOST) that is supported, the only marker that lets its bullet say "matches".

An equivalence test of any of these (paired by seed for a difference) is checked with ``tost
M`` after the expression, M its margin: ``loss "A" - "B" @16 tost 0.02 = −0.065 to +0.084; not
equivalent`` quotes TOST's 90% interval and says whether it lies inside (-M, M).

Percent-valued text (``60.1 ± 6.9%``, ``−37.6 ± 9.3 points``) is compared as a fraction x 100.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from lssar.studies.stats import Interval, mean_ci, tost

MARKER = re.compile(
    r"<!--\s*check\s+(?P<report>\S+?):\s*(?P<expr>.+?)\s+=\s+(?P<text>[^;]+?)"
    r"(?:;\s*(?P<verdict>sig|ns|equivalent|not equivalent))?\s*-->",
    re.S,
)
_CLAIM = re.compile(r'claim\s+"(?P<prefix>[^"]+)"$')
_VERDICTS = ("supported", "contradicted", "within noise", "not separable at this power")
_EXPR = re.compile(
    r'(?P<q>loss|passkey|sink|recall)\s+"(?P<a>[^"]+)"'
    r'(?:\s*(?P<op>[-/])\s*"(?P<b>[^"]+)")?'
    r"\s*@(?P<m>\d+)(?:(?P<lop>[/-])(?P<base>\d+))?(?:\s+(?P<dist>beyond|within|all))?"
    r"(?:\s+tost\s+(?P<margin>\d+(?:\.\d+)?))?$"
)
_NUMBER = re.compile(r"[+\-−]?\d+(?:\.\d+)?")
# only an equivalence test may say these; the LM reports print its verdicts
EQUIVALENCE_WORDS = ("matches", "matched", "ties", "as well as")


@dataclass(frozen=True)
class Check:
    """One marker: where it is, what it claims and what the report gives."""

    line: int
    report: str
    expr: str
    text: str
    verdict: str | None
    got: Interval | None = None
    problem: str | None = None


def _seed_values(report: Path, q: str, arm: str, m: int, dist: str | None) -> dict[int, float]:
    """seed -> the quantity ``q`` of ``arm`` at multiple ``m`` in the report's results.json."""
    data = json.loads((report / "results.json").read_text())
    if q == "sink" and arm == "uniform":  # uniform attention over the same rows, per seed
        key = "uniform_sink_beyond" if dist == "beyond" else "uniform_sink"
        return {
            r["config"]["seed"]: r["diagnostics"][str(m * r["train_len"])][key]
            for r in data["results"]
            if str(m * r["train_len"]) in r.get("diagnostics", {})
        }
    if q == "recall":
        rows = data["rows"]
        out = {
            r["seed"]: r["accuracy"]
            for r in rows
            if r["arm"] == arm and r["length_multiple"] == m and r["distance"] == (dist or "all")
        }
    else:
        from lssar.studies.labels import label_of

        out = {}
        for r in data["results"]:
            if label_of(r) != arm:
                continue
            length = str(m * r["train_len"])
            if q == "loss":
                v = r["loss"].get(length)
            elif q == "passkey" and dist in ("beyond", "within"):
                b = (r.get("passkey") or {}).get("by_distance", {}).get(length, {}).get(dist)
                v = b["hits"] / b["n"] if b and b["n"] else None
            elif q == "passkey":
                acc = (r.get("passkey") or {}).get("accuracy", {}).get(length)
                v = None if not acc else sum(acc.values()) / len(acc)
            else:  # sink: first-token mass, mean over layers (rows past L for "beyond")
                d = r["diagnostics"].get(length)
                key = "sink_beyond" if dist == "beyond" else "sink"
                v = None if not d or key not in d else sum(d[key]) / len(d[key])
            if v is not None:
                out[r["config"]["seed"]] = v
    if not out:
        raise KeyError(f"{q} of {arm!r} at {m}x{f' ({dist})' if dist else ''}: not in the report")
    return out


def _parse(expr: str) -> re.Match:
    e = _EXPR.match(expr.strip())
    if e is None:
        raise ValueError(f"cannot read the expression {expr!r}")
    return e


def values(report: Path, expr: str) -> list[float]:
    """The per-seed values a marker's expression names, in seed order (module docstring)."""
    e = _parse(expr)
    q, a, b, op = e["q"], e["a"], e["b"], e["op"]
    m, base, dist = int(e["m"]), e["base"], e["dist"]
    va = _seed_values(report, q, a, m, dist)
    if base is not None:  # two lengths of one arm: per seed, A at m over (or minus) A at base
        vb = _seed_values(report, q, a, int(base), dist)
        seeds = sorted(set(va) & set(vb))
        if e["lop"] == "-":
            return [va[s] - vb[s] for s in seeds]
        return [va[s] / vb[s] for s in seeds]
    if b is None:
        return [va[s] for s in sorted(va)]
    vb = _seed_values(report, q, b, m, dist)
    seeds = sorted(set(va) & set(vb))
    if op == "-":
        return [va[s] - vb[s] for s in seeds]
    return [va[s] / vb[s] - 1 for s in seeds]


def quantity(report: Path, expr: str) -> Interval:
    """The interval a marker's expression names (see the module docstring)."""
    return mean_ci(values(report, expr))


def _tost_problem(
    report: Path, expr: str, margin: float, text: str, said: str | None
) -> str | None:
    """None when ``text`` ("lo to hi") is TOST's 90% interval of the expression's values against
    ``margin`` and ``said`` ("equivalent" / "not equivalent") is its outcome."""
    eq = tost(values(report, expr), margin=margin)
    if eq.lo is None:
        return "an equivalence test needs more than one seed"
    if said not in ("equivalent", "not equivalent"):
        return "a tost marker ends with '; equivalent' or '; not equivalent'"
    nums = _NUMBER.findall(text)
    if len(nums) != 2:
        return f"cannot read {text!r} as TOST's 90% interval 'lo to hi'"
    for num, value in zip(nums, (eq.lo, eq.hi)):
        digits = len(num.split(".")[1]) if "." in num else 0
        if abs(round(value, digits) - float(num.replace("−", "-"))) > 0.51 * 10.0**-digits:
            return f"{text!r}: TOST's 90% interval is {eq.lo:.4f} .. {eq.hi:.4f}"
    if (said == "equivalent") != eq.equivalent:
        return f"TOST within ±{margin:g} says {'' if eq.equivalent else 'not '}equivalent"
    return None


def claim_verdict(report: Path, prefix: str) -> tuple[str, bool]:
    """(verdict after Holm, whether it is an equivalence claim) of the declared claim of the LM
    report whose text starts with ``prefix``, recomputed from its results.json as the report
    does."""
    from lssar.studies.labels import group
    from lssar.studies.lm.verdicts import declared_claims, losses_of
    from lssar.studies.stats import judge_claims

    results = json.loads((report / "results.json").read_text())["results"]
    train = results[0]["train_len"]
    multiples = sorted({int(n) // train for r in results for n in r["loss"]})
    groups = group(results)
    claims = declared_claims(losses_of(groups, multiples), multiples, groups)
    hits = [
        (c, final)
        for c, (_raw, final, _note) in zip(claims, judge_claims(claims))
        if c.text.startswith(prefix)
    ]
    if len(hits) != 1:
        raise KeyError(f"{len(hits)} declared claims start with {prefix!r}: name exactly one")
    c, final = hits[0]
    return final, c.margin is not None


def _claim_problem(report: Path, prefix: str, text: str) -> str | None:
    final, equivalence = claim_verdict(report, prefix)
    if text == "equivalent":
        if not equivalence:
            return "'equivalent' is for an equivalence claim (TOST); this one is directional"
        return None if final == "supported" else f"the report's verdict is {final!r}"
    if text not in _VERDICTS:
        return f"cannot read {text!r} as a verdict ({', '.join(_VERDICTS)} or equivalent)"
    return None if final == text else f"the report's verdict is {final!r}, not {text!r}"


def _agrees(text: str, iv: Interval) -> str | None:
    """None when ``iv`` rounds to ``text`` ("mean" or "mean ± half", percent or not)."""
    nums = _NUMBER.findall(text)
    if not nums or len(nums) > 2:
        return f"cannot read {text!r} as 'mean' or 'mean ± half-width'"
    scale = 100.0 if "%" in text or "points" in text else 1.0
    for num, value in zip(nums, (iv.mean, iv.half)):
        if value is None:
            return f"{text!r} quotes a half-width, but the report has one seed"
        digits = len(num.split(".")[1]) if "." in num else 0
        quoted = float(num.replace("−", "-"))
        if abs(round(value * scale, digits) - quoted) > 0.51 * 10.0**-digits:
            return f"{text!r}: the report gives {value * scale:.{digits + 2}f}"
    return None


def _verdict_problem(verdict: str | None, iv: Interval) -> str | None:
    if verdict is None or iv.lo is None:
        return None if verdict is None else f"verdict {verdict!r} needs more than one seed"
    excludes = iv.lo > 0 or iv.hi < 0
    if verdict == "sig" and not excludes:
        return f"says 'sig' but the interval [{iv.lo:.4f}, {iv.hi:.4f}] includes 0"
    if verdict == "ns" and excludes:
        return f"says 'ns' but the interval [{iv.lo:.4f}, {iv.hi:.4f}] excludes 0"
    return None


def _norm(s: str) -> str:
    return re.sub(r"\s+", " ", s.replace("−", "-"))


def check_text(readme: str, root: Path) -> list[Check]:
    """Every marker of ``readme`` (reports relative to ``root``), checked."""
    out = []
    for mk in MARKER.finditer(readme):
        line = readme.count("\n", 0, mk.start()) + 1
        c = Check(line, mk["report"], _norm(mk["expr"]), mk["text"].strip(), mk["verdict"])
        claim = _CLAIM.match(c.expr)
        if claim is not None:
            try:
                problem = _claim_problem(root / c.report, claim["prefix"], c.text)
            except (OSError, KeyError, ValueError) as exc:
                problem = str(exc)
            out.append(Check(**{**c.__dict__, "problem": problem}))
            continue
        try:
            iv = quantity(root / c.report, c.expr)
            margin = _parse(c.expr)["margin"]
            if margin is not None:
                problem = _tost_problem(root / c.report, c.expr, float(margin), c.text, c.verdict)
            elif c.verdict in ("equivalent", "not equivalent"):
                problem = f"'{c.verdict}' needs an equivalence test: add 'tost MARGIN'"
            else:
                problem = _agrees(c.text, iv) or _verdict_problem(c.verdict, iv)
        except (OSError, KeyError, ValueError) as exc:
            out.append(Check(**{**c.__dict__, "problem": str(exc)}))
            continue
        # the bullet or paragraph the marker ends (its markers removed)
        start = max(readme.rfind("\n- ", 0, mk.start()), readme.rfind("\n\n", 0, mk.start()))
        before = MARKER.sub("", readme[max(start, 0) : mk.start()])
        if problem is None and _norm(c.text) not in _norm(before):
            problem = f"{c.text!r} is not in the sentence before the marker"
        out.append(Check(**{**c.__dict__, "got": iv, "problem": problem}))
    return out


def findings_section(readme: str) -> str:
    """The findings of a page: all of it when it is titled "# Findings" (``docs/findings.md``);
    else from "What the committed reports show" to the next heading, and every paragraph that
    opens with "**Finding" (the studies' own sections)."""
    if readme.lstrip().startswith("# Findings"):
        return readme
    parts = []
    start = readme.find("What the committed reports show")
    if start >= 0:
        end = readme.find("\n## ", start)
        parts.append(readme[start : end if end > 0 else len(readme)])
    parts += re.findall(r"(?:^|\n)(\*\*Finding.*?)(?=\n\n|\n#|$)", readme, re.S)
    return "\n\n".join(parts)


def equivalence_words(text: str) -> list[str]:
    """The words of :data:`EQUIVALENCE_WORDS` used in ``text`` outside markers, except in a
    bullet or paragraph that carries a ``claim "..." = equivalent`` marker (which
    :func:`check_text` holds to the report's TOST verdict)."""
    found: list[str] = []
    for part in re.split(r"\n(?=- )|\n\n", text):
        if any(
            _CLAIM.match(_norm(m["expr"])) and m["text"].strip() == "equivalent"
            for m in MARKER.finditer(part)
        ):
            continue
        plain = MARKER.sub("", part).lower()
        found += [w for w in EQUIVALENCE_WORDS if re.search(rf"\b{w}\b", plain) and w not in found]
    return found


def project_root(page: Path) -> Path:
    """The folder the markers' report paths are relative to: the nearest one at or above
    ``page``'s folder that holds ``reports/`` (the repository root, for README.md and docs/)."""
    start = page.resolve().parent
    for folder in (start, *start.parents):
        if (folder / "reports").is_dir():
            return folder
    raise FileNotFoundError(f"no reports/ folder at or above {start}: run from a checkout")


def check_page(path: Path) -> tuple[list[Check], list[str]]:
    """(every marker of the page at ``path``, checked; the equivalence words its findings use)."""
    text = path.read_text()
    return check_text(text, project_root(path)), equivalence_words(findings_section(text))


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (argv if argv is not None else sys.argv[1:]) or ["docs/findings.md"]]
    failed = False
    for path in paths:
        checks, words = check_page(path)
        bad = [c for c in checks if c.problem]
        for c in checks:
            status = "FAIL" if c.problem else "ok"
            print(
                f"{status:4} {path}:{c.line} {c.report}: {c.expr} = {c.text}"
                + (f"  -- {c.problem}" if c.problem else "")
            )
        if words:
            print(f"FAIL {path} says {', '.join(map(repr, words))}: only an equivalence test may")
        print(f"{path}: {len(checks) - len(bad)} of {len(checks)} markers agree with their reports")
        failed = failed or bool(bad or words)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

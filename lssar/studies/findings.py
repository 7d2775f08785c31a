"""Findings (``docs/findings.md``, and the README's one-line summaries), checked against the
reports they quote.

Every number a findings page states carries a marker, an HTML comment (invisible when rendered)
at the end of its bullet or paragraph::

    LSSAR − it = +0.244 ± 0.054 <!-- check reports/cpu-baselines-2026-12-03:
        loss "lssar p=15" - "softmax + alibi" @16 = +0.244 ± 0.054; sig -->

``python -m lssar.studies.findings docs/findings.md README.md`` (and
``tests/studies/test_findings.py``) recomputes each marker's quantity from the report's
``results.json`` with the reports' own
statistics (means and 95% t-intervals over seeds, differences paired by seed), and fails when

- the recomputed value, rounded as the quoted text is, differs from it;
- the marker's verdict disagrees with the interval: ``sig`` (it excludes 0) or ``ns`` (it
  includes 0);
- the findings (a page titled "# Findings", whole; elsewhere, from "What the committed reports
  show" to the next heading and every "**Finding" paragraph) use "matches", "matched", "ties"
  or "as well as", which only an equivalence test may say: such a bullet must carry a
  ``claim "..." = equivalent`` marker (below), checked true.

and it holds the prose of every bullet or paragraph that carries markers to them (a
checker of markers alone passed "beats" edited to "is worse than", "2.22" to "12.22"):

- *numbers*: each quoted text stands in the prose as whole numbers, sign included ("2.22" is not
  found in "12.22", "± 0.16" not in "± 0.169", "0.60" not in "−0.60"; the k-th marker of a text
  at its k-th occurrence, the last one also at later repetitions), and every measurement in the
  prose (a decimal or a percentage) is quoted by a marker, or listed with its source in a note
  ``<!-- given 1.04, 2.20: the paper's 16x / 1x ratios -->`` (the paper's values, a chance
  level, a threshold: numbers no report holds);
- *verdict words* (:data:`VERDICT_WORDS`: "beats", "better", "gains", "worse", "loses", "within
  noise", "not separable", "excludes 0", "supported", "contradicted", ...): each is bound to the
  nearest checked quantity of its sentence (a difference with a verdict, or the quantity a
  claim is judged on): the first after it before the next verdict word, else the last before it
  since the previous one, else the nearest before, else after it; and must follow from it. A
  direction word needs an interval that excludes 0 and the right sign: the sentence speaks of
  the marker's first arm, unless the marker ends ``; sig; said of "B"`` (a lower loss, a higher
  passkey or recall accuracy is better; a sink's mass is neither). A noise word needs an
  interval that includes 0 (or a claim within noise), a claim word the claim's verdict;
- *claims*: a claim marker is judged on the quantity of the marker before it, and some verdict
  word bound to that quantity must say its verdict ("supported" may be said by a direction
  word).
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
- ``recall "A" @16 beyond``, ``recall "A" - "B" @16 beyond``: recall accuracy;
- ``own "A" @16``: the loss of ``A`` with every query limited to its own last L keys (the
  own-window control), so ``loss "A" - own "A" @16`` is what the keys beyond L are worth (a
  quantity after the operator may name its own kind: ``loss``, ``own``, ``copy``, ...);
  ``copy "A" @16`` / ``firstcopy "A" @16``: the copy probe's loss on the second / first copy,
  16 L apart; ``owncopy "A" @16``: the second copy with the own window (``copy "A" - owncopy
  "A" @16`` below 0: ``A`` copies from 16 L back).

A declared claim of an LM report (its "The paper's claims" list) is checked by its verdict after
Holm's correction, recomputed from ``results.json``: ``claim "LSSAR beats softmax at" =
supported`` names the one claim whose text starts so; the verdict is ``supported``,
``contradicted``, ``within noise`` or ``not separable at this power``, or ``equivalent`` for an
equivalence claim (TOST) that is supported, the only marker that lets its bullet say "matches".

An equivalence test of any of these (paired by seed for a difference) is checked with ``tost
M`` after the expression, M its margin: ``loss "A" - "B" @16 tost 0.02 = −0.065 to +0.084; not
equivalent`` quotes TOST's 90% interval and says whether it lies inside (-M, M).

Percent-valued text (``60.1 ± 6.9%``, ``−37.6 ± 9.3 points``) is compared as a fraction x 100.

One module (~620 lines): one checker (markers -> the reports' numbers -> the prose's verdict
words and numbers); its rules are only meaningful together.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lssar.studies.stats import Interval, mean_ci, tost

MARKER = re.compile(
    r"<!--\s*check\s+(?P<report>\S+?):\s*(?P<expr>.+?)\s+=\s+(?P<text>[^;]+?)"
    r"(?:;\s*(?P<verdict>sig|ns|equivalent|not equivalent))?"
    r"(?:;\s*said of\s+\"(?P<subject>[^\"]+)\")?\s*-->",
    re.S,
)
_CLAIM = re.compile(r'claim\s+"(?P<prefix>[^"]+)"$')
_VERDICTS = ("supported", "contradicted", "within noise", "not separable at this power")
_EXPR = re.compile(
    r'(?P<q>loss|own|copy|owncopy|firstcopy|passkey|sink|recall)\s+"(?P<a>[^"]+)"'
    r'(?:\s*(?P<op>[-/])\s*(?:(?P<qb>loss|own|copy|owncopy|firstcopy)\s+)?"(?P<b>[^"]+)")?'
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


@functools.cache
def _results(report: Path) -> dict[str, Any]:
    """A report's results.json, read once per process (the checker reads many markers of one
    report; nothing here writes it)."""
    return json.loads((report / "results.json").read_text())


def _seed_values(report: Path, q: str, arm: str, m: int, dist: str | None) -> dict[int, float]:
    """seed -> the quantity ``q`` of ``arm`` at multiple ``m`` in the report's results.json."""
    data = _results(report)
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
            own = r.get("own_window") or {}
            if q == "loss":
                v = r["loss"].get(length)
            elif q == "own":
                v = own.get("loss", {}).get(length)
            elif q in ("copy", "firstcopy", "owncopy"):
                probe = (own if q == "owncopy" else r).get("copy") or {}
                v = probe.get("first" if q == "firstcopy" else "second", {}).get(length)
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
    vb = _seed_values(report, e["qb"] or q, b, m, dist)
    seeds = sorted(set(va) & set(vb))
    if op == "-":
        return [va[s] - vb[s] for s in seeds]
    return [va[s] / vb[s] - 1 for s in seeds]


@functools.cache
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


@functools.cache
def claim_verdict(report: Path, prefix: str) -> tuple[str, bool]:
    """(verdict after Holm, whether it is an equivalence claim) of the declared claim of the LM
    report whose text starts with ``prefix``, recomputed from its results.json as the report
    does."""
    from lssar.studies.labels import group
    from lssar.studies.lm.verdicts import declared_claims, losses_of
    from lssar.studies.stats import judge_claims

    results = _results(report)["results"]
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


# ------------------------------------------------------------------------ prose, held to markers

# The words that state a verdict, by what they claim of the quantity they are bound to (the
# nearest checked difference or claim in their sentence: check_text). "better" / "worse": the
# sentence's subject (the marker's first arm, unless it says `said of "B"`) has the better /
# worse value (lower loss; higher passkey or recall accuracy) beyond noise; "holm": the claim
# judged on it is within noise (or not separable) after Holm's correction; "noise": the interval
# includes 0 (a claim's verdict where the quantity has no interval verdict); "sig": it excludes
# 0. A claim word must be the claim's verdict; "supported" of a plain difference: it excludes 0.
VERDICT_WORDS: dict[str, tuple[str, ...]] = {
    "better": (
        "beats?",
        "better",
        "best",
        "gains?",
        "wins?",
        "rescues?",
        "helps?",
        "retrieves more",
    ),
    "worse": ("worse", "loses?", "hurts?", "costs?"),
    "holm": ("within noise after holm", "not separable after holm"),
    "noise": ("within noise", "not separable", "does not separate", "includes 0"),
    "sig": ("beyond noise", "excludes? 0"),
    "supported": ("supported",),
    "contradicted": ("contradict(?:ed|ing|s)?",),
    "equivalent": ("equivalent",),
}
_WORDS = re.compile(  # matched in the lowercased prose
    "|".join(rf"(?P<{kind}>\b(?:{'|'.join(w)})\b)" for kind, w in VERDICT_WORDS.items())
)
# lower is better for a loss, higher for an accuracy; a sink's mass is neither
_HIGHER_IS_BETTER = {"passkey": True, "recall": True} | dict.fromkeys(
    ("loss", "own", "copy", "owncopy", "firstcopy"), False
)
# a note for numbers of a finding that no report holds (the paper's values, a chance level, a
# threshold): <!-- given 1.04, 2.20: the paper's Table 2 -->
GIVEN = re.compile(r"<!--\s*given\s+(?P<nums>[^:]+?):\s*(?P<why>.+?)\s*-->", re.S)
# a number as written, its sign and percent sign included ("1,800" is one number)
_TOKEN = re.compile(r"(?<![\w.])(?:[+\-](?=\d))?\d+(?:,\d{3})*(?:\.\d+)?%?")
_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\bvs)\.(?=\**(?:\s|$))")
_CLAIM_WORDS = {
    "supported": ("supported", "better", "worse"),
    "contradicted": ("contradicted",),
    "within noise": ("noise", "holm"),
    "not separable at this power": ("noise", "holm"),
    "equivalent": ("equivalent",),
}


def _quoted_at(text: str, prose: str) -> list[tuple[int, int]]:
    """Where ``text`` (normalised) stands in ``prose`` as whole numbers: "2.22" is not in
    "12.22", "± 0.16" not in "± 0.169", an unsigned "0.60" not in "-0.60"."""
    t = _norm(text).strip()
    head = r"(?<![\d.])" + (r"(?<![+\-])" if t[:1].isdigit() else "")
    tail = r"(?!\d)(?!\.\d)" if t[-1:].isdigit() else ""
    return [(m.start(), m.end()) for m in re.finditer(head + re.escape(t) + tail, prose)]


def _measurements(prose: str) -> list[tuple[int, int, str]]:
    """The numbers of ``prose`` that state a measurement: a decimal or a percentage."""
    return [
        (m.start(), m.end(), m.group())
        for m in _TOKEN.finditer(prose)
        if "." in m.group() or m.group().endswith("%")
    ]


@dataclass
class _Quote:
    """A marker of a paragraph: its check, its quantity (``q``, ``op``, arms, the subject its
    sentence speaks of), where its text stands in the prose, the claim markers judged on it and
    the kinds of the verdict words bound to it."""

    check: Check
    q: str | None = None
    op: str | None = None
    arms: tuple[str, ...] = ()
    subject: str | None = None
    spans: list[tuple[int, int]] = field(default_factory=list)
    claims: list[int] = field(default_factory=list)
    words: list[str] = field(default_factory=list)


def _word_problem(kind: str, word: str, quote: _Quote, claim: str | None) -> str | None:
    """Why ``word`` (of ``kind``) does not follow from the quantity ``quote`` it is bound to
    (``claim``: the verdict of the claim judged on it, if any), or None."""
    c, iv = quote.check, quote.check.got
    if c.verdict in ("equivalent", "not equivalent"):  # a TOST marker: its outcome, said as such
        if kind == "equivalent":
            return None
        return f"{word!r} is bound to TOST's interval {c.text!r}: say (not) 'equivalent'"
    raw = quote.op is not None and c.verdict is not None  # a difference with its own verdict
    of_claim = kind in ("holm", "contradicted", "equivalent") or (
        claim is not None and (kind == "supported" or (kind == "noise" and not raw))
    )
    if of_claim:
        if claim is None:
            return f"{word!r} needs a claim marker judged on {c.text!r}"
        return None if kind in _CLAIM_WORDS[claim] else f"{word!r}: the claim is {claim!r}"
    if not raw:
        return f"{word!r} is bound to {c.text!r}, which is no difference with a verdict"
    if kind == "noise":
        return None if c.verdict == "ns" else f"{word!r}, but {c.text!r} excludes 0 (sig)"
    if c.verdict != "sig":
        return f"{word!r} needs an interval that excludes 0; {c.text!r} includes it (ns)"
    if kind in ("sig", "supported"):
        return None
    higher = _HIGHER_IS_BETTER.get(quote.q or "")
    if higher is None:
        return f"{word!r} says better or worse of a {quote.q} quantity, which has neither"
    first_better = (iv.mean > 0) == higher
    better = first_better if quote.subject in (None, quote.arms[0]) else not first_better
    if better == (kind == "better"):
        return None
    who = quote.subject or quote.arms[0]
    return f"{word!r} of {who!r}, but {c.text!r} makes it {'better' if better else 'worse'}"


def _paragraph(block: str, start: int, readme: str, root: Path) -> list[Check]:
    """The checks of one bullet or paragraph ``block`` (at ``start`` in ``readme``): its
    markers against their reports, then its prose against its markers."""
    prose = _norm(GIVEN.sub("", MARKER.sub("", block)))
    quotes: list[_Quote] = []
    for mk in MARKER.finditer(block):
        line = readme.count("\n", 0, start + mk.start()) + 1
        c = Check(line, mk["report"], _norm(mk["expr"]), mk["text"].strip(), mk["verdict"])
        claim = _CLAIM.match(c.expr)
        if claim is not None:  # judged on the quantity of the marker before it
            anchor = next((q for q in reversed(quotes) if q.q is not None), None)
            try:
                problem = _claim_problem(root / c.report, claim["prefix"], c.text)
            except (OSError, KeyError, ValueError) as exc:
                problem = str(exc)
            if problem is None and anchor is None:
                problem = "a claim marker follows the marker of the quantity it is judged on"
            if anchor is not None:
                anchor.claims.append(len(quotes))
            quotes.append(_Quote(Check(**{**c.__dict__, "problem": problem})))
            continue
        quote = _Quote(c)
        if (e := _EXPR.match(c.expr.strip())) is not None:
            quote.q, quote.op, quote.arms, quote.subject = (
                e["q"],
                e["op"],
                (e["a"], e["b"]),
                mk["subject"],
            )
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
            quote.check = Check(**{**c.__dict__, "problem": str(exc)})
            quotes.append(quote)
            continue
        if problem is None and quote.subject is not None and quote.subject not in quote.arms:
            problem = f"said of {quote.subject!r}, which is neither arm of {c.expr!r}"
        # the k-th marker of a text stands at its k-th occurrence; the last one also at any
        # later repetition (a number restated, in a bullet's lead and its body)
        same = [q for q in quotes if q.check.text == c.text and q.spans]
        at = _quoted_at(c.text, prose)
        if same and len(same[-1].spans) > 1:  # the previous marker of this text took them all
            at = same[-1].spans[1:]
            same[-1].spans = same[-1].spans[:1]
        elif same:
            at = at[len(same) :]
        if problem is None and not at:
            problem = f"{c.text!r} is not in the sentence before the marker"
        quote.spans = at
        quote.check = Check(**{**c.__dict__, "got": iv, "problem": problem})
        quotes.append(quote)
    line = readme.count("\n", 0, start) + 1 + (readme[start : start + 1] == "\n")
    extra: list[Check] = []

    def flag(text: str, problem: str) -> None:
        extra.append(Check(line, "", "(prose)", text, None, problem=problem))

    # every measurement in the prose is quoted by a marker, or given with its source
    given = [_norm(n).strip() for g in GIVEN.finditer(block) for n in g["nums"].split(",")]
    for n in given:
        if not _quoted_at(n, prose):
            flag(n, f"given {n!r} is not in the paragraph")
    spans = [sp for q in quotes for sp in q.spans]
    for a, b, num in _measurements(prose):
        if not any(x <= a and b <= y for x, y in spans) and num not in given:
            flag(num, f"{num!r} is quoted by no marker (add one, or a `given` note: its source)")
    # every verdict word is bound to the nearest checked quantity of its sentence and follows
    # from it: the first after it before the next verdict word, else the last before it since
    # the previous one, else the nearest before it, else after it; every claim is said of the
    # quantity it is judged on
    bearers = sorted(
        (sp, q) for q in quotes if (q.op and q.check.verdict) or q.claims for sp in q.spans
    )
    words = [(m.start(), m.end(), m.lastgroup, m.group()) for m in _WORDS.finditer(prose.lower())]
    ends = [m.end() for m in _SENTENCE_END.finditer(prose)] + [len(prose)]
    for k, (a, b, kind, word) in enumerate(words):
        s0 = max([0] + [e for e in ends if e <= a])
        s1 = min(e for e in ends if e > a)
        nxt = words[k + 1][0] if k + 1 < len(words) else len(prose)
        prev = words[k - 1][1] if k else 0
        here = [(x, y, q) for (x, y), q in bearers if s0 <= x and y <= s1]
        ahead = [q for x, y, q in here if b <= x and y <= nxt]
        behind = [q for x, y, q in here if prev <= x and y <= a]
        before = [q for x, y, q in here if y <= a]
        after = [q for x, y, q in here if b <= x]
        bound = (ahead[:1] or behind[-1:] or before[-1:] or after[:1] or [None])[0]
        if bound is None:
            flag(word, f"{word!r} is bound to no checked difference or claim in its sentence")
            continue
        claim = quotes[bound.claims[-1]].check.text if bound.claims else None
        if (problem := _word_problem(kind, word, bound, claim)) is not None:
            flag(word, problem)
        bound.words.append(kind)
    for q in quotes:
        for i in q.claims:
            claim = quotes[i].check
            if claim.problem is None and not set(q.words) & set(_CLAIM_WORDS[claim.text]):
                problem = f"no verdict word says {claim.text!r} of {q.check.text!r}"
                quotes[i].check = Check(**{**claim.__dict__, "problem": problem})
    return [q.check for q in quotes] + extra


def check_text(readme: str, root: Path) -> list[Check]:
    """Every marker of ``readme`` (reports relative to ``root``), checked, and the prose of every
    bullet or paragraph that carries markers held to them: each quoted text stands in it as
    whole numbers, sign included; each measurement in it is quoted by a marker (or given with
    its source); each verdict word follows from the quantity it is bound to; each claim is said.
    A problem of the prose is a :class:`Check` with ``expr == "(prose)"``."""
    out: list[Check] = []
    for a, b in marked_paragraphs(readme):
        out += _paragraph(readme[a:b], a, readme, root)
    return out


def marked_paragraphs(readme: str) -> list[tuple[int, int]]:
    """``(start, end)`` of every bullet or paragraph of ``readme`` that carries a marker."""
    cuts = [0] + [m.start() + 1 for m in re.finditer(r"\n(?=- )|\n\n", readme)] + [len(readme)]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if MARKER.search(readme, a, b)]


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
        markers = [c for c in checks if c.expr != "(prose)"]
        prose = [c for c in checks if c.expr == "(prose)"]
        for c in checks:
            what = f"prose: {c.text}" if c in prose else f"{c.report}: {c.expr} = {c.text}"
            status = "FAIL" if c.problem else "ok"
            print(f"{status:4} {path}:{c.line} {what}" + (f"  -- {c.problem}" if c.problem else ""))
        if words:
            print(f"FAIL {path} says {', '.join(map(repr, words))}: only an equivalence test may")
        bad = [c for c in markers if c.problem]
        print(
            f"{path}: {len(markers) - len(bad)} of {len(markers)} markers agree with their "
            f"reports; {len(prose)} problems in the prose around them"
        )
        failed = failed or bool(bad or prose or words)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The documentation is tested: links and anchors resolve, code citations name sections that
exist, the quickstart's and the API page's code runs, the README's and the quickstart's shell
commands run in order from a fresh shell (at toy size), the examples run (at toy size), the site
builds, and no tracker issue numbers remain.

A ```python block that must not run is preceded by ``<!-- no-run: <reason> -->``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md")],
    key=lambda p: str(p),
)
# the benchmark history is an archive moved here unchanged: its links and citations are as they
# were written (relative to benchmarks/), and it is not checked
ARCHIVE = ROOT / "docs" / "history"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
NO_RUN = re.compile(r"<!--\s*no-run:\s*(?P<reason>[^>]*?)\s*-->\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _checked_pages() -> list[Path]:
    return [p for p in PAGES if ARCHIVE not in p.parents]


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks and HTML comments (links there are not links)."""
    return re.sub(r"<!--.*?-->", "", FENCE.sub("", text), flags=re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading (mkdocs' toc gives the same for these pages)."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    out: set[str] = set()
    for line in _prose(page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            base, n = slug(m[1]), 0
            while (s := base if n == 0 else f"{base}-{n}") in out:
                n += 1
            out.add(s)
    return out


def broken_links(page: Path) -> list[str]:
    """Relative links of ``page`` whose file or anchor does not exist."""
    bad = []
    where = page.relative_to(ROOT) if ROOT in page.parents else page.name
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{where}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{where}: {target} (no such heading)")
    return bad


def test_relative_links_and_anchors_resolve():
    assert [b for p in _checked_pages() for b in broken_links(p)] == []


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## Load a run in Python\n")
    page = tmp_path / "p.md"
    page.write_text(
        "# A title\n\n## 7. What it says\n\n[ok](#7-what-it-says) [x](#nope) [y](no.md)\n"
        "[ok](other.md#load-a-run-in-python) [z](other.md#nothing) ![img](ok.png)\n"
        "```python\n[not a link](nowhere.md)\n```\n"
    )
    assert broken_links(page) == [
        "p.md: #nope (no such heading)",
        "p.md: no.md (no such file)",
        "p.md: other.md#nothing (no such heading)",
    ]
    assert slug("GPU kernels (Triton, FlexAttention)") == "gpu-kernels-triton-flexattention"
    assert slug("`lssar eval` and **more**") == "lssar-eval-and-more"


# --------------------------------------------------------------------------- code citations

CITATION = re.compile(r"docs/(?P<page>[\w/-]+\.md)(?:'s)? sections? (?P<a>\d+)(?:-(?P<b>\d+))?")


def _tracked(*paths: str) -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", *paths], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / p for p in out if (ROOT / p).is_file()]


def citation_problems(text: str, where: str) -> list[str]:
    """Each citation "docs/<page>.md section N" (or "sections N-M") in ``text`` whose page has no
    "## N." heading."""
    bad = []
    for m in CITATION.finditer(text):
        page = ROOT / "docs" / m["page"]
        if not page.is_file():
            bad.append(f"{where}: {m[0]} (no such page)")
            continue
        have = set(re.findall(r"^## (\d+)\.", page.read_text(), re.M))
        last = int(m["b"] or m["a"])
        for n in range(int(m["a"]), last + 1):
            if str(n) not in have:
                bad.append(f"{where}: {m[0]} (no section {n})")
    return bad


def test_code_citations_name_sections_that_exist():
    files = _tracked("lssar", "tests", "benchmarks", "examples", "README.md", "CONTRIBUTING.md")
    files += [p for p in _tracked("docs") if ARCHIVE not in p.parents]
    here = Path(__file__).resolve()  # its own examples of bad citations are not citations
    texts = {str(p.relative_to(ROOT)): p.read_text(errors="replace") for p in files if p != here}
    cited = sum(len(CITATION.findall(t)) for t in texts.values())
    assert cited >= 20  # the kernels, the reference and the reports cite the method page
    assert [b for w, t in texts.items() for b in citation_problems(t, w)] == []
    # the specification lives in docs/method.md: nothing cites the file it came from
    stale = [w for w, t in texts.items() if "METHOD" + ".md" in t and w != "docs/method.md"]
    assert stale == []


def test_a_citation_of_a_missing_section_fails():
    assert citation_problems("see docs/method.md section 4", "x") == []
    assert citation_problems("docs/method.md sections 3-5", "x") == []
    assert citation_problems("docs/method.md section 9", "x") == [
        "x: docs/method.md section 9 (no section 9)"
    ]
    assert citation_problems("docs/nope.md section 1", "x") == [
        "x: docs/nope.md section 1 (no such page)"
    ]


def test_no_tracker_issue_numbers_remain():
    """Readers outside the project cannot see its tracker: code, tests and docs explain
    themselves instead of citing an issue number."""
    pattern = r"\b(issues?|PR|pull request)\s*#?" + r"[0-9]+\b"
    files = _tracked("lssar", "tests", "benchmarks", "examples", "configs", "docs", "README.md")
    files += _tracked("CONTRIBUTING.md", "Makefile", "pyproject.toml")
    hits = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in files
        if ARCHIVE not in p.parents and p.suffix not in (".png", ".pt")
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if re.search(pattern, line, re.I)
    ]
    assert hits == []


# --------------------------------------------------------------------------------- the front


def test_readme_is_a_front_page_whose_set_up_commands_come_first():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150
    first_screen = "\n".join(lines[:25])
    assert "make reproduce" in first_screen and "make test" in first_screen
    assert ".venv/bin/lssar" in first_screen and "source .venv/bin/activate" in first_screen
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^reproduce: ", makefile, re.M) and re.search(r"^test: ", makefile, re.M)


def test_the_site_builds_strictly(tmp_path):
    out = subprocess.run(  # mkdocs is pinned in requirements.txt and the dev extra
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "site" / "method" / "index.html").is_file()


# ------------------------------------------------------------------------------- code blocks


def blocks(page: Path, langs: tuple[str, ...]) -> list[tuple[str, str, str | None]]:
    """(language, code, the reason it must not run or None) of each fenced block in ``langs``."""
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        if m[1] in langs:
            before = text[: m.start()].rstrip("\n").splitlines()
            no_run = NO_RUN.search(before[-1]) if before else None
            out.append((m[1], m[2], no_run["reason"] if no_run else None))
    return out


# the quickstart's blocks run in order with its shell commands (below); every other page's here
CODE_PAGES = [
    p
    for p in _checked_pages()
    if p.parent.name == "docs"
    and p.name != "quickstart.md"
    and any(reason is None for _, _, reason in blocks(p, ("python",)))
]


def test_blocks_that_do_not_run_say_why():
    marked = [r for p in _checked_pages() for _, _, r in blocks(p, ("python",)) if r is not None]
    assert all(marked)
    assert {p.name for p in CODE_PAGES} >= {"api.md", "packing.md", "decoding.md"}


@pytest.mark.parametrize("page", CODE_PAGES, ids=lambda p: p.name)
def test_every_python_block_of_the_docs_runs(page, one_thread):
    for _, code, reason in blocks(page, ("python",)):
        if reason is None:
            exec(compile(code, str(page.relative_to(ROOT)), "exec"), {"__name__": "__docs__"})


def test_the_lssar_command_lets_waiting_threads_sleep():
    """OpenMP reads OMP_WAIT_POLICY once, when torch loads: the command sets it before."""
    probe = "import sys, os, lssar.cli; lssar.cli.main(['variants']); "
    probe += "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.stdout.strip().splitlines()[-1] == "PASSIVE True", out.stderr[-2000:]
    env["OMP_WAIT_POLICY"] = "ACTIVE"  # what the user sets wins
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.stdout.strip().splitlines()[-1] == "ACTIVE True"


# ------------------------------------------------------------------ the first run, in order

# toy-size flags for each command the pages show (the pages show the real sizes)
TOY_TRAIN = (
    "--seq_len=32 --n_layer=1 --n_head=2 --n_embd=32 --batch_size=4 --max_steps=4 "
    "--warmup_steps=1 --eval_every=4 --ckpt_every=4 --log_every=2 --eval_tokens=256 --dtype=fp32"
)
TOY = [
    (re.compile(r"^make reproduce\b"), f'make reproduce ARGS="{TOY_TRAIN}"'),
    (re.compile(r"^make test\b"), "make -n test"),  # the suite does not run itself
    (re.compile(r"^lssar (train|reproduce)\b.*"), rf"\g<0> {TOY_TRAIN}"),
    (re.compile(r"^lssar eval\b.*"), r"\g<0> --lengths 1,2 --tokens 256"),
    (re.compile(r"^lssar sample\b.*"), r"\g<0> --max-new-tokens 8"),
]


def toy(command: str) -> str:
    """``command`` (a comment stripped) with the flags that shrink it to toy size."""
    command = re.sub(r"\s+#.*$", "", command).strip()
    for pattern, repl in TOY:
        if pattern.match(command):
            return pattern.sub(repl, command, count=1)
    return command


def first_run_script(tmp: Path) -> str:
    """The README's and the quickstart's shell commands and the quickstart's Python blocks, in
    order, as one bash script (Python blocks as files run by the venv's python)."""
    lines = ["set -euo pipefail"]
    n = 0
    for page in (ROOT / "README.md", ROOT / "docs" / "quickstart.md"):
        for lang, code, reason in blocks(page, ("bash", "python")):
            if reason is not None or (lang == "python" and page.name == "README.md"):
                continue
            if lang == "python":
                n += 1
                (tmp / f"block{n}.py").write_text(code)
                lines += [f"echo '+ python block {n} of {page.name}'", f"python block{n}.py"]
                continue
            for command in code.splitlines():
                if command.strip():
                    lines += [f"echo {shlex.quote('+ ' + command)}", toy(command)]
    return "\n".join(lines) + "\n"


def fresh_checkout(tmp: Path) -> None:
    """A folder laid out like a fresh clone after ``make setup``: the repository's files linked,
    ``.venv`` this interpreter's environment (its stamp new, so make sees it set up)."""
    for name in ("Makefile", "requirements.txt", "pyproject.toml", "configs", "lssar"):
        (tmp / name).symlink_to(ROOT / name)
    venv = tmp / ".venv"
    venv.mkdir()
    for entry in Path(sys.prefix).iterdir():
        if entry.name != ".installed":
            (venv / entry.name).symlink_to(entry)
    (venv / ".installed").touch()


def test_toy_flags_go_before_the_comment():
    assert (
        toy("lssar eval runs/x   # loss by length")
        == "lssar eval runs/x --lengths 1,2 --tokens 256"
    )
    assert toy("make test        # the suite") == "make -n test"
    assert toy("source .venv/bin/activate  # PATH") == "source .venv/bin/activate"


@pytest.mark.skipif(
    not (Path(sys.prefix) / "bin" / "activate").is_file(), reason="needs a virtualenv's activate"
)
def test_the_first_run_chains_in_order_from_a_fresh_shell(tmp_path):
    """Every shell command of the README and the quickstart, in order, in a new bash whose
    environment holds only PATH (system folders), HOME and the kernel cache: a command that
    needs one the pages did not run first (or an activation they did not show) fails here."""
    fresh_checkout(tmp_path)
    script = tmp_path / "first_run.sh"
    script.write_text(first_run_script(tmp_path))
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "PYTHONPATH": str(ROOT),  # this checkout's lssar, whatever the venv's editable install
        "OMP_NUM_THREADS": "1",
        "LANG": "C.UTF-8",
    }
    for keep in ("TORCH_EXTENSIONS_DIR", "TMPDIR"):
        if keep in os.environ:
            env[keep] = os.environ[keep]
    out = subprocess.run(
        ["bash", "--noprofile", "--norc", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.returncode == 0, textwrap.shorten(out.stdout[-3000:], 3000) + out.stderr[-4000:]
    said = out.stdout
    assert "+ make reproduce" in said and "+ lssar train --preset tiny-cpu --attn=lssar" in said
    reports = list((tmp_path / "reports").glob("quick-*/REPORT.md"))
    assert len(reports) == 1  # make reproduce and lssar reproduce wrote one report, its runs reused
    report = reports[0].read_text()
    assert "## What one seed can and cannot show" in report and "cpu-2026-12-03" in report
    assert "[whole command]" in out.stderr or "[whole command]" in said
    for run in ("tiny-cpu-lssar-s0", "tiny-cpu-softmax-s0"):
        assert (tmp_path / "runs" / run / "DONE").is_file()


# ---------------------------------------------------------------------------------- examples

EXAMPLES = {
    "hf_swap.py": ["--layers", "1", "--width", "32", "--new-tokens", "4"],
    "decode_kv_cache.py": ["--prompt", "64", "--steps", "4"],
    "hf_trainer_packed.py": ["--steps", "2", "--layers", "1", "--width", "32", "--batch", "4"],
    "train_and_evaluate.py": ["--steps", "4", "--lengths", "1,2", "--tokens", "512", "--set"]
    + [
        f"{k}={v}"
        for k, v in (("seq_len", 32), ("n_layer", 1), ("n_embd", 32), ("eval_tokens", 256))
    ],
}


def test_every_example_is_run_here():
    assert sorted(EXAMPLES) == sorted(p.name for p in (ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs_at_toy_size(name, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *EXAMPLES[name]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]

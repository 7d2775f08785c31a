"""The package's layers: imports flow down (integrations, studies -> library -> ops), no circles;
and the tests mirror the package (a folder per part, no file past ~500 lines).

Read from the source (every ``import`` statement, at module level or inside a function), so a
lazy import that closes a circle or reaches up a layer fails here too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import lssar

ROOT = Path(lssar.__file__).resolve().parent

# A module's layer is the first of these prefixes its name starts with; it may import from its
# own layer and the ones after it, never from one before it.
LAYERS = [
    ("cli", ("lssar.cli", "lssar.__main__", "lssar.harness")),
    # studies are experiments built on everything below them, Hugging Face models included (the
    # conversion study fine-tunes and evaluates them); integrations never import a study
    ("studies", ("lssar.studies",)),
    ("integrations", ("lssar.integrations", "lssar.hf")),
    ("training", ("lssar.train",)),
    ("data", ("lssar.data",)),
    (
        "model",
        (
            "lssar.model",
            "lssar.nn",
            "lssar.spec",
            "lssar.positions",
            "lssar.runio",
            "lssar.clihelp",
        ),
    ),
    ("ops", ("lssar.ops", "lssar")),  # lssar/__init__ re-exports the op layer only
]


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """module -> the lssar modules it imports (``from lssar.x import y`` counts ``lssar.x.y``
    when that is a module, else ``lssar.x``)."""
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.split(".")[0] == "lssar"}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] != "lssar":
                    continue
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    deps.add(sub if sub in modules else node.module)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _layer(module: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def _package(module: str) -> str:
    return module.rsplit(".", 1)[0]


def test_imports_flow_down_the_layers():
    graph = _imports()
    up = [
        f"{m} ({LAYERS[_layer(m)][0]}) imports {d} ({LAYERS[_layer(d)][0]})"
        for m, deps in graph.items()
        for d in deps
        if _layer(d) < _layer(m) and d != "lssar"
    ]
    assert not up, "imports that reach up a layer:\n" + "\n".join(sorted(up))


def test_no_import_circles():
    graph = _imports()
    # a package's __init__ re-exporting its own modules is not a circle of the design
    graph = {
        m: {d for d in ds if not (m == _package(d) or d == _package(m))} for m, ds in graph.items()
    }
    cycles, state = [], dict.fromkeys(graph, 0)  # 0 new, 1 on the stack, 2 done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state[d] == 1:
                cycles.append(" -> ".join(stack[stack.index(d) :] + [m, d]))
            elif state[d] == 0:
                visit(d, stack + [m])
        state[m] = 2

    for m in sorted(graph):
        if state[m] == 0:
            visit(m, [])
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_the_checker_sees_a_circle_and_an_upward_import(tmp_path, monkeypatch):
    """The two tests above can fail: a planted package with a circle and an upward import."""
    pkg = tmp_path / "lssar"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "studies").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "a.py").write_text("from lssar.studies import b\n")
    (pkg / "studies" / "__init__.py").write_text("")
    (pkg / "studies" / "b.py").write_text("def f():\n    import lssar.ops.a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    graph = _imports()
    assert graph["lssar.ops.a"] == {"lssar.studies.b"}
    assert graph["lssar.studies.b"] == {"lssar.ops.a"}
    for test in (test_imports_flow_down_the_layers, test_no_import_circles):
        try:
            test()
        except AssertionError as e:
            assert "lssar.ops.a" in str(e)
        else:
            raise AssertionError(f"{test.__name__} passed on a planted defect")


# ------------------------------------------------------------------------- the tests' own tree

TESTS = Path(__file__).resolve().parent
# tests/<folder>/ holds the tests of one part of the package: a test file there imports at least
# one module of that part (a lazy import inside a test counts)
TEST_FOLDERS = {
    "ops": ("lssar.ops",),
    "model": ("lssar.model", "lssar.nn", "lssar.spec", "lssar.positions"),
    "data": ("lssar.data",),
    "train": ("lssar.train", "lssar.runio"),
    "studies": ("lssar.studies",),
    "integrations": ("lssar.integrations", "lssar.hf", "lssar.harness"),
}
# the tests of the whole project (its docs, its layers, its packaging, its CLI's help, its
# benchmark scripts) and the helpers every folder shares live directly in tests/
CROSS_CUTTING = {
    "test_docs.py",
    "test_layout.py",
    "test_packaging.py",
    "test_cli_help.py",
    "test_benchmarks.py",
}
SHARED = {"__init__.py", "conftest.py", "accuracy.py"}
MAX_LINES = 500  # split a test file by concern before it passes this


def _lssar_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n == "lssar" or n.startswith("lssar.")}


def tree_problems(tests: Path) -> list[str]:
    """Where the test tree under ``tests`` stops mirroring the package."""
    bad = []
    for path in sorted(tests.rglob("*.py")):
        rel = path.relative_to(tests)
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            bad.append(f"{rel}: {lines} lines (> {MAX_LINES}): split it by concern")
        if len(rel.parts) == 1:
            if rel.name not in CROSS_CUTTING | SHARED:
                bad.append(f"{rel}: not a cross-cutting test: move it into a TEST_FOLDERS folder")
            continue
        folder = rel.parts[0]
        if folder not in TEST_FOLDERS or len(rel.parts) > 2:
            bad.append(f"{rel}: not in a folder of TEST_FOLDERS ({', '.join(TEST_FOLDERS)})")
            continue
        if not rel.name.startswith("test_"):
            continue  # a helper of its folder
        part = TEST_FOLDERS[folder]
        if not any(m == p or m.startswith(p + ".") for m in _lssar_imports(path) for p in part):
            bad.append(f"{rel}: imports nothing of {', '.join(part)}: is it in the right folder?")
    for folder in TEST_FOLDERS:
        if not (tests / folder / "__init__.py").is_file():
            bad.append(f"{folder}/__init__.py missing (tests import each other as tests.<folder>)")
    return bad


def test_tests_mirror_the_package():
    assert tree_problems(TESTS) == []


def test_the_tree_checker_sees_a_misplaced_or_long_test_file(tmp_path):
    """The test above can fail: a planted tree with a stray top-level test, a test in a folder
    of another part, a folder the mapping lacks, a missing ``__init__.py`` and a long file."""
    for folder in TEST_FOLDERS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "data" / "__init__.py").unlink()
    (tmp_path / "conftest.py").write_text("")
    (tmp_path / "test_docs.py").write_text("")
    (tmp_path / "test_stray.py").write_text("")
    (tmp_path / "ops" / "test_ok.py").write_text("def f():\n    from lssar.ops import registry\n")
    (tmp_path / "ops" / "helper.py").write_text("")
    (tmp_path / "model" / "test_wrong.py").write_text("from lssar.studies import stats\n")
    (tmp_path / "misc").mkdir()
    (tmp_path / "misc" / "test_x.py").write_text("import lssar.model\n")
    (tmp_path / "train" / "test_long.py").write_text("import lssar.train\n" + "x = 1\n" * 500)
    assert tree_problems(tmp_path) == [
        "misc/test_x.py: not in a folder of TEST_FOLDERS (ops, model, data, train, studies, "
        "integrations)",
        "model/test_wrong.py: imports nothing of lssar.model, lssar.nn, lssar.spec, "
        "lssar.positions: is it in the right folder?",
        "test_stray.py: not a cross-cutting test: move it into a TEST_FOLDERS folder",
        "train/test_long.py: 501 lines (> 500): split it by concern",
        "data/__init__.py missing (tests import each other as tests.<folder>)",
    ]

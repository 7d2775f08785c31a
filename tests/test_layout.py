"""The package's layers: imports flow down (integrations, studies -> library -> ops), no circles.

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

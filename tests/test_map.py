"""The map stays true: docs/design.md names every module of shardkit (one row each), every
guide in docs/ and every benchmark; each package's docstring names each of its modules.

A module that a newcomer cannot find by its name on the map is a room nobody knows about: this
fails the day one is added, moved or renamed without the map.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "shardkit"
DESIGN = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")


def _modules() -> list[Path]:
    """Every module of the package: .py files other than __init__, and C sources."""
    return sorted(
        p
        for p in PACKAGE.rglob("*")
        if p.suffix in (".py", ".c") and p.name != "__init__.py" and "__pycache__" not in p.parts
    )


def _packages() -> list[Path]:
    return sorted(p.parent for p in PACKAGE.rglob("__init__.py"))


def test_the_map_walks_the_whole_tree():
    assert len(_modules()) > 60 and len(_packages()) > 8  # the walk itself found the tree


@pytest.mark.parametrize("module", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_design_md_names_every_module(module):
    rel = module.relative_to(PACKAGE).as_posix()
    assert f"`{rel}`" in DESIGN, f"docs/design.md's module map has no row for `{rel}`"


@pytest.mark.parametrize("package", _packages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_each_package_docstring_names_its_modules(package):
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8")))
    assert doc, f"{package.relative_to(ROOT)}/__init__.py has no docstring"
    children = [p for p in package.iterdir() if p.suffix in (".py", ".c") and p.stem != "__init__"]
    children += [p for p in package.iterdir() if (p / "__init__.py").exists()]
    missing = [
        p.name
        for p in sorted(children)
        if not re.search(rf"(?<![\w.]){re.escape(p.stem)}(?![\w])", doc)
    ]
    assert not missing, (
        f"{package.relative_to(ROOT)}/__init__.py's docstring does not name {missing}"
    )


def test_design_md_names_every_guide_and_benchmark():
    guides = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "design.md")
    missing = [g for g in guides if f"({g})" not in DESIGN and f"docs/{g}" not in DESIGN]
    assert not missing, f"docs/design.md does not link the guides {missing}"
    benches = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "__init__.py")
    missing = [b for b in benches if f"`{b}`" not in DESIGN and f"benchmarks/{b}" not in DESIGN]
    assert not missing, f"docs/design.md does not name the benchmarks {missing}"

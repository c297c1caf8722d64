"""The package's shape: no import cycle between shardkit modules, optional extras stay optional."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "shardkit"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """shardkit modules imported anywhere in ``tree`` (functions too), except TYPE_CHECKING."""
    found: set[str] = set()
    here = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = here
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = node.module or ""
            if node.level:
                target = f"{base}.{target}" if target else base
            if target in known:
                found.add(target)
            for alias in node.names:  # `from . import x` where x is a submodule
                if f"{target}.{alias.name}" in known:
                    found.add(f"{target}.{alias.name}")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(files)
    return {
        name: _imports(ast.parse(p.read_text()), name, p.name == "__init__.py", known)
        for name, p in files.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the list of modules around it; None when the graph is acyclic.

    A package's own ``__init__`` importing its submodules is the one allowed back-edge: a
    submodule reaching its parent package is how ``from . import x`` works, not a cycle.
    """
    state: dict[str, int] = {}
    stack: list[str] = []

    def edges(m: str) -> set[str]:
        return {t for t in graph[m] if not m.startswith(t + ".")}

    def dfs(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges(m)):
            if state.get(t) == 1:
                return stack[stack.index(t) :] + [t]
            if t not in state:
                found = dfs(t)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = dfs(m)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_shardkit():
    graph = import_graph()
    assert "shardkit.bench.runner" in graph and graph["shardkit.bench.report"]
    assert "shardkit.bench.runner" not in graph["shardkit.bench.report"]
    assert "shardkit.bench.runner" not in graph["shardkit.bench.plot"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


_BLOCK = """
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Block())
"""


def _without(blocked: set[str], code: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter whose imports of ``blocked`` packages fail."""
    script = _BLOCK.format(blocked=blocked) + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, extra",
    [
        (["bench", "--plot", "{tmp}/p.png", "--data", "{tmp}/none"], "bench"),
        (["bench", "--timeline", "{tmp}/t.png", "--data", "{tmp}/none"], "bench"),
        (["synth", "lfw", "{tmp}/lfw", "--scale", "0.005"], "synth"),
    ],
)
def test_a_missing_extra_is_one_line_naming_the_install(tmp_path, argv, extra):
    args = [a.format(tmp=tmp_path) for a in argv]
    r = _without(
        {"matplotlib", "skimage"},
        """
        import sys
        from shardkit.cli import main
        sys.argv = ["shardkit", *sys.argv[1:]]
        main()
        """,
        *args,
    )
    assert r.returncode != 0, r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and f"pip install 'shardkit[{extra}]'" in lines[0]
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "lfw").exists() and not (tmp_path / "p.png").exists()


@pytest.mark.slow
def test_streaming_never_imports_the_extras(tmp_path):
    r = _without(
        {"matplotlib", "skimage"},
        """
        import shardkit, shardkit.bench, shardkit.cli, shardkit.synth
        from shardkit.bench import BenchConfig, format_table, run_bench
        print("ok")
        """,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.slow
def test_plots_leave_the_callers_matplotlib_backend_alone(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import sys
                import matplotlib
                matplotlib.use("svg")
                import matplotlib.pyplot as plt
                from shardkit.bench.results import Timeline
                from shardkit.bench.plot import plot_timeline
                tl = Timeline("tar", 1, 0, 0.0, 1, 0.01, [(0, 0.0, 0.1, 0.1), (0, 0.1, 0.2, 0.2)],
                              [(0.0, 0.1), (0.1, 0.2)], [])
                plot_timeline(tl, sys.argv[1])
                print(matplotlib.get_backend(), len(plt.get_fignums()))
                """
            ),
            str(tmp_path / "t.png"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["svg", "0"]
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

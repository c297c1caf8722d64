"""The package's shape: layers that only import downward, no import cycle, optional extras stay
optional.

A check anyone can run: ``python tests/test_layout.py`` prints the layers and any upward import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import import_target

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


def _imports(
    tree: ast.AST, module: str, is_package: bool, known: set[str], typing: bool = False
) -> set[str]:
    """shardkit modules imported anywhere in ``tree`` (functions too), except TYPE_CHECKING
    (``typing``: those too)."""
    found: set[str] = set()
    here = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not typing:
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            target = import_target(node, here)
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


def import_graph(typing: bool = False) -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(files)
    return {
        name: _imports(ast.parse(p.read_text()), name, p.name == "__init__.py", known, typing)
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


#: The layers of the package, lowest first: a module imports only from its own layer or below
#: (within a layer, ``test_no_import_cycle_in_shardkit`` keeps the order acyclic). A unit is a
#: module or a package with everything under it; every module must sit in exactly one unit.
LAYERS: list[tuple[str, set[str]]] = [
    (
        "shared utilities",
        {"errors", "redact", "retry", "sizes", "urls", "records", "extras", "progress", "fsutil"},
    ),
    ("images: checks, decode, geometry", {"images"}),
    ("bytes on disk and where they live", {"manifest", "remote", "formats", "paths", "scan"}),
    ("reading: shards to samples", {"stream"}),
    ("writing: folders to shards, verify", {"write"}),
    ("batches", {"loader"}),
    ("front doors", {"bench", "synth", "integrations", "cli", ""}),
]


def layer_of(module: str) -> int:
    """Index in ``LAYERS`` of the unit ``module`` belongs to (the longest matching unit)."""
    best, found = -1, None
    for i, (_, units) in enumerate(LAYERS):
        for unit in units:
            name = f"shardkit.{unit}" if unit else "shardkit"
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), i
    if found is None:
        raise AssertionError(f"{module} is in no layer of LAYERS: place it there")
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``importer -> imported`` for every import of a higher layer (a package's own parent
    ``__init__`` aside: ``from . import x`` reaches it)."""
    return [
        f"{m} ({LAYERS[layer_of(m)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})"
        for m in sorted(graph)
        for t in sorted(graph[m])
        if not m.startswith(t + ".") and layer_of(t) > layer_of(m)
    ]


def test_every_module_sits_in_a_layer_and_imports_only_downward():
    graph = import_graph()
    assert {"shardkit.stream.dataset", "shardkit.images.decode", "shardkit.write.packer"} <= set(
        graph
    )
    assert upward_imports(graph) == []


def test_the_layer_check_sees_an_upward_import():
    graph = {"shardkit.errors": {"shardkit.stream.stages"}, "shardkit.stream.stages": set()}
    assert upward_imports(graph) == [
        "shardkit.errors (shared utilities) -> shardkit.stream.stages (reading: shards to samples)"
    ]


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_shardkit():
    graph = import_graph()
    assert "shardkit.bench.runner" in graph and graph["shardkit.bench.report"]
    assert "shardkit.bench.runner" not in graph["shardkit.bench.report"]
    assert "shardkit.bench.runner" not in graph["shardkit.bench.plot"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_stream_modules_import_one_way_even_for_type_hints():
    """Within ``shardkit.stream`` not even a TYPE_CHECKING import points back: the planner
    reads the state format and the sources' shape, and neither reads the planner."""
    graph = import_graph(typing=True)
    stream = {
        m: {t for t in ts if t.startswith("shardkit.stream.")}
        for m, ts in graph.items()
        if m.startswith("shardkit.stream.")
    }
    assert find_cycle(stream) is None, " -> ".join(find_cycle(stream) or [])


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
        (["pack", "{tmp}", "{tmp}/lfw", "--engine", "ray"], "ray"),
    ],
)
def test_a_missing_extra_is_one_line_naming_the_install(tmp_path, argv, extra):
    args = [a.format(tmp=tmp_path) for a in argv]
    r = _without(
        {"matplotlib", "skimage", "ray"},
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


if __name__ == "__main__":
    graph = import_graph()
    for i, (name, _) in enumerate(LAYERS):
        mods = sorted(m for m in graph if layer_of(m) == i)
        print(f"{i} {name}: {', '.join(m.removeprefix('shardkit.') or 'shardkit' for m in mods)}")
    bad = upward_imports(graph)
    print("\n".join(bad) or "no module imports upward")
    sys.exit(1 if bad else 0)

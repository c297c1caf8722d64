"""``shardkit ls``, ``show``, ``info`` and ``verify`` answer without torch and without the loader.

They read the manifest, the sample indexes and the shards' bytes; importing torch alone takes
seconds and a few hundred MB, more than the index's answer. The child-process test runs each
command in a fresh interpreter and looks at ``sys.modules`` after it; the static test follows the
module-level imports of what each command imports, so ``make test`` catches a new top-level
``import torch`` on that path too.
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import import_target

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "shardkit"

#: The commands that inspect a dataset, by their function in ``shardkit/cli.py``.
INSPECTING = {"ls": "ls_cmd", "show": "show_cmd", "info": "info_cmd", "verify": "verify_cmd"}
#: What they must not load: torch, and the loader (which is built on it).
HEAVY = ("torch", "shardkit.loader")


def _heavy(names) -> list[str]:
    return sorted(n for n in names if any(n == h or n.startswith(h + ".") for h in HEAVY))


@pytest.mark.slow  # a fresh interpreter
@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_inspecting_commands_leave_torch_and_the_loader_unimported(packed_tree, fmt):
    out = packed_tree(20, 3, [fmt])[fmt]
    code = textwrap.dedent(
        """
        import json, sys
        from shardkit.cli import main
        out, found = sys.argv[1], {}
        for args in (["ls", out, "--head", "1"], ["show", out, "#0"], ["info", out],
                     ["verify", out, "-q", "--decode"]):
            main(args, standalone_mode=False)
            heavy = (m for m in sys.modules if m.split(".")[0] == "torch" or "shardkit.loader" in m)
            found[args[0]] = sorted(heavy)[:3]
        print(json.dumps(found))
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", code, out], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert r.returncode == 0, r.stderr
    printed = r.stdout.strip().splitlines()
    assert printed[0].startswith("0  ") and any(line.startswith("OK: ") for line in printed), (
        r.stdout
    )
    assert json.loads(printed[-1]) == {"ls": [], "show": [], "info": [], "verify": []}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports_now(body: list[ast.stmt], module: str, is_package: bool) -> set[str]:
    """Modules the statements ``body`` import when they run: function bodies (run later) and
    ``if TYPE_CHECKING:`` blocks left out; each ``from X import y`` as ``X`` and ``X.y``."""
    here = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in (
            getattr(test, "id", None),
            getattr(test, "attr", None),
        ):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = import_target(node, here)
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    for stmt in body:
        visit(stmt)
    return found


@functools.cache
def _module_imports(path: Path, name: str) -> frozenset[str]:
    return frozenset(
        _imports_now(ast.parse(path.read_text()).body, name, path.name == "__init__.py")
    )


def _loaded_by(start: set[str]) -> set[str]:
    """Every module importing ``start`` runs at import time: shardkit's followed through their
    files (with their parent packages), others (torch, numpy ...) named by their top package."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    seen: set[str] = set()
    todo = list(start)
    while todo:
        name = todo.pop()
        if name not in files:  # a name imported from a module, or a third-party module
            if not name.startswith("shardkit"):
                seen.add(name.split(".")[0])
            continue
        if name in seen:
            continue
        seen.add(name)
        todo += _module_imports(files[name], name)
        todo += [name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)]  # parents
    return seen


def _command_imports(function: str) -> set[str]:
    """``shardkit.cli`` and what the command's function in it imports."""
    tree = ast.parse((PACKAGE / "cli.py").read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function]
    return {"shardkit.cli"} | _imports_now(fn.body, "shardkit.cli", False)


@pytest.mark.parametrize("command", sorted(INSPECTING))
def test_inspecting_commands_import_no_torch_at_module_level(command):
    loaded = _loaded_by(_command_imports(INSPECTING[command]))
    assert {"click", "shardkit.errors", "shardkit.manifest", "numpy"} <= loaded  # followed
    assert _heavy(loaded) == []


def test_the_import_walk_sees_torch_and_the_loader_where_they_are_imported():
    assert "torch" in _loaded_by({"shardkit.stream.dataset"})
    assert {"shardkit.loader", "shardkit.loader.epoch"} <= set(
        _heavy(_loaded_by({"shardkit.loader"}))
    )


def test_a_view_is_still_a_dataset_to_torch(packed_tree):
    """``ShardView`` is map-style by protocol, without torch's base class: a ``DataLoader``
    batches it and ``view + view`` is torch's ``ConcatDataset``, as before."""
    from torch.utils.data import ConcatDataset, DataLoader

    from shardkit import ShardView

    view = ShardView(packed_tree(12, 3, ["tar"])["tar"], decode="raw", with_keys=True)
    both = view + view
    assert isinstance(both, ConcatDataset) and len(both) == 24 and both[12] == view[0]
    keys = [k for batch in DataLoader(view, batch_size=5, collate_fn=list) for *_, k in batch]
    assert keys == view.keys()

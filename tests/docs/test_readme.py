"""README.md and docs/*.md run as written: every ```console and ```python block, in order.

Each file runs in a scratch directory of its own, prepared as ``make demo`` leaves a fresh clone
(``tools/demo.py``'s ``LAYOUT``: ``data/lfw``, README's Quick start pack in ``out/`` packed with
the very options its command names, so that command finds it up to date, and an LMDB copy in
``out-lmdb/``), with small data: the embedded LFW-shaped set at ``SHARDKIT_LFW_SCALE`` (the
documented way to shrink the default set), and small LMDB shards so the docs' multi-shard
examples have several. Bench commands are bounded through click's
``SHARDKIT_<COMMAND>_<OPTION>`` environment variables; the remote section talks to the loopback
moto server through ``AWS_ENDPOINT_URL``; the training loop finds the variables torchrun sets
(a world of one).

Rules, so new sections are picked up without touching this file:
- a ```console block: lines starting ``$ `` are commands (run with bash, ``shardkit`` and
  ``python`` on PATH); the lines after a command, up to the next ``$ ``, are its expected output.
- a ```python block runs in one namespace shared by all python blocks (as one reader's session).
- a bare ``` block right after a python or console block is that block's expected output.
- ``<!-- readme-test: skip: REASON -->`` right above a block leaves it out (e.g. it needs a
  GPU); the test warns with every block left out, so the list stays visible.
- expected output is compared line by line with numbers and absolute directories masked, and a
  line must keep its shape (first word equal, the rest similar); an ``error:`` line means the
  command must fail, otherwise it must succeed. Progress and warnings on stderr are not compared
  unless the README shows ``error:``/``warning:`` lines.
"""

from __future__ import annotations

import contextlib
import difflib
import gc
import importlib.util
import io
import os
import re
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: README first, then every guide in docs/ (each runs in a scratch directory of its own).
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
#: The most lines README may have: a front door, with the rest in docs/.
README_MAX_LINES = 350
#: How shardkit's retired-keyword warnings begin (``shardkit.stream.retired.PREFIX``).
RETIRED = "retired keyword"
SCALE = "0.05"  # ~660 images: the whole README in about a minute on 2 cores

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@dataclass
class Block:
    lang: str  # "console", "python" or "" (a bare block)
    text: str
    line: int  # 1-based line of the opening fence in README.md
    expected: str | None = None  # a following bare block: this block's output
    skip: str = ""  # why it is not run: `<!-- readme-test: skip: REASON -->` right above it


_FENCE = re.compile(r"^```([A-Za-z]*)\n(.*?)^```[ \t]*$", re.M | re.S)
_SKIP = re.compile(r"<!--\s*readme-test:\s*skip:\s*(.+?)\s*-->\s*$")


def readme_blocks(text: str) -> list[Block]:
    """The runnable blocks of README in order, each with the bare block that follows it."""
    blocks: list[Block] = []
    last_end = None
    for m in _FENCE.finditer(text):
        lang, body = m.group(1).lower(), m.group(2)
        line = text.count("\n", 0, m.start()) + 1
        adjacent = last_end is not None and text[last_end : m.start()].strip() == ""
        if lang == "" and adjacent and blocks and blocks[-1].expected is None:
            blocks[-1].expected = body
        elif lang in ("console", "python"):
            skip = _SKIP.search(text[last_end or 0 : m.start()])
            blocks.append(Block(lang, body, line, skip=skip.group(1) if skip else ""))
        last_end = m.end()
    return blocks


def console_steps(text: str) -> list[tuple[str, list[str]]]:
    """``$ cmd`` lines with the output lines under each."""
    steps: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line)
        elif line.strip():
            raise AssertionError(f"console block starts with output, not a command: {line!r}")
    return steps


_ABS_DIR = re.compile(r"(?<![\w.])/(?:[\w.+-]+/)+")
_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
# Person names of the LFW-shaped set (Aaron_Baker): which ones appear depends on its scale.
_PERSON = re.compile(r"\b[A-Z][a-z]+(?:_[A-Za-z]+)+")


def mask(line: str) -> str:
    """Figures, names and absolute directories out: what stays is the line's shape."""
    line = _ABS_DIR.sub("<dir>/", line.rstrip())
    return _NUMBER.sub("N", _PERSON.sub("Name", line))


def assert_output_like(expected: list[str], actual: list[str], where: str) -> None:
    exp = [mask(x) for x in expected if x.strip()]
    act = [mask(x) for x in actual if x.strip()]
    report = f"{where}\nexpected (masked):\n" + "\n".join(exp) + "\nactual (masked):\n"
    report += "\n".join(act)
    assert len(exp) == len(act), report
    for e, a in zip(exp, act, strict=True):
        same_start = e.split(" ", 1)[0] == a.split(" ", 1)[0]
        similar = difflib.SequenceMatcher(None, e, a).ratio() >= 0.7
        assert same_start and similar, f"line differs: {e!r} vs {a!r}\n{report}"


def _demo_layout():
    spec = importlib.util.spec_from_file_location("shardkit_demo", ROOT / "tools" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo.LAYOUT


@pytest.fixture()
def scratch(tmp_path, s3, gcs_server, azure_server, monkeypatch) -> Path:
    """A directory as ``make demo`` leaves it (small data), an env that bounds the bench,
    points S3, GCS and Azure at the loopback servers (each with the reader's own bucket,
    ``datasets``) and sets torchrun's variables, and ``shardkit``/``python`` on PATH."""
    from remote_servers import FAKE_KEY, FAKE_SECRET, free_port

    from shardkit.synth import make_lfw
    from shardkit.write.packer import pack

    env = {
        "SHARDKIT_LFW_SCALE": SCALE,
        "SHARDKIT_BENCH_REPEATS": "1",
        "SHARDKIT_BENCH_BATCHES": "2",
        "SHARDKIT_BENCH_MIN_SAMPLES": "0",
        "SHARDKIT_BENCH_MIN_SECONDS": "0",
        "SHARDKIT_BENCH_MAX_SECONDS": "0.5",
        "AWS_ENDPOINT_URL": s3.endpoint,
        "AWS_ACCESS_KEY_ID": FAKE_KEY,
        "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        **gcs_server.env(gcs_server.endpoint),
        **azure_server.env(azure_server.endpoint),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        # -W error::FutureWarning for shardkit's retired keywords, in every command
        "PYTHONWARNINGS": f"error:{RETIRED}:FutureWarning",
        # what torchrun sets, for a world of one
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    bindir = tmp_path / ".bin"
    bindir.mkdir()
    for name, argv in (("shardkit", "-m shardkit.cli"), ("python", "")):
        script = bindir / name
        script.write_text(f'#!/bin/sh\nexec {sys.executable} {argv} "$@"\n')
        script.chmod(0o755)
    env["PATH"] = f"{bindir}{os.pathsep}{os.environ['PATH']}"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in [k for k in os.environ if k.startswith("AWS_") and k not in env]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)

    layout = _demo_layout()
    make_lfw(layout.data)
    for i, (out, fmt, size) in enumerate(layout.packs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # the first is README's Quick start pack, options as printed; the others get small
            # shards, so the docs' multi-shard examples find several in the small data
            pack(layout.data, out, format=fmt, shard_size=size if i == 0 else "1MB", progress=False)
    with contextlib.suppress(Exception):  # the session's server may have it from another file
        s3.client().create_bucket(Bucket="datasets")  # the reader's own bucket
    from shardkit.remote.fs import filesystem

    for scheme, server in (("gs", gcs_server), ("az", azure_server)):
        fs = filesystem(scheme, server.options(server.endpoint))
        if not fs.exists("datasets"):
            fs.mkdir("datasets")
    return tmp_path


def run_console(block: Block, cwd: Path, name: str = "README.md") -> None:
    for cmd, expected in console_steps(block.text):
        print(f"{time.strftime('%H:%M:%S')} {name}:{block.line}: $ {cmd}")
        proc = subprocess.run(
            ["bash", "-c", cmd], cwd=cwd, capture_output=True, text=True, timeout=600
        )
        where = f"{name}:{block.line}: $ {cmd}\nstderr:\n{proc.stderr[-3000:]}"
        fails = any(x.startswith("error:") for x in expected)
        if fails:
            assert proc.returncode != 0, where
        else:
            assert proc.returncode == 0, where
        if not any(x.strip() for x in expected):
            continue
        shown = ("error:", "warning:")
        stderr = [x for x in proc.stderr.splitlines() if x.startswith(shown)]
        if not any(x.startswith("warning:") for x in expected):
            stderr = [x for x in stderr if not x.startswith("warning:")]
        assert_output_like(expected, proc.stdout.splitlines() + stderr, where)


def run_python(block: Block, namespace: dict, name: str = "README.md") -> None:
    print(f"{time.strftime('%H:%M:%S')} {name}:{block.line}: python")
    out = io.StringIO()
    code = compile(block.text, f"{name}:{block.line}", "exec")
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the docs show the current spelling: a retired keyword is an error, not a warning
        warnings.filterwarnings("error", message=RETIRED, category=FutureWarning)
        exec(code, namespace)
    if block.expected is not None:
        assert_output_like(
            block.expected.splitlines(), out.getvalue().splitlines(), f"{name}:{block.line}"
        )


def test_readme_blocks_are_found():
    """The parser sees the README's runnable blocks, and outputs attach to their snippets."""
    blocks = readme_blocks(README.read_text())
    langs = {b.lang for b in blocks}
    assert langs == {"console", "python"}
    assert any(b.lang == "python" and b.expected for b in blocks)
    assert all(console_steps(b.text) for b in blocks if b.lang == "console")


def test_mask_keeps_shape_and_catches_drift():
    assert_output_like(
        ["epoch 0: 208 batches, last (25, 3, 250, 250)"],
        ["epoch 1: 11 batches, last (9, 3, 250, 250)"],
        "same shape",
    )
    with pytest.raises(AssertionError):
        assert_output_like(["epoch 0: 208 batches"], ["error: no such file"], "drift")
    with pytest.raises(AssertionError):
        assert_output_like(["a", "b"], ["a"], "missing line")


def _name(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


def test_readme_is_a_front_door():
    """README stays short: what it is, the two commands, the Quick start, training, links."""
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    for command in ("make demo", "make test"):  # .ci/run calls `make test`
        assert command in text


def test_every_file_in_docs_is_linked():
    """No orphan in docs/: every file there is linked from README or from a doc."""
    linked: set[Path] = set()
    for doc in [*DOCS, ROOT / "FORMAT.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)", doc.read_text()):
            if "://" not in target:
                linked.add((doc.parent / target).resolve())
    orphans = sorted(p.name for p in (ROOT / "docs").iterdir() if p.resolve() not in linked)
    assert orphans == []


@pytest.mark.parametrize("doc", [d for d in DOCS if readme_blocks(d.read_text())], ids=_name)
def test_doc_runs_as_written(scratch, doc):
    name = _name(doc)
    namespace: dict = {"__name__": "__readme__"}
    not_run = []
    try:
        for block in readme_blocks(doc.read_text()):
            if block.skip:
                not_run.append(f"{name}:{block.line}: {block.skip}")
            elif block.lang == "console":
                run_console(block, scratch, name)
                if block.expected is not None:
                    raise AssertionError(
                        f"{name}:{block.line}: put the output inside the console block"
                    )
            else:
                run_python(block, namespace, name)
    finally:
        # The snippets' loaders hold persistent workers and storages: let them shut down.
        namespace.clear()
        gc.collect()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():  # a snippet that failed midway
            dist.destroy_process_group()
    if not_run:
        warnings.warn(f"{name} blocks not run: " + "; ".join(not_run), stacklevel=1)

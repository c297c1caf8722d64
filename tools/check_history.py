"""Fail when code names the tracker instead of saying what it means: ``#12``, ``issue 13``,
``ticket 4``, ``H9s``-style tags, in comments, docstrings, strings or names.

Why a thing is so belongs in the code's own words; which issue asked for it belongs in git log.
Run by ``make lint``; prints ``file:line: text`` for each hit and exits 1 if there is any.

    python tools/check_history.py [PATH ...]    # default: shardkit tests benchmarks tools
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ("shardkit", "tests", "benchmarks", "tools", "pyproject.toml")
SUFFIXES = {".py", ".c", ".toml", ".md", ".txt", ".cfg"}

PATTERN = re.compile(
    r"(?<![\w\"'&/])#\d{1,4}\b"  # #12 (not "#999999" colours, not URL fragments)
    r"|\b[Ii]ssues?[ _#]?\d+\b"  # issue 13, issue_13, issues 9
    r"|\b[Tt]ickets?[ _#]?\d+\b"  # ticket 4
    r"|\bH\d{1,2}[a-z]?\b"  # H9s, H9b: tags of a tracker's items
    r"|the_issue_example|\bthe issue.s example\b"  # what an issue said, not what it is
)

#: Files being rewritten on another branch, checked again when that branch lands (path: reason).
PENDING: dict[str, str] = {}


def hits(path: Path) -> list[str]:
    found = []
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return found
    for n, line in enumerate(text.splitlines(), 1):
        if PATTERN.search(line):
            found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    return found


def files(paths: list[str]) -> list[Path]:
    out = []
    for p in paths:
        base = (ROOT / p).resolve()
        candidates = [base] if base.is_file() else sorted(base.rglob("*"))
        for f in candidates:
            if f.is_file() and f.suffix in SUFFIXES and "__pycache__" not in f.parts:
                if str(f.relative_to(ROOT)) not in PENDING and f != Path(__file__).resolve():
                    out.append(f)
    return out


def main(argv: list[str]) -> int:
    found = [h for f in files(argv or list(DEFAULT)) for h in hits(f)]
    for h in found:
        print(h)
    if found:
        print(
            f"{len(found)} reference(s) to tracker items: say what the code does or why, "
            "and leave the issue number to the commit message"
        )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""``python -m benchmarks list`` names every case; ``python -m benchmarks run CASE [--small]
[--against DIR] [case flags]`` runs one (``harness.main``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

harness.main()

"""Optional dependencies: the ``bench`` plots need matplotlib, ``synth`` needs the photographs
shipped in scikit-image and matplotlib. A streaming user installs neither; asking for a feature
without its extra is a one-line error naming the ``pip install`` that fixes it.
"""

from __future__ import annotations

import importlib.util

from .errors import MissingExtraError

__all__ = ["EXTRAS", "require"]

#: extra -> the import names it provides (pyproject.toml's [project.optional-dependencies]).
EXTRAS = {
    "bench": ("matplotlib",),
    "synth": ("skimage", "matplotlib"),
    "ray": ("ray",),
    "parquet": ("pyarrow",),
}

_DISTRIBUTIONS = {"skimage": "scikit-image"}


def require(extra: str, feature: str) -> None:
    """Raise MissingExtraError unless every package of ``extra`` can be imported.

    Checked through import specs, without importing (importing skimage takes seconds).
    """
    for module in EXTRAS[extra]:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            name = _DISTRIBUTIONS.get(module, module)
            raise MissingExtraError(
                f"{feature} needs {name}, which is not installed: pip install 'shardkit[{extra}]'"
            )

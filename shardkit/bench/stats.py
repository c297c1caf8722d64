"""Is a difference between two configurations real? Welch's t-test on the per-run rates.

The bench repeats every configuration a few times; two means can differ by 20% and still be
noise on a shared machine (measured: "tar vs folder 1.2x (408 ± 223 vs 336 ± 188)"). The verdict
therefore calls a difference real only when Welch's unequal-variance t-test rejects "same mean"
at the 95% level. Implemented with the standard library (Student's t tail from the regularized
incomplete beta function, Lentz's continued fraction) so that core shardkit does not depend on
scipy; ``tests/bench/test_bench.py`` checks it against scipy where scipy happens to be installed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ALPHA", "Comparison", "student_t_sf2", "welch"]

#: Significance level: a difference is called real when the two-sided p-value is below this.
ALPHA = 0.05


@dataclass(frozen=True)
class Comparison:
    """Welch's t-test of ``a`` against ``b``.

    ``p``: two-sided p-value, None when a side has fewer than 2 runs (no spread to test with).
    ``real``: the difference is significant at ``ALPHA``; False when it cannot be tested.
    ``short_s``: set (the shortest timed run, seconds) when the runs were too short to judge.
    """

    mean_a: float
    mean_b: float
    t: float | None
    df: float | None
    p: float | None
    short_s: float | None = None

    @property
    def ratio(self) -> float:
        return self.mean_a / self.mean_b if self.mean_b else math.inf

    @property
    def real(self) -> bool:
        return self.p is not None and self.p < ALPHA and self.short_s is None

    def describe(self) -> str:
        """``"p=0.003"`` / ``"p<0.001"`` / ``"untested: 1 run"`` for the verdict's wording."""
        if self.short_s is not None:
            return f"too short to judge: a run timed {self.short_s * 1000:.3g} ms"
        if self.p is None:
            return "untested: fewer than 2 runs each"
        return "p<0.001" if self.p < 0.001 else f"p={self.p:.2g}"


def _mean_var(values: Sequence[float]) -> tuple[float, float, int]:
    n = len(values)
    mean = math.fsum(values) / n
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, var, n


def welch(a: Sequence[float], b: Sequence[float]) -> Comparison:
    """Welch's t-test (unequal variances) of the runs ``a`` against ``b``."""
    ma, va, na = _mean_var(a)
    mb, vb, nb = _mean_var(b)
    if na < 2 or nb < 2:
        return Comparison(ma, mb, None, None, None)
    sa, sb = va / na, vb / nb
    se2 = sa + sb
    if se2 == 0.0:  # no spread at all: any difference is exact, none is none
        return Comparison(ma, mb, math.inf if ma != mb else 0.0, None, 0.0 if ma != mb else 1.0)
    t = (ma - mb) / math.sqrt(se2)
    df = se2**2 / (sa**2 / (na - 1) + sb**2 / (nb - 1))
    return Comparison(ma, mb, t, df, student_t_sf2(t, df))


def student_t_sf2(t: float, df: float) -> float:
    """Two-sided tail P(|T| >= |t|) of Student's t with ``df`` degrees of freedom."""
    x = df / (df + t * t)
    return min(1.0, max(0.0, _betainc(df / 2.0, 0.5, x)))


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b) (Numerical Recipes' ``betai``)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    front = math.exp(log_front)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def _betacf(a: float, b: float, x: float, iterations: int = 300, eps: float = 1e-15) -> float:
    """Continued fraction for the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, iterations + 1):
        m2 = 2 * m
        for aa in (
            m * (b - m) * x / ((qam + m2) * (a + m2)),
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),
        ):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h

"""Class-size distributions and class names: LFW's long tail, WordNet-style ImageNet ids.

Pure functions of (scale, seed): the tree builder and the tests ask them for counts and names.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ..errors import InputError

__all__ = ["LFW_IMAGES", "LFW_PEOPLE", "imagenet_wnids", "lfw_counts", "lfw_names"]

LFW_PEOPLE = 5749
LFW_IMAGES = 13233
# The head of real LFW (people with 40+ images), which every LFW user meets first.
_LFW_HEAD = [
    ("George_W_Bush", 530),
    ("Colin_Powell", 236),
    ("Tony_Blair", 144),
    ("Donald_Rumsfeld", 121),
    ("Gerhard_Schroeder", 109),
    ("Ariel_Sharon", 77),
    ("Hugo_Chavez", 71),
    ("Junichiro_Koizumi", 60),
    ("Jean_Chretien", 55),
    ("John_Ashcroft", 53),
    ("Jacques_Chirac", 52),
    ("Serena_Williams", 52),
    ("Vladimir_Putin", 49),
    ("Luiz_Inacio_Lula_da_Silva", 48),
    ("Gloria_Macapagal_Arroyo", 44),
    ("Arnold_Schwarzenegger", 42),
    ("Jennifer_Capriati", 42),
    ("Laura_Bush", 41),
    ("Lleyton_Hewitt", 41),
]
# The rest of real LFW by bracket: (fewest, most, people, images). 62 people have 20+ images
# (3,023 in all), 158 have 10+ (4,324), 1,680 have 2+; 4,069 have exactly one.
_LFW_BRACKETS = [(20, 39, 43, 1156), (10, 19, 96, 1301), (2, 9, 1522, 4840)]
_LFW_SINGLES = 4069

_FIRST = (
    "Aaron Abdullah Adam Adriana Ahmed Aicha Akira Alan Alberto Alejandro Alexandra Ali Alicia "
    "Amanda Amelie Ana Andre Andrea Angela Anna Anthony Antonio Ari Arturo Ayumi Barbara Beatriz "
    "Ben Bernard Bill Bob Boris Brian Bruce Carla Carlos Carmen Catherine Cesar Charles Chen Chris "
    "Christine Claudia Colin Daniel David Deborah Dennis Diana Dmitri Dolores Elena Elizabeth "
    "Emily Emma Enrique Eric Erik Eva Fatima Felipe Fernando Frank Gabriel George Gerard Gina "
    "Gordon "
    "Grace Gustavo Hamid Hans Harry Helen Hiroshi Hugo Ian Igor Ingrid Irene Isabel Ivan Jack "
    "Jacques Jake James Jan Jane Javier Jean Jennifer Jeremy Jessica Jim Joan Joe John Jorge Jose "
    "Joseph Juan Julia Julie Karen Kate Kenji Kevin Kim Kofi Laura Leonid Li Linda Lisa Lucia "
    "Luis Lynn Manuel Marco Maria Mark Martin Mary Masao Matt Megan Michael Michelle Miguel Mike "
    "Mohammed Monica Nancy Naomi Natalie Nicole Nina Olga Omar Oscar Pablo Patricia Paul Pedro "
    "Peter Pierre Rachel Rafael Ralph Raul Ricardo Richard Rita Robert Roberto Rosa Ruth Sally "
    "Sam Sandra Sarah Sergei Sharon Silvio Simon Sofia Stefan Stephen Steve Susan Tariq Tatiana "
    "Thomas Tim Tom Valentina Vicente Victor Walter Wang Wendy William Yasser Yoko Yuri Zhang Zoran"
).split()
_LAST = (
    "Abbas Adams Aguilar Ahmadi Albright Alvarez Anderson Andrade Arafat Armstrong Aziz Baker "
    "Banda Barnes Bauer Becker Bell Bennett Berlusconi Bianchi Blanco Bondarenko Borges Brown "
    "Bruno Cabrera Campbell Carter Castillo Castro Chang Chavez Cho Clark Collins Cooper Costa "
    "Cruz Davis Diaz Dubois Duarte Edwards Evans Fernandez Ferrari Fischer Fisher Flores Fontaine "
    "Garcia Gomez Gonzalez Green Guerrero Gupta Hall Hansen Harris Hernandez Herrera Hill Hoffmann "
    "Hughes Ivanov Jackson Jensen Jimenez Johnson Jones Kaur Keller Khan Kim King Klein Koch "
    "Kowalski Kumar Lambert Lee Lewis Lopez Mahmoud Martin Martinez Mendoza Meyer Miller Mitchell "
    "Molina Moore Morales Moreau Morris Muller Murphy Nakamura Nelson Nguyen Novak Ortiz Park "
    "Patel Perez Peterson Petrov Phillips Pham Popescu Ramirez Reyes Richter Rivera Roberts "
    "Robinson Rodriguez Romero Rossi Ruiz Russo Sanchez Santos Sato Schmidt Schneider Schulz "
    "Scott Silva Singh Smith Sokolov Sousa Stewart Suzuki Tanaka Taylor Thomas Thompson Torres "
    "Turner Vargas Vasquez Vega Volkov Wagner Walker Wang Watanabe Weber White Williams Wilson "
    "Wong Wright Yamamoto Yilmaz Young Zhang Zimmermann"
).split()


# --- class-size distributions and names --------------------------------------------------------


def _bracket_counts(lo: int, hi: int, people: int, images: int) -> list[int]:
    """``people`` counts in [lo, hi] summing to ``images``, falling off like a power law.

    Count at rank r is ``lo + (hi - lo) * (1 - r / people) ** p``; ``p`` is found by bisection so
    the rounded counts land near ``images``, and the last few units are settled one at a time.
    """

    def counts(p: float) -> list[int]:
        return [int(lo + (hi - lo) * (1 - r / people) ** p + 0.5) for r in range(people)]

    a, b = 0.01, 100.0
    for _ in range(80):
        mid = (a + b) / 2
        if sum(counts(mid)) > images:
            a = mid
        else:
            b = mid
    out = counts(b)
    diff = images - sum(out)
    i = 0
    while diff:  # a few units at most; keep within bounds and non-increasing
        step = 1 if diff > 0 else -1
        j = i % people if step > 0 else people - 1 - (i % people)
        if lo <= out[j] + step <= hi:
            out[j] += step
            diff -= step
        i += 1
    return sorted(out, reverse=True)


@functools.cache
def _full_lfw_counts() -> tuple[int, ...]:
    counts = [c for _, c in _LFW_HEAD]
    for bracket in _LFW_BRACKETS:
        counts += _bracket_counts(*bracket)
    counts += [1] * _LFW_SINGLES
    assert len(counts) == LFW_PEOPLE and sum(counts) == LFW_IMAGES
    return tuple(counts)


def _lfw_ranks(scale: float) -> list[int]:
    """Ranks (into the full table) of the people kept at ``scale``: evenly spaced quantiles.

    Sampling the sorted table at evenly spaced quantiles keeps its shape (about 71% singletons, a
    head of people with many images) and its mean, so the image count follows the scale too.
    """
    people = max(2, int(LFW_PEOPLE * scale + 0.5))
    return [int((i + 0.5) * LFW_PEOPLE / people) for i in range(people)]


def lfw_counts(scale: float = 1.0) -> list[int]:
    """Images per person of the LFW-shaped set at ``scale``, largest first.

    At 1.0 this is LFW's own shape: 5,749 people, 13,233 images, 4,069 with one image, George W
    Bush 530. Smaller scales keep about ``5749 * scale`` people (at least 2) and
    ``13233 * scale`` images (at least one per person), with the long tail kept.
    """
    _check_scale(scale)
    full = _full_lfw_counts()
    counts = [full[r] for r in _lfw_ranks(scale)]
    target = max(len(counts), int(LFW_IMAGES * scale + 0.5))
    diff = target - sum(counts)
    # Settle the difference on the people who have several images, round-robin from the largest,
    # so singletons stay singletons and the head keeps its weight.
    many = [i for i, c in enumerate(counts) if c > 1] or [0]
    i = 0
    while diff > 0:
        counts[many[i % len(many)]] += 1
        diff -= 1
        i += 1
    while diff < 0:
        donors = [k for k in many if counts[k] > 2] or [k for k, c in enumerate(counts) if c > 1]
        counts[donors[i % len(donors)]] -= 1
        diff += 1
        i += 1
    return sorted(counts, reverse=True)


def lfw_names(scale: float = 1.0) -> list[str]:
    """Folder names matching :func:`lfw_counts`, LFW style (``First_Last``, unique).

    The head carries real LFW's names; the rest are drawn, seed-independently, from common first
    names and surnames, with a middle name added where a pair is already taken.
    """
    _check_scale(scale)
    full = _full_lfw_names()
    return [full[r] for r in _lfw_ranks(scale)]


@functools.cache
def _full_lfw_names() -> tuple[str, ...]:
    rng = np.random.default_rng(2007)
    names = [n for n, _ in _LFW_HEAD]
    taken = set(names)
    while len(names) < LFW_PEOPLE:
        first, last = _FIRST[rng.integers(len(_FIRST))], _LAST[rng.integers(len(_LAST))]
        name = f"{first}_{last}"
        if name in taken:
            name = f"{first}_{_FIRST[rng.integers(len(_FIRST))]}_{last}"
        if name in taken:
            continue
        taken.add(name)
        names.append(name)
    return tuple(names)


def imagenet_wnids(classes: int, seed: int = 0) -> list[str]:
    """``classes`` distinct, sorted WordNet-style ids (``n`` + 8 digits) drawn from ``seed``.

    Drawn from the range the real ILSVRC ids span (n01440764 .. n15075141).
    """
    rng = np.random.default_rng([seed, 1, 0])
    ids = rng.choice(15075141 - 1440764, size=classes, replace=False) + 1440764
    return [f"n{i:08d}" for i in sorted(int(x) for x in ids)]


def _check_scale(scale: float) -> None:
    if not (0 < scale <= 1) or math.isnan(scale):
        raise InputError(f"scale={scale} must be in (0, 1]; 1.0 is LFW's full size")

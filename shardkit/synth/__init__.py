"""Embedded default datasets: LFW- and ImageNet-shaped folder trees made from real photographs.

Nothing can be downloaded where shardkit is built and tested, yet packing and streaming only mean
something on files that look like the real ones: JPEGs whose sizes and decode costs are those of
photographs, in the folder layouts and class-size distributions people actually pack. So the pixels
come from the colour photographs that ship inside the scikit-image and matplotlib wheels, cropped,
rotated, zoomed, flipped, colour-jittered, blurred or grained per image and re-encoded at a JPEG
quality drawn from a realistic range.

Every image's random state is seeded from ``(seed, kind, class, index)`` alone, so a seed gives
byte-identical files whatever the worker count or scheduling. Output is written into a temporary
sibling directory and renamed into place when complete, with ``.synth.json`` (plain JSON) written
last; a later call with the same parameters finds the marker and reuses the tree.

Modules by concern: ``names`` (class sizes and names), ``render`` (one image from the shipped
photographs), ``build`` (a whole tree: threads, temporary directory, marker, reuse). The
photographs come with the ``synth`` extra: ``pip install 'shardkit[synth]'``.
"""

from __future__ import annotations

from .build import GENERATOR_VERSION, MARKER, SynthReport, make_imagenet, make_lfw
from .names import LFW_IMAGES, LFW_PEOPLE, imagenet_wnids, lfw_counts, lfw_names
from .render import photo_sources

__all__ = [
    "GENERATOR_VERSION",
    "LFW_IMAGES",
    "LFW_PEOPLE",
    "MARKER",
    "SynthReport",
    "imagenet_wnids",
    "lfw_counts",
    "lfw_names",
    "make_imagenet",
    "make_lfw",
    "photo_sources",
]

"""URLs as shardkit derives them: what is one, its parent, its last name, a name joined to it.

One module so every place that turns a manifest URL into shard URLs (sources, verify, the writer,
the remote cache) agrees. A URL may end in a query string, such as a token that is valid for the
whole prefix (``https://h/ds/manifest.json?sig=...``): it is kept last in every URL derived from
it, and never taken for part of a name. Plain string work, no imports of network libraries.
"""

from __future__ import annotations

import posixpath

__all__ = [
    "is_remote",
    "is_url",
    "join_url",
    "join_parts",
    "url_name",
    "url_parent",
    "url_path",
]


def is_url(source: str) -> bool:
    """True for ``scheme://...`` strings; plain paths (including Windows ``C:\\``) are not URLs."""
    head, sep, _ = source.partition("://")
    return bool(sep) and len(head) > 1 and head.replace("+", "").replace("-", "").isalnum()


def is_remote(path: str) -> bool:
    """An object-store or HTTP URL (``s3://``, ``https://`` ...): a URL that is not ``file://``."""
    return is_url(path) and not path.startswith("file://")


def url_path(url: str) -> str:
    """``url`` without its query string."""
    return url.partition("?")[0]


def join_url(base: str, name: str) -> str:
    """``s3://b/prefix/`` + ``shard-000000.tar`` -> ``s3://b/prefix/shard-000000.tar``.

    A query string (a token valid for the whole prefix) stays at the end:
    ``https://h/p?tok=x`` + ``manifest.json`` -> ``https://h/p/manifest.json?tok=x``.
    """
    path, q, query = base.partition("?")
    path = path.rstrip("/")
    return (posixpath.join(path, name) if path else name) + q + query


def join_parts(base: str) -> tuple[str, str]:
    """``(head, tail)`` with ``head + name + tail == join_url(base, name)`` for every plain
    ``name`` (no ``/``): a shard list of many names under one prefix keeps the names and these
    two strings, and makes a URL only when one is asked for."""
    path, q, query = base.partition("?")
    path = path.rstrip("/")
    return (path + "/" if path else ""), q + query


def url_parent(url: str) -> str:
    """``https://h/p/manifest.json?tok=x`` -> ``https://h/p?tok=x`` (the query kept for joins)."""
    path, q, query = url.partition("?")
    return path.rstrip("/").rpartition("/")[0] + q + query


def url_name(url: str) -> str:
    """The last path segment, without the query string."""
    return url.partition("?")[0].rstrip("/").rpartition("/")[2]

"""Turn what a user writes as a dataset source into a concrete, ordered shard list.

Accepted: a glob (``out/*.tar``), a brace pattern (``out/shard-{000000..000051}.tar``), a list of
shard paths, a shard directory, or its ``manifest.json``; each as a local path or a URL
(``s3://``, ``https://``, ``file://``), URLs resolved through fsspec. A manifest beside the shards
is used for exact per-shard counts and the class list, so nothing has to be opened to plan an
epoch; shards without one (e.g. tars written by other WebDataset tools) get counted later.
"""

from __future__ import annotations

import glob as globmod
import os
from collections.abc import Sequence
from dataclasses import dataclass

from braceexpand import braceexpand

from ..errors import InputError, ManifestError
from ..formats import FORMATS, format_for_path, is_shard_name
from ..fsutil import interrupted_commit, interrupted_message
from ..manifest import MANIFEST_NAME, Manifest, ShardEntries, read_manifest, shard_entries
from ..records import UNKNOWN, ShardTable
from ..urls import is_url, join_parts, join_url, url_name, url_parent, url_path

__all__ = ["ShardSource", "resolve_source", "UNKNOWN"]

_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True)
class ShardSource:
    """An ordered shard list and what is known about it without opening a shard.

    ``shards[i]`` carries shard i's URL and what a manifest says about it (samples, bytes,
    sha256, offset index), or ``UNKNOWN`` counts where none does: a ``ShardTable``, columns
    rather than an object a shard, each ``ShardInfo`` made when asked for. ``classes`` is set
    only when manifests cover every shard and agree; ``manifest`` only when one manifest does.
    """

    shards: ShardTable
    format: str
    classes: tuple[str, ...] | None = None
    manifest: Manifest | None = None
    manifest_path: str | None = None

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(self.shards.urls)


class _Fs:
    """The few filesystem calls resolution needs, over os for paths and fsspec for URLs.

    URLs are taken apart by ``shardkit.urls`` only, so a query string (a token for the whole
    prefix, as in ``https://h/ds/manifest.json?sig=...``) is never part of a name and stays
    last in every shard URL derived from the manifest's.
    """

    def __init__(self, remote: bool, url: str = "", storage_options: dict | None = None):
        self.remote = remote
        self.storage_options = storage_options
        self.fs = None
        if remote and "::" in url:  # a chained URL (simplecache::s3://...): fsspec's own
            import fsspec

            self.fs, _ = fsspec.core.url_to_fs(url, **(storage_options or {}))
        elif remote:  # the process's filesystem: timeouts set, the driver's retries off
            from ..remote.fs import filesystem, protocol_of

            self.fs = filesystem(protocol_of(url), storage_options)

    def isdir(self, path: str) -> bool:
        return self.fs.isdir(path) if self.remote else os.path.isdir(path)

    def join(self, base: str, rel: str) -> str:
        return join_url(base, rel) if self.remote else os.path.join(base, rel)

    def dirname(self, path: str) -> str:
        return url_parent(path) if self.remote else os.path.dirname(path)

    def basename(self, path: str) -> str:
        return url_name(path) if self.remote else os.path.basename(path)

    def glob(self, pattern: str) -> list[str]:
        if not self.remote:
            return sorted(globmod.glob(pattern))
        return sorted(self.fs.unstrip_protocol(p) for p in self.fs.glob(pattern))

    def listdir(self, path: str) -> list[str]:
        if not self.remote:
            return [os.path.join(path, n) for n in sorted(os.listdir(path))]
        return sorted(self.fs.unstrip_protocol(p) for p in self.fs.ls(path, detail=False))

    def read_manifest(self, path: str) -> Manifest | None:
        """The manifest at ``path``; None where there is none (a URL's in one GET: an
        existence check first would fetch it twice over HTTP)."""
        if not self.remote:
            return read_manifest(path) if os.path.exists(path) else None
        return read_manifest(path, storage_options=self.storage_options, missing_ok=True)


def resolve_source(
    source: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    storage_options: dict | None = None,
) -> ShardSource:
    """Resolve ``source`` to shards; raises InputError/ManifestError naming what is wrong."""
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if not text:
            raise InputError("empty dataset source: pass a shard directory, glob or list of shards")
        fs = _Fs(is_url(text), text, storage_options)
        name = fs.basename(text)
        if name == MANIFEST_NAME:
            return _from_manifest(fs, text)
        if fs.remote and not _has_pattern(text) and not is_shard_name(name):
            manifest_path = fs.join(text, MANIFEST_NAME)  # a prefix: HTTP cannot list one
            manifest = fs.read_manifest(manifest_path)
            if manifest is not None:
                return _from_manifest(fs, manifest_path, manifest)
        if not _has_pattern(text) and fs.isdir(text):
            manifest_path = fs.join(text, MANIFEST_NAME)
            manifest = fs.read_manifest(manifest_path)
            if manifest is not None:
                return _from_manifest(fs, manifest_path, manifest)
            if not fs.remote and interrupted_commit(text):  # shards of a killed pack: refuse
                raise ManifestError(interrupted_message(text))
            urls = [
                p
                for p in fs.listdir(text)
                if is_shard_name(fs.basename(p)) and not fs.basename(p).startswith(".")
            ]
            if not urls:
                suffixes = " or ".join(s for f in FORMATS.values() for s in (f.suffix, *f.also))
                raise InputError(
                    f"{text}: no shards ({suffixes} files) and no {MANIFEST_NAME} in this "
                    "directory; pack it first with `shardkit pack`"
                )
            return _from_urls(fs, urls, text)
        return _from_urls(fs, _expand(fs, text), text)
    items = [os.fspath(s) for s in source]
    if not items:
        raise InputError("empty list of shards: pass at least one shard path")
    remote = {is_url(s) for s in items}
    if len(remote) > 1:
        raise InputError("the shard list mixes URLs and local paths: use one kind")
    fs = _Fs(remote.pop(), items[0], storage_options)
    return _from_urls(fs, items, f"the list of {len(items)} shards")


def _has_pattern(text: str) -> bool:
    """Glob or brace characters; in an HTTP(S) URL only before its query (``?sig=...``)."""
    if text.startswith(("http://", "https://")):
        text = url_path(text)
    return any(c in text for c in _GLOB_CHARS) or ("{" in text and "}" in text)


def _expand(fs: _Fs, pattern: str) -> list[str]:
    """Brace-expand, then glob the parts that hold wildcards; literal parts must exist."""
    urls: list[str] = []
    for part in braceexpand(pattern):
        if any(c in part for c in _GLOB_CHARS):
            found = fs.glob(part)
            if not found:
                raise InputError(f"{part}: no shards match this pattern; check the path")
            urls.extend(found)
        else:
            urls.append(part)
    return urls


def _shard_format(urls: list[str], where: str) -> str:
    fmts: dict[str, str] = {}
    for u in urls:
        fmts.setdefault(format_for_path(u).name, u)
    if len(fmts) > 1:
        examples = ", ".join(f"{u} ({name})" for name, u in fmts.items())
        raise InputError(
            f"{where}: mixes shard formats ({examples}); stream one format per dataset"
        )
    return next(iter(fmts))


def _check_exist(fs: _Fs, urls: list[str]) -> None:
    """Local shards are checked up front (cheap); remote ones fail when opened, naming the URL."""
    if fs.remote:
        return
    missing = [u for u in urls if not os.path.exists(u)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InputError(f"{missing[0]}: shard not found{more}; check the source pattern or list")


def _check_unique(urls: list[str], where: str) -> None:
    seen: set[str] = set()
    for u in urls:
        if u in seen:
            raise InputError(
                f"{where}: shard {u} is listed twice; each sample must appear once per epoch"
            )
        seen.add(u)


def _from_manifest(fs: _Fs, manifest_path: str, manifest: Manifest | None = None) -> ShardSource:
    """The shards the manifest at ``manifest_path`` lists (``manifest``: already read)."""
    manifest = manifest or fs.read_manifest(manifest_path)
    if manifest is None:
        raise InputError(f"{manifest_path}: no such manifest; check the path")
    if manifest.shard_format not in FORMATS:
        raise ManifestError(
            f"{manifest_path}: unknown shard_format {manifest.shard_format!r}; "
            "upgrade shardkit or re-pack"
        )
    if not manifest.shards:
        raise ManifestError(f"{manifest_path}: lists no shards; the pack was empty, re-pack")
    base = fs.dirname(manifest_path)
    # plain names (the manifest checks them), unique: one prefix and the names, no URL each
    head, tail = join_parts(base) if fs.remote else (os.path.join(base, ""), "")
    entries = shard_entries(manifest.shards)
    shards = ShardTable(
        entries.names,
        entries.samples,
        entries.bytes,
        entries.sha256,
        entries.index_sha256,
        entries.index,
        head=head,
        tail=tail,
        columns_sha256=entries.columns_sha256,
    )
    if not fs.remote:
        _check_listed(base, shards)
    return ShardSource(
        shards=shards,
        format=manifest.shard_format,
        classes=tuple(manifest.classes),
        manifest=manifest,
        manifest_path=manifest_path,
    )


def _check_listed(base: str, shards: ShardTable) -> None:
    """Every shard a local manifest lists is there: one listing of its directory, not one
    ``stat`` a shard (40,000 of them cost a tenth of a second in every process)."""
    try:
        present = set(os.listdir(base or "."))
    except OSError:
        present = set()
    absent = [n for n in shards.names if n not in present]  # C-speed membership, no syscalls
    missing = [shards.head + n for n in absent if not os.path.exists(shards.head + n)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InputError(f"{missing[0]}: shard not found{more}; check the source pattern or list")


def _from_urls(fs: _Fs, urls: list[str], where: str) -> ShardSource:
    fmt = _shard_format(urls, where)
    _check_unique(urls, where)
    _check_exist(fs, urls)
    # A manifest beside the shards gives counts and classes; each directory is read once, and
    # its shards' columns are gathered by row, not made into an object a shard.
    manifests: dict[str, tuple[str, Manifest, ShardEntries, dict[str, int]] | None] = {}
    n = len(urls)
    samples, sizes = [UNKNOWN] * n, [UNKNOWN] * n
    shas, index_shas, column_shas = [""] * n, [""] * n, [""] * n
    index: dict[int, tuple[int, ...]] = {}
    covering: list[tuple[str, Manifest]] = []
    for i, u in enumerate(urls):
        d = fs.dirname(u)
        if d not in manifests:
            mpath = fs.join(d, MANIFEST_NAME)
            m = fs.read_manifest(mpath)
            if m is not None:
                t = shard_entries(m.shards)
                manifests[d] = (mpath, m, t, {name: r for r, name in enumerate(t.names)})
            else:
                manifests[d] = None
        entry = manifests[d]
        if entry is None:
            continue
        mpath, m, t, rows = entry
        rel = fs.basename(u)
        if rel not in rows or m.shard_format != fmt:
            raise ManifestError(
                f"{u} is not listed in {mpath}: the manifest belongs to another pack; remove "
                "the stray shard, or re-pack the directory"
            )
        r = rows[rel]
        samples[i], sizes[i] = int(t.samples[r]), int(t.bytes[r])
        shas[i], index_shas[i] = t.sha256[r], t.index_sha256[r]
        column_shas[i] = t.columns_sha256[r]
        if r in t.index:
            index[i] = t.index[r]
        covering.append((mpath, m))
    classes = None
    manifest = manifest_path = None
    if covering and len(covering) == len(urls):
        distinct = {p: m for p, m in covering}
        class_lists = {tuple(m.classes) for m in distinct.values()}
        if len(class_lists) > 1:
            raise ManifestError(
                f"{where}: the shards come from packs with different class lists "
                f"({', '.join(distinct)}); their labels do not mean the same classes"
            )
        classes = class_lists.pop()
        if len(distinct) == 1:
            manifest_path, manifest = next(iter(distinct.items()))
    return ShardSource(
        shards=ShardTable(
            urls, samples, sizes, shas, index_shas, index, columns_sha256=column_shas
        ),
        format=fmt,
        classes=classes,
        manifest=manifest,
        manifest_path=manifest_path,
    )

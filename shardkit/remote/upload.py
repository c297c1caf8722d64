"""Uploads for ``shardkit pack SRC s3://bucket/prefix/``: shards as they complete, manifest last.

Object stores make a PUT visible only when it is complete, so a shard needs no temporary name;
what makes a remote dataset safe to read mid-upload is the order: ``manifest.json`` (the commit
point, as locally) goes up only after every shard it lists has been uploaded and its size checked.
A pack that dies part-way leaves shards without a manifest, which readers of the prefix ignore.
"""

from __future__ import annotations

import os
import posixpath
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any

from ..errors import InputError, OutputError, StorageError
from .fetch import storage_error
from .fs import DEFAULT_TIMEOUT, filesystem, protocol_of, strip
from .retry import RetryPolicy, is_transient

__all__ = ["upload_file", "Uploader", "pack_to_url", "join_url"]

MANIFEST_NAME = "manifest.json"


def join_url(base: str, name: str) -> str:
    """``s3://b/prefix/`` + ``shard-000000.tar`` -> ``s3://b/prefix/shard-000000.tar``."""
    return posixpath.join(base.rstrip("/"), name) if base.rstrip("/") else name


def _check_writable(url: str) -> None:
    if protocol_of(url) in ("http", "https"):
        raise InputError(
            f"{url}: HTTP(S) URLs are read-only here; upload to an object store "
            "(s3://, gs://, az://) and serve that over HTTP"
        )


def upload_file(
    local_path: str | os.PathLike,
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    policy: RetryPolicy | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> int:
    """Upload one file to ``url`` with retries; return its size once the store reports it whole.

    A transient failure re-sends the whole file (a PUT cannot resume); the size check after the
    upload catches a store that acknowledged a short object.
    """
    _check_writable(url)
    policy = policy or RetryPolicy()
    local_path = os.fspath(local_path)
    size = os.path.getsize(local_path)
    fs = filesystem(protocol_of(url), storage_options, timeout)
    path = strip(fs, url)
    delays = policy.delays()
    attempts = 0
    while True:
        attempts += 1
        try:
            fs.put_file(local_path, path)
            fs.invalidate_cache(path)
            remote_size = fs.info(path).get("size")
            if remote_size is not None and int(remote_size) != size:
                raise StorageError(f"store reports {remote_size} bytes, expected {size}")
            return size
        except PermissionError as exc:
            raise storage_error(
                url, "upload refused; check the credentials and bucket", exc, storage_options
            ) from None
        except Exception as exc:
            transient = is_transient(exc) or isinstance(exc, StorageError)
            delay = next(delays, None) if transient else None
            if delay is None:
                what = f"upload of {local_path} failed after {attempts} attempt(s)"
                raise storage_error(url, what, exc, storage_options) from None
            time.sleep(delay)


class Uploader:
    """Uploads files to ``base_url`` on ``concurrency`` background threads, in any order.

    ``submit`` returns at once (packing goes on while shards upload); ``finish(manifest)`` waits
    for every upload, raises the first failure, and only then uploads the manifest.
    """

    def __init__(
        self,
        base_url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        concurrency: int = 4,
        policy: RetryPolicy | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        delete_after: bool = False,
    ):
        _check_writable(base_url)
        self.base_url = base_url
        self.storage_options = dict(storage_options or {})
        self.policy = policy or RetryPolicy()
        self.timeout = timeout
        self.delete_after = delete_after
        self.uploaded: list[str] = []
        self.bytes = 0
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._threads = [
            threading.Thread(target=self._work, name="shardkit-upload", daemon=True)
            for _ in range(max(1, concurrency))
        ]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                local, url = job
                with self._lock:
                    if self._errors:
                        continue  # one failure dooms the pack: stop spending bandwidth
                try:
                    n = upload_file(
                        local, url, self.storage_options, policy=self.policy, timeout=self.timeout
                    )
                    if self.delete_after:
                        os.unlink(local)
                    with self._lock:
                        self.uploaded.append(url)
                        self.bytes += n
                except BaseException as exc:
                    with self._lock:
                        self._errors.append(exc)
            finally:
                self._jobs.task_done()

    def submit(self, local_path: str | os.PathLike, name: str | None = None) -> str:
        """Queue ``local_path`` for upload as ``base_url/name`` (default: its file name)."""
        with self._lock:
            if self._errors:
                raise self._errors[0]
        url = join_url(self.base_url, name or os.path.basename(os.fspath(local_path)))
        self._jobs.put((os.fspath(local_path), url))
        return url

    def wait(self) -> None:
        """Block until every submitted upload is done; raise the first failure."""
        self._jobs.join()
        with self._lock:
            if self._errors:
                raise self._errors[0]

    def finish(self, manifest_path: str | os.PathLike | None = None) -> str | None:
        """Wait for the shards, then upload the manifest last; return its URL."""
        try:
            self.wait()
            if manifest_path is None:
                return None
            url = join_url(self.base_url, MANIFEST_NAME)
            upload_file(
                manifest_path, url, self.storage_options, policy=self.policy, timeout=self.timeout
            )
            return url
        finally:
            self.close()

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        self._threads = []


def pack_to_url(
    src: str,
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    work_dir: str | None = None,
    concurrency: int = 4,
    **pack_kwargs: Any,
):
    """``pack(src, <local staging dir>)`` with every finished shard uploaded to ``url`` at once,
    and the manifest uploaded last. Returns pack's report with ``out`` set to ``url``.

    Shards upload while later ones are packed (pack's ``on_shard`` hook); the manifest is
    uploaded only after every shard has arrived.
    """
    from ..packer import pack

    started = time.perf_counter()
    _check_writable(url)
    fs = filesystem(protocol_of(url), storage_options)
    manifest_url = join_url(url, MANIFEST_NAME)
    try:
        exists = fs.exists(strip(fs, manifest_url))
    except Exception as exc:
        raise storage_error(url, "cannot list the destination", exc, storage_options) from None
    if exists and not overwrite:
        raise OutputError(
            f"{url} already holds a packed dataset ({MANIFEST_NAME}); pass --overwrite to "
            "replace it, or choose another prefix"
        )
    if exists:  # no manifest may ever describe a mix of old and new shards
        fs.rm_file(strip(fs, manifest_url))
    tmp = tempfile.mkdtemp(prefix="shardkit-pack-", dir=work_dir)
    out = os.path.join(tmp, "out")
    uploader = Uploader(url, storage_options, concurrency=concurrency)
    try:
        links = os.path.join(tmp, "upload")
        os.mkdir(links)

        def on_shard(path: str) -> None:
            # pack renames its staged shards at the end; a hard link keeps this name valid
            # for the upload thread whatever happens to the staging name.
            link = os.path.join(links, os.path.basename(path))
            os.link(path, link)
            uploader.submit(link)

        report = pack(src, out, on_shard=on_shard, **pack_kwargs)
        uploader.finish(os.path.join(out, MANIFEST_NAME))
    finally:
        uploader.close()
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        report.out = url
        report.manifest_path = manifest_url
        report.seconds = time.perf_counter() - started  # the rates then include the upload
    except AttributeError:  # a frozen report: leave it as pack made it
        pass
    return report

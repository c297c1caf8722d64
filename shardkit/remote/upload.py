"""Uploads for a ``ShardWriter`` (or ``pack``) whose ``out`` is a URL: shards as they complete,
the manifest last.

Object stores make a PUT visible only when it is complete, so a shard needs no temporary name;
what makes a remote dataset safe to read is the order: ``manifest.json`` (the commit point, as
locally) goes up only after every shard it lists has been uploaded and its size checked. A pack
that dies part-way leaves shards without a manifest (FORMAT.md says what readers then do).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

from ..errors import InputError, StorageError
from ..manifest import MANIFEST_NAME
from ..retry import RetryPolicy, is_transient
from ..urls import join_url, url_name, url_parent  # re-exported: the one URL module
from .fetch import storage_error
from .fs import DEFAULT_TIMEOUT, filesystem, protocol_of, strip

__all__ = ["check_writable", "join_url", "url_name", "url_parent", "upload_file", "Uploader"]


def check_writable(url: str) -> None:
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
    check_writable(url)
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
        check_writable(base_url)
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

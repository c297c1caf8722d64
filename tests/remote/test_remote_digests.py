"""A store or proxy that alters the bytes of a ranged GET never gets them handed out: each sample
of a split's or subset's ranged epoch, and of ``ShardView``, is checked against its index's
digest; a range that differs is fetched once more, and where it differs again the read is a
one-line ``StorageError`` naming the URL and the key. Against a loopback proxy in front of the
HTTP server that flips one byte in the first sample of each ranged body of a shard (or only in the
first answer for each range)."""

from __future__ import annotations

import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import ranged_pack

from shardkit.errors import StorageError
from shardkit.manifest import read_manifest
from shardkit.remote import RemoteStorage
from shardkit.stream.dataset import ShardDataset
from shardkit.stream.mix import Source
from shardkit.stream.shuffle import Order
from shardkit.stream.view import ShardView

pytest.importorskip("aiohttp")
pytestmark = [pytest.mark.slow]  # real servers on loopback


#: Where a ranged body's byte is flipped (at most): in its first sample's data (a range begins
#: with a drawn sample's 512-byte header); further in, it may be a hole between drawn samples
#: that one GET reads and passes over (``RemoteStorage(ranged_gap=)``), never handed out.
FLIP = 600


class FlippingProxy:
    """Forwards GET and HEAD to ``target``; flips one byte of a ranged GET's body (``FLIP``) of a
    ``.tar`` (``mode`` "always", or "first": only the first answer for each range). ``gets``
    counts the ranged GETs of each (path, range)."""

    def __init__(self, target: str, mode: str) -> None:
        proxy = self
        self.target, self.mode = target, mode
        self.gets: dict[tuple[str, str], int] = {}
        self.lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self, head: bool) -> None:
                rng = self.headers.get("Range", "")
                req = urllib.request.Request(proxy.target + self.path, method=self.command)
                if rng:
                    req.add_header("Range", rng)
                try:
                    with urllib.request.urlopen(req) as got:  # loopback only
                        status, headers, body = got.status, got.headers, got.read()
                except urllib.error.HTTPError as err:
                    status, headers, body = err.code, err.headers, err.read()
                if not head and rng and self.path.endswith(".tar") and body:
                    with proxy.lock:
                        n = proxy.gets[(self.path, rng)] = proxy.gets.get((self.path, rng), 0) + 1
                    if proxy.mode == "always" or n == 1:
                        body = bytearray(body)
                        body[min(len(body) // 2, FLIP)] ^= 0x01
                        body = bytes(body)
                self.send_response(status)
                for name in ("Content-Type", "Content-Range", "Accept-Ranges", "Content-Length"):
                    if headers.get(name) is not None:
                        self.send_header(name, headers[name])
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def do_GET(self) -> None:
                self._forward(False)

            def do_HEAD(self) -> None:
                self._forward(True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(
            target=self.server.serve_forever, daemon=True, name="test-http-server-flips"
        )

    def __enter__(self) -> FlippingProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """120 samples in shards of ~40, with sample indexes: a 20% split reads ranges."""
    root = ranged_pack(tmp_path_factory.mktemp("digests"), 120, "60kB")
    assert len(read_manifest(str(root / "tar")).shards) >= 3
    return root


def _epoch(url, gets: int = 1, **kw) -> list[tuple[str, bytes]]:
    storage = RemoteStorage(None, prefetch=0, ranged_gets=gets)
    ds = ShardDataset(
        Source(url, **kw), decode="raw", with_keys=True, storage=storage, order=Order(shuffle=False)
    )
    return [(s[2], s[0]) for s in ds]


SPLIT = {"split": "val", "val_fraction": 0.2}


@pytest.mark.parametrize("gets", [1, 4])
@pytest.mark.parametrize("kw", [SPLIT, {"subset": 0.1}], ids=["split", "subset"])
def test_an_altered_range_is_fetched_again_then_an_error_naming_url_and_key(http, packed, gets, kw):
    http.root = packed
    truth = _epoch(f"{http.url}/tar/manifest.json", **kw)
    assert truth
    with FlippingProxy(http.url, "always") as proxy:
        with pytest.raises(StorageError) as err:
            _epoch(f"{proxy.url}/tar/manifest.json", gets, **kw)
        message = str(err.value)
        assert "\n" not in message and f"{proxy.url}/tar/shard-" in message
        assert "(key '" in message and "other bytes than its sample index's digest" in message
        flipped = [n for (path, _), n in proxy.gets.items() if path.endswith(".tar")]
        assert 2 in flipped and max(flipped) == 2  # the failing range: fetched twice, no more


@pytest.mark.parametrize("kw", [SPLIT, {"subset": 0.1}], ids=["split", "subset"])
def test_a_range_altered_once_is_read_right_the_second_time(http, packed, kw):
    http.root = packed
    truth = _epoch(f"{http.url}/tar/manifest.json", **kw)
    with FlippingProxy(http.url, "first") as proxy:
        assert _epoch(f"{proxy.url}/tar/manifest.json", 4, **kw) == truth  # the right bytes
        assert set(proxy.gets.values()) == {2}  # each range: altered once, fetched again


def test_a_view_over_an_altering_proxy_never_hands_out_its_bytes(http, packed):
    http.root = packed
    view = ShardView(f"{http.url}/tar/manifest.json", decode="raw", with_keys=True)
    key = view.key(5)
    right = view.get(key)
    with FlippingProxy(http.url, "first") as proxy:
        assert ShardView(f"{proxy.url}/tar/manifest.json", decode="raw").get(key)[0] == right[0]
    with FlippingProxy(http.url, "always") as proxy:
        flipped = ShardView(f"{proxy.url}/tar/manifest.json", decode="raw")
        with pytest.raises(StorageError, match=rf"sample 5 \(key '{key}'\)") as err:
            flipped.get(key)
        assert "\n" not in str(err.value)
        with pytest.raises(StorageError, match="other bytes than its sample index's digest"):
            flipped.members(5, ("cls",))

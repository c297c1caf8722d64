"""Fuzzed tar bytes: any input streams or raises a ShardkitError, in bounded time.

hypothesis flips, overwrites and cuts bytes of small valid tars (GNU, PAX, ustar); the reader,
the header-only counter and webdataset-style grouping must never hang, allocate what a header
claims, or raise anything but our own errors, and when both succeed they agree.
"""

from __future__ import annotations

import io
import tarfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkit.errors import ShardkitError
from shardkit.formats.tar import iter_tar_records, tally_tar


def _tar(fmt: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for i, (name, data) in enumerate(
            [
                ("a/s0.jpg", b"\xff\xd8" * 300),
                ("a/s0.cls", b"1"),
                ("a/s0.json", b"{}"),
                ("l" * 120 + "/ü.png", b"p" * 700),
                ("l" * 120 + "/ü.cls", b"2"),
                ("__meta__.json", b"{}"),
                ("s2.input.jpg", b"j" * 5),
            ]
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = i
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


BASES = [_tar(f) for f in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT)]


@st.composite
def damaged(draw, bases=BASES, edits: int = 6, width: int = 12):
    """One of ``bases`` with up to ``edits`` overwrites of up to ``width`` bytes, maybe cut."""
    data = bytearray(draw(st.sampled_from(bases)))
    for _ in range(draw(st.integers(1, edits))):
        pos = draw(st.integers(0, len(data) - 1))
        chunk = draw(st.binary(min_size=1, max_size=width))
        data[pos : pos + len(chunk)] = chunk
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=damaged())
def test_damaged_tars_stream_or_raise_our_error(data):
    try:
        records = list(iter_tar_records(io.BytesIO(data), fields=("json",)))
    except ShardkitError:
        records = None
    try:
        tally = tally_tar(io.BytesIO(data), labels=True)
    except ShardkitError:
        tally = None
    if records is not None and tally is not None:
        assert tally.samples == len(records)
        # labels of samples agree (-1 is also what a sample without a label member reads as)
        assert tally.labels - {-1} == {r.label for r in records} - {-1}

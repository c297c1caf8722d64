"""``pack --append`` and ``shardkit merge``: exact manifests, nothing already packed rewritten,
an interrupted append leaves the old dataset intact. Real files, real child processes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import xxhash
from click.testing import CliRunner
from PIL import Image

from shardkit.cli import main
from shardkit.errors import InputError, ManifestError, OutputError
from shardkit.formats import get_format
from shardkit.formats.key_file import block_table, run_count
from shardkit.formats.sample_index import key_hashes
from shardkit.fsutil import JOURNAL_NAME
from shardkit.manifest import ShardEntry, read_manifest
from shardkit.stream.dataset import ShardDataset
from shardkit.write.index import index_shards
from shardkit.write.keyfile import HEAD, KEYS_NAME, KeyFileWarning, dataset_columns, held_in
from shardkit.write.merge import MERGED_FIELD, merge
from shardkit.write.packer import pack
from shardkit.write.plan import APPENDED_FIELD
from shardkit.write.verify import verify


def tree(root, classes: dict[str, int], seed: int) -> str:
    rng = np.random.default_rng(seed)
    for cls, n in classes.items():
        os.makedirs(os.path.join(root, cls), exist_ok=True)
        for i in range(n):
            arr = rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)
            Image.fromarray(arr).save(os.path.join(root, cls, f"{cls}{seed}_{i:03d}.jpg"))
    return str(root)


def quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kw)


def packed(src, out, **kw):
    kw.setdefault("shard_size", "6kB")
    return quiet(pack, src, str(out), progress=False, **kw)


def files(out) -> dict[str, tuple[int, str]]:
    """name -> (inode, sha256) of every shard in ``out``."""
    return {
        n: (os.stat(os.path.join(out, n)).st_ino, _sha(os.path.join(out, n)))
        for n in sorted(os.listdir(out))
        if n.startswith("shard-")
    }


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def samples(out) -> list[tuple[str, str]]:
    """(key, class name) of every sample, through the shards' own labels."""
    m = read_manifest(str(out))
    fmt = get_format(m.shard_format)
    return [
        (r.key, m.classes[r.label])
        for s in m.shards
        for r in fmt.iter_records(os.path.join(str(out), s.path))
    ]


@pytest.fixture
def srcs(tmp_path):
    return (
        tree(tmp_path / "a", {"x": 6, "y": 6}, 1),
        tree(tmp_path / "b", {"y": 5, "z": 7}, 2),
        tree(tmp_path / "c", {"x": 4, "y": 3, "w": 5}, 3),
    )


# --- append ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_append_adds_shards_after_the_old_ones_and_rewrites_nothing(srcs, tmp_path, fmt):
    a, b, _ = srcs
    out = tmp_path / "out"
    packed(a, out, format=fmt)
    old, before = read_manifest(str(out)), files(out)
    report = packed(b, out, format=fmt, append=True)
    new = read_manifest(str(out))
    assert new.shards[: len(old.shards)] == old.shards  # old entries exactly as they were
    assert {n: files(out)[n] for n in before} == before  # same inodes, same bytes
    names = [s.path for s in new.shards[len(old.shards) :]]
    assert names == [
        f"shard-{i:06d}.{fmt}" for i in range(len(old.shards), len(old.shards) + len(names))
    ]
    assert new.classes == ["x", "y", "z"]  # the new class after the old ones
    got = samples(out)
    assert len(got) == 12 + 12 and (report.samples, report.appended_to) == (12, 12)
    assert report.shards == len(names) and report.summary().startswith(
        f"Appended 12 samples of 3 classes after the 12 already there, as {len(names)} new "
    )
    assert all(key.split("/")[0] == cls for key, cls in got)  # labels mapped by name
    assert [a["source"] for a in new.pack[APPENDED_FIELD]] == [b]
    assert (
        new.pack["source"] == a and new.pack["source_fingerprint"] == old.pack["source_fingerprint"]
    )
    again = packed(b, out, format=fmt, append=True)  # the same folder again: up to date
    assert again.up_to_date and read_manifest(str(out)) == new


def test_append_refuses_what_it_cannot_do(srcs, tmp_path):
    a, b, _ = srcs
    out = tmp_path / "out"
    with pytest.raises(InputError, match="holds no dataset .* to append to"):
        packed(b, out, append=True)
    packed(a, out)
    with pytest.raises(InputError, match='holds tar shards; append with format="tar"'):
        packed(b, out, append=True, format="lmdb")
    with pytest.raises(InputError, match="pick one"):
        packed(b, out, append=True, overwrite=True)
    r = CliRunner().invoke(main, ["pack", b, str(out), "-q", "--append", "--format", "lmdb"])
    assert r.exit_code == 2 and "holds tar shards; append with --format tar" in r.output


def _captions(root, n: int) -> str:
    """``root/caps.csv``: ``n`` captioned images and no label column (samples without labels)."""
    os.makedirs(os.path.join(root, "img"))
    rows = ["image,caption"]
    for i in range(n):
        Image.new("RGB", (20, 24), (9 * i, 3, 7)).save(os.path.join(root, "img", f"c{i}.jpg"))
        rows.append(f"img/c{i}.jpg,caption {i}")
    with open(os.path.join(root, "caps.csv"), "w") as f:
        f.write("\n".join(rows) + "\n")
    return os.path.join(root, "caps.csv")


def labels_by_key(out) -> dict[str, int]:
    return {k: int(label) for _, label, k in ShardDataset(str(out), decode="raw", with_keys=True)}


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_labelled_and_unlabelled_samples_mix_under_one_rule_minus_one_is_no_label(
    srcs, tmp_path, fmt
):
    a, _, _ = srcs
    caps = _captions(tmp_path / "t", 5)
    packed(a, tmp_path / "ref")
    want = {f"img/c{i}": -1 for i in range(5)}
    want |= {k: ["x", "y"].index(cls) for k, cls in samples(tmp_path / "ref")}

    def check(out):
        assert read_manifest(str(out)).classes == ["x", "y"]
        assert labels_by_key(out) == want  # the captions' samples read -1, the others theirs
        r = CliRunner().invoke(main, ["verify", str(out), "-q"])
        assert r.exit_code == 0 and r.output.startswith("OK"), r.output

    # a caption-only table appended to a labelled dataset, with the CLI (as users type it)
    lab = tmp_path / "lab"
    packed(a, lab, format=fmt)
    r = CliRunner().invoke(
        main, ["pack", caps, str(lab), "--append", "-q", "--format", fmt, "--shard-size", "6kB"]
    )
    assert r.exit_code == 0, r.output
    check(lab)
    # a labelled folder appended to a caption dataset: its untouched shards verify OK
    cap = tmp_path / "cap"
    packed(caps, cap, format=fmt)
    before = files(cap)
    packed(a, cap, format=fmt, append=True)
    assert {n: files(cap)[n] for n in before} == before
    check(cap)
    # merged: the caption dataset first, then the labelled one
    only_caps, only_lab = tmp_path / "oc", tmp_path / "ol"
    packed(caps, only_caps, format=fmt)
    packed(a, only_lab, format=fmt)
    merge([only_caps, only_lab], tmp_path / "merged")
    check(tmp_path / "merged")
    if fmt == "tar":  # indexed as foreign tars: the labels found give classes "0", "1"
        foreign = tmp_path / "foreign"
        foreign.mkdir()
        for s in read_manifest(str(cap)).shards:
            shutil.copy(cap / s.path, foreign / s.path)
        (r,) = index_shards([foreign])
        assert r.manifest.classes == ["0", "1"] and r.manifest.fields == {"txt": 5}
        assert labels_by_key(foreign) == want and verify(str(foreign)).ok


_KILLED_APPEND = textwrap.dedent(
    """
    import os, signal, sys, warnings
    import shardkit.fsutil as fsutil
    from shardkit import pack
    warnings.simplefilter("ignore")
    real = fsutil.atomic_write_bytes

    def write(path, data):  # die as the commit point (the journal) is about to land
        if path.endswith(fsutil.JOURNAL_NAME):
            os.kill(os.getpid(), signal.SIGKILL)
        real(path, data)

    fsutil.atomic_write_bytes = write
    pack(sys.argv[1], sys.argv[2], shard_size="6kB", progress=False, append=True)
    """
)


@pytest.mark.slow  # a child process SIGKILLed
def test_an_interrupted_append_leaves_the_old_dataset_intact_and_resumes(srcs, tmp_path):
    a, b, _ = srcs
    out, ref = tmp_path / "out", tmp_path / "ref"
    packed(a, out)
    packed(a, ref)
    packed(b, ref, append=True)
    old = {n: _sha(out / n) for n in os.listdir(out)}
    r = subprocess.run([sys.executable, "-c", _KILLED_APPEND, b, str(out)], timeout=120)
    assert r.returncode == -signal.SIGKILL
    assert {n: _sha(out / n) for n in os.listdir(out) if not n.startswith(".")} == old
    assert len(samples(out)) == 12  # readers see the old dataset, whole
    packed(b, out, append=True)  # the same command finishes it from its receipts
    assert {n: _sha(out / n) for n in os.listdir(out)} == {
        n: _sha(ref / n) for n in os.listdir(ref)
    }


# --- merge -----------------------------------------------------------------------------------


def test_merge_links_every_shard_under_one_manifest(srcs, tmp_path):
    a, _, c = srcs
    pa, pc, out = tmp_path / "pa", tmp_path / "pc", tmp_path / "merged"
    packed(a, pa)  # classes x, y
    packed(c, pc)  # classes w, x, y: a conflict with x, y ...
    with pytest.raises(InputError, match=r"class 0 is 'w' there and 'x' in .*--append"):
        merge([pa, pc], out)
    assert not out.exists() or os.listdir(out) == []
    pa2 = tmp_path / "pa2"
    packed(tree(tmp_path / "a2", {"x": 3, "y": 2, "z": 4}, 4), pa2)  # x, y, z: agrees with A
    report = merge([pa, pa2], out)
    m, ma, mb = (read_manifest(str(p)) for p in (out, pa, pa2))
    assert m.classes == ["x", "y", "z"] and report.samples == 12 + 9 == m.num_samples
    pairs = [(pa, s) for s in ma.shards] + [(pa2, s) for s in mb.shards]
    assert [s.path for s in m.shards] == [f"shard-{i:06d}.tar" for i in range(len(pairs))]
    for mine, (src, theirs) in zip(m.shards, pairs, strict=True):
        assert (mine.samples, mine.bytes, mine.sha256) == (
            theirs.samples,
            theirs.bytes,
            theirs.sha256,
        )
        assert os.stat(out / mine.path).st_ino == os.stat(src / theirs.path).st_ino  # linked
    assert all(key.split("/")[0] == cls for key, cls in samples(out))
    assert [d["dataset"] for d in m.pack[MERGED_FIELD]] == [str(pa), str(pa2)]


def test_merge_in_place_adds_the_others_to_the_first(srcs, tmp_path):
    a, _, _ = srcs
    pa, pb = tmp_path / "pa", tmp_path / "pb"
    packed(a, pa, format="lmdb")
    packed(tree(tmp_path / "b2", {"x": 2, "y": 5}, 5), pb, format="lmdb")
    before, old = files(pa), read_manifest(str(pa))
    r = CliRunner().invoke(main, ["merge", str(pa), str(pb), str(pa)])
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"Merged into {pa}: 19 samples")
    m = read_manifest(str(pa))
    assert m.shards[: len(old.shards)] == old.shards and m.pack["source"] == a
    assert {n: files(pa)[n] for n in before} == before
    assert len(samples(pa)) == 19
    shutil.rmtree(pb)  # the merged dataset does not depend on the other one's folder
    assert len(samples(pa)) == 19
    lmdb_vs_tar = tmp_path / "pt"
    packed(a, lmdb_vs_tar)
    with pytest.raises(InputError, match="holds tar shards and .* lmdb; merge datasets of one"):
        merge([pa, lmdb_vs_tar], tmp_path / "mixed")


# --- growth: idempotent, all or nothing, never twice ------------------------------------------

_KILLED_AFTER_COMMIT = textwrap.dedent(
    """
    import os, signal, sys, warnings
    import shardkit.fsutil as fsutil
    warnings.simplefilter("ignore")
    command, out, when = sys.argv[1], os.path.realpath(sys.argv[2]), sys.argv[3]
    real_write, real_roll, real_replace, real_unlink = (
        fsutil.atomic_write_bytes, fsutil._roll_forward, os.replace, os.unlink
    )
    done = {"shard": 0, "r": 0, "u": 0}

    def write(path, data):  # 'pre': die as the commit point (the journal) is about to land
        if when == "pre" and path.endswith(fsutil.JOURNAL_NAME):
            os.kill(os.getpid(), signal.SIGKILL)
        real_write(path, data)

    def roll(directory, journal):  # 'journal': die right after the commit point
        if when == "journal":
            os.kill(os.getpid(), signal.SIGKILL)
        real_roll(directory, journal)

    def step(kind, path):  # a number: die after moving that many shards into OUT;
        if os.path.dirname(os.path.realpath(path)) != out:  # 'r3': after the third file
            return  # of any name moved into OUT; 'u1': after the first removed from it
        if kind == "r" and os.path.basename(path).startswith("shard-"):
            done["shard"] += 1
            if str(done["shard"]) == when:
                os.kill(os.getpid(), signal.SIGKILL)
        done[kind] += 1
        if when == f"{kind}{done[kind]}":
            os.kill(os.getpid(), signal.SIGKILL)

    def replace(a, b):
        real_replace(a, b)
        step("r", b)

    def unlink(path, *args, **kw):
        real_unlink(path, *args, **kw)
        step("u", path)

    fsutil.atomic_write_bytes, fsutil._roll_forward = write, roll
    os.replace, os.unlink = replace, unlink
    sys.argv = ["shardkit", *sys.argv[4:]]
    from shardkit.cli import main
    main()
    """
)


def killed(out, when: str, *args: str) -> None:
    """Run the CLI with ``args`` in a child that SIGKILLs itself after its commit point."""
    r = subprocess.run(
        [sys.executable, "-c", _KILLED_AFTER_COMMIT, "", str(out), when, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == -signal.SIGKILL, r.stderr


def digests(out) -> dict[str, str]:
    """sha256 of every file in ``out``, hidden ones too: nothing may be left behind."""
    return {n: _sha(os.path.join(out, n)) for n in sorted(os.listdir(out))}


def cli(*args: str) -> str:
    """The CLI's last line (its summary) on success."""
    r = CliRunner().invoke(main, [*args])
    assert r.exit_code == 0, r.output
    return r.output.splitlines()[-1]


@pytest.mark.slow  # child processes SIGKILLed
@pytest.mark.parametrize("when", ["journal", "1", "3"])
def test_an_append_killed_after_its_commit_point_is_finished_and_never_added_twice(
    srcs, tmp_path, when
):
    a, b, _ = srcs
    out, ref = tmp_path / "out", tmp_path / "ref"
    for o in (out, ref):
        packed(a, o)
    packed(b, ref, append=True)
    append = ["pack", b, str(out), "-q", "--shard-size", "6kB", "--append"]
    killed(out, when, *append)
    assert JOURNAL_NAME in os.listdir(out)  # killed inside the commit
    assert cli(*append).startswith(f"{out} is up to date: 24 samples")  # the same command
    assert digests(out) == digests(ref)
    assert len(samples(out)) == 24 == len(set(samples(out)))


def test_appending_samples_already_there_leaves_them_out_unless_told(srcs, tmp_path):
    a, b, _ = srcs
    out = tmp_path / "out"
    packed(a, out)
    before = digests(out)
    with pytest.warns(UserWarning, match=r"left out 12 whose key .* already holds"):
        report = pack(a, str(out), shard_size="6kB", progress=False, append=True)
    assert (report.samples, report.duplicates) == (0, 12)
    assert report.summary().startswith(f"Nothing appended to {out}: all 12 samples")
    assert digests(out) == before  # the folder it was packed from: nothing written
    shared = tmp_path / "shared"  # a folder sharing six files with A, plus new ones
    shutil.copytree(os.path.join(a, "x"), shared / "x")
    tree(shared, {"q": 4}, 9)
    report = packed(shared, out, append=True)
    assert (report.samples, report.duplicates) == (4, 6)
    keys = [k for k, _ in samples(out)]
    assert len(keys) == 16 == len(set(keys))
    out2 = tmp_path / "out2"
    packed(a, out2)
    out = cli("pack", a, str(out2), "-q", "--shard-size", "6kB", "--append", "--allow-duplicates")
    assert out.startswith("Appended 12 samples") and len(samples(out2)) == 24


def test_a_table_listing_an_image_twice_packs_it_once_unless_told(srcs, tmp_path):
    a, _, _ = srcs
    table = tmp_path / "pairs.csv"
    names = sorted(os.listdir(os.path.join(a, "x")))
    rows = [f"{a}/x/{names[0]},first", f"{a}/x/{names[1]},other", f"{a}/x/{names[0]},again"]
    table.write_text("image,caption\n" + "\n".join(r.replace(f"{a}/", "") for r in rows) + "\n")
    with pytest.warns(UserWarning, match="left out 1 listed again on a later row"):
        report = pack(str(table), str(tmp_path / "o"), root=a, progress=False)
    assert (report.samples, report.duplicates) == (2, 1)
    (again,) = [
        s for s in read_manifest(str(tmp_path / "o")).skipped if "more than one" in s.reason
    ]
    assert again.path == f"x/{names[0]}"
    m = read_manifest(str(tmp_path / "o"))
    keys = sorted(
        r.key for s in m.shards for r in get_format("tar").iter_records(tmp_path / "o" / s.path)
    )
    assert keys == sorted(f"x/{n[:-4]}" for n in names[:2])  # one sample per image: one side
    both = quiet(pack, str(table), str(tmp_path / "o2"), root=a, progress=False,
                 allow_duplicates=True)  # fmt: skip
    assert (both.samples, both.duplicates) == (3, 0)


def test_growth_never_replaces_a_file_shardkit_did_not_write(srcs, tmp_path):
    a, b, _ = srcs
    out, pb = tmp_path / "out", tmp_path / "pb"
    packed(a, out)
    packed(tree(tmp_path / "a2", {"x": 3, "y": 2, "z": 1}, 4), pb)  # classes agree with A + B
    n = len(read_manifest(str(out)).shards)
    theirs = out / f"shard-{n:06d}.tar"  # a user's file named like the next shard
    theirs.write_bytes(b"not a shard of ours")
    packed(b, out, append=True)
    merge([out, pb], out)  # in place
    assert theirs.read_bytes() == b"not a shard of ours"
    m = read_manifest(str(out))
    assert theirs.name not in [s.path for s in m.shards] and m.num_samples == 12 + 12 + 6
    assert all(int(s.path[6:12]) != n for s in m.shards)
    one = tmp_path / "one"  # --overwrite: the new shards would take that name
    packed(a, one, shard_size="1MB")
    (one / "shard-000001.tar").write_bytes(b"mine")
    before = digests(one)
    with pytest.raises(OutputError, match=r"shard-000001.tar is in the way: .* move it out"):
        packed(b, one, overwrite=True)
    assert digests(one) == before


@pytest.mark.slow  # child processes SIGKILLed
def test_a_merge_killed_after_its_commit_point_is_finished_by_the_same_command(srcs, tmp_path):
    a, _, _ = srcs
    pa, pb, new = tmp_path / "pa", tmp_path / "pb", tmp_path / "new"
    packed(a, pa, format="lmdb")
    packed(tree(tmp_path / "b2", {"x": 2, "y": 5}, 5), pb, format="lmdb")
    ref_new, ref_pa = tmp_path / "ref_new", tmp_path / "ref_pa"
    merge([pa, pb], ref_new)
    shutil.copytree(pa, ref_pa)
    merge([ref_pa, pb], ref_pa)
    killed(new, "journal", "merge", str(pa), str(pb), str(new))
    assert cli("merge", str(pa), str(pb), str(new)).startswith(f"{new} is up to date: 19 samples")
    assert digests(new) == digests(ref_new)
    killed(pa, "1", "merge", str(pa), str(pb), str(pa))  # in place, while moving shards
    with pytest.raises(ManifestError, match="interrupted while committing"):
        read_manifest(str(pa))
    assert cli("merge", str(pa), str(pb), str(pa)).startswith(f"{pa} is up to date: 19 samples")
    assert digests(pa) == {**digests(ref_pa), "manifest.json": _sha(ref_pa / "manifest.json")}
    assert len(samples(pa)) == 19 == len(set(samples(pa)))
    again = merge([pa, pb], pa)  # not interrupted: the same command is up to date too
    assert again.up_to_date and again.added_shards == 0 and len(samples(pa)) == 19


def test_merge_refuses_one_dataset_twice_and_shared_keys_unless_told(srcs, tmp_path):
    a, b, _ = srcs
    pa, out = tmp_path / "pa", tmp_path / "out"
    packed(a, pa)
    os.symlink(pa, tmp_path / "link")
    shutil.copytree(pa, tmp_path / "copy")
    for twin in (pa, tmp_path / "link", tmp_path / "copy"):
        with pytest.raises(InputError, match=r"same (dataset|shards)"):
            merge([pa, twin], out)
        assert not out.exists() or os.listdir(out) == []
    shared = tmp_path / "shared"  # another pack sharing the keys of A's class x
    shutil.copytree(os.path.join(a, "x"), shared / "x")
    tree(shared, {"y": 1}, 8)
    packed(shared, tmp_path / "ps")
    with pytest.raises(InputError, match=r"ps: 6 of its keys are in another dataset .*allow_dup"):
        merge([pa, tmp_path / "ps"], out)
    r = CliRunner().invoke(main, ["merge", str(pa), str(tmp_path / "ps"), str(pa)])
    assert r.exit_code == 2 and "--allow-duplicates to keep both" in r.output
    assert len(samples(pa)) == 12
    assert cli("merge", str(pa), str(tmp_path / "ps"), str(out), "--allow-duplicates")
    assert len(samples(out)) == 12 + 7


# --- growth reads the indexes, not the shards --------------------------------------------------


class _Opens:
    """Counts files opened under a folder (an audit hook sees every ``open`` and ``os.open``,
    shardkit's and the libraries'): what growth read of the dataset it grows."""

    watching: list[_Opens] = []  # the counters counting now

    def __init__(self, *folders):
        self.folders = [os.path.realpath(f) + os.sep for f in folders]
        self.paths: list[str] = []

    def __enter__(self):
        if not _Opens.hooked:
            sys.addaudithook(_Opens._hook)  # once per process: hooks cannot be removed
            _Opens.hooked = True
        _Opens.watching.append(self)
        return self

    def __exit__(self, *exc):
        _Opens.watching.remove(self)

    hooked = False

    @staticmethod
    def _hook(event, args):
        if event != "open" or not _Opens.watching or not isinstance(args[0], (str, bytes)):
            return
        path = os.path.realpath(os.fsdecode(args[0]))
        for w in _Opens.watching:
            if any(path.startswith(f) for f in w.folders):
                w.paths.append(path)

    def shards(self) -> list[str]:
        """Shard files opened (a ``.tar``, ``.lmdb``: their data; not their ``.idx``)."""
        return [p for p in self.paths if p.endswith((".tar", ".lmdb"))]


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_growth_reads_no_old_tar_and_still_refuses_a_key_twice(srcs, tmp_path, fmt):
    a, _, c = srcs
    out, pb = tmp_path / "out", tmp_path / "pb"
    packed(a, out, format=fmt)
    packed(tree(tmp_path / "p", {"x": 3}, 7), pb, format=fmt)  # classes: a prefix of out's
    old = [os.path.join(out, s.path) for s in read_manifest(str(out)).shards]
    assert len(old) > 2
    with _Opens(out) as opens:
        report = packed(c, out, append=True, format=fmt)
    assert report.samples == 12 and report.duplicates == 0
    if fmt == "tar":  # LMDB's keys are in an index record inside each shard: read there
        assert not set(opens.shards()) & set(old)
    assert any(p.endswith(".idx") for p in opens.paths) or fmt == "lmdb"
    with _Opens(out) as opens, pytest.warns(UserWarning, match=r"left out 12 whose key"):
        again = pack(a, str(out), shard_size="6kB", progress=False, append=True, format=fmt)
    assert (again.samples, again.duplicates) == (0, 12)  # every key is there: refused
    if fmt == "tar":
        grown = {os.path.join(out, s.path) for s in read_manifest(str(out)).shards}
        assert len(set(opens.shards()) & grown) <= 2  # the shards of the matches: their keys
    keys = [k for k, _ in samples(out)]
    assert len(keys) == 24 == len(set(keys))
    with _Opens(out, pb) as opens:  # merged: the shards are linked, never read
        merge([out, pb], tmp_path / "merged")
    if fmt == "tar":
        assert opens.shards() == []
    assert len(samples(tmp_path / "merged")) == 24 + 3
    with _Opens(out, pb, tmp_path / "merged2") as opens:  # no key check: no shard read, but
        merge([out, pb], tmp_path / "merged2", allow_duplicates=True)  # each index's column
    assert [p for p in opens.paths if p.endswith(".tar")] == []  # checked by its keys
    assert verify(str(tmp_path / "merged2")).ok
    shared = tmp_path / "shared"  # shares A's class x: refused in any order, by count and key
    shutil.copytree(os.path.join(a, "x"), shared / "x")
    packed(shared, tmp_path / "ps", format=fmt)
    for order in ([out, tmp_path / "ps"], [tmp_path / "ps", out]):
        with pytest.raises(
            InputError, match=r": 6 of its keys are in another dataset .*first: 'x/x"
        ):
            merge(order, tmp_path / "m2")


def test_growth_of_an_older_pack_without_indexes_reads_its_keys_from_the_shards(srcs, tmp_path):
    a, _, c = srcs
    out = tmp_path / "out"
    packed(a, out)
    for name in os.listdir(out):
        if name.endswith(".idx"):
            os.unlink(out / name)
    with _Opens(out) as opens, pytest.warns(UserWarning, match=r"left out 12 whose key"):
        pack(a, str(out), shard_size="6kB", progress=False, append=True)
    assert len(opens.shards()) == len(read_manifest(str(out)).shards)  # the fallback: headers
    assert packed(c, out, append=True).samples == 12


def test_growth_takes_no_stored_key_hash_that_the_manifest_does_not_vouch_for(srcs, tmp_path):
    """A tar index whose hash column is damaged and whose trailing sha256 was fixed up (so the
    file still checks by itself) would hide a key the dataset holds from the growth check, and
    an append would add that key a second time: its hashes count only once the whole file is
    the one the manifest's index_sha256 names; else its keys are hashed again."""
    import hashlib as _hashlib

    from shardkit.formats.sample_index import _HEAD, decode_index, index_path

    a, _, _ = srcs
    out = tmp_path / "out"
    packed(a, out)
    for entry in read_manifest(str(out)).shards:  # every stored hash flipped, trailers fixed
        path = index_path(os.path.join(out, entry.path))
        data = bytearray(open(path, "rb").read())
        n = decode_index(bytes(data), path).samples
        for i in range(n):
            data[_HEAD.size + 8 * (n + 1) + 8 * i + 7] ^= 0x80
        data[-32:] = _hashlib.sha256(bytes(data[:-32])).digest()
        with open(path, "wb") as f:
            f.write(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the stale indexes are named; the check is the test
        again = pack(a, str(out), shard_size="6kB", progress=False, append=True)
    assert (again.samples, again.duplicates) == (0, 12)
    keys = [k for k, _ in samples(out)]
    assert len(keys) == len(set(keys)) == 12


def _written(out, keys, shard_size="800kB"):
    """A dataset of tiny samples ``c0/kNNNNN`` in shards of ~400 (``ShardWriter``: fast)."""
    from shardkit import ShardWriter

    with ShardWriter(str(out), shard_size=shard_size, classes=["c0"]) as w:
        for k in keys:
            w.add(f"c0/k{k:05d}", "jpg", b"\xff\xd8 %d" % k, 0)
    return out


def test_a_merge_holds_the_few_new_keys_hashes_not_the_large_datasets(tmp_path, monkeypatch):
    """Counted (tracemalloc, numpy's arrays included; the audit hook for files opened): the
    key check of a merge of 60 new samples with 12,000 holds the 60 keys' hashes, in either
    order the two are named, not the 12,000 keys' hashes (the large dataset's key file is
    memory-mapped); where no hash is shared it opens none of the large dataset's indexes and
    none of its shards. A shared key is still found in either order."""
    import tracemalloc

    import shardkit.write.merge as merge_module

    written = _written
    big = written(tmp_path / "big", range(12000))
    few = written(tmp_path / "few", range(20000, 20060))
    shards = read_manifest(str(big)).shards
    peaks = []
    check = merge_module._check_keys

    def counted(datasets, columns):
        tracemalloc.start()
        try:
            return check(datasets, columns)
        finally:
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()

    monkeypatch.setattr(merge_module, "_check_keys", counted)
    for order in ((big, few), (few, big)):
        out = tmp_path / f"merged-{order[0].name}"
        with _Opens(big) as opens:
            merge(order, out)
        assert opens.shards() == []
        assert [p for p in opens.paths if p.endswith(".idx")] == []
        assert read_manifest(str(out)).num_samples == 12060
    assert len(shards) >= 20 and len(peaks) == 2
    assert max(peaks) < 8 * 12000, peaks
    dup = written(tmp_path / "dup", (20001, 7000, 5))  # shares keys with both, stored order
    cases = [((big, dup), 2, 7000), ((dup, big), 2, 5), ((few, dup), 1, 20001)]
    cases.append(((big, few, dup), 3, 20001))  # dup against both: each key counted once
    for order, count, first in cases:
        with pytest.raises(InputError, match=rf": {count} of its keys .*'c0/k{first:05d}'"):
            merge(order, tmp_path / "refused")
    assert not os.path.exists(tmp_path / "refused" / "manifest.json")


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts reads through /proc")
def test_growth_reads_the_key_file_and_no_index_and_without_it_each_index_whole(tmp_path):
    """Counted (``rchar``: every byte this process read): a merge of 60 new samples with 12,000
    reads the large dataset's key file (12 bytes a sample) and none of its indexes or shards.
    A dataset without a key file (made before it) is read as before: each index whole, its
    stored hashes checked by its keys (a column and its ``columns_sha256`` computed again from
    an edited file agree with each other, not with the keys), and none of its shards; with or
    without ``columns_sha256`` listed. Shared keys are refused alike."""
    from shardkit.formats.key_file import count_bits, count_bytes

    big = _written(tmp_path / "big", range(12000))
    few = _written(tmp_path / "few", range(20000, 20060))
    shards = read_manifest(str(big)).shards
    assert all(len(s.columns_sha256) == 64 for s in shards)
    whole = sum(os.path.getsize(os.path.join(big, s.path) + ".idx") for s in shards)
    keyfile = os.path.getsize(big / "manifest.keys")
    grid = count_bytes(count_bits(12000, len(shards)), len(shards))  # its count table
    assert grid and keyfile == 56 + 12 * 12000 + 16 * 24 + grid and whole > 4 * keyfile
    tars = sum(s.bytes for s in shards)
    assert tars > 4 * whole
    before = _rchar()
    merge([few, big], tmp_path / "merged")
    # beside it: the blocks the 60 keys search (the 24 blocks, at most: 6 KB a block), the
    # manifests, the few's key file, the package's metadata (created_by)
    assert keyfile < _rchar() - before < 2 * keyfile + 64_000
    assert read_manifest(str(tmp_path / "merged")).shards[0].columns_sha256  # carried over
    doc = json.loads((big / "manifest.json").read_text())
    del doc["keys"]  # a dataset made before the key file
    (big / "manifest.json").write_text(json.dumps(doc))
    before = _rchar()
    merge([few, big], tmp_path / "merged-nokeys")
    assert whole < _rchar() - before < whole + 64_000
    for entry in doc["shards"]:
        del entry["columns_sha256"]
    (big / "manifest.json").write_text(json.dumps(doc))
    before = _rchar()
    merge([few, big], tmp_path / "merged-older")
    assert whole < _rchar() - before < whole + 64_000
    dup = _written(tmp_path / "dup", (20001, 7000, 5))
    with pytest.raises(InputError, match=r": 2 of its keys .*'c0/k00005'"):
        merge([dup, big], tmp_path / "refused")


def _record_columns(out) -> dict[str, str]:
    """Each LMDB shard's ``lmdb_columns_sha256``, computed from its index record."""
    import lmdb

    from shardkit.formats.lmdb import INDEX_KEY
    from shardkit.formats.lmdb.index import lmdb_columns_sha256

    got = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".lmdb"):
            env = lmdb.open(os.path.join(out, name), subdir=False, readonly=True, lock=False)
            with env.begin() as txn:
                got[name] = lmdb_columns_sha256(bytes(txn.get(INDEX_KEY)))
            env.close()
    return got


def test_every_lmdb_writer_lists_each_index_records_columns_sha256(tmp_path):
    """pack (in process and through an engine), --append, ShardWriter and merge: each LMDB
    shard's manifest entry lists the sha256 of its index record's columns (what lets a split
    use the stored hashes without hashing every key), and ``verify`` checks it."""
    from shardkit import ShardWriter
    from shardkit.write.engines import LocalRunner

    src = tree(tmp_path / "src", {"a": 5, "b": 4}, 0)
    more = tree(tmp_path / "more", {"a": 3, "c": 3}, 1)
    one, two = tmp_path / "one", tmp_path / "two"
    packed(src, one, format="lmdb")
    packed(src, two, format="lmdb", runner=LocalRunner(2), shards_per_task=1)
    packed(more, one, format="lmdb", append=True)
    writer = tmp_path / "writer"
    with ShardWriter(str(writer), shard_size="6kB", format="lmdb", classes=["a", "b", "c"]) as w:
        for i in range(20):
            w.add(f"w{i}", "jpg", b"\xff\xd8" + bytes([i]) * 2000, 0)
    merged = tmp_path / "merged"
    quiet(merge, [str(one), str(writer)], str(merged))
    for out in (one, two, writer, merged):
        entries = read_manifest(str(out)).shards
        assert len(entries) > 1
        listed = {e.path: e.columns_sha256 for e in entries}
        assert listed == _record_columns(out), out
        assert not any(e.index_sha256 for e in entries)
        assert "columns_sha256" in open(os.path.join(out, "manifest.json")).read()
    assert verify(str(merged)).ok
    doc = json.load(open(os.path.join(merged, "manifest.json")))
    doc["shards"][0]["columns_sha256"] = "0" * 64
    with open(os.path.join(merged, "manifest.json"), "w") as f:
        json.dump(doc, f)
    report = verify(str(merged))
    assert not report.ok and "columns_sha256" in " ".join(map(str, report.bad))


# --- the key file ------------------------------------------------------------------------


def _key_file_sha256(data: bytes, n: int) -> str:
    """The manifest's ``keys.sha256`` as FORMAT.md gives it: the sha256 of the sha256 of the
    head and hashes, then of the shard column's."""
    split = HEAD + 8 * n
    both = hashlib.sha256(data[:split]).digest() + hashlib.sha256(data[split:]).digest()
    return hashlib.sha256(both).hexdigest()


def _count_table(data: bytes, n: int, shards: int, listed: dict | None) -> bytes:
    """A run's count table (FORMAT.md, "Count table"), checked as FORMAT.md gives it against
    its columns and block table: the k its size gives, each point's position and digest,
    each vector the counts below its point; b"" where none is listed (a run too small)."""
    k, g = 0, 1
    while (
        4 ** (k + 1) <= n and 64 * (16 * 2 ** (k + 1) + 4 * shards * (2 ** (k + 1) - 1)) <= 12 * n
    ):
        k += 1
    if not listed:
        assert k == 0
        return b""
    g, nb = 2**k, -(-n // 512)
    assert listed["k"] == k and listed["bytes"] == 16 * g + 4 * shards * (g - 1)
    at = HEAD + 12 * n + 16 * nb
    grid = data[at : at + listed["bytes"]]
    assert listed["sha256"] == hashlib.sha256(grid[: 16 * g]).hexdigest()
    rows = np.frombuffer(grid, "<u8", 2 * g).reshape(g, 2)
    hashes = np.frombuffer(data, "<u8", n, HEAD)
    column = np.frombuffer(data, "<u4", n, HEAD + 8 * n)
    table = data[HEAD + 12 * n : at]
    for j in range(g):
        p = int(np.searchsorted(hashes, np.uint64(j << (64 - k))))
        q = int(np.searchsorted(hashes, np.uint64((j + 1) << (64 - k)))) if j + 1 < g else n
        vec = b""
        if j:
            vec = grid[16 * g + 4 * shards * (j - 1) : 16 * g + 4 * shards * j]
            want = np.bincount(column[:p], minlength=shards).astype("<u4")
            assert vec == want.tobytes()
        b0, b1 = min(p // 512, nb - 1), min(q // 512, nb - 1)
        assert int(rows[j, 0]) == p
        assert int(rows[j, 1]) == xxhash.xxh3_64_intdigest(vec + table[16 * b0 : 16 * (b1 + 1)])
    return grid


def key_file(out) -> tuple[np.ndarray, np.ndarray]:
    """The key file of ``out`` (its base file and growth runs), parsed as FORMAT.md says,
    after checking each run is the one its manifest vouches for and that together they
    describe exactly the dataset's keys (by reading every shard); all runs' columns, merged."""
    m = read_manifest(str(out))
    listed = m.keys
    runs = [
        {
            k: listed[k]
            for k in ("path", "sha256", "bytes", "blocks_sha256", "counts")
            if k in listed
        }
    ]
    runs += listed.get("runs", [])
    assert runs[0]["path"] == KEYS_NAME
    assert all(r["path"] == f"{KEYS_NAME}.{r['path'].rsplit('.', 1)[-1]}" for r in runs[1:])
    hashes, shards, count = [], [], len(m.shards)
    for i, r in enumerate(runs):
        data = open(os.path.join(out, r["path"]), "rb").read()
        n = int.from_bytes(data[8:16], "little")
        blocks = -(-n // 512)  # the block table: a fence and a digest a block of 512
        named = int.from_bytes(data[16:24], "little")
        grid = _count_table(data, n, named, r.get("counts"))
        assert len(data) == HEAD + 12 * n + 16 * blocks + len(grid) == r["bytes"]
        assert r["sha256"] == _key_file_sha256(data, n)
        table = data[HEAD + 12 * n : HEAD + 12 * n + 16 * blocks]
        assert r["blocks_sha256"] == hashlib.sha256(table).hexdigest()
        for b, (fence, digest) in enumerate(np.frombuffer(table, "<u8").reshape(-1, 2)):
            i, j = 512 * b, min(512 * b + 512, n)
            h = data[HEAD + 8 * i : HEAD + 8 * j]
            sh = data[HEAD + 8 * n + 4 * i : HEAD + 8 * n + 4 * j]
            assert fence == int.from_bytes(h[:8], "little")
            assert digest == xxhash.xxh3_64_intdigest(h + sh)
        assert data[:8] == b"SHKKEYS1"
        assert int.from_bytes(data[8:16], "little") == n
        # the newest names every shard
        assert named == count if i == len(runs) - 1 else 0 < named <= count
        doc = [[s.samples, s.sha256] for s in m.shards[:named]]
        assert data[24:56] == hashlib.sha256(json.dumps(doc).encode()).digest()
        hashes.append(np.frombuffer(data, "<u8", n, HEAD))
        shards.append(np.frombuffer(data, "<u4", n, HEAD + 8 * n))
        assert np.all(np.diff(hashes[-1].astype(np.float64)) >= 0)
        assert np.all(shards[-1] < named)
    for a, b in zip(
        runs, runs[1:], strict=False
    ):  # the compaction rule: each run under 1/4 of the one before
        assert 4 * run_count(b) < run_count(a)
    order = np.lexsort((np.concatenate(shards), np.concatenate(hashes)))
    hashes, shards = np.concatenate(hashes)[order], np.concatenate(shards)[order]
    n = m.num_samples
    keys = samples(out)
    where = np.repeat(np.arange(count, dtype=np.uint32), [s.samples for s in m.shards])
    want = key_hashes([k for k, _ in keys])
    order = np.lexsort((where, want))
    assert len(hashes) == n
    assert np.array_equal(hashes, want[order])
    assert np.array_equal(shards, where[order])
    return hashes, shards


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_pack_append_and_merge_write_the_key_file_the_manifest_vouches_for(srcs, tmp_path, fmt):
    a, b, _ = srcs
    pa, pb, merged = tmp_path / "pa", tmp_path / "pb", tmp_path / "merged"
    packed(a, pa, format=fmt)
    key_file(pa)
    packed(b, pa, append=True, format=fmt)  # classes x, y, z
    key_file(pa)
    q = tree(tmp_path / "q", {"x": 3, "y": 4}, 5)
    packed(q, pb, format=fmt)
    merge([pa, pb], merged)
    key_file(merged)
    packed(tree(tmp_path / "d", {"x": 4}, 9), merged, append=True, format=fmt)
    key_file(merged)
    # the keys of the second dataset merged in (its shards numbered past the first's) are found
    with pytest.warns(UserWarning, match=r"left out 7 whose key"):
        again = pack(q, str(merged), shard_size="6kB", progress=False, append=True, format=fmt)
    assert (again.samples, again.duplicates) == (0, 7)
    before = read_manifest(str(merged)).num_samples
    pc = tmp_path / "pc"
    packed(tree(tmp_path / "f", {"x": 3}, 11), pc, format=fmt)
    merge([merged, pc], merged)  # in place
    key_file(merged)
    assert read_manifest(str(merged)).num_samples == before + 3
    with pytest.raises(InputError, match=r": 7 of its keys are in another dataset"):
        merge([merged, pb], tmp_path / "refused")


def test_an_append_reads_the_key_file_not_the_old_indexes(srcs, tmp_path):
    a, _, c = srcs
    out = tmp_path / "out"
    packed(a, out)
    old = read_manifest(str(out)).shards
    assert len(old) > 2
    with _Opens(out) as opens:
        report = packed(c, out, append=True)
    assert report.samples == 12
    read = {os.path.basename(p) for p in opens.paths}
    assert KEYS_NAME in read
    assert not {s.path for s in old} & read
    assert not {s.path + ".idx" for s in old} & read
    key_file(out)


def test_growth_reads_the_grown_datasets_manifest_once(srcs, tmp_path):
    """The manifest is O(shards) (~1.7 KB a shard): an append read it three times (its
    up-to-date check, the output's lock, its plan) and a merge in place twice; once each now,
    and again only where the file changed between the check and the lock."""
    a, _, c = srcs
    out = tmp_path / "out"
    packed(a, out)
    packed(tree(tmp_path / "b2", {"x": 2, "y": 5}, 5), tmp_path / "pb")
    manifest = os.path.realpath(out / "manifest.json")
    with _Opens(out) as opens:
        packed(c, out, append=True)
    assert opens.paths.count(manifest) == 1, opens.paths
    with _Opens(out) as opens:
        quiet(merge, [str(out), str(tmp_path / "pb")], str(out))
    assert opens.paths.count(manifest) == 1, opens.paths
    assert len(samples(out)) == 12 + 12 + 7


def test_a_hash_the_key_file_holds_is_confirmed_on_the_key_never_taken_for_it(srcs, tmp_path):
    """A collision, made: the key file (its sha256 in the manifest made again, so it serves)
    lists a new key's hash for an old shard holding another key. The append reads that shard's
    keys, finds the key is not there, and packs it; the keys that are there are still left out."""
    a, _, c = srcs
    out = tmp_path / "out"
    packed(a, out)
    m = read_manifest(str(out))
    n = m.num_samples
    path = out / KEYS_NAME
    data = bytearray(path.read_bytes())
    hashes = np.frombuffer(data, "<u8", n, HEAD).copy()
    shards = np.frombuffer(data, "<u4", n, HEAD + 8 * n).copy()
    new_keys = sorted(os.path.relpath(os.path.join(d, f), c) for d, _, fs in os.walk(c) for f in fs)
    new_keys = [os.path.splitext(k)[0] for k in new_keys]
    hashes[:3] = key_hashes(new_keys[:3])  # three old samples now "collide" with new keys
    order = np.lexsort((shards, hashes))
    data[HEAD : HEAD + 8 * n] = hashes[order].astype("<u8").tobytes()
    data[HEAD + 8 * n :] = shards[order].astype("<u4").tobytes()
    path.write_bytes(bytes(data))
    doc = json.loads((out / "manifest.json").read_text())
    doc["keys"]["sha256"] = _key_file_sha256(bytes(data), n)
    (out / "manifest.json").write_text(json.dumps(doc))
    report = packed(c, out, append=True)
    assert (report.samples, report.duplicates) == (12, 0)
    grown = read_manifest(str(out))
    held = held_in(str(out), grown, dataset_columns(str(out), grown))
    assert held(new_keys).all() and not held(["x/none", "y/none"]).any()
    keys = [k for k, _ in samples(out)]
    assert len(keys) == 24 == len(set(keys))


@pytest.mark.parametrize("damage", ["unlisted", "missing", "edited", "stale"])
def test_a_dataset_without_a_key_file_that_serves_is_grown_as_before_and_gets_one(
    srcs, tmp_path, damage
):
    a, b, c = srcs
    out = tmp_path / "out"
    packed(a, out)
    doc = json.loads((out / "manifest.json").read_text())
    if damage == "unlisted":  # made before the key file
        del doc["keys"]
        os.unlink(out / KEYS_NAME)
    elif damage == "missing":  # a copy without it
        os.unlink(out / KEYS_NAME)
    elif damage == "edited":
        with open(out / KEYS_NAME, "r+b") as f:
            f.seek(HEAD)
            f.write(b"\0" * 8)
    else:  # another dataset's key file with its sha256: its head names other shards
        other = tmp_path / "other"
        packed(b, other)
        shutil.copyfile(other / KEYS_NAME, out / KEYS_NAME)
        doc["keys"] = json.loads((other / "manifest.json").read_text())["keys"]
    (out / "manifest.json").write_text(json.dumps(doc))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        # edited: the block its smallest hash is in fails its digest, whichever key searches it
        again = pack(a, str(out), shard_size="6kB", progress=False, append=True)
        assert (again.samples, again.duplicates) == (0, 12)  # nothing to append
    named = [w for w in seen if issubclass(w.category, KeyFileWarning)]
    assert bool(named) == (damage != "unlisted")
    if named:
        assert str(out / KEYS_NAME) in str(named[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = packed(c, out, append=True)
    assert report.samples == 12
    key_file(out)  # the append wrote it anew
    keys = [k for k, _ in samples(out)]
    assert len(keys) == 24 == len(set(keys))


def test_a_merge_of_datasets_without_key_files_refuses_shared_keys_and_writes_one(tmp_path):
    big = _written(tmp_path / "big", range(3000))
    dup = _written(tmp_path / "dup", (20001, 7000, 5))
    for d in (big, dup):
        doc = json.loads((d / "manifest.json").read_text())
        del doc["keys"]
        (d / "manifest.json").write_text(json.dumps(doc))
        os.unlink(d / KEYS_NAME)
    with pytest.raises(InputError, match=r"big: 1 of its keys .*'c0/k00005'"):
        merge([dup, big], tmp_path / "refused")
    merge([big, dup], tmp_path / "kept", allow_duplicates=True)
    hashes, _ = key_file(tmp_path / "kept")
    assert len(hashes) == 3003


def test_key_files_merged_in_pieces_are_the_whole_sort(tmp_path, monkeypatch):
    """Three key columns (equal hashes within and across them, one empty) merged a few samples
    a piece: the file is the one sort of them all by hash, then shard (FORMAT.md)."""
    from shardkit.write import keyfile

    monkeypatch.setattr(keyfile, "CHUNK", 7)
    rng = np.random.default_rng(3)
    parts, offset = [], 0
    for n, shards in ((100, 5), (0, 1), (61, 4)):
        hashes = rng.integers(0, 40, n).astype(np.uint64) << np.uint64(58)
        where = rng.integers(0, shards, n).astype(np.uint32)
        order = np.lexsort((where, hashes))
        parts.append(keyfile.KeyColumns(hashes[order], where[order], offset))
        offset += shards
    entries = [ShardEntry(f"s{i}", 0, 0, "0" * 64) for i in range(offset)]
    listed = keyfile.write_key_file(str(tmp_path), parts, entries)
    data = (tmp_path / keyfile.KEYS_NAME).read_bytes()
    n = 161
    assert listed == {
        "path": "manifest.keys",
        "sha256": _key_file_sha256(data, n),
        "bytes": len(data),
        "blocks_sha256": hashlib.sha256(data[HEAD + 12 * n :]).hexdigest(),
    }
    hashes = np.concatenate([p.hashes for p in parts])
    where = np.concatenate([p.shards + np.uint32(p.offset) for p in parts])
    order = np.lexsort((where, hashes))
    # the block table, written piece by piece (7 samples a piece), is the whole columns' table
    assert data[HEAD + 12 * n :] == block_table(hashes[order], where[order])
    assert len(data) == HEAD + 12 * n + 16 * 1
    assert np.array_equal(np.frombuffer(data, "<u8", n, HEAD), hashes[order])
    assert np.array_equal(np.frombuffer(data, "<u4", n, HEAD + 8 * n), where[order])


def test_an_engine_pack_and_append_write_the_key_file(srcs, tmp_path):
    from shardkit.write.engines import LocalRunner

    a, b, _ = srcs
    out = tmp_path / "out"
    packed(a, out, runner=LocalRunner(processes=2))
    key_file(out)
    packed(b, out, append=True, runner=LocalRunner(processes=2))
    key_file(out)
    assert read_manifest(str(out)).num_samples == 24


# --- the key file's runs ---------------------------------------------------------------------


def _runs(out) -> list[int]:
    """The samples of each of ``out``'s key file runs, the base first."""
    keys = read_manifest(str(out)).keys
    return [run_count(r) for r in [keys, *keys.get("runs", [])]]


def _view_finds(out, keys) -> dict[str, int]:
    from shardkit import ShardView

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the key file serves: no private table built
        view = ShardView(str(out), decode="raw", with_keys=True)
        try:
            return {k: view.get(k)[2] for k in keys}
        finally:
            view.close()


def test_growth_writes_runs_every_reader_searches_and_merges_them_by_the_rule(tmp_path):
    """Merged in place and appended, a dataset of 3,000 keys gains one run a growth step
    (each under a quarter of the one before: FORMAT.md's rule), which every reader searches:
    ``get(key)``, the duplicate check of an append and of a merge (a key in any run refused by
    name). A step large enough merges the runs back into one base file: same answers."""
    big = _written(tmp_path / "big", range(3000))
    steps = [range(5000 + 1000 * i, 5000 + 1000 * i + n) for i, n in enumerate((300, 60, 10))]
    for i, keys in enumerate(steps):
        merge([big, _written(tmp_path / f"s{i}", keys)], big)
    assert _runs(big) == [3000, 300, 60, 10]
    hashes, _ = key_file(big)  # each run vouched for, together every key
    assert len(hashes) == 3370
    names = sorted(n for n in os.listdir(big) if n.startswith(KEYS_NAME))
    assert names == [KEYS_NAME, f"{KEYS_NAME}.1", f"{KEYS_NAME}.2", f"{KEYS_NAME}.3"]
    probe = ["c0/k00007", "c0/k05001", "c0/k05150", "c0/k06005", "c0/k07009"]
    found = _view_finds(big, probe)
    assert found == {k: k for k in probe}
    for key in probe[1:]:  # a key of each run refused, by name, by merge and by append
        n = int(key[-5:])
        with pytest.raises(InputError, match=rf"first: {key!r}"):
            merge([big, _written(tmp_path / f"d{n}", [n, 9000 + n])], tmp_path / "refused")
    src = tmp_path / "src"
    for key in (probe[2], "c0/k09999"):
        os.makedirs(src / "c0", exist_ok=True)
        Image.new("RGB", (4, 4)).save(src / f"{key}.jpg")
    with pytest.warns(UserWarning, match=r"left out 1 whose key"):
        grown = pack(str(src), str(big), shard_size="800kB", progress=False, append=True)
    assert (grown.samples, grown.duplicates) == (1, 1)
    assert _runs(big) == [3000, 300, 60, 10, 1]  # 1 is under a quarter of 10: a run
    merge([big, _written(tmp_path / "large", range(10000, 10800))], big)
    assert _runs(big) == [4171]  # 800 >= 371 / 4 ... >= 3000 / 4: one base file again
    assert names_of(big) == [KEYS_NAME]  # the runs merged are gone
    key_file(big)
    assert _view_finds(big, [*probe, "c0/k09999", "c0/k10500"])["c0/k05150"] == "c0/k05150"


def names_of(out) -> list[str]:
    return sorted(n for n in os.listdir(out) if n.startswith(KEYS_NAME))


def test_an_older_reader_of_a_manifest_with_runs_falls_back_never_answers_wrong(tmp_path):
    """What shardkit before the runs reads of a grown manifest: ``keys`` without ``runs``
    (its parser keeps only path, sha256 and bytes), naming the base file, whose size is not the
    dataset's: refused with a warning by growth and by ``get(key)``, which read the shards'
    indexes instead and still find every key and refuse every duplicate."""
    from shardkit import ShardView
    from shardkit.formats.key_file import problem

    big = _written(tmp_path / "big", range(2000))
    merge([big, _written(tmp_path / "s", range(5000, 5100))], big)
    doc = json.loads((big / "manifest.json").read_text())
    assert len(doc["keys"]["runs"]) == 1
    m = read_manifest(str(big))
    why = problem(str(big / KEYS_NAME), doc["keys"], m.num_samples, m.shards)  # older check
    grid = doc["keys"]["counts"]["bytes"]  # the base file's count table
    assert why == f"not the {HEAD + 12 * 2100 + 16 * 5 + grid} bytes of 2100 samples"
    del doc["keys"]["runs"]  # as an older parser keeps it
    (big / "manifest.json").write_text(json.dumps(doc))
    with pytest.warns(RuntimeWarning, match=r"hold 2000 key hashes, not 2100; get\(key\) sorts"):
        view = ShardView(str(big), decode="raw", with_keys=True)
        assert view.get("c0/k05050")[2] == "c0/k05050"
    view.close()
    with pytest.warns(KeyFileWarning, match=r"its runs hold 2000 key hashes, not 2100"):
        with pytest.raises(InputError, match=r"first: 'c0/k05050'"):
            merge([big, _written(tmp_path / "d", [5050])], tmp_path / "refused")


_READ_BYTES = textwrap.dedent(
    """
    import sys, warnings
    warnings.simplefilter("ignore")
    from shardkit.write.merge import merge

    def rchar():
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar")).split()[1])

    merge([sys.argv[3], sys.argv[4]], sys.argv[3])  # a warm-up: every module imported
    before = rchar()
    merge([sys.argv[1], sys.argv[2]], sys.argv[1])
    print(rchar() - before)
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts bytes read by /proc")
def test_a_growth_step_reads_bytes_of_its_new_keys_not_of_the_old_dataset(tmp_path):
    """Counted (``rchar``: every byte a read returned, in a child): growing a dataset of
    20,000 keys by 10 reads at most what growing one of 2,000 by 10 does plus FORMAT.md's law
    for the difference: the larger block table (16 bytes a block of 512) and at most one
    checked block (512 samples: 6 KB) a new key, not the old run's 12 bytes a sample; before
    the runs, the old key file was read whole (its sha256) and written whole at every step."""
    read = {}
    for n in (2000, 20000):
        old = _written(tmp_path / f"old{n}", range(n), shard_size="64MB")
        new = _written(tmp_path / f"new{n}", range(40000, 40010), shard_size="64MB")
        warm = [_written(tmp_path / f"w{n}{i}", range(i, 50, 2)) for i in (0, 1)]
        r = subprocess.run(
            [sys.executable, "-c", _READ_BYTES, str(old), str(new), *map(str, warm)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        read[n] = int(r.stdout.split()[-1])
        assert _runs(old) == [n, 10]  # a run of its own
    law = 16 * (40 - 4) + 10 * 512 * 12
    assert read[20000] - read[2000] <= law < 12 * (20000 - 2000), read


@pytest.mark.slow  # child processes SIGKILLed
def test_a_growth_with_runs_killed_at_every_step_is_the_uninterrupted_one_once_rerun(tmp_path):
    """A merge in place that writes a run and removes the one it merged (runs 2,000 + 100,
    grown by 60: the 160 keys in one new run), killed before its commit point, at it, and
    after each file it moves into or removes from the dataset: the dataset read in between is
    the old one or refused as interrupted, never a mix, and the same command run again leaves
    exactly what the uninterrupted merge does."""
    base = _written(tmp_path / "base", range(2000))
    merge([base, _written(tmp_path / "s1", range(5000, 5100))], base)
    step = _written(tmp_path / "s2", range(6000, 6060))
    ref = tmp_path / "ref"
    shutil.copytree(base, ref)
    merge([ref, step], ref)
    assert _runs(base) == [2000, 100] and _runs(ref) == [2000, 160]
    assert "counts" in read_manifest(str(base)).keys  # the base's count table, the runs' none
    assert names_of(ref) == [KEYS_NAME, f"{KEYS_NAME}.2"]  # the run of 100 merged, removed
    kinds = ["pre", "journal", *(f"r{i}" for i in range(1, 9)), *(f"u{i}" for i in range(1, 9))]
    killed_at = []
    for when in kinds:
        out = tmp_path / f"out-{when}"
        shutil.copytree(base, out)
        args = ["merge", str(out), str(step), str(out)]
        r = subprocess.run(
            [sys.executable, "-c", _KILLED_AFTER_COMMIT, "", str(out), when, *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if r.returncode == 0:  # no such step: the merge ran to its end
            assert digests(out) == digests(ref)
            continue
        assert r.returncode == -signal.SIGKILL, r.stderr
        killed_at.append(when)
        try:
            between = read_manifest(str(out))
        except ManifestError as exc:
            assert "interrupted while committing" in str(exc)
        else:
            assert between.num_samples in (2100, 2160)
            key_file(out)  # the runs it lists are there and are its keys
        cli(*args)
        assert digests(out) == digests(ref), when
        assert _view_finds(out, ["c0/k05050", "c0/k06059"]) == {
            "c0/k05050": "c0/k05050",
            "c0/k06059": "c0/k06059",
        }
    assert {"pre", "journal", "r1", "r2", "u1"} <= set(killed_at)


def test_a_run_read_whole_is_checked_by_its_sha256_first(tmp_path):
    """A merge reads the datasets it copies whole: a run of one edited in place (its size and
    head kept, so a search would take it) is named in a warning and that dataset's keys are
    read from its shards instead; the merged key file is every key's, the edit not copied."""
    a = _written(tmp_path / "a", range(1000))
    merge([a, _written(tmp_path / "s", range(5000, 5100))], a)
    assert _runs(a) == [1000, 100]
    run = a / f"{KEYS_NAME}.1"
    data = bytearray(run.read_bytes())
    data[HEAD : HEAD + 8] = bytes(8)  # its smallest hash zeroed: still sorted
    run.write_bytes(bytes(data))
    b = _written(tmp_path / "b", range(7000, 7010))
    # named at the first read of it: the block the new keys' search reads fails its digest
    with pytest.warns(KeyFileWarning, match=r"keys\.1: its block 0 \(samples 0 \.\. 100\) is not"):
        merge([a, b], tmp_path / "m")
    hashes, _ = key_file(tmp_path / "m")
    assert len(hashes) == 1110 and _runs(tmp_path / "m") == [1110]


def _flip(path, at: int) -> None:
    """One byte of ``path`` changed in place: its size, head and listing kept."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x5A]))


@pytest.mark.parametrize("column", ["hash", "shard"])
def test_a_run_searched_not_merged_is_checked_by_its_blocks_never_a_duplicate(tmp_path, column):
    """A growth step that only searches a run (1,100 keys in the base, 100 in a run; 5 new
    keys, none merged into the base) reads the blocks its keys fall in and checks each by its
    digest: a hash or a shard byte of the base flipped in place (its size, head and the
    manifest untouched), in the block of a key the step appends again, is named in a warning
    and the keys are read from the shards: the key is refused, never packed twice."""
    a = _written(tmp_path / "a", range(1100))
    merge([a, _written(tmp_path / "s", range(5000, 5100))], a)
    assert _runs(a) == [1100, 100]
    hashes, _ = key_file(a)
    dup = 700  # a key the dataset holds: the block of its hash is damaged
    rank = int(np.searchsorted(np.sort(hashes[:1100]), key_hashes([f"c0/k{dup:05d}"])[0]))
    n = 1100
    if column == "hash":  # the key's own hash: a search would miss it, and pack it again
        _flip(a / KEYS_NAME, HEAD + 8 * rank)
    else:  # its shard: a search would look in another shard, miss it, and pack it again
        _flip(a / KEYS_NAME, HEAD + 8 * n + 4 * rank)
    step = _written(tmp_path / "step", [dup, 9000, 9001, 9002, 9003])
    with pytest.warns(KeyFileWarning, match=r"manifest\.keys: its block \d+ .* not its digest"):
        with pytest.raises(InputError, match=rf"first: 'c0/k{dup:05d}'"):
            merge([a, step], a)
    src = tmp_path / "src"
    os.makedirs(src / "c0")
    for k in (dup, 9100):
        Image.new("RGB", (4, 4)).save(src / f"c0/k{k:05d}.jpg")
    with pytest.warns(KeyFileWarning, match=r"its block \d+ .* not its digest"):
        grown = pack(str(src), str(a), shard_size="800kB", progress=False, append=True)
    assert (grown.samples, grown.duplicates) == (1, 1)
    key_file(a)  # written anew, whole, from the shards: every key once
    keys = [k for k, _ in samples(a)]
    assert len(keys) == 1201 == len(set(keys))


def test_get_key_in_a_damaged_block_is_found_never_called_missing(tmp_path):
    """``get(key)`` reads the one block its hash falls in and checks it: a key whose block
    was damaged in place is found through the shards (a warning names the key file), never
    "no sample with key"; a missing key is answered from checked blocks, the file's sha256
    never read."""
    from shardkit import ShardView

    a = _written(tmp_path / "a", range(2000))
    hashes, _ = key_file(a)
    key = "c0/k01234"
    rank = int(np.searchsorted(hashes, key_hashes([key])[0]))
    _flip(a / KEYS_NAME, HEAD + 8 * rank)
    view = ShardView(str(a), decode="raw", with_keys=True)
    try:
        with pytest.warns(RuntimeWarning, match=r"manifest\.keys: its block \d+ .* not its digest"):
            assert view.get(key)[2] == key
        with pytest.raises(InputError, match="no sample with key 'c0/k09999'"):
            view.get("c0/k09999")
    finally:
        view.close()
    b = _written(tmp_path / "b", range(2000))
    view = ShardView(str(b), decode="raw", with_keys=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the key file serves: no private table built
            with pytest.raises(InputError, match="no sample with key 'c0/k09999'"):
                view.get("c0/k09999")
            assert view.get("c0/k01999")[2] == "c0/k01999"
    finally:
        view.close()


def test_an_older_reader_of_runs_with_block_tables_falls_back_never_answers_wrong(tmp_path):
    """shardkit before the block table parses ``keys`` without ``blocks_sha256`` and takes a
    run's count from its size, ``(bytes - 56) / 12``: with the table after the columns that is
    not the run's count, so it refuses the key file with a warning and reads the shards'
    indexes (never a count, hash or shard taken from the table's bytes)."""
    from shardkit.formats.key_file import problem

    big = _written(tmp_path / "big", range(2000))
    listed = dict(read_manifest(str(big)).keys)
    del listed["blocks_sha256"], listed["counts"]  # what an older parser keeps
    older_n = (listed["bytes"] - HEAD) // 12
    assert older_n != 2000 and run_count(listed) == older_n
    m = read_manifest(str(big))
    assert problem(str(big / KEYS_NAME), listed, 2000, m.shards).startswith("not the ")


@pytest.mark.parametrize("samples", [2000, 2048, 3000])
def test_an_older_reader_of_runs_with_count_tables_falls_back_never_answers_wrong(
    tmp_path, samples
):
    """shardkit before the count table keeps ``blocks_sha256`` and not ``counts`` and takes
    a run's count as the largest whose columns and block table fit its ``bytes``: the count
    table after the block table makes that count more than the run's, or (where it adds no
    sample: 2,048 is a whole number of blocks) the size not that count's, so its check fails
    and it reads the shards' indexes; its runs' counts never sum to the dataset's."""
    from shardkit.formats.key_file import problem, runs_problem

    big = _written(tmp_path / "big", range(samples))
    m = read_manifest(str(big))
    listed = dict(m.keys)
    assert listed["counts"]["bytes"] >= 36
    del listed["counts"]  # what the previous parser keeps
    older_n = run_count(listed)  # its rule, the same function without ``counts``
    assert older_n > samples or problem(str(big / KEYS_NAME), listed, older_n, m.shards)
    why = runs_problem(str(big), listed, samples, m.shards, whole=False)
    assert why.startswith(("not the ", f"its runs hold {older_n} key hashes, not {samples}"))


def test_a_run_written_before_the_block_table_is_searched_once_its_sha256_is_checked(tmp_path):
    """A key file from shardkit before the block table (no table, no ``blocks_sha256``) is
    still read: a run a step searches is read whole first and checked by its sha256 (12
    bytes a sample), so a hash edited in place is named and the duplicate still refused."""
    a = _written(tmp_path / "a", range(1000))
    path = a / KEYS_NAME
    data = path.read_bytes()[: HEAD + 12 * 1000]  # the columns, as older shardkit wrote them
    path.write_bytes(data)
    doc = json.loads((a / "manifest.json").read_text())
    del doc["keys"]["blocks_sha256"], doc["keys"]["counts"]
    doc["keys"].update(bytes=len(data), sha256=_key_file_sha256(data, 1000))
    (a / "manifest.json").write_text(json.dumps(doc))
    with warnings.catch_warnings():
        warnings.simplefilter("error", KeyFileWarning)  # it serves
        with pytest.raises(InputError, match=r"first: 'c0/k00500'"):
            merge([a, _written(tmp_path / "d", [500, 9000])], a)
    hashes = np.frombuffer(data, "<u8", 1000, HEAD)
    rank = int(np.searchsorted(hashes, key_hashes(["c0/k00500"])[0]))
    _flip(path, HEAD + 8 * rank)
    with pytest.warns(KeyFileWarning, match=r"manifest\.keys: its sha256 is not the manifest's"):
        with pytest.raises(InputError, match=r"first: 'c0/k00500'"):
            merge([a, _written(tmp_path / "d2", [500, 9001])], a)

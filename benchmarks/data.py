"""The benchmarks' data makers, each set made once under ``root()`` (``$SHARDKIT_BENCH_DATA``,
default ``/tmp/shardkit-bench``) and reused while complete; a case's own path flag picks another
place.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import warnings
from pathlib import Path


def root() -> Path:
    """Where every made data set lives (``$SHARDKIT_BENCH_DATA``)."""
    return Path(os.environ.get("SHARDKIT_BENCH_DATA", "/tmp/shardkit-bench"))


def say(text: str) -> None:
    print(text, flush=True)


def imagenet(tree: Path | None = None, classes: int = 4, per_class: int = 150) -> Path:
    """An ImageNet-shaped tree (``shardkit synth``: mostly 500x375, ~110 KB each)."""
    tree = Path(tree) if tree else root() / f"inet-{classes}x{per_class}"
    if not tree.exists():
        from shardkit.synth import make_imagenet

        say(f"making {tree} ...")
        make_imagenet(str(tree), classes=classes, images_per_class=per_class)
    return tree


def lfw(tree: Path | None = None, scale: float | None = None) -> Path:
    """An LFW-shaped tree (250x250 faces, LFW's long tail) at ``scale`` of LFW's 13,233."""
    tree = Path(tree) if tree else root() / f"lfw-{scale or 'default'}"
    if not tree.exists():
        from shardkit.synth import make_lfw

        say(f"making {tree} ...")
        make_lfw(str(tree), scale=scale)
    return tree


def lfw_with_captions(where: Path | None = None, scale: float = 0.15) -> Path:
    """An LFW-shaped tree with a ``.txt`` caption and a ``.json`` record beside every image,
    packed; returns the pack."""
    where = Path(where) if where else root() / f"lfw-fields-{scale}"
    tree = where / "tree"
    if not tree.exists():
        lfw(tree, scale)
        for i, image in enumerate(sorted(tree.rglob("*.jpg"))):
            stem = image.with_suffix("")
            Path(f"{stem}.txt").write_text(f"a photo of {image.parent.name}, number {i}")
            Path(f"{stem}.json").write_text(json.dumps({"i": i, "person": image.parent.name}))
    return packed(tree, where / "packed")


def lfw_with_masks(where: Path | None = None, scale: float = 0.15) -> Path:
    """An LFW-shaped tree with a ``.seg.png`` mask (4 levels of the image's grey) beside every
    image, packed; returns the pack."""
    from PIL import Image

    where = Path(where) if where else root() / f"lfw-masks-{scale}"
    tree = where / "tree"
    if not tree.exists():
        lfw(tree, scale)
        for image in sorted(tree.rglob("*.jpg")):
            with Image.open(image) as img:
                mask = img.convert("L").point(lambda v: v // 64)
            mask.save(f"{image.with_suffix('')}.seg.png")
    return packed(tree, where / "packed")


def noisy(
    tree: Path | None = None,
    count: int = 2048,
    width: int = 160,
    height: int = 120,
    classes: int = 4,
) -> Path:
    """``count`` JPEGs of random pixels (``width`` x ``height``, quality 90) in ``classes`` class
    folders: small photos whose decode costs little, so what a loader does around each image
    (a sample transform, its batch's way to the caller) shows."""
    import numpy as np
    from PIL import Image

    tree = Path(tree) if tree else root() / f"noisy-{count}-{width}x{height}"
    if tree.exists():
        return tree
    say(f"making {tree} ...")
    tmp = tree.with_name(tree.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        folder = tmp / f"c{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{i:05d}.jpg", quality=90)
    os.replace(tmp, tree)
    return tree


def packed(src: Path, out: Path | None = None, **pack_kw) -> Path:
    """``src`` packed (``shardkit.pack``) beside it as ``<src>-tar``, or at ``out``; made again
    when the manifest's shard size differs from the asked one."""
    from shardkit import pack
    from shardkit.manifest import read_manifest
    from shardkit.sizes import parse_size

    src = Path(src)
    out = Path(out) if out else src.with_name(src.name + "-tar")
    if (out / "manifest.json").exists():
        want = pack_kw.get("shard_size")
        if want is None or read_manifest(str(out)).pack.get("shard_size") == parse_size(want):
            return out
    say(f"packing {src} -> {out} ...")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pack(str(src), str(out), progress=False, overwrite=True, **pack_kw)
    return out


def tiny_jpeg(side: int = 64, seed: int = 0) -> bytes:
    """One JPEG of random pixels (a sample's bytes where only the count matters)."""
    import numpy as np
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=85)
    return buf.getvalue()


def jpeg_bytes(tree: Path) -> list[bytes]:
    """Every image file's bytes under ``tree`` (class folders), sorted by path; reading them
    also puts the files in the page cache."""
    out = []
    for f in sorted(Path(tree).glob("*/*")):
        if f.suffix.lower() in (".jpg", ".jpeg"):
            out.append(f.read_bytes())
    return out


def table(work: Path | None = None, rows: int = 10_000, classes: int = 1000) -> Path:
    """``work/table-<rows>.csv`` (``image,caption,label``) whose images are hard links to 64
    tiny JPEGs (one inode each: an N-row tree costs directory entries, not disk)."""
    from PIL import Image

    work = Path(work) if work else root() / "table"
    table = work / f"table-{rows}.csv"
    if table.exists():
        return table
    img = work / "img"
    img.mkdir(parents=True, exist_ok=True)
    seeds = []
    for s in range(64):  # ext4 allows 65,000 links per inode
        p = work / f"seed{s}.jpg"
        if not p.exists():
            Image.new("RGB", (8, 8), (4 * s, 100, 255 - 3 * s)).save(p, quality=90)
        seeds.append(p)
    per = max(1, rows // classes)
    tmp = table.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("image,caption,label\n")
        for i in range(rows):
            c = min(i // per, classes - 1)
            folder = img / f"c{c:04d}"
            if i % per == 0 or not folder.exists():
                folder.mkdir(exist_ok=True)
            name = folder / f"img{i:09d}.jpg"
            if not name.exists():
                os.link(seeds[i % len(seeds)], name)
            f.write(f"img/c{c:04d}/img{i:09d}.jpg,a photo of thing {i} in class {c},n{c:08d}\n")
    tmp.rename(table)
    return table


def clip_shards(tree: Path, out: Path | None = None, per_shard: int = 100) -> Path:
    """img2dataset's layout (``000000000.jpg/.txt/.json`` per sample, no class) for every photo
    of ``tree``, then ``shardkit index``: WebDataset and shardkit read the very same tars."""
    tree = Path(tree)
    out = Path(out) if out else tree.parent / f"{tree.name}-clip-shards"
    if (out / "manifest.json").exists():
        return out
    from shardkit.write.index import index_shards

    photos = sorted(tree.rglob("*.JPEG")) + sorted(tree.rglob("*.jpg"))
    out.mkdir(parents=True, exist_ok=True)
    for s in range(0, len(photos), per_shard):
        with tarfile.open(out / f"{s // per_shard:05d}.tar", "w") as tar:
            for j, path in enumerate(photos[s : s + per_shard]):
                key = f"{s // per_shard:05d}{j:04d}"
                meta = {"url": f"https://example.com/{path.name}", "key": key, "caption": None,
                        "status": "success", "exif": None, "error_message": None}  # fmt: skip
                members = (
                    ("jpg", path.read_bytes()),
                    ("txt", f"a photo of a {path.parent.name}".encode()),
                    ("json", json.dumps(meta).encode()),
                )
                for ext, blob in members:
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(blob)
                    tar.addfile(info, io.BytesIO(blob))
    index_shards([str(out)])
    return out


def scale_set(
    n: int, work: Path | None = None, fmt: str = "tar", shard_size: str = "5MB", start: int = 0
) -> tuple[Path, Path]:
    """N samples (one tiny JPEG's bytes under N keys in 1,000 classes, ``ShardWriter``: fast)
    packed with sample indexes, and the same shards without them (an older pack: hard links
    with the ``.idx`` files left out; LMDB: a copy whose shards lost their index record).
    ``start``: the first sample's number in the keys (a set to merge with another)."""
    import numpy as np

    from shardkit import ShardWriter

    work = Path(work) if work else root() / "scale"
    tag = ("" if fmt == "tar" else f"-{fmt}") + ("" if shard_size == "5MB" else f"-{shard_size}")
    tag += f"-from{start}" if start else ""
    with_idx, bare = work / f"n{n}{tag}", work / f"n{n}{tag}-noindex"
    if not (with_idx / "manifest.json").exists():
        blob = tiny_jpeg()
        labels = np.random.default_rng(0).integers(0, 1000, n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            classes = [f"n{c:08d}" for c in range(1000)]
            with ShardWriter(
                str(with_idx), shard_size=shard_size, format=fmt, classes=classes
            ) as w:
                for i in range(n):
                    c = int(labels[i])
                    w.add(f"n{c:08d}/n{c:08d}_{start + i}", "jpg", blob, c)
    if not bare.exists():
        if fmt == "lmdb":
            _without_records(with_idx, bare)
        else:
            bare.mkdir(parents=True)
            for name in os.listdir(with_idx):
                if not name.endswith(".idx"):
                    os.link(with_idx / name, bare / name)
    return with_idx, bare


def scale_tree(k: int, start: int, work: Path | None = None) -> Path:
    """A class-per-folder tree of ``k`` new samples keyed like ``scale_set``'s from ``start``
    on (hard links to one tiny JPEG): what ``pack --append`` adds to a scale set."""
    import numpy as np

    work = Path(work) if work else root() / "scale"
    tree = work / f"more-{k}-from{start}"
    if tree.exists():
        return tree
    tmp = tree.with_name(tree.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    seed = tmp / "seed.jpg"
    tmp.mkdir(parents=True)
    seed.write_bytes(tiny_jpeg(seed=1))
    labels = np.random.default_rng(1).integers(0, 1000, k)
    for i in range(k):
        c = int(labels[i])
        folder = tmp / f"n{c:08d}"
        folder.mkdir(exist_ok=True)
        os.link(seed, folder / f"n{c:08d}_{start + i}.jpg")
    seed.unlink()
    os.replace(tmp, tree)
    return tree


def linked_copy(src: Path, dest: Path) -> Path:
    """A copy of a pack whose shard files are hard links (never rewritten) and whose other
    files (manifest, sidecars) are copies: a pack to append to without touching ``src``."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name in os.listdir(src):
        if name.endswith((".tar", ".idx", ".lmdb")):
            os.link(src / name, dest / name)
        elif (src / name).is_file():
            shutil.copy2(src / name, dest / name)
        else:
            shutil.copytree(src / name, dest / name)
    return dest


def many_shards(shards: int, samples: int, work: Path | None = None) -> tuple[Path, Path]:
    """A pack of ``shards`` tar shards of ``samples`` tiny samples each, and its
    ``json-offsets`` twin: the same shards under a manifest that also lists each shard's
    sparse byte offsets as JSON ints (``index_every``/``index``, how packs were written before
    the offsets were read from each shard's ``.idx``). One real shard (with its ``.idx``) is
    written once and hard-linked ``shards`` times per pack: no disk beyond one shard a pack."""
    from shardkit import ShardWriter
    from shardkit.formats.sample_index import decode_index, index_path

    work = Path(work) if work else root() / "open"
    packed_dir, legacy = work / f"s{shards}x{samples}", work / f"s{shards}x{samples}-json"
    if (packed_dir / "manifest.json").exists() and (legacy / "manifest.json").exists():
        return packed_dir, legacy
    one = work / f"one{samples}"
    if not (one / "manifest.json").exists():
        say(f"making {one} ...")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with ShardWriter(str(one), shard_size="1GB", classes=["a", "b"]) as w:
                for i in range(samples):
                    w.add(f"k{i:07d}", "jpg", b"\xff\xd8" + i.to_bytes(8, "big"), i % 2)
    doc = json.loads((one / "manifest.json").read_text())
    (entry,) = doc["shards"]
    entry = {k: v for k, v in entry.items() if k not in ("index", "index_every")}
    src = one / entry["path"]
    offsets = decode_index((one / index_path(entry["path"])).read_bytes(), "one").offsets
    say(f"linking {shards} shards into {packed_dir} and {legacy} ...")
    for d, inline in ((packed_dir, False), (legacy, True)):
        d.mkdir(parents=True, exist_ok=True)
        own = d.with_name(d.name + "-src.tar")  # one source per pack: a file has < 65,000 links
        if not own.exists():
            shutil.copyfile(src, own)
            shutil.copyfile(index_path(str(src)), index_path(str(own)))
        listed = []
        for i in range(shards):
            name = f"shard-{i:06d}.tar"
            for a, b in ((own, d / name), (index_path(str(own)), d / index_path(name))):
                if not os.path.exists(b):
                    os.link(a, b)
            e = dict(entry, path=name)
            if inline:
                e["index_every"] = 64
                e["index"] = offsets[:-1:64].tolist()
            listed.append(e)
        m = dict(doc, shards=listed, num_samples=shards * samples)
        m["total_bytes"] = shards * entry["bytes"]
        tmp = d / "manifest.json.tmp"  # the manifest last, whole: a complete pack or none
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(m, f, indent=1)
            f.write("\n")
        os.replace(tmp, d / "manifest.json")
    return packed_dir, legacy


def _without_records(packed_dir: Path, bare: Path) -> None:
    import lmdb

    from shardkit.formats.lmdb.index import INDEX_KEY

    tmp = bare.with_name(bare.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(packed_dir, tmp)
    for name in os.listdir(tmp):
        if name.endswith(".lmdb"):
            env = lmdb.open(str(tmp / name), subdir=False, lock=False)
            with env.begin(write=True) as txn:
                txn.delete(INDEX_KEY)
            env.close()
    os.replace(tmp, bare)


def replicated(shards: Path, samples: int, dest: Path) -> tuple[list[str], int]:
    """The tar shards hard-linked under new names at ``dest`` as many times as an epoch of at
    least ``samples`` needs (more samples from the same bytes; no manifest: the dataset counts
    them): their paths and the samples they hold."""
    from shardkit import Order, ShardDataset

    count = sum(1 for _ in ShardDataset(str(shards), decode="raw", order=Order(shuffle=False)))
    copies = max(1, -(-samples // count))
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for c in range(copies):
        for f in sorted(Path(shards).glob("*.tar")):
            target = dest / f"copy{c}-{f.name}"
            if not target.exists():
                try:
                    os.link(f, target)
                except OSError:
                    shutil.copyfile(f, target)
            out.append(str(target))
    return out, count * copies

"""The ``shardkit`` command line: thin click wrappers over the library.

Each command parses options, calls one library function and prints its summary. User errors are
``ShardkitError``s, turned here into one ``error: ...`` line and a non-zero exit, never a traceback;
click's parameter types (``Size``, ``IntList``) reject malformed flag values the same way.

One meaning per flag name across commands: ``--threads`` is threads inside one process (pack's
readers, synth's renderers); ``--workers`` is DataLoader worker processes (bench).
"""

from __future__ import annotations

import contextlib
import re
import sys

import click

from .errors import ShardkitError
from .sizes import parse_size, size_text


class _Failure(click.ClickException):
    """A ``ShardkitError`` on its way out: click's exception path, with the error's exit code."""

    def __init__(self, exc: ShardkitError):
        super().__init__(as_flags(str(exc)))
        self.exit_code = exc.exit_code


class _Group(click.Group):
    """One way out for every user error: ``error: <message>`` on stderr, one line, and the code.

    Bad flag values (click's ``UsageError``, exit 2) and our ``ShardkitError``s (their
    ``exit_code``) are printed the same way, so scripts and tests see one prefix.
    """

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except ShardkitError as exc:
            raise _Failure(exc) from None
        except KeyboardInterrupt:
            click.echo("interrupted: nothing was left under a final name", err=True)
            sys.exit(130)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click.UsageError as exc:
            hint = f"; see '{exc.ctx.command_path} -h'" if exc.ctx is not None else ""
            _fail(exc.format_message().rstrip(".") + hint, exc.exit_code)
        except click.ClickException as exc:
            _fail(exc.format_message(), exc.exit_code)
        except click.Abort:
            _fail("aborted", 1)
        sys.exit(code if isinstance(code, int) else 0)


def _fail(message: str, code: int) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


class Size(click.ParamType):
    """``256MB``, ``64MiB``, ``1G`` or a byte count -> bytes; click reports a bad value itself."""

    name = "size"

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            size = parse_size(value, minimum=0)
        except ShardkitError:
            self.fail(
                f"{value!r} is not a size; use e.g. 256MB, 64MiB, 1G or a plain number of bytes",
                param,
                ctx,
            )
        if size < 1:
            self.fail(
                f"{value!r} is {size} bytes: a shard needs room for at least one sample; "
                "use e.g. 256MB (a sample bigger than the size gets a shard of its own)",
                param,
                ctx,
            )
        return size


class IntList(click.ParamType):
    """``0,2,4,8`` -> ``(0, 2, 4, 8)``: comma-separated whole numbers from ``low`` to ``high``."""

    name = "list"

    def __init__(self, low: int = 0, high: int = 256):
        self.low, self.high = low, high

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        from .bench.config import int_list

        try:
            return int_list(str(value), self.low, self.high)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class NameList(click.ParamType):
    """``folder,tar`` -> ``("folder", "tar")``: comma-separated bench formats."""

    name = "list"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        from .bench.config import format_list

        try:
            return format_list(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


# Every option can also come from SHARDKIT_<COMMAND>_<OPTION>, named after the flag
# (SHARDKIT_PACK_FORMAT for --format, SHARDKIT_SYNTH_LFW_SCALE for synth lfw's --scale); a flag on
# the command line wins. ``assign_envvars`` sets the names at the end of this module and ``-h``
# shows each one. The README doc test bounds the bench this way without editing its commands.
@click.group(
    cls=_Group,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(package_name="shardkit")
def main() -> None:
    """Pack folders of images into sequential shards and stream them into PyTorch.

    Every option can also come from SHARDKIT_<COMMAND>_<OPTION> (SHARDKIT_PACK_FORMAT=lmdb,
    SHARDKIT_BENCH_REPEATS=1; each command's -h shows the name); a flag wins. An unknown
    SHARDKIT_* variable is warned about.
    """
    _warn_unknown_env()


#: Variables read by the library rather than by one command's option.
LIBRARY_ENV = {
    "SHARDKIT_LFW_SCALE": "the default --scale of synth lfw and of the bench's default set",
    "SHARDKIT_PROGRESS_INTERVAL": "seconds between plain progress lines off a terminal",
}


class _EnvOption(click.Option):
    """An option whose -h shows its variable, and whose errors name the variable only when the
    bad value came from it (a bad flag is the flag's error, not the variable's)."""

    def get_error_hint(self, ctx: click.Context | None) -> str:
        hint = click.Parameter.get_error_hint(self, ctx)
        source = ctx.get_parameter_source(self.name) if ctx is not None and self.name else None
        if source == click.core.ParameterSource.ENVIRONMENT:
            hint += f" (from {self.envvar})"
        return hint


def assign_envvars(group: click.Group, prefix: str = "SHARDKIT") -> dict[str, str]:
    """Name every option's variable after its command path and long flag; return name -> flag.

    Set explicitly rather than with click's ``auto_envvar_prefix``, which names a variable after
    the Python parameter (``SHARDKIT_PACK_FMT`` for ``--format``), not after the flag a user sees.
    """
    names: dict[str, str] = {}
    for name, cmd in group.commands.items():
        path = f"{prefix}_{name.upper().replace('-', '_')}"
        if isinstance(cmd, click.Group):
            names.update(assign_envvars(cmd, path))
            continue
        for param in cmd.params:
            if not isinstance(param, click.Option) or not param.opts[0].startswith("-"):
                continue
            flag = max(param.opts, key=len)
            param.envvar = f"{path}_{flag.lstrip('-').upper().replace('-', '_')}"
            param.show_envvar = True
            param.__class__ = _EnvOption
            names[param.envvar] = f"{cmd.name} {flag}"
    return names


def _warn_unknown_env() -> None:
    """One warning line per SHARDKIT_* variable that nothing reads (a typo would be silent)."""
    import difflib
    import os

    known = {**ENV_VARS, **LIBRARY_ENV}
    for name in sorted(os.environ):
        if name.startswith("SHARDKIT_") and name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]}?" if close else "; see shardkit -h"
            click.echo(f"warning: {name} is not a shardkit variable, ignored{hint}", err=True)


_PARAM = re.compile(r'\b([a-z][a-z_]*)=(True\b|False\b|"([^"]*)"|(?=[\s,;)]|$))')


def as_flags(message: str) -> str:
    """Library errors name Python parameters (``overwrite=True``, ``on_error="skip"``); on the
    command line the same advice names the flags (``--overwrite``, ``--on-error skip``)."""

    def flag(m: re.Match) -> str:
        name, value, text = m.group(1).replace("_", "-"), m.group(2), m.group(3)
        if value == "False":
            return f"--no-{name}"
        return f"--{name}" + (f" {text}" if text is not None else "")

    return _PARAM.sub(flag, message)


# --- synth -----------------------------------------------------------------------------------


@main.group()
def synth() -> None:
    """Make LFW- or ImageNet-shaped JPEG folder trees from the photographs shipped in our deps.

    Same seed and options, same bytes; a complete tree made with the same options is reused.
    """


@synth.command("lfw")
@click.argument("out", type=click.Path(file_okay=False))
@click.option(
    "--scale",
    type=float,
    default=None,
    help="Fraction of LFW's 5,749 people / 13,233 images; the long tail is kept. "
    "Default: $SHARDKIT_LFW_SCALE or 1.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--size", type=int, default=250, show_default=True, help="Image side in pixels.")
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="Rendering threads (default: usable CPUs); never changes the bytes.",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def synth_lfw(
    out: str, scale: float | None, seed: int, size: int, threads: int | None, quiet: bool
) -> None:
    """LFW layout: OUT/Person_Name/Person_Name_0001.jpg."""
    from .synth import make_lfw

    report = make_lfw(out, scale=scale, seed=seed, size=size, workers=threads, progress=not quiet)
    click.echo(report.summary())


@synth.command("imagenet")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--classes", type=int, default=10, show_default=True)
@click.option("--images-per-class", type=int, default=100, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="Rendering threads (default: usable CPUs); never changes the bytes.",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def synth_imagenet(
    out: str, classes: int, images_per_class: int, seed: int, threads: int | None, quiet: bool
) -> None:
    """ImageNet layout: OUT/n01440764/n01440764_10026.JPEG, sizes around 500x375."""
    from .synth import make_imagenet

    report = make_imagenet(
        out,
        classes=classes,
        images_per_class=images_per_class,
        seed=seed,
        workers=threads,
        progress=not quiet,
    )
    click.echo(report.summary())


# --- pack ------------------------------------------------------------------------------------


@main.command("pack")
@click.argument("src", type=click.Path())
@click.argument("out", type=click.Path())
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["tar", "lmdb"]),
    default="tar",
    show_default=True,
    help="Shard format.",
)
@click.option(
    "--shard-size",
    type=Size(),
    default="256MB",
    show_default=True,
    help="Largest shard: 256MB, 64MiB, 1G or bytes. A bigger sample gets its own shard.",
)
@click.option(
    "--shuffle/--no-shuffle",
    default=True,
    show_default=True,
    help="Shuffle the sample order once, so that sequential shards are well mixed.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of that shuffle.")
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Reader threads (the main thread writes).",
)
@click.option(
    "--on-error",
    type=click.Choice(["skip", "raise"]),
    default="skip",
    show_default=True,
    help="Bad or unreadable image: list it in the manifest and go on, or stop.",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace the shards and manifest already in OUT (once the new ones are done).",
)
@click.option(
    "--resize-short",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Re-encode (JPEG q90) so the shorter side is at most N pixels.",
)
@click.option(
    "--validate",
    type=click.Choice(["header", "decode", "none"]),
    default="header",
    show_default=True,
    help="header: magic bytes and end markers (cheap); decode: full decode with PIL.",
)
@click.option(
    "--root",
    type=click.Path(file_okay=False),
    default=None,
    help="Table source: the folder its image paths are relative to (default: the table's). "
    "Nothing outside it is read.",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@click.option(
    "--engine",
    type=click.Choice(["local", "ray"]),
    default=None,
    help="Run the shard tasks on a process pool here (local) or a Ray cluster (ray); the "
    "bytes are the same as without. A failed or killed run resumes when run again.",
)
@click.option(
    "--processes",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="--engine local: worker processes (ray: CPUs of a cluster started for the pack).",
)
@click.option(
    "--ray-address",
    default=None,
    metavar="ADDR",
    help="--engine ray: the cluster to join (auto: the one this node is in); default: start "
    "one here for the pack.",
)
@click.option(
    "--shards-per-task",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="With --engine: consecutive shards per task.",
)
@click.option(
    "--plan-only",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="PLAN",
    help="Write the shard tasks to the file PLAN and stop: run each with `shardkit pack-task PLAN "
    "--task I` (e.g. a SLURM array), then this command without --plan-only commits.",
)
@click.option(
    "--append",
    is_flag=True,
    help="Add SRC's images to the dataset in OUT as new shards; nothing packed is rewritten.",
)
@click.option(
    "--allow-duplicates",
    is_flag=True,
    help="Pack samples whose key OUT already holds (--append) and table rows naming an image "
    "again; by default they are left out and counted.",
)
def pack_cmd(
    src,
    out,
    fmt,
    shard_size,
    shuffle,
    seed,
    threads,
    on_error,
    overwrite,
    resize_short,
    validate,
    root,
    quiet,
    engine,
    processes,
    ray_address,
    shards_per_task,
    plan_only,
    append,
    allow_duplicates,
) -> None:
    """Pack the class-per-folder image tree SRC into shards and a manifest in OUT.

    SRC may also be a table (.csv, .tsv, .jsonl, .parquet with pyarrow) with an image column
    (image, path, file or filename), optionally a caption (caption, text: field txt) and a label
    column; other columns go into field json. An img2dataset shard table (a key column, no
    image column) finds its images beside it, in <table name>/<key>.jpg or <table name>.tar;
    SRC may be img2dataset's whole output folder (tables beside tars): one pack, reading the
    images from the tars, each sample keyed by img2dataset's key as `shardkit index` keys it.

    OUT may be a URL (s3://bucket/prefix/): shards upload as they complete, the manifest last.
    Run again with the same files and options, it says OUT is up to date and exits 0, as make
    would; a non-empty OUT holding anything else needs --overwrite.
    """
    import warnings

    from .errors import OutputError
    from .write.packer import pack

    note_interrupted(out)
    asked = {
        "format": fmt,
        "shard_size": shard_size,
        "shuffle": shuffle,
        "seed": seed,
        "validate": validate,
        "resize_short": resize_short,
        "on_error": on_error,
    }
    runner = _pack_runner(engine, processes, threads, ray_address)
    with warnings.catch_warnings(record=True) as caught, _explained(out, src, asked, OutputError):
        warnings.simplefilter("always")
        report = pack(
            src,
            out,
            shard_size=shard_size,
            format=fmt,
            shuffle=shuffle,
            seed=seed,
            workers=threads,
            on_error=on_error,
            overwrite=overwrite,
            resize_short=resize_short,
            validate=validate,
            progress=not quiet,
            root=root,
            runner=runner,
            shards_per_task=shards_per_task,
            append=append,
            plan_only=plan_only,
            allow_duplicates=allow_duplicates,
        )
    echo_warnings(caught)
    if plan_only is not None and report.appended_to is None:  # (else: nothing left to append)
        tasks = -(-report.shards // shards_per_task)
        click.echo(
            f"Planned {report.samples} samples in {report.shards} shards as {tasks} task(s) in "
            f"{plan_only}; run `shardkit pack-task {plan_only} --task I` for I = 0..{tasks - 1}, "
            "then this command again without --plan-only to commit"
        )
        return
    click.echo(report.summary())


#: pack's options as its manifest records them (``pack`` object) -> the flag that sets them.
_PACK_FLAGS = {
    "format": "--format",
    "shard_size": "--shard-size",
    "shuffle": "--shuffle",
    "seed": "--seed",
    "validate": "--validate",
    "resize_short": "--resize-short",
    "on_error": "--on-error",
}


def what_differs(out: str, src: str, asked: dict) -> str | None:
    """What separates the pack in OUT from the one asked for, from OUT's manifest: the source,
    each option (flag, old and new value), or else the source's files; None if OUT holds no
    pack of ours."""
    import os

    from .manifest import read_manifest

    try:
        manifest = read_manifest(out)
    except ShardkitError:
        return None
    recorded = manifest.pack
    if not isinstance(recorded, dict) or "source_fingerprint" not in recorded:
        return None  # older packs and ShardWriter's: nothing recorded to compare with
    for shard in manifest.shards:
        path = os.path.join(out, shard.path)
        if not os.path.isfile(path) or os.path.getsize(path) != shard.bytes:
            return f"its shard {shard.path} missing or changed"
    parts = []
    if os.path.realpath(str(recorded["source"])) != os.path.realpath(src):
        parts.append(f"source {recorded['source']} -> {src}")
    for key, flag in _PACK_FLAGS.items():
        if key in recorded and recorded[key] != asked[key]:
            if isinstance(asked[key], bool):  # --shuffle -> --no-shuffle
                old, new = (
                    flag if v else flag.replace("--", "--no-") for v in (not asked[key], asked[key])
                )
                parts.append(f"{old} -> {new}")
            elif key == "shard_size":
                parts.append(f"{flag} {size_text(recorded[key])} -> {size_text(asked[key])}")
            else:
                parts.append(f"{flag} {recorded[key]} -> {asked[key]}")
    if parts:
        return "other options: " + ", ".join(parts)
    return "the same options, but the source's files changed since (names, sizes or mtimes)"


class _explained:
    """Turn pack's "OUT is not empty" into what differs from the pack already there."""

    def __init__(self, out: str, src: str, asked: dict, error: type):
        self.out, self.src, self.asked, self.error = out, src, asked, error

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is None or not issubclass(kind, self.error) or "is not empty" not in str(exc):
            return False
        why = what_differs(self.out, self.src, self.asked)
        if why is None:
            return False
        raise self.error(
            f"{self.out} holds a pack made with {why}; pass --overwrite to replace it, or "
            "choose another output"
        ) from None


def note_interrupted(out: str) -> None:
    """Mention what a killed pack left in OUT (``.partial-<pid>-...`` of a dead pid)."""
    import os

    from .fsutil import stale_staging
    from .urls import is_url

    if is_url(out) or not os.path.isdir(out):
        return
    for name in stale_staging(out):
        click.echo(
            f"note: {os.path.join(out, name)} was left by an interrupted pack (its process is "
            "gone); a pack that writes there removes it, or delete it",
            err=True,
        )


def echo_warnings(caught) -> None:
    """One ``warning:`` line per kind of warning: those that differ only in their figures (one
    per shard of a tiny --shard-size) are one line with a count of the others."""
    groups: dict[str, list[str]] = {}
    for w in caught:
        text = str(w.message)
        groups.setdefault(re.sub(r"\d[\d,.]*", "N", text), []).append(text)
    for texts in groups.values():
        more = f" ({len(texts) - 1} more like it)" if len(texts) > 1 else ""
        click.echo(f"warning: {texts[0]}{more}", err=True)


@main.command("pack-task")
@click.argument("plan", type=click.Path(dir_okay=False))
@click.option("--task", "index", type=click.IntRange(min=0), required=True, help="Task number.")
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Reader threads (the main thread writes).",
)
def pack_task_cmd(plan, index, threads) -> None:
    """Run task I of a plan written by `shardkit pack --plan-only PLAN` (safe to re-run)."""
    from .write.planfile import load_task
    from .write.task import run_task

    task, total = load_task(plan, index)
    receipts = run_task(task, threads)
    done = sum(r.samples for r in receipts)
    click.echo(
        f"Task {index} of {total}: shards {task.first}..{task.shards.stop - 1} done "
        f"({done} samples) in {task.job}"
    )


@main.command("merge")
@click.argument("datasets", nargs=-1, required=True, type=click.Path())
@click.argument("out", type=click.Path())
@click.option(
    "--allow-duplicates",
    is_flag=True,
    help="Merge datasets that share keys (by default refused: keys are unique in a dataset).",
)
def merge_cmd(datasets, out, allow_duplicates) -> None:
    """Join the packed DATASETS (same format, agreeing class lists) into OUT.

    OUT is a new folder, or the first dataset itself (the others are added to it). Shards are
    hard-linked (or copied), never rewritten; one manifest lists them all, committed last.
    Interrupted, the same command finishes it; run again, it is up to date.
    """
    from .write.merge import merge

    click.echo(merge(list(datasets), out, allow_duplicates=allow_duplicates).summary())


def _pack_runner(engine, processes, threads, ray_address):
    """The runner ``--engine`` names (None: the plan runs in this process)."""
    if ray_address is not None and engine != "ray":
        raise click.UsageError("--ray-address needs --engine ray")
    if engine == "local":
        from .write.engines import LocalRunner

        return LocalRunner(processes, threads)
    if engine == "ray":
        from .integrations.ray import RayRunner

        return RayRunner(ray_address, threads=threads, num_cpus=processes)
    return None


# --- info / verify ---------------------------------------------------------------------------


@main.command("info")
@click.argument("out", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for machines.")
@click.option(
    "--skipped",
    "list_skipped",
    is_flag=True,
    help="Also list each file pack skipped, with the reason (a bad image, a non-image, ...).",
)
def info_cmd(out, as_json, list_skipped) -> None:
    """Show what the packed dataset in OUT (a directory or URL) holds."""
    from .redact import redact
    from .write.verify import dataset_info

    note_interrupted(out)
    info = dataset_info(out)
    skipped = []
    if list_skipped:
        from .manifest import read_manifest

        skipped = [{"path": s.path, "reason": s.reason} for s in read_manifest(out).skipped]
    if as_json:
        import json

        if list_skipped:
            info["skipped_files"] = skipped
        click.echo(redact(json.dumps(info, indent=1, ensure_ascii=False)))
        return
    names = info["classes"]
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    lines = [
        f"format:   {info['format']}",
        f"shards:   {info['shards']}",
        f"samples:  {info['samples']}",
        f"bytes:    {info['bytes']} ({size_text(info['bytes'])})",
        f"classes:  {info['num_classes']} ({shown})"
        if names
        else "classes:  none (unlabelled"
        + ("; captioned: field txt" if "txt" in info["fields"] else "")
        + ")",
        "fields:   "
        + (", ".join(f"{k} {v}" for k, v in info["fields"].items()) or "none")
        + (" (samples carrying each)" if info["fields"] else ""),
        f"skipped:  {info['skipped']}"
        + ("" if list_skipped or not info["skipped"] else " (--skipped lists them)"),
    ]
    lines += [f"  {s['path']}: {s['reason']}" for s in skipped]
    lines.append(f"manifest: {info['manifest']}")
    click.echo(redact("\n".join(lines)))


@main.command("verify")
@click.argument("out", type=click.Path())
@click.option("--decode", is_flag=True, help="Also decode every image.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def verify_cmd(out, decode, quiet) -> None:
    """Re-read every shard in OUT; check size, sample count and sha256 against the manifest."""
    from .errors import ShardFormatError
    from .redact import redact
    from .write.verify import verify

    note_interrupted(out)
    report = verify(out, decode=decode, progress=not quiet)
    for bad in [*report.bad, *([report.key_file] if report.key_file else [])]:
        click.echo(redact(f"BAD {bad}"))
    if not report.ok:
        fix = "; re-copy them or re-pack" if report.bad else ""
        raise ShardFormatError(report.summary() + fix)
    click.echo(redact(report.summary()))


# --- index -----------------------------------------------------------------------------------


@main.command("index")
@click.argument("shards", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--overwrite", is_flag=True, help="Replace an existing manifest.json.")
@click.option(
    "--append",
    is_flag=True,
    help="Add the shards an existing manifest.json does not list (reading only those; their "
    "keys are checked against the dataset's).",
)
@click.option(
    "--rehash",
    is_flag=True,
    help="Give a dataset made before per-sample digests its digests: each tar shard's older "
    "index is rebuilt (the shard read once, checked against the manifest) and the manifest's "
    "index checksums updated; no shard is rewritten.",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def index_cmd(shards, overwrite, append, rehash, quiet) -> None:
    """Write manifest.json beside existing tar SHARDS (files or directories) without rewriting
    them: exact counts, checksums for `verify`, the offset index and classes from .cls members.
    With --append, tars dropped into an indexed folder are added to its manifest; with
    --rehash, a dataset's sample indexes get the per-sample digests that partial reads check."""
    import warnings

    from .write.index import index_shards

    with warnings.catch_warnings():  # the summary line reports records passed over
        warnings.simplefilter("ignore", RuntimeWarning)
        results = index_shards(
            shards, overwrite=overwrite, append=append, rehash=rehash, progress=not quiet
        )
    for result in results:
        click.echo(result.summary())


# --- bench -----------------------------------------------------------------------------------


class FormatWorkers(click.ParamType):
    """``tar:4`` -> ``("tar", 4)``: the (format, workers) run that ``--timeline`` draws."""

    name = "FORMAT:WORKERS"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        fmt, sep, workers = value.partition(":")
        if not sep or not workers.strip().isdigit():
            self.fail(f"{value!r} is malformed: use FORMAT:WORKERS, e.g. tar:4", param, ctx)
        return fmt.strip().lower(), int(workers)


@main.command("bench")
@click.option(
    "--workers",
    type=IntList(0, 256),
    default="0,2,4,8",
    show_default=True,
    help="Comma-separated DataLoader worker counts (0: load in the main process).",
)
@click.option(
    "--data",
    type=click.Path(),
    default=None,
    help="Image folder (class-per-folder). Default: the embedded LFW-shaped set in "
    "data/lfw, made and packed on first use.",
)
@click.option(
    "--shards",
    default=None,
    metavar="PATH",
    help="Packed shards (dir, manifest, glob or URL), packed from --data if absent; "
    "{format} is replaced per shard format. Default: <data>-shards-{format}.",
)
@click.option(
    "--formats",
    type=NameList(),
    default=None,
    metavar="LIST",
    help="Comma-separated, from folder,tar,lmdb,memory,loader. Default: folder,tar,lmdb "
    "(folder only when a source folder is known). memory: a reference, the same "
    "bytes held in RAM through the same DataLoader. loader: the tar shards "
    "through ShardLoader (worker processes, --workers of them), decode mode only.",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True)
@click.option(
    "--batches",
    type=click.IntRange(min=1),
    default=None,
    help="Time exactly this many batches per run (after a warm-up of one batch per "
    "worker) instead of --min-samples/--min-seconds.",
)
@click.option(
    "--min-samples",
    type=click.IntRange(min=0),
    default=1024,
    show_default=True,
    help="Time each run until it has at least this many samples...",
)
@click.option(
    "--min-seconds",
    type=click.FloatRange(min=0),
    default=2.0,
    show_default=True,
    help="...and at least this many seconds (or the epoch ends).",
)
@click.option(
    "--max-seconds",
    type=click.FloatRange(min=0),
    default=3.0,
    show_default=True,
    help="Stop timing a run after this long even if short of the minimums, so the "
    "bench's time is known up front; 0: no limit.",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Runs per (format, workers); the table shows mean ± std over them.",
)
@click.option(
    "--cold/--warm",
    default=True,
    show_default=True,
    help="cold: evict the files read from the page cache before every run; warm: read "
    "them all once first.",
)
@click.option(
    "--latency-ms",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Sleep this long on every storage open: per image for folder, per shard "
    "slice a worker opens for shards (an object store's time to first byte).",
)
@click.option(
    "--mode",
    type=click.Choice(["raw", "decode", "augment"]),
    default="decode",
    show_default=True,
    help="raw: bytes only; decode: uint8 CHW tensors; augment: decode + a CPU-heavy "
    "PIL/numpy augmentation.",
)
@click.option(
    "--size",
    type=click.IntRange(min=0),
    default=224,
    show_default=True,
    help="decode mode and loader: resize and centre-crop every image to SIZE x SIZE, as "
    "most ImageNet recipes do, so images of mixed sizes batch; 0: as stored (one size only).",
)
@click.option(
    "--step-ms",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="The training step: the loop sleeps this long per batch (a GPU step); the "
    "table's wait column is then the input-bound share.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write results (one row per format x workers) and machine facts as JSON.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write an error-bar PNG: samples/s against workers, one line per format.",
)
@click.option(
    "--timeline",
    "timeline_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write a PNG of one run over time: each worker's batches, the loop's waits.",
)
@click.option(
    "--timeline-config",
    type=FormatWorkers(),
    default=None,
    help="The run drawn by --timeline. Default: first shard format, most workers.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Shuffle seed.")
@click.option(
    "--shard-size",
    type=Size(),
    default="32MB",
    show_default=True,
    help="Shard size when packing on the fly.",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress lines on stderr.")
def bench_cmd(
    workers,
    data,
    shards,
    formats,
    batch_size,
    batches,
    min_samples,
    min_seconds,
    max_seconds,
    repeats,
    cold,
    latency_ms,
    mode,
    size,
    step_ms,
    json_path,
    plot_path,
    timeline_path,
    timeline_config,
    seed,
    shard_size,
    quiet,
) -> None:
    """Measure folder-of-files vs shards through real DataLoaders across worker counts.

    Prints a table (format x workers: samples/s mean ± std, MB/s, first-batch time, share of
    time waiting for data) and a verdict: best worker count per format, shards vs folder, and
    with --step-ms whether training would be input-bound and what to change.
    """
    from .bench import BenchConfig, format_table, run_bench, verdict

    config = BenchConfig(
        data=data,
        shards=shards,
        formats=formats,
        workers=workers,
        batch_size=batch_size,
        batches=batches,
        min_samples=min_samples,
        min_seconds=min_seconds,
        max_seconds=max_seconds or None,
        repeats=repeats,
        cold=cold,
        latency_ms=latency_ms,
        mode=mode,
        size=size,
        step_ms=step_ms,
        seed=seed,
        shard_size=shard_size,
        timeline_config=timeline_config,
        json_path=json_path,
        plot_path=plot_path,
        timeline_path=timeline_path,
        progress=None if quiet else (lambda msg: click.echo(msg, err=True)),
    )
    import warnings

    def show(message, category, filename, lineno, file=None, line=None):
        click.echo(f"warning: {message}", err=True)  # one line, as it happens, no source line

    with warnings.catch_warnings():
        warnings.showwarning = show
        result = run_bench(config)
    click.echo(format_table(result))
    click.echo("")
    for line in verdict(result):
        click.echo(f"- {line}")
    for note in result.notes:
        click.echo(f"note: {note}")


@main.command("ls")
@click.argument("out", type=click.Path())
@click.option("--offset", type=click.IntRange(min=0), default=0, help="Start at sample N.")
@click.option("--limit", type=click.IntRange(min=0), default=None, help="At most N samples.")
@click.option("--head", type=click.IntRange(min=0), default=None, help="Same as --limit.")
@click.option("--prefix", default=None, help="Only samples whose key starts with this.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per sample, for machines.")
def ls_cmd(out, offset, limit, head, prefix, as_json) -> None:
    """List the samples of OUT in packed order: index, key, label, members and their sizes.

    Streams: each line is printed as its sample is read, so the first comes at once."""
    from .stream.show import list_lines
    from .stream.view import ShardView

    with _warning_lines():
        view = ShardView(out, decode="raw")
        limit = head if limit is None else limit
        for line in list_lines(view, limit, offset=offset, prefix=prefix, as_json=as_json):
            click.echo(line)


@main.command("show")
@click.argument("out", type=click.Path())
@click.argument("key", required=False)
@click.option(
    "--index",
    "position",
    type=click.IntRange(min=0),
    default=None,
    help="The sample at this position (as `ls` prints it) instead of KEY; KEY may also be #N.",
)
@click.option(
    "--key",
    "literal",
    default=None,
    help="The sample with exactly this key, even one that looks like #N (KEY's other reading).",
)
@click.option(
    "--to",
    "folder",
    type=click.Path(file_okay=False),
    default=None,
    help="Write the sample's members into this folder (KEY.EXT each) instead of printing.",
)
def show_cmd(out, key, position, literal, folder) -> None:
    """Print the sample KEY (or #N) of OUT: its fields, JSON pretty-printed, text escaped; or
    write its members. A key that looks like #N is given with --key."""
    from .stream.show import escape, resolve_sample, show_lines, write_members
    from .stream.view import ShardView

    with _warning_lines():
        view = ShardView(out, decode="raw")
        i = resolve_sample(view, key, position, literal)
        if folder is None:
            for line in show_lines(view, i):
                click.echo(line)
            return
        for path in write_members(view, i, folder):
            click.echo(f"wrote {escape(path)}")


@contextlib.contextmanager
def _warning_lines():
    """Warnings as one ``warning:`` line each on stderr, as they happen (no source line): what
    ``ls`` and ``show`` say of a dataset read unchecked or an index read around."""
    import warnings

    def show(message, category, filename, lineno, file=None, line=None):
        click.echo(f"warning: {message}", err=True)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


#: Every SHARDKIT_<COMMAND>_<OPTION> variable -> the command and flag it stands for.
ENV_VARS = assign_envvars(main)

if __name__ == "__main__":  # pragma: no cover
    main()

"""The ``shardkit`` command line: thin click wrappers over the library.

Each command parses options, calls one library function and prints its summary. User errors are
``ShardkitError``s, turned here into one ``error: ...`` line and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import sys

import click

from .errors import ShardkitError


class _Group(click.Group):
    """Turns our exceptions into one line on stderr and the exception's exit code."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except ShardkitError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted: nothing was left under a final name", err=True)
            sys.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="shardkit")
def main() -> None:
    """Pack folders of images into sequential shards and stream them into PyTorch."""


# --- synth -----------------------------------------------------------------------------------


# --- pack ------------------------------------------------------------------------------------


# --- info / verify ---------------------------------------------------------------------------


# --- bench -----------------------------------------------------------------------------------


if __name__ == "__main__":  # pragma: no cover
    main()

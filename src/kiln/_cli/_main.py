"""The ``kiln`` parser and :func:`main`: options every verb takes, the verbs of each command
module, kiln's warnings and errors as the command line shows them."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

from .._base import KilnError, KilnWarning, _config
from . import _bundles, _demo, _inspect, _maintain, _run, _server
from ._common import Failure
from ._render import note

__all__ = ["main", "prepare"]

# the command modules, in the order of their verbs in ``kiln --help``
_COMMANDS = (_run, _inspect, _maintain, _bundles, _demo, _server)


class _Parser(argparse.ArgumentParser):
    """argparse with kiln's error format (``error: <what>`` after the usage line)."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(2, f"error: {message}\n")


def _common(suppress: bool) -> _Parser:
    """``--cache-dir`` / ``--store``, accepted before and after the verb."""
    p = _Parser(add_help=False)
    default = argparse.SUPPRESS if suppress else None
    p.add_argument("--cache-dir", metavar="DIR", default=default,
                   help="directory of the local store (default: KILN_CACHE_DIR or the user cache)")
    p.add_argument("--store", metavar="URL", default=default,
                   help="store URL: a directory, 'local', 'memory', 'null', redis://host:port/db, "
                   "s3://bucket/prefix or another fsspec URL (default: KILN_STORE)")
    return p


def _parser() -> argparse.ArgumentParser:
    from .._base import __version__

    parser = _Parser(
        prog="kiln",
        description="kiln: make XLA compilation a one-time cost for JAX programs.",
        parents=[_common(suppress=False)],
    )
    parser.add_argument("--version", action="version", version=f"kiln {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    verbs.required = True
    common = [_common(suppress=True)]
    for command in _COMMANDS:
        command.register(verbs, common)
    return parser


def prepare(argv: list[str]) -> None:
    """``kiln run``'s prelude in the warm process of ``kiln run --server`` (``kiln_warm``), for
    kiln's command line ``argv`` (see :func:`kiln._cli._run.prepare`)."""
    _run.prepare(_parser().parse_args(argv))


def _show_warning(show: Callable[..., None]) -> Callable[..., None]:
    """``warnings.showwarning`` for the command line: kiln's own warnings as ``kiln: warning:
    <text>`` on stderr (not Python's ``<file>:<line>: StoreWarning: kiln: ...``); any other
    (a script's under ``kiln run``) as Python shows it."""

    def showwarning(message: Warning | str, category: type[Warning], filename: str,
                    lineno: int, file: Any = None, line: str | None = None) -> None:
        if not issubclass(category, KilnWarning):
            show(message, category, filename, lineno, file, line)
            return
        text = str(message)
        note("kiln: warning: " + (text[len("kiln: "):] if text.startswith("kiln: ") else text))

    return showwarning


def main(argv: list[str] | None = None) -> int:
    """Run the ``kiln`` command line with ``argv`` (default ``sys.argv[1:]``); return the status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors
        return e.code if isinstance(e.code, int) else 2
    try:  # (settings restored after: a second main() in this process starts afresh)
        with _config.process_settings(cache_dir=args.cache_dir, store=args.store), \
                warnings.catch_warnings():
            warnings.showwarning = _show_warning(warnings.showwarning)
            return int(args.func(args))
    except Failure as e:
        note(f"error: {e}")
        return e.code
    except BrokenPipeError:
        # the reader went away (``kiln ls | head``): not an error; keep Python's exit-time
        # flush of stdout from complaining
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except (KilnError, OSError) as e:
        note(f"error: {e}")
        return 1

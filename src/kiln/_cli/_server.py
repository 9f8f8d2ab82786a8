"""``kiln server ls`` and ``kiln server stop``: the warm processes of ``kiln run --server``
(:mod:`kiln_server`), listed and stopped without importing jax."""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Iterable
from typing import Any

from ._common import Failure
from ._render import ago, columns, say, show

__all__ = ["register"]


def register(verbs: Any, common: list[argparse.ArgumentParser]) -> None:
    """Add ``server`` (``ls``, ``stop``) to the ``kiln`` parser's ``verbs``."""
    server = verbs.add_parser(
        "server", parents=common, help="list or stop the warm processes of kiln run --server",
        description="The warm processes kiln run --server (KILN_SERVER=1) keeps, one per "
        "program and environment: 'ls' lists them, 'stop' ends them (all, or the keys given; "
        "a run in progress finishes first). Each ends by itself after KILN_SERVER_IDLE "
        "seconds unused (default 900).")
    actions = server.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    ls = actions.add_parser("ls", help="list this user's servers")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=_cmd_ls)
    stop = actions.add_parser("stop", help="stop servers (all unless KEY is given)")
    stop.add_argument("keys", metavar="KEY", nargs="*",
                      help="the start of a server's key, as 'kiln server ls' shows it")
    stop.set_defaults(func=_cmd_stop)


def _servers() -> list[dict[str, Any]]:
    import kiln_server

    try:
        return kiln_server.list_servers()
    except OSError as e:
        raise Failure(f"kiln server: {e}") from e


@dataclasses.dataclass
class _Listed:
    servers: list[dict[str, Any]]

    def as_json(self) -> Any:
        return self.servers

    def as_text(self) -> Iterable[str]:
        if not self.servers:
            yield "no servers"
            return
        now = time.time()
        rows = [["KEY", "PID", "STATE", "PROGRAM", "MODULES", "RUNS", "STARTED", "LAST USED",
                 "ENDS IN"]]
        for s in self.servers:
            left = float(s.get("last_used", now)) + float(s.get("idle", 0)) - now
            rows.append([str(s.get("key", ""))[:12], str(s.get("pid", "")),
                         str(s.get("state", "")), str(s.get("target", "")),
                         str(s.get("preloaded", "")),
                         str(s.get("runs", 0)), ago(now - float(s.get("started", now))),
                         ago(now - float(s.get("last_used", now))),
                         f"{max(int(left), 0)} s idle"])
        yield from columns(rows, [False, True, False, False, True, True, False, False, False])


def _cmd_ls(args: argparse.Namespace) -> int:
    show(_Listed(_servers()), as_json=args.json)
    return 0


def _cmd_stop(args: argparse.Namespace) -> int:
    import kiln_server

    servers = _servers()
    chosen = [s for s in servers
              if not args.keys or any(str(s.get("key", "")).startswith(k) for k in args.keys)]
    if args.keys and not chosen:
        raise Failure(f"kiln server stop: no server's key starts with {', '.join(args.keys)}; "
                      "'kiln server ls' lists them")
    failed = 0
    for s in chosen:
        if kiln_server.stop_server(s):
            say(f"stopped {str(s.get('key', ''))[:12]} (pid {s.get('pid')}, {s.get('target')})")
        else:
            failed += 1
            say(f"still running: {str(s.get('key', ''))[:12]} (pid {s.get('pid')}): a run in "
                "progress; it ends after it")
    if not chosen:
        say("no servers")
    return 1 if failed else 0

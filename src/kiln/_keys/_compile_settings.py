"""What the compiler is given, as key parts: the compile options and XLA's flags.

A warm start must load an executable only where XLA would build the same one, so the key holds
what XLA is actually given, not what the environment says at call time:

- ``compile-options``: the digest of the compile options JAX builds for a program from its
  config (``jax_disable_most_optimizations``, the optimization efforts and levels, ...), with
  XLA's debug options as XLA parsed them (:func:`kiln._base._jax_compat.compile_options_digest`);
- ``xla-flags:XLA_FLAGS``, ``xla-flags:LIBTPU_INIT_ARGS``: the flags as the backend read them
  when it started (a flags file by its contents; :func:`parse_xla_flags`), and
  ``xla-flags:argv``: the ``--xla`` words of ``sys.argv`` (JAX's own cache key holds them).
  Setting ``os.environ["XLA_FLAGS"]`` after the backend started changes nothing XLA does, and
  nothing in the key.

JAX's own cache key (``jax/_src/cache_key.py``) hashes the same compile options, but the text of
``XLA_FLAGS`` at call time (a file by its name). The flags it leaves out because they do not
change the executable (dump settings, the forced CPU device count: the key holds the devices)
are left out here too.
"""

from __future__ import annotations

import functools
from typing import Any

from .._base import _jax_compat

__all__ = ["compile_settings_parts", "parse_xla_flags"]

_WHITE = " \t\r\n"
_NAME = frozenset("-_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")


def parse_xla_flags(text: str) -> list[str]:
    """The flags XLA reads from ``text`` (the rule of XLA's ``parse_flags_from_env.cc``), in
    order (a later one wins): white-space separated ``--name`` or ``--name=value`` words; a value
    in single or double quotes may hold white space (a backslash escapes the next character in
    double quotes) and is given without its quotes; reading stops at the first word that does
    not start with ``-`` (XLA ignores the rest).

    >>> parse_xla_flags(" --a=1 --b='x y'  stop --c")
    ['--a=1', '--b=x y']
    """
    out = []
    n, i = len(text), 0
    while i < n and text[i] in _WHITE:
        i += 1
    while i < n and text[i] == "-":
        start = i
        while i < n and text[i] in _NAME:
            i += 1
        if i + 1 < n and text[i] == "=" and text[i + 1] in "'\"":
            name, quote, i = text[start:i + 1], text[i + 1], i + 2
            value = []
            while i < n and text[i] != quote:
                if quote == '"' and text[i] == "\\" and i + 1 < n:
                    i += 1
                value.append(text[i])
                i += 1
            i += 1  # the closing quote
            out.append(name + "".join(value))
        else:
            while i < n and text[i] not in _WHITE:
                i += 1
            out.append(text[start:i])
        while i < n and text[i] in _WHITE:
            i += 1
    return out


@functools.lru_cache(maxsize=1)
def _flag_parts() -> tuple[tuple[str, str], ...]:
    left_out = _jax_compat.flags_left_out_of_jax_key()
    parts = []
    for source, text in _jax_compat.flags_at_backend_start().items():
        words = parse_xla_flags(text) if source != "argv" else text.split()
        kept = [w for w in words if w.split("=", 1)[0] not in left_out]
        parts.append((f"xla-flags:{source}", " ".join(kept)))
    return tuple(parts)


def compile_settings_parts(backend: Any) -> list[tuple[str, str]]:
    """The ``compile-options`` and ``xla-flags:*`` key parts (see the module docstring) for a
    program on ``backend`` (a started backend: its flags are known then)."""
    return [("compile-options", _jax_compat.compile_options_digest(backend)), *_flag_parts()]

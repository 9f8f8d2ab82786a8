"""kiln's configuration: one frozen :class:`Config`, read lazily.

Precedence for every field, highest first: :func:`config_context` (a context manager), then
:func:`configure` (process-wide), then the ``KILN_<FIELD>`` environment variable, then the
default. The environment is read on every miss (never on the hot path), so a test or a CLI may
change ``os.environ`` at any time. (jax's config states; not equinox's import-time read.)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import re
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import platformdirs

from ._errors import ConfigError

__all__ = ["Config", "configure", "config_context", "get_config", "parse_size"]

_GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Config:
    """kiln's settings. Each field ``f`` is also read from the ``KILN_<F>`` environment variable.

    Attributes:
        cache_dir: directory of the default local store. Default: the user cache directory
            (``platformdirs.user_cache_dir("kiln")``), created private to the user (0700).
        store: store URL: ``None`` or ``"local"`` (the local directory store at ``cache_dir``),
            a directory path or ``file://`` URL, ``"memory"`` (this process only), ``"null"``
            (persistence off), or a remote store shared by many processes and hosts:
            ``redis://host:port/db`` (also ``rediss://``, ``unix://``; needs the ``redis``
            extra) or any fsspec URL (``s3://bucket/prefix``, ``gs://...``, ``memory://...``;
            needs the fsspec implementation, e.g. the ``s3`` extra). A remote store sits behind
            the local one (see ``remote_mode``).
        remote_mode: how a remote ``store`` is used: ``"layered"`` (default: read the local
            store, then the remote; a remote hit is copied into the local store; writes go to
            both), ``"remote-only"`` (no local store) or ``"read-only"`` (layered, but never
            writes to the remote: for workers that must not publish entries).
        remote_timeout: seconds a remote store may take to answer the first contact of a
            process (connecting: at most 1 s) before it is skipped for the rest of the
            process; once it has answered, five times that per answer (a large entry streaming
            in is not cut off). Default 0.8: a hung or dead store costs a process under a
            second, once (Redis answers a read in milliseconds, S3 in tens).
        lease_seconds: single-flight: a process compiling a key holds a lease on it for this
            many seconds, renewed while it compiles; other processes wait for its entry, and
            take over if the lease runs out (its holder died). Default 30.
        lease_wait: seconds a process waits for another's compile of the same key before
            compiling it itself anyway. Default 900.
        max_size: size cap of the local store in bytes (``KILN_MAX_SIZE`` accepts ``4GiB``,
            ``500MB``, ...). Least recently used entries are evicted above it. Default 4 GiB.
        explain: log why each miss happened at WARNING (else DEBUG).
        verify: audit mode: every warm hit is also traced and lowered, and a mismatch with the
            stored module raises :class:`kiln.VerifyError`.
        strict: a store or decode failure raises :class:`kiln.StoreError` instead of a warning
            followed by a recompile.
        signing_key: if set, entries carry an HMAC-SHA256 under this key instead of a plain
            SHA-256 digest, and entries not signed with it are refused.
        signing_keys_old: earlier signing keys still accepted for reading during a key
            rotation (``KILN_SIGNING_KEYS_OLD``: comma-separated); entries are always written
            with ``signing_key``.
        progress: show a progress line on stderr while a compile runs longer than ~1.5 s
            (``None``: only when stderr is a terminal).
        tier_up: under :func:`kiln.jit`, a program that calls :func:`kiln.noinline` functions
            first runs with those calls as host callbacks, while the fully inlined program
            compiles in a background thread and is then swapped in and stored (default on).
        pickle_max_size: bytes of stored entries a kiln function pickled by value carries
            with it (``KILN_PICKLE_MAX_SIZE`` accepts ``256MiB``, ...); 0 carries none. Entries
            past the cap are left out (the receiving process compiles them). Default 256 MiB.
        jax_cache: route JAX's own persistent compilation cache into the store
            (:func:`kiln.enable_jax_cache`) in any process that creates a :func:`kiln.jit`
            function, so library-internal ``jax.jit`` programs and eager operations persist
            too; ``KILN_JAX_CACHE=0`` turns that off. Never overrides a
            ``jax_compilation_cache_dir`` the user set. Default on.
        replace_jit: the jax.jit swap (:func:`kiln.replace_jax_jit`) from ``import kiln`` on:
            every ``jax.jit`` made afterwards outside JAX itself (the program's code, the
            libraries it imports) is a :func:`kiln.jit`. Default off in a plain ``python``
            process; ``kiln run`` and ``pytest --kiln`` turn it on unless it is set to 0
            (``KILN_REPLACE_JIT=0``) or ``--no-jit`` / ``--kiln-no-jit`` is given.
        eager: under the ``jax.jit`` swap, JAX's own eager work (``jnp`` functions, primitives
            applied outside a trace) is stored and loaded with no trace or lowering too
            (``KILN_EAGER=0`` leaves it to JAX; see ``docs/how-it-works.md``). Default on.
        jit_exclude: what the swap leaves to ``jax.jit`` (``KILN_JIT_EXCLUDE``: comma-separated):
            a module prefix (``mylib``: functions of ``mylib`` and ``mylib.*``, and
            ``jax.jit`` calls made there) or ``module:qualname`` (that function, and the
            methods of a class named so). Default none.
        guard_exclude: inputs left out of every entry's guard (``KILN_GUARD_EXCLUDE``:
            comma-separated), at the user's own risk: a warm start no longer verifies when
            they change, so a change in them that shapes a trace gives a stale result. A kind
            (``files``, ``listings``, ``env``, ``argv``, ``cwd``, ``distributions``) or a glob
            pattern of file paths and variable names (``/data/logs/*``, ``MYAPP_RUN_*``).
            Default none: the guard is never off (``docs/never-stale.md``, "The guard").
    """

    cache_dir: Path
    store: str | None = None
    remote_mode: str = "layered"
    remote_timeout: float = 0.8
    lease_seconds: float = 30.0
    lease_wait: float = 900.0
    max_size: int = 4 * _GIB
    explain: bool = False
    verify: bool = False
    strict: bool = False
    signing_key: str | None = None
    signing_keys_old: tuple[str, ...] = ()
    progress: bool | None = None
    tier_up: bool = True
    pickle_max_size: int = 256 * 1024**2
    jax_cache: bool = True
    replace_jit: bool = False
    eager: bool = True
    jit_exclude: tuple[str, ...] = ()
    guard_exclude: tuple[str, ...] = ()


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
_overrides: dict[str, Any] = {}
_NO_CONTEXT: Mapping[str, Any] = types.MappingProxyType({})
_context: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "kiln_config", default=_NO_CONTEXT
)

_REMOTE_MODES = ("layered", "remote-only", "read-only")
_SCHEME_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}


def parse_size(value: str | int, *, name: str = "max_size") -> int:
    """Parse a size in bytes: an int, or a string such as ``"4GiB"``, ``"500MB"``, ``"10k"``.

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary units (KiB, MiB, GiB, TiB) powers
    of 1024.

    Raises:
        ConfigError: the value is not a non-negative size; the message names ``name``.

    >>> parse_size("4GiB")
    4294967296
    >>> parse_size("1.5MB")
    1500000
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a size in bytes, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name} must be >= 0 bytes, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    if m is None:
        raise ConfigError(
            f"{name} must be a size such as '4GiB', '500MB' or '1048576', got {value!r}"
        )
    number, unit = m.group(1), (m.group(2) or "").lower()
    binary = "i" in unit
    letter = unit[:1] if unit[:1] != "b" else ""
    scale = 1024 ** " kmgt".index(letter) if binary and letter else _UNITS[letter]
    return int(float(number) * scale)


def _parse_bool(name: str, raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(
        f"KILN_{name.upper()} must be 1 or 0 (or true/false, yes/no, on/off), got {raw!r}"
    )


def _coerce(name: str, value: Any, *, from_env: bool) -> Any:
    where = f"KILN_{name.upper()}" if from_env else name  # (how a message names the setting)
    if name == "cache_dir":
        if value in (None, ""):
            return _default_cache_dir()  # KILN_CACHE_DIR="" means the default, not "."
        try:
            return Path(value).expanduser()
        except RuntimeError as e:  # "~nosuchuser/x": pathlib cannot find that home directory
            raise ConfigError(
                f"{where}={str(value)!r}: {e}; give an absolute path or one under your own "
                "home directory (~/...)"
            ) from None
    if name in ("max_size", "pickle_max_size"):
        return parse_size(value, name=where)
    if name == "progress" and value is None:
        return None
    if name in ("explain", "verify", "strict", "tier_up", "jax_cache", "replace_jit", "eager",
                "progress"):
        return _parse_bool(name, value) if from_env else bool(value)
    if name == "store":
        if value in (None, ""):
            return None
        text = str(value)
        if "://" in text and not _SCHEME_RE.match(text):
            raise ConfigError(
                f"{where}={text!r} is not a store URL; use 'local', 'memory', 'null', a "
                "directory path, or a URL such as redis://host:6379/0 or s3://bucket/prefix"
            )
        scheme = text.partition("://")[0].lower() if "://" in text else ""
        problem = _url_problem(scheme, text)
        if problem is not None:
            raise ConfigError(f"{where}={_redacted(text)!r}: {problem}")
        if scheme and not _known_scheme(scheme):
            raise ConfigError(
                f"{where}={text!r}: unknown store scheme {scheme!r}; use 'local', 'memory', "
                "'null', a directory path or file:// URL, redis://host:port/db, or a URL fsspec "
                "knows (s3://bucket/prefix, gs://..., memory://...)"
            )
        return text
    if name == "remote_mode":
        text = str(value).strip().lower()
        if text not in _REMOTE_MODES:
            raise ConfigError(f"{where} must be one of {', '.join(_REMOTE_MODES)}, got {value!r}")
        return text
    if name in ("remote_timeout", "lease_seconds", "lease_wait"):
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a number of seconds, got {value!r}") from None
        if not 0 < seconds <= _MAX_SECONDS:
            raise ConfigError(f"{where} must be a number of seconds above 0 and at most "
                              f"{_MAX_SECONDS:g} (a year), got {value!r}")
        return seconds
    if name in ("jit_exclude", "signing_keys_old", "guard_exclude"):
        if value in (None, ""):
            return ()
        items = value.split(",") if isinstance(value, str) else list(value)
        return tuple(str(k).strip() for k in items if str(k).strip())
    if name == "signing_key":
        return None if value in (None, "") else str(value)
    raise AssertionError(name)  # pragma: no cover


_MAX_SECONDS = 365 * 86400.0  # (thread waits and Redis expiries overflow far above this)
_OBJECT_STORES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl")


def _url_problem(scheme: str, text: str) -> str | None:
    """What is wrong with a Redis or object-store URL that its library would only find (or
    silently default) later, or None."""
    from urllib.parse import urlsplit

    if scheme in ("redis", "rediss"):
        parts = urlsplit(text)
        try:
            port = parts.port
        except ValueError:
            return "the port must be a number from 1 to 65535 (redis://host:6379/0)"
        if not parts.hostname:
            return "the URL names no host; use redis://host:port/db"
        if port == 0:
            return "the port must be a number from 1 to 65535 (redis://host:6379/0)"
        db = parts.path.strip("/")
        if db and not db.isdigit():
            return f"the database must be a number (redis://host:port/0), got {db!r}"
    elif scheme in _OBJECT_STORES and not urlsplit(text).netloc:
        return f"the URL names no bucket; use {scheme}://bucket/prefix"
    return None


def _redacted(url: str) -> str:
    """``url`` without a password."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@", 1)
    return url


def _known_scheme(scheme: str) -> bool:
    """Whether kiln.stores can open a ``scheme://`` store URL: file, Redis, or a protocol fsspec
    knows (without fsspec installed, any: opening the store says what to install)."""
    if scheme in ("file", "redis", "rediss", "unix"):
        return True
    try:
        from fsspec.registry import known_implementations, registry
    except ImportError:
        return True
    return scheme in known_implementations or scheme in registry


def _default_cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir("kiln", appauthor=False))


# the environment variables a configuration is made from (the default cache directory follows
# XDG_CACHE_HOME and HOME: platformdirs)
_ENV_NAMES = (*(f"KILN_{name.upper()}" for name in _FIELDS), "XDG_CACHE_HOME", "HOME")
# (environment, process-wide overrides, this context's overrides) -> the Config made from them:
# get_config runs several times per JAX-cache lookup through the kiln:// route (0.2 ms each)
_memo: tuple[tuple[str | None, ...], dict[str, Any], Mapping[str, Any], Config] | None = None


# os.environ's own dict (bytes names on POSIX): 18 lookups there cost ~0.6 us, through the
# os.environ mapping (a name encoded, a value decoded each) ~11 us, on every JAX-cache read
_ENV_DATA: Any = getattr(os.environ, "_data", None)
_ENV_KEYS = tuple(os.environ.encodekey(n) for n in _ENV_NAMES) if _ENV_DATA is not None else ()


def _env_now() -> tuple[Any, ...]:
    if _ENV_DATA is not None:
        return tuple(map(_ENV_DATA.get, _ENV_KEYS))
    return tuple(map(os.environ.get, _ENV_NAMES))


def get_config() -> Config:
    """The configuration in force now (context manager > configure() > env var > default)."""
    global _memo
    env = _env_now()
    context = _context.get()
    memo = _memo
    if memo is not None and memo[0] == env and memo[2] is context and memo[1] == _overrides:
        return memo[3]
    config = _make_config()
    _memo = (env, dict(_overrides), context, config)
    return config


def _make_config() -> Config:
    values: dict[str, Any] = {}
    for name in _FIELDS:
        env = os.environ.get(f"KILN_{name.upper()}")
        if env is not None:
            values[name] = _coerce(name, env, from_env=True)
    values.update(_overrides)
    values.update(_context.get())
    values.setdefault("cache_dir", _default_cache_dir())
    if values.get("signing_keys_old") and not values.get("signing_key"):
        raise ConfigError("KILN_SIGNING_KEYS_OLD (signing_keys_old) is set but KILN_SIGNING_KEY "
                          "(signing_key) is not: old keys are only read beside a current key; "
                          "set KILN_SIGNING_KEY to the key entries are signed with now")
    return Config(**values)


def _validate(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for name, value in kwargs.items():
        if name not in _FIELDS:
            raise ConfigError(
                f"unknown kiln setting {name!r}; known settings: {', '.join(sorted(_FIELDS))}"
            )
        out[name] = _coerce(name, value, from_env=False)
    return out


def configure(**kwargs: Any) -> None:
    """Set kiln settings for this process (see :class:`Config` for the fields).

    Passing ``None`` for a field removes the process-wide override (the environment variable or
    default applies again).

    Raises:
        ConfigError: an unknown field or an invalid value.

    Example:
        >>> import kiln
        >>> kiln.configure(max_size="1GiB")
        >>> kiln.configure(max_size=None)
    """
    for name, value in kwargs.items():
        if value is None and name in _FIELDS:
            _overrides.pop(name, None)
        else:
            _overrides.update(_validate({name: value}))


@contextlib.contextmanager
def process_settings(**kwargs: Any) -> Iterator[None]:
    """:func:`configure` for the duration of a block (all threads), then restore the previous
    process-wide settings. ``None`` values are skipped. Used by the CLI."""
    settings = {k: v for k, v in kwargs.items() if v is not None}
    saved = dict(_overrides)
    configure(**settings)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


@contextlib.contextmanager
def config_context(**kwargs: Any) -> Iterator[Config]:
    """Override kiln settings inside a ``with`` block (this thread / task only).

    Example:
        >>> import kiln
        >>> with kiln.config_context(store="memory") as cfg:
        ...     cfg.store
        'memory'
    """
    token = _context.set({**_context.get(), **_validate(kwargs)})
    try:
        yield get_config()
    finally:
        _context.reset(token)

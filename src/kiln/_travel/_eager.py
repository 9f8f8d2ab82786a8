"""JAX's eager work from the store: its own jitted functions and primitives applied outside a
trace, loaded with no trace, no lowering and no compile.

Outside any ``jax.jit``, ``jnp.multiply(x, y)``, ``jax.random.normal(key, (3,))`` and
``lax.sin(x)`` each run a small program JAX traces, lowers and compiles on its first call with
a signature in every process (JAX's persistent cache, the ``kiln://`` route, skips only the
compile). With the ``jax.jit`` swap on (``kiln run``, ``pytest --kiln``, ``KILN_REPLACE_JIT=1``,
:func:`kiln.replace_jax_jit`; ``KILN_EAGER=0`` leaves eager work to JAX), such a call is keyed
and its executable stored on the first run; later runs load it (the C++ fast path then serves
further calls as it does under JAX).

**What is keyed, and how.** JAX's code is keyed by its distribution (``jax`` and ``jaxlib``,
version and the digest of the installed files their ``RECORD`` lists), not walked; then the
function's identity (module, qualified name, file and line of its code), its closure and
defaults, its static arguments, the pytree structure and avals of its dynamic arguments, each
array argument's sharding and whether it is committed, the default device, the ``jax.jit``
options it was made with, every setting a trace reads (JAX's trace context, x64, the PRNG
implementation, matmul precision, ...), the compile options and XLA flags, the backend and
machine, and the lowering rules registered outside JAX (a library's or the program's
``mlir.register_lowering``, by module, name and code). A primitive is keyed by its name, its
parameters and where its lowering rules come from.

**What goes to JAX's path, and why** (``KILN_EXPLAIN=1`` says it once per function and reason;
``kiln.stats().eager_left`` counts the calls):

- a function whose code is not in JAX's installed files (a user's function that
  ``functools.wraps`` copied a JAX name onto), or a JAX installed without a ``RECORD`` of its
  files (an editable install: its files could change unseen);
- a static argument, closure cell, default or primitive parameter that is not plain data (a
  callable, a jaxpr, an object with methods, a custom pytree node): those carry user code,
  which :func:`kiln.jit` keys and JAX's own jits do not (the call is JAX's, traced as before);
- a primitive lowered by a rule from outside JAX (a user's or a library's primitive);
- a function whose code reads a name of a JAX module that the program has set since eager
  work was turned on (a monkeypatched ``lax.sin`` read by ``jnp.sinc``; see
  the JAX gate's ``_patches`` for what this does not see);
- a mesh in context, explicit shardings or devices given to the jit, ``jax_debug_nans`` /
  ``jax_debug_infs`` (JAX re-runs the operation to name it), a ``jax.distributed`` job, a
  program with effects, host callbacks or constants passed as arguments.

A corrupt, foreign or tampered entry is never loaded: logged once (``kiln`` logger, WARNING:
this runs inside JAX's dispatch, where a warning made an error would fail the user's call), then
the operation compiles as JAX's would and its entry is replaced.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import logging
import os
import threading
import time
import types
from typing import Any

import jax
import jaxlib
import numpy as np

from .._base import (
    FORMAT_VERSION,
    StoreError,
    UnverifiableEntry,
    _jax_compat,
    _stats,
    get_config,
    short_key,
)
from .._keys import environment_parts, library_version, machine, make_key
from ..stores import open_store
from ._entries import decode_kind, read_blob, write_entry

__all__ = ["disable_eager", "enable_eager", "is_enabled"]

logger = logging.getLogger("kiln")

_KIND = "eager"
_JAX_DIR = os.path.dirname(jax.__file__) + os.sep
_JAXLIB_DIR = os.path.dirname(jaxlib.__file__) + os.sep
_MEMO_SIZE = 4096
# config a trace reads beyond JAX's trace context (keyed by environment_parts; the memo of
# those parts is per value of these too)
_EXTRA_CONFIG = ("jax_default_prng_impl", "jax_enable_custom_prng", "jax_legacy_prng_key",
                 "jax_default_dtype_bits", "jax_dynamic_shapes", "jax_enable_checks",
                 "jax_threefry_partitionable", "jax_default_matmul_precision")

_lock = threading.Lock()
_memo: collections.OrderedDict[str, Any] = collections.OrderedDict()  # key -> StoredCall
_unusable: set[str] = set()  # keys whose stored entry was bad (replaced when written)
_said: set[tuple[str, str]] = set()
_env: dict[Any, list[tuple[str, str]]] = {}
_overrides_text: list[Any] = [None, ""]  # [the scan it was made from, its text]


class _NotPlain(Exception):
    """A value that is not plain data (it may carry code): the call is JAX's."""


def _plain(v: Any, depth: int = 0) -> str:
    """Canonical text of plain data (numbers, strings, dtypes, enums, shapes, shardings, and
    tuples / lists / dicts of them); raises :class:`_NotPlain` for anything else."""
    if depth > 20:
        raise _NotPlain("nested too deeply")
    if v is None or isinstance(v, bool | int | str | bytes):
        return f"{type(v).__name__}:{v!r}"
    if isinstance(v, float):
        return f"float:{v.hex()}"
    if isinstance(v, complex):
        return f"complex:{v.real.hex()},{v.imag.hex()}"
    if isinstance(v, np.dtype):
        return f"dtype:{v.str}:{v.name}"
    if isinstance(v, np.generic):
        return f"np:{v.dtype.str}:{v.tobytes().hex()}"
    if isinstance(v, type) and (v.__module__ in ("builtins", "numpy") or _is_jax_name(
            v.__module__)):
        return f"type:{v.__module__}.{v.__qualname__}"
    if isinstance(v, enum.Enum) and _is_jax_name(type(v).__module__):
        return f"enum:{type(v).__module__}.{type(v).__qualname__}.{v.name}"
    if isinstance(v, jax.sharding.Sharding):
        return f"sharding:{_jax_compat.sharding_text(v)}"
    if type(v) in (tuple, list):
        return f"{type(v).__name__}({','.join(_plain(x, depth + 1) for x in v)})"
    if isinstance(v, tuple) and hasattr(v, "_fields") and _is_jax_name(type(v).__module__):
        # JAX's own named tuples (GatherDimensionNumbers, ConvDimensionNumbers, ...)
        inner = ",".join(_plain(x, depth + 1) for x in v)
        return f"{type(v).__module__}.{type(v).__qualname__}({inner})"
    if type(v) is dict:
        items = sorted((_plain(k, depth + 1), _plain(x, depth + 1)) for k, x in v.items())
        return f"dict({items})"
    if type(v) is frozenset:
        return f"frozenset({sorted(_plain(x, depth + 1) for x in v)})"
    raise _NotPlain(f"{type(v).__module__}.{type(v).__qualname__}")


def _is_jax_name(module: str) -> bool:
    return module == "jax" or module.startswith(("jax.", "jaxlib."))


def _in_jax_files(code: types.CodeType) -> bool:
    return code.co_filename.startswith((_JAX_DIR, _JAXLIB_DIR))


def _foreign_code(obj: Any, depth: int = 0) -> list[Any]:
    """The functions from outside JAX's files that a lowering rule is or holds (a
    ``functools.partial``'s function and arguments, a closure's cells), to depth 4."""
    if depth > 4:
        return []
    if isinstance(obj, functools.partial):
        found = _foreign_code(obj.func, depth + 1)
        for x in (*obj.args, *(obj.keywords or {}).values()):
            found += _foreign_code(x, depth + 1)
        return found
    if isinstance(obj, types.MethodType):
        return _foreign_code(obj.__func__, depth + 1)
    if isinstance(obj, types.FunctionType):
        if not _in_jax_files(obj.__code__):
            return [obj]
        found = []
        for cell in obj.__closure__ or ():
            try:
                found += _foreign_code(cell.cell_contents, depth + 1)
            except ValueError:  # an empty cell
                continue
        return found
    if callable(obj) and not isinstance(obj, type) and not _is_jax_name(
            str(getattr(type(obj), "__module__", ""))):
        return [obj]  # (a callable object from outside JAX)
    return []


def _code_text(fun: Any) -> str:
    """Module, name, and a digest of the code and the file of a function from outside JAX."""
    code = getattr(fun, "__code__", None)
    if code is None:
        return f"{type(fun).__module__}.{type(fun).__qualname__}"

    def consts(c: types.CodeType) -> list[str]:
        return [repr(x) if not isinstance(x, types.CodeType) else
                f"code({c.co_name}:{x.co_code.hex()}:{consts(x)})" for x in c.co_consts]

    digest = make_key([("code", code.co_code.hex()), ("consts", repr(consts(code))),
                       ("names", repr(code.co_names)), ("file", _file_digest(code.co_filename))])
    return f"{fun.__module__}.{fun.__qualname__}:{digest[:16]}"


@functools.lru_cache(maxsize=256)
def _file_digest_at(path: str, mtime_ns: int, size: int) -> str:
    with open(path, "rb") as f:
        return make_key([("bytes", f.read().hex())])[:16]


def _file_digest(path: str) -> str:
    """A digest of a source file's bytes (its helpers edited change it), or its name."""
    try:
        st = os.stat(path)
        return _file_digest_at(path, st.st_mtime_ns, st.st_size)
    except OSError:
        return path


def _function_parts(fun: Any, platform: str) -> list[tuple[str, str]]:
    """Key parts naming an eager function: JAX's own function (or a primitive applied), its
    closure and defaults. Raises :class:`_NotPlain` for one that is not JAX's plain code."""
    prim = _jax_compat.primitive_of(fun)
    if prim is not None:
        primitive, params = prim
        rules = _jax_compat.lowering_rules(primitive, platform)
        if not rules or any(_foreign_code(r) for r in rules):
            raise _NotPlain(f"primitive {primitive.name} is lowered by a rule from outside JAX")
        if not _is_jax_name(type(primitive).__module__):
            raise _NotPlain(f"primitive {primitive.name} is of class {type(primitive)}")
        return [("primitive", primitive.name), ("params", _plain(params))]
    parts = []
    while isinstance(fun, functools.partial):
        parts.append(("partial", _plain((fun.args, fun.keywords))))
        fun = fun.func
    if type(fun) is not types.FunctionType or not _in_jax_files(fun.__code__):
        raise _NotPlain("its code is not in JAX's installed files")
    code = fun.__code__
    parts.append(("function", f"{fun.__module__}.{fun.__qualname__}@"
                  f"{code.co_filename[len(_JAX_DIR):]}:{code.co_firstlineno}"))
    if fun.__closure__:
        parts.append(("closure", _plain([c.cell_contents for c in fun.__closure__])))
    if fun.__defaults__ or fun.__kwdefaults__:
        parts.append(("defaults", _plain((fun.__defaults__, fun.__kwdefaults__))))
    return parts


def _jit_parts(ji: Any) -> list[tuple[str, str]]:
    """The jit's options (explicit shardings, layouts, a device or backend: JAX's path)."""
    unspecified = all(type(s).__name__ == "UnspecifiedValue"
                      for s in (*ji.in_shardings_leaves, *ji.out_shardings_leaves))
    if not unspecified or any(x is not None for x in (*ji.in_layouts_leaves,
                                                      *ji.out_layouts_leaves)):
        raise _NotPlain("the jit was given shardings or layouts")
    if ji.device is not None or ji.backend is not None:
        raise _NotPlain("the jit was given a device or backend")
    return [("jit", _plain((ji.static_argnums, ji.static_argnames, ji.donate_argnums,
                            ji.donate_argnames, bool(ji.keep_unused), repr(ji.inline),
                            ji.compiler_options_kvs)))]


def _arg_parts(facts: Any) -> list[tuple[str, str]]:
    sig = facts.signature
    trees = []
    for t in sig.dynamic_arg_treedefs:
        text = str(t)
        if "CustomNode" in text or "namedtuple" in text.lower():
            raise _NotPlain("an argument is a custom pytree")
        trees.append(text)
    placements = []
    for x in facts.dynargs:
        sharding = getattr(x, "sharding", None)
        if sharding is None:
            placements.append("host")
        else:
            placements.append(f"{bool(getattr(x, '_committed', True))}:"
                              f"{_jax_compat.sharding_text(sharding)}")
    return [
        ("statics", _plain((list(sig.static_args), list(sig.static_arg_names),
                            list(sig.dynamic_arg_names)))),
        ("trees", repr(trees)),
        ("avals", repr([repr(a) for a in facts.avals])),
        ("placement", repr(placements)),
        ("default-device", _jax_compat.default_device_text()),
    ]


def _environment() -> list[tuple[str, str]]:
    """Versions, JAX's files, backend, machine, trace settings, compile options and lowering
    rules from outside JAX: memoized per trace context."""
    token = (_jax_compat.trace_context_token(),
             *(getattr(jax.config, name, None) for name in _EXTRA_CONFIG))
    found = _jax_compat.lowering_overrides(_foreign_code)
    if _overrides_text[0] is not found:  # (scanned again: a rule table changed)
        _overrides_text[:] = [found, repr([(p, n, [_code_text(f) for f in fs])
                                           for p, n, fs in found])]
    parts = _env.get(token)
    if parts is None:
        parts = [("format", str(FORMAT_VERSION)), ("kind", _KIND),
                 ("jax-files", library_version("jax")),
                 ("jaxlib-files", library_version("jaxlib")), *environment_parts()]
        _env[token] = parts
    return [*parts, ("lowering-overrides", _overrides_text[1])]


def _explain_once(name: str, reason: str) -> None:
    _stats.bump(eager_left=1)
    if (name, reason) in _said:
        return
    _said.add((name, reason))
    try:
        explain_on = get_config().explain
    except Exception:  # noqa: BLE001
        explain_on = False
    message = f"kiln: eager {name}: left to JAX (traced and lowered as before): {reason}"
    logger.log(logging.WARNING if explain_on else logging.DEBUG, message)


def _name(fun: Any) -> str:
    prim = _jax_compat.primitive_of(fun)
    if prim is not None:
        return f"primitive {prim[0].name}"
    base = fun
    while hasattr(base, "func"):
        base = base.func
    return f"{getattr(base, '__module__', '?')}.{getattr(base, '__qualname__', '?')}"


@dataclasses.dataclass(slots=True, eq=False)
class _Token:
    """A cold eager call to record: its key, name and signature (its avals)."""

    key: str
    name: str
    signature: str


def _why_not(fun: Any, ji: Any) -> str | None:
    """Why this process leaves eager calls of ``fun`` to JAX, or None."""
    if jax.config.jax_debug_nans or jax.config.jax_debug_infs:  # type: ignore[attr-defined]
        return "jax_debug_nans / jax_debug_infs is on (JAX re-runs the operation to name it)"
    if jax.process_count() > 1:
        return "a jax.distributed job (each process compiles its own eager work)"
    if not _jax_compat.ctx_mesh_empty(ji):
        return "a mesh is in context"
    base = fun
    while isinstance(base, functools.partial):
        base = base.func
    if isinstance(base, types.FunctionType):
        _jax_compat.snapshot_jax_modules()  # (modules loaded since: as they are now)
        patched = _jax_compat.patched_reads(base)
        if patched is not None:
            return f"the program set {patched}, which it reads (JAX's code is not its files')"
    if "record:" not in library_version("jax"):
        return "JAX is installed without a RECORD of its files (an editable install)"
    return None


def _before(fun: Any, ji: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The stored executable for this eager call, a token to record its compile, or None
    (JAX's path); its seconds count in ``kiln.stats().eager_seconds``."""
    start = time.perf_counter()
    try:
        return _lookup(fun, ji, args, kwargs)
    finally:
        _stats.bump(eager_seconds=time.perf_counter() - start)


def _lookup(fun: Any, ji: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        reason = _why_not(fun, ji)
        if reason is not None:
            _explain_once(_name(fun), reason)
            return None
        facts = _jax_compat.call_facts(fun, ji, args, kwargs)
        platform = jax.devices()[0].platform
        parts = [*_environment(), *_function_parts(fun, platform), *_jit_parts(ji),
                 *_arg_parts(facts)]
    except _NotPlain as e:
        _explain_once(_name(fun), str(e))
        return None
    except Exception as e:  # noqa: BLE001 - JAX raises its own error on its path
        logger.debug("kiln: eager %s: not keyed: %s: %s", _name(fun), type(e).__name__, e)
        return None
    key = make_key(parts)
    with _lock:
        stored = _memo.get(key)
        if stored is not None:
            _memo.move_to_end(key)
    if stored is None:
        stored = _load(key, _name(fun))
    if stored is not None:
        _jax_compat.remember_facts(facts)
        return stored
    _stats.bump(eager_misses=1)
    return _Token(key, _name(fun), _jax_compat.avals_text_of(facts.avals))


def _load(key: str, name: str) -> Any:
    cfg = get_config()
    store = open_store(cfg)
    blob = read_blob(store, key, strict=False, unusable=_unusable)
    if blob is None:
        return None
    try:
        stored = _jax_compat.load_eager(decode_kind(blob, key, _KIND, cfg).sections)
    except Exception as e:  # noqa: BLE001 - never the user's error: JAX compiles it again
        if not isinstance(e, UnverifiableEntry):
            _unusable.add(key)
        _stats.bump(bad_entries=1)
        logger.warning("kiln: eager entry %s (%s) in %r is unusable (%s: %s); JAX compiles it "
                       "again and kiln replaces it", short_key(key), name, store.url,
                       type(e).__name__, e)
        return None
    _remember(key, stored)
    _stats.bump(eager_hits=1)  # (its seconds count in eager_seconds: _before)
    return stored


def _remember(key: str, stored: Any) -> None:
    with _lock:
        _memo[key] = stored
        if len(_memo) > _MEMO_SIZE:
            _memo.popitem(last=False)


def _record(token: Any, p: Any, compiled: Any) -> None:
    """Store what XLA compiled for a cold eager call (before it runs)."""
    try:
        sections, stored = _jax_compat.serialize_eager(p, compiled)
    except _jax_compat.Unserializable as e:
        _explain_once(token.name, f"not stored: {e}")
        return
    except Exception as e:  # noqa: BLE001
        logger.debug("kiln: eager %s not stored: %s: %s", token.name, type(e).__name__, e)
        return
    _remember(token.key, stored)
    cfg = get_config()
    header: dict[str, Any] = {
        "kind": _KIND, "key": token.key, "function": f"eager:{token.name}",
        "signature": token.signature, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "machine": machine(), "created": time.time(),
    }
    try:
        store = open_store(cfg)
    except (OSError, StoreError):
        return
    if write_entry(store, token.key, header, sections, cfg, strict=False, unusable=_unusable):
        _stats.bump(eager_writes=1)


def enable_eager() -> bool:
    """Load JAX's eager work from the store from now on (see the module docstring). Returns
    True if this call turned it on; False if it was on, or ``KILN_EAGER=0``."""
    try:
        if not get_config().eager:
            return False
    except Exception:  # noqa: BLE001 - a bad KILN_* setting is reported where it is used
        return False
    if _jax_compat.eager_installed():
        return False
    _jax_compat.snapshot_jax_modules()
    _jax_compat.install_eager(_before, _record)
    return True


def disable_eager() -> bool:
    """JAX's eager work goes JAX's own way again (entries stay in the store)."""
    if not _jax_compat.eager_installed():
        return False
    _jax_compat.uninstall_eager()
    with _lock:
        _memo.clear()
    return True


def is_enabled() -> bool:
    return _jax_compat.eager_installed()

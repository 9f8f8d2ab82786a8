"""JAX's eager work as kiln sees it: the calls of JAX's own jitted functions and of primitives
applied outside any trace, which reach jax.jit's ``cache_miss`` (``jax._src.pjit._cpp_pjit``;
the same on jax 0.10.2, 0.11.2 and 0.12.1).

Outside a trace, ``jnp.multiply(x, y)`` and ``lax.sin(x)`` (``dispatch.apply_primitive``, which
jits a ``prim_fun`` closing over the primitive and its parameters) both end in ``cache_miss``
of their jitted function on the first call with a signature: ``_infer_params`` traces it,
``_run_python_pjit`` lowers, compiles and runs it, and the C++ fast path serves later calls.
:func:`install_eager` wraps those two module globals (``cache_miss`` reads them at each call): a
``before`` hook may answer a call with a stored executable (:class:`StoredCall`: no trace, no
lowering, no compile; the C++ fast path is fed as JAX feeds it), and a cold call's executable
is handed to ``record`` right after XLA compiled it, before it first runs (XLA refuses to
serialise some executables once they ran).

Part of the JAX gate (:mod:`kiln._base._jax_compat`)."""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax

from . import _executables
from ._errors import Unserializable
from ._private import _core, _dispatch, _jax_jit, _mlir, _pjit, _pxla, _stages, _tree_util

__all__ = ["StoredCall", "CallFacts", "install_eager", "uninstall_eager", "eager_installed",
           "call_facts", "primitive_of", "lowering_rules", "lowering_overrides",
           "ctx_mesh_empty", "remember_facts",
           "serialize_eager", "load_eager", "avals_text_of"]


_ORIGINAL_INFER = _pjit._infer_params
_ORIGINAL_RUN = _pjit._run_python_pjit
_ORIGINAL_COMPILE = _pxla.MeshComputation.compile

_local = threading.local()


@dataclasses.dataclass(slots=True, eq=False)
class StoredCall:
    """What ``before`` answers a call with: a loaded executable (``MeshExecutable``) and the
    output tree of the function (a ``PyTreeDef``), run in place of JAX's trace, lowering and
    compile. Stands in for JAX's ``PjitParams`` between ``_infer_params`` and
    ``_run_python_pjit``."""

    executable: Any
    out_tree: Any


class _NoEffects:
    """The part of a ``ClosedJaxpr`` ``cache_miss`` reads after the run (effects, consts)."""

    effects: frozenset[Any] = frozenset()
    consts: list[Any] = []


@dataclasses.dataclass(slots=True, eq=False)
class CallFacts:
    """One eager call as ``_infer_params`` parses it: the static arguments, the trees of the
    dynamic ones, their avals and flat values (what JAX's in-memory caches key it by)."""

    fun: Any
    jit_info: Any
    signature: Any
    dynargs: list[Any]
    avals: tuple[Any, ...]


Before = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], "StoredCall | object | None"]
Record = Callable[[object, Any, Any], None]

_hooks: dict[str, Any] = {}


def _infer_params(fun: Any, ji: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    before = _hooks.get("before")
    # only jax.jit's cache_miss (not .lower() / .trace(), which need JAX's own params), and
    # only outside any trace (an eager call)
    if before is not None and sys._getframe(1).f_code.co_name == "cache_miss" \
            and _core.trace_state_clean():
        try:
            answer = before(fun, ji, args, kwargs)
        except Exception:  # noqa: BLE001 - a store is a cache: JAX's path
            answer = None
        if isinstance(answer, StoredCall):
            return answer, None
        if answer is not None:  # a token: record what this call compiles
            p, args_flat = _ORIGINAL_INFER(fun, ji, args, kwargs)
            _local.pending = (answer, p)
            return p, args_flat
    return _ORIGINAL_INFER(fun, ji, args, kwargs)


def _run_python_pjit(p: Any, args_flat: Any, fun: Any, args: Any, kwargs: Any) -> Any:
    if isinstance(p, StoredCall):
        return _run_stored(p, fun, args, kwargs)
    pending = getattr(_local, "pending", None)
    if pending is None or pending[1] is not p:
        return _ORIGINAL_RUN(p, args_flat, fun, args, kwargs)
    _local.pending = None
    # (an eager call inside this one's lowering records its own compile, then gives this one
    # back: a stack, one entry per call being run)
    before = getattr(_local, "recording", None)
    _local.recording = pending[0], p
    try:
        return _ORIGINAL_RUN(p, args_flat, fun, args, kwargs)
    finally:
        _local.recording = before


def _is_for(computation: Any, p: Any) -> bool:
    """``computation`` (a ``MeshComputation``) is the program of the eager call with params
    ``p``, not one compiled while lowering it: its name is ``jit(<name>)`` (jax 0.10 to 0.12;
    ``jit_<name>`` before)."""
    name = str(p.params.get("name", ""))
    return getattr(computation, "_name", None) in (f"jit({name})", f"jit_{name}")


def _compile(self: Any, *args: Any, **kwargs: Any) -> Any:
    recording = getattr(_local, "recording", None)
    record = _hooks.get("record")
    if recording is None or record is None or not _is_for(self, recording[1]) or args or kwargs:
        return _ORIGINAL_COMPILE(self, *args, **kwargs)
    _local.recording = None  # (one compile per eager call)
    # an executable JAX's persistent cache deserialized serializes without its kernels (see
    # _executables.compile_to_store): compiled again with an option at its default value (the
    # same executable under another key of JAX's cache), so that it can be stored
    _executables.watch_cache_hits()
    compiled = None
    for options in (None, {"xla_embed_ir_in_executable": False}):
        _executables._watch.on, _executables._watch.hit = True, False
        try:
            with _executables.no_persistent_cache_writes():  # (kiln stores it: no 2nd write)
                compiled = _ORIGINAL_COMPILE(self, options)
        finally:
            _executables._watch.on = False
        if not _executables._watch.hit:
            try:
                record(recording[0], recording[1], compiled)
            except Exception:  # noqa: BLE001 - storing is never the user's failure
                pass
            break
    return compiled


def _run_stored(p: StoredCall, fun: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``_run_python_pjit`` for a stored executable: the same checks of the arguments, the run,
    and what ``cache_miss`` makes the C++ fast path's entry of."""
    facts = getattr(_local, "facts", None)
    _local.facts = None
    args_flat = facts.dynargs if facts is not None else call_facts(
        fun, None, args, kwargs).dynargs  # pragma: no cover - before() always parses
    for arg in args_flat:
        _dispatch.check_arg(arg)
    args_flat = [_core.full_lower(a) for a in args_flat]
    out_flat = p.executable.unsafe_call(*args_flat)
    outs = p.out_tree.unflatten(out_flat)
    return outs, out_flat, p.out_tree, args_flat, _NoEffects, p.executable, None, []


def remember_facts(facts: CallFacts) -> None:
    """Keep ``facts`` of the call being answered with a :class:`StoredCall` (its flat
    arguments, parsed once)."""
    _local.facts = facts


def call_facts(fun: Any, ji: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallFacts:
    """Parse an eager call as ``_infer_params`` does (static arguments out, dynamic ones
    flattened, their avals). Raises what JAX raises for arguments it cannot take."""
    static_argnums = ji.static_argnums if ji is not None else ()
    static_argnames = ji.static_argnames if ji is not None else ()
    signature, dynargs = _jax_jit.parse_arguments(
        args, tuple(kwargs.values()), tuple(kwargs.keys()), static_argnums, static_argnames,
        _tree_util.tracing_registry)
    avals = tuple(_core.shaped_abstractify(x) for x in dynargs)
    return CallFacts(fun, ji, signature, list(dynargs), avals)


def ctx_mesh_empty(ji: Any) -> bool:
    """No mesh is in context (``jax.sharding.use_mesh``, ``with mesh:``): the call's program
    depends only on its arguments' shardings."""
    try:
        return bool(_pjit.get_ctx_mesh(ji.use_resource_env).empty)
    except Exception:  # noqa: BLE001 - an unknown shape of JAX: not eager-stored
        return False


def primitive_of(fun: Any) -> tuple[Any, dict[str, Any]] | None:
    """(primitive, parameters) of ``dispatch.apply_primitive``'s jitted ``prim_fun``, or
    None for any other function."""
    if not getattr(fun, "_apply_primitive", False):
        return None
    cells = dict(zip(fun.__code__.co_freevars, (c.cell_contents for c in fun.__closure__ or ()),
                     strict=True))
    prim, params = cells.get("prim"), cells.get("params")
    if not isinstance(prim, _core.Primitive) or not isinstance(params, dict):
        return None
    return prim, params


def _rule(entry: Any) -> Any:
    return getattr(entry, "rule", entry)  # (a LoweringRuleEntry(rule, inline): jax 0.4.36+)


def lowering_rules(prim: Any, platform: str) -> list[Any]:
    """The rules that lower ``prim`` on ``platform``: the platform's own, then the generic."""
    specific = _mlir._platform_specific_lowerings.get(platform, {})
    return [_rule(table[prim]) for table in (specific, _mlir._lowerings) if prim in table]


class _Versioned(dict):  # type: ignore[type-arg]
    """A lowering-rule table that counts its changes (``mlir.register_lowering`` writes
    ``table[prim] = entry``), so the scan for rules from outside JAX runs only after one."""

    def __setitem__(self, key: Any, value: Any) -> None:
        _version[0] += 1
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        _version[0] += 1
        super().__delitem__(key)

    def update(self, *args: Any, **kwargs: Any) -> None:
        _version[0] += 1
        super().update(*args, **kwargs)

    def pop(self, *args: Any) -> Any:
        _version[0] += 1
        return super().pop(*args)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        _version[0] += 1
        return super().setdefault(key, default)


class _VersionedTables(_Versioned):
    """``_platform_specific_lowerings``: a table of tables, each made a :class:`_Versioned`."""

    def __missing__(self, platform: str) -> _Versioned:
        table = _Versioned()
        self[platform] = table
        return table


_version = [0]
_overrides: dict[str, Any] = {"version": -1, "found": []}


def _watch_rule_tables() -> None:
    if not isinstance(_mlir._lowerings, _Versioned):
        _mlir._lowerings = _Versioned(_mlir._lowerings)
    if not isinstance(_mlir._platform_specific_lowerings, _VersionedTables):
        tables = _VersionedTables()
        for platform, table in _mlir._platform_specific_lowerings.items():
            dict.__setitem__(tables, platform, _Versioned(table))
        _mlir._platform_specific_lowerings = tables
    _version[0] += 1


def lowering_overrides(foreign: Callable[[Any], list[Any]]) -> list[tuple[str, str, Any]]:
    """(platform, primitive name, what ``foreign(rule)`` found) of every lowering rule that
    holds code from outside JAX (``mlir.register_lowering`` by a library or the program, a
    ``mlir.lower_fun`` of the program's function), in a stable order; scanned again only
    after a table changed."""
    if _overrides["version"] == _version[0]:
        return _overrides["found"]  # type: ignore[no-any-return]
    version = _version[0]
    out = []
    tables = [("*", _mlir._lowerings), *sorted(_mlir._platform_specific_lowerings.items())]
    for platform, table in tables:
        for prim, entry in list(table.items()):
            found = foreign(_rule(entry))
            if found:
                out.append((platform, str(getattr(prim, "name", prim)), found))
    out.sort(key=lambda t: (t[0], t[1]))
    _overrides.update(version=version, found=out)
    return out


# -- installing -------------------------------------------------------------------------------

def install_eager(before: Before, record: Record) -> None:
    """Route eager calls through ``before`` (answer with a :class:`StoredCall`, a token whose
    compile is to be recorded, or None for JAX's own path) and ``record(token, params,
    compiled)`` (the ``MeshExecutable`` XLA compiled for that call, before it runs)."""
    _hooks["before"] = before
    _hooks["record"] = record
    _watch_rule_tables()
    # (module attributes and a method set by kiln: the watcher exempts kiln's own)
    _pjit._infer_params = _infer_params
    _pjit._run_python_pjit = _run_python_pjit
    _pxla.MeshComputation.compile = _compile  # type: ignore[method-assign]


def uninstall_eager() -> None:
    _hooks.clear()
    _pjit._infer_params = _ORIGINAL_INFER
    _pjit._run_python_pjit = _ORIGINAL_RUN
    _pxla.MeshComputation.compile = _ORIGINAL_COMPILE  # type: ignore[method-assign]


def eager_installed() -> bool:
    return _pjit._infer_params is _infer_params


def serialize_eager(p: Any, compiled: Any) -> tuple[dict[str, bytes], StoredCall]:
    """(entry sections, the call to remember) of the ``MeshExecutable`` XLA compiled for a cold
    eager call with params ``p``, before it ran.

    Raises:
        Unserializable: the program has effects, host callbacks or constants passed as
            arguments, or XLA cannot serialize it.
    """
    jaxpr = p.params["jaxpr"]
    call = getattr(compiled, "unsafe_call", None)
    ok = (
        not jaxpr.effects
        and not p.consts
        and not getattr(jaxpr.jaxpr, "is_high", False)
        and isinstance(compiled, _pxla.MeshExecutable)
        and isinstance(call, _pxla.ExecuteReplicated)
        and not call.has_unordered_effects
        and not call.ordered_effects
        and not call.has_host_callbacks
    )
    if not ok:
        raise Unserializable("the program has effects, host callbacks or constants passed as "
                             "arguments")
    wrapped = _stages.Compiled(compiled, [], (), p.out_tree, no_kwargs=True)
    sections, _ = _executables.serialize_compiled(wrapped)
    # LAPACK kernels must be registered before a loaded executable calls them (a process that
    # loads one never lowered a linalg op: _executables._ensure_cpu_kernels)
    text = "".join(m.to_string() for m in compiled.xla_executable.hlo_modules())
    sections["lapack"] = b"1" if "lapack_" in text else b"0"
    return sections, StoredCall(compiled, p.out_tree)


def load_eager(sections: dict[str, bytes]) -> StoredCall:
    """The call a stored eager entry answers with (only after its digest verified).

    The first one also starts JAX's persistent cache, as the compile it replaces would have
    (``compilation_cache._get_cache`` makes its cache object on the first compile): a
    warm run leaves JAX's globals as a cold one does (JAX's own tests check them)."""
    if not _started[0]:
        _started[0] = True
        from jax._src import compilation_cache

        backend = jax.devices()[0].client
        if compilation_cache.is_cache_used(backend):  # (jax 0.4.30 to 0.12)
            compilation_cache._get_cache(backend)
    compiled = _executables.load_compiled(sections, lapack=sections.get("lapack") != b"0")
    return StoredCall(compiled._executable, compiled.out_tree)


_started = [False]


def avals_text_of(avals: tuple[Any, ...]) -> str:
    """``float32[3], int32[]``: the avals of an eager call, for an entry's header."""
    return ", ".join(a.str_short() for a in avals)

"""``kiln.jit``: ``jax.jit`` whose executables outlive the process.

Data flow of one call (docs/how-it-works.md)::

    call(*args)
      -> split static / dynamic args; signature = (trace config, pytree structure, leaf avals,
         static digests)
      -> in-process table hit?                         -> run executable        (hot path)
      -> persistent key = sha256(named parts)          -> store.get(key)
           entry found, digest ok, manifest matches    -> deserialize, run      (warm start)
      -> trace (recording the manifest) -> lower -> compile -> store.put -> run (cold)

What a warm start skips:

- programs without host callbacks, and programs whose host callbacks (``jax.debug.print``,
  ``jax.pure_callback``, equinox's runtime error checks) can be pickled with cloudpickle: no
  trace, no lowering, no compile;
- programs whose host callbacks cannot be pickled (they close over a lock, a file, ...): trace
  and lower to rebuild the callables, but no compile;
- functions kiln cannot fingerprint soundly (a global it reads has no canonical value digest,
  a function that ran while tracing cannot be found again by module + qualname): the *verify
  path*, trace and lower on every new process, key by the lowered module, no compile.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Unpack

import jax

from .._base import _jax_compat, _stats
from .._keys import STATIC_LEAF, _args, script_module
from .._miss import (
    Call,
    Miss,
    Once,
    Request,
    Statics,
    _explain,
    _tier_up,
    abstract_sig,
    with_static_outputs,
)
from .._travel import _jax_cache, _pickling
from . import _dispatch, _prepare, _stages
from ._dispatch import unwrapped
from ._options import JIT_DEFAULTS, JitKeywords, JitOptions, check_keywords
from ._prepare import TO_JAX
from ._wrappers import JitWrappers

__all__ = ["JitFunction"]

_instances: weakref.WeakSet[JitFunction] = weakref.WeakSet()


def hot_calls() -> int:
    """Calls served from the in-process tables of all live kiln.jit functions."""
    return sum(f._hot_calls for f in list(_instances))


_stats.register_hot_counter(hot_calls)


def _clear_all() -> None:
    """``jax.clear_caches()``: every kiln.jit function forgets this process's executables, as
    jax.jit's do (the store is untouched: a later call loads its entry)."""
    for f in list(_instances):
        f.clear_cache()


_on_clear_caches = _jax_compat.on_clear_caches(_clear_all)

_shared: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()
_shared_lock = threading.Lock()


def _shared_state(
    fun: Any, options: Any
) -> tuple[dict[Any, Any], threading.RLock, list[list[Any]]]:
    """(in-process table, its lock, the (store, key) entries of each miss) for ``fun`` with
    ``options`` (``JitOptions.identity``):
    one per function object and options while the function lives; private when ``fun`` cannot
    be weakly referenced or hashed (a bound method is a new object on every access). The
    table's keys, in insertion order, are the signatures compiled so far."""
    fresh: tuple[dict[Any, Any], threading.RLock, list[list[Any]]] = (
        {}, threading.RLock(), [])
    if isinstance(fun, types.MethodType):
        return fresh
    try:
        with _shared_lock:
            return _shared.setdefault(fun, {}).setdefault(options, fresh)  # type: ignore[no-any-return]
    except TypeError:  # not hashable, or no weak references
        return fresh


def _unpickle(fun: Any, ctor: dict[str, Any], entries: list[tuple[str, bytes]]) -> JitFunction:
    """A kiln function pickled by value, made again; its carried entries go to this process's
    store (verified first), where its calls find them."""
    if entries:
        _pickling.store_carried(entries)
    return JitFunction(fun, **ctor)


class JitFunction:
    """A function compiled by ``kiln.jit``. Call it like the wrapped function.

    Attributes beyond those of the wrapped function: :meth:`precompile`, :meth:`lower`,
    :meth:`trace`, :meth:`clear_cache`.
    """

    # why the last miss took the verify path (None: keyed by its fingerprint), for the jax.jit
    # swap's explanations
    _verify_reason: str | None = None
    # static arguments with no hash of their own (arrays, lists) are keyed by value (the jax.jit
    # swap leaves them to jax.jit, which refuses them)
    _statics_by_value = True
    # a fingerprint miss looks for the same lowered module under the call's alias entry
    # (kiln._miss._compile._Miss._same_program): the jax.jit swap's, whose functions live in
    # libraries whose values kiln's walk reaches (numpyro's caches keyed by id())
    _same_program_alias = False

    def __init__(self, fun: Callable[..., Any], *, _filter: str | None = None,
                 **options: Unpack[JitKeywords]) -> None:
        check_keywords("JitFunction", dict(options))
        if callable(fun):
            functools.update_wrapper(self, fun)
        self._fun = fun
        # kiln.jit's arguments (_filter: kiln.filter_jit's donate mode; None for kiln.jit), as
        # given, made into options once
        given: dict[str, Any] = {**JIT_DEFAULTS, **options, "_filter": _filter}
        self._options = opts = JitOptions.make(fun, given)
        # the plain jax.jit of fun: jax's checks at decoration, and jax's errors for arguments
        # kiln.jit hands to it (TO_JAX)
        self._jax_jit = opts.jax_jit(fun)
        # Like jax.jit, whose caches hang off the function: kiln.jit(f) made again around the
        # same function object with the same options shares the executables of this process
        # (no retrace, no store read). Held while f lives.
        self._table, self._lock, self._entries = _shared_state(fun, opts.identity())
        self._hot_calls = 0
        self._may_tier_up = True  # False for kiln.noinline's own executables
        self._not_stored = Once()  # the warning that its executables cannot be stored
        _instances.add(self)
        self._name = getattr(fun, "__qualname__", type(fun).__qualname__)
        self._module = script_module(getattr(fun, "__module__", None) or type(fun).__module__)
        # flat jax.jit of fun per static configuration, for top-level misses and nested calls
        # alike (so a function called both ways traces once per signature, as jax.jit does)
        self._wrappers = JitWrappers(fun, self._name, opts)
        # The C++ dispatcher jax.jit uses (without static arguments, __call__ itself)
        self._dispatch = _dispatch.install(self, type(self), self._name, opts)
        _note_creation(fun)
        # JAX's own cache into the store too (library-internal jax.jit, eager operations)
        _jax_cache.enable_by_default()

    def __del__(self) -> None:
        # A class is always in a reference cycle (its __mro__ holds it), so the class of its
        # own (_dispatch.install) lives until the garbage collector runs: let go of the
        # dispatcher and its compiled executables now, as jax.jit does when its function is
        # deleted. (no module globals here: at interpreter exit they may already be None)
        try:
            cls = type(self)
            if "__call__" in cls.__dict__ and len(cls.__mro__) > 2:
                delattr(cls, "__call__")
        except Exception:  # noqa: BLE001, S110 - nothing to free, or too late to
            pass

    # -- descriptor protocol: @kiln.jit on a method ---------------------------------------
    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return functools.partial(self, instance)

    def __repr__(self) -> str:
        kind = "kiln.filter_jit" if self._options.filter_jit else "kiln.jit"
        return f"<{kind} {self._module}.{self._name}>"

    def __reduce__(self) -> Any:
        """By reference when this very object can be found again by module and name (as
        functions and jax.jit's are); otherwise by value, carrying the stored entries of the
        signatures compiled so far (``pickle_max_size``). By value: a script's or notebook's
        ``__main__`` (its function travels as cloudpickle bytes, so plain pickle and
        ``multiprocessing`` carry it too), a closure or lambda (cloudpickle needed for the
        function). Unpickling is trusted, as pickle always is: a pickle can run any code."""
        name = _pickling.name_if_found(self)
        if name is not None:
            return name
        entries = [e for per_miss in list(self._entries) for e in list(per_miss)]
        return (_unpickle, (_pickling.portable(self._fun), self._options.given,
                            _pickling.carried_entries(entries)))

    def __getstate__(self) -> dict[str, Any]:
        """The attributes, and ``function_name`` as ``jax.jit``'s state names the function
        (pickling goes through ``__reduce__``, not this)."""
        state = dict(self.__dict__)
        state["function_name"] = _jax_compat.fun_name(self._fun)
        return state

    def _cache_size(self) -> int:
        """The number of executables this function holds in this process (as ``jax.jit``'s
        ``_cache_size``): one per signature called or compiled so far."""
        return len(self._table)

    # -- what the miss path is given ----------------------------------------------------------
    def _request(self, call: Call) -> Request:
        """The record of what a miss of ``call`` reads (its static values resolved once)."""
        statics = Statics.of(call)
        # uncompiled: the function of the array leaves as plain Python (jax.disable_jit);
        # jitted: its jax.jit, which the miss traces, lowers and compiles
        uncompiled, jitted, box = self._wrappers.flat(call, statics.leaves)
        return Request(
            call=call, statics=statics, fun=self._fun, name=self._name, module=self._module,
            options=self._options, uncompiled=uncompiled, jitted=jitted, box=box,
            donated=self._wrappers.donated_leaves(call, statics.leaves),
            may_tier_up=self._may_tier_up, same_program_alias=self._same_program_alias,
            not_stored=self._not_stored,
        )

    # -- calling ------------------------------------------------------------------------------
    @_jax_compat.api_boundary
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # where there is no C++ dispatcher (negative static_argnums); else __init__ makes it
        # (as jax.jit's) __call__: Python only runs on signatures it has not cached
        return self._python_call(args, kwargs)[0]

    def _python_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """(outputs, executable for the C++ cache or None)."""
        call = _prepare.prepare(self._options, self._name, args, kwargs)
        if call.key is TO_JAX:
            return self._jax_jit(*unwrapped(args), **unwrapped(kwargs)), None
        if call.key is None:
            # Under a transformation (grad, vmap, an outer jit): a nested jax.jit, the same one
            # a top-level miss traces (one trace per signature, as jax.jit)
            with self._donation_warnings():
                return self._nested_call(call), None
        executable = self._table.get(call.key)
        if executable is None:
            with self._donation_warnings():
                executable = self._miss(call)
        else:
            self._hot_calls += 1
        try:
            outs = executable(*call.leaves)
        except _jax_compat.InternalFloatingPointError as e:
            # jax_debug_nans / jax_debug_infs: as jax.jit, re-run op by op to name the
            # operation, raising FloatingPointError (never jax's internal exception)
            _jax_compat.raise_floating_point_error(e, self._fun, unwrapped(args),
                                                   unwrapped(kwargs))
        # only a plain executable over all dynamic leaves of (args, kwargs) can be cached in
        # C++ (not with filter_jit's static leaves, nor after it moved keyword arguments, nor
        # with the function's own arrays before them: traced_fun)
        cacheable = (isinstance(executable, jax.stages.Compiled) and STATIC_LEAF not in call.sigs
                     and not (kwargs and self._options.filter_jit)
                     and not self._options.traced_fun)
        return outs, (executable if cacheable else None)

    @contextlib.contextmanager
    def _donation_warnings(self) -> Iterator[None]:
        """filter_jit(donate="all" / "all-except-first") silences jax's warning about donated
        buffers it could not use, as equinox does."""
        if not self._options.quiet_donation:
            yield
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            yield

    def _nested_call(self, call: Call) -> Any:
        _, jitted, box = self._wrappers.flat(call)
        out = jitted(*call.leaves)
        static_out = box.get(abstract_sig(call.leaves))
        return out if static_out is None else with_static_outputs(out, *static_out)

    # -- ahead of time ------------------------------------------------------------------------
    def precompile(self, *args: Any, **kwargs: Any) -> None:
        """Compile (or load) and store the entry for these arguments without running it.

        Dynamic arguments may be arrays or ``jax.ShapeDtypeStruct`` (pytrees of them); static
        arguments are passed as values. A later call with the same abstract signature, in this
        or any process sharing the store, runs the stored executable.

        Example:
            >>> import jax, jax.numpy as jnp, kiln
            >>> f = kiln.jit(lambda x: x * 2)
            >>> f.precompile(jax.ShapeDtypeStruct((3,), jnp.float32))
            >>> f(jnp.ones(3)).tolist()
            [2.0, 2.0, 2.0]
        """
        call = _prepare.prepare(self._options, self._name, args, kwargs)
        if call.key is TO_JAX:
            self._jax_jit.trace(*args, **kwargs)  # jax's TypeError naming the argument
        if call.key is None or call.key is TO_JAX:
            raise TypeError("precompile: arguments must be concrete arrays or ShapeDtypeStructs")
        if call.key not in self._table:
            self._miss(call)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """Lower for these arguments, as ``jax.jit(fun).lower(...)``: a :class:`kiln.Lowered`
        (``as_text()``, ``cost_analysis()``, ``compile()``). Its ``compile()`` loads the
        executable from the store, or compiles and stores it, and gives a
        :class:`kiln.Compiled` that takes the dynamic arguments (as ``jax.stages.Compiled``).

        Under a transformation, or with arguments kiln.jit does not take, this is jax.jit's own
        ``lower`` (jax's ``Lowered``, or jax's error).
        """
        call = _prepare.prepare(self._options, self._name, args, kwargs)
        if call.key is None or call.key is TO_JAX:
            return self._jax_jit.lower(*args, **kwargs)

        @functools.cache
        def miss() -> Miss:
            return Miss(self._request(call))

        def lower_program() -> jax.stages.Lowered:
            return miss().lower()  # type: ignore[no-any-return]

        def compile(compiler_options: dict[str, Any] | None = None,
                    device_assignment: Any = None) -> _stages.Compiled:
            with self._donation_warnings():
                if compiler_options is None and device_assignment is None:
                    executable = self._miss(call, miss() if call.key not in self._table else None)
                else:  # JAX's compile with per-compile options: not stored
                    executable = lower_program().compile(compiler_options,
                                                         device_assignment=device_assignment)
            check = _prepare.aot_check(self._options, self._name, call)
            return _stages.Compiled(executable, check, lower_program, lowered)

        # JAX's own lowering of the call as written (args_info, in_tree, ...); filter_jit's
        # description is kiln's lowered program of the leaves, as equinox's
        lowered = _stages.Lowered(lower_program, compile, None if self._options.filter_jit
                                  else functools.partial(self._jax_jit.lower, *args, **kwargs))
        return lowered

    def trace(self, *args: Any, **kwargs: Any) -> jax.stages.Traced:
        """``jax.jit(fun).trace(...)``: jax's ``Traced`` (``jaxpr``, ``lower()``) for these
        arguments, with kiln's static argument handling; nothing is stored."""
        call = _prepare.prepare(self._options, self._name, args, kwargs)
        if call.key is TO_JAX or (not self._options.filter_jit and not call.statics):
            return self._jax_jit.trace(*args, **kwargs)
        if not self._options.filter_jit:
            return self._wrappers.structured(call).trace(  # type: ignore[no-any-return]
                *call.dyn_args, **call.dyn_kwargs)
        return self._wrappers.flat(call)[1].trace(*call.leaves)  # type: ignore[no-any-return]

    def clear_cache(self) -> None:
        """Forget this process's executables (the store is untouched)."""
        with self._lock:
            if self._dispatch is not None:
                self._dispatch._clear_cache()
            self._table.clear()
            self._wrappers.clear()

    # -- misses -------------------------------------------------------------------------------
    def _miss(self, call: Call, miss: Miss | None = None) -> Any:
        with self._lock:
            executable = self._table.get(call.key)
            if executable is not None:
                return executable
            if miss is None:
                miss = Miss(self._request(call))
            if _jax_compat.jit_disabled():
                self._table[call.key] = miss.request.uncompiled
                return miss.request.uncompiled
            result = miss.run(functools.partial(self._memory_miss_reason, call))
            self._verify_reason = result.verify_reason
            self._table[call.key] = result.executable
            self._entries.append(result.entries)  # (a tier-up adds its own: _swap_in)
            if result.tier_up is not None:
                _tier_up.start(result.tier_up,
                               functools.partial(self._swap_in, call.key, result.entries))
            return result.executable

    def _swap_in(self, key: Any, entries: list[Any], executable: Any, written: list[Any]) -> None:
        """Put a tier-up's inlined executable in place of the first one for ``key`` (unless
        the table was cleared meanwhile); the entries it wrote (``written``) join its miss's."""
        entries.extend(written)
        with self._lock:
            if key in self._table:
                self._table[key] = executable
                if self._dispatch is not None:
                    self._dispatch._clear_cache()

    def _memory_miss_reason(self, call: Call) -> tuple[str, str]:
        """(kind, message) explaining why this call missed the in-process table: kind
        ``new-function``, ``re-created`` (a kiln.jit made again around a function made again,
        said before the store is read: costly even when it hits) or ``signature``. (Asked by
        the miss only when explanations are wanted.)"""
        if not self._table:
            n = _creations.get(_code_of(self._fun), 0)
            hint = (
                f" (kiln.jit was applied to {n} function objects with this code in this "
                "process: if it is re-created on every call, hoist the kiln.jit(...) out of the "
                "loop or function)" if n > 2 else ""
            )
            return ("re-created" if hint else "new-function",
                    f"{self._name}: first call in this process{hint}")
        paths = _args.leaf_paths(self._options.positional, call.dyn_args, call.dyn_kwargs,
                                 call.statics)
        new = (call.key.treedef, paths, call.key.sigs, call.key.static_key)
        seen = [(k.treedef, paths, k.sigs, k.static_key) for k in self._table]
        return "signature", _explain.describe_signature_change(self._name, new, seen)


# kiln functions made per code object (or class of a callable object): a hint for the
# explanation of a function re-created on every call; weak, so code let go is forgotten
_creations: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _code_of(fun: Any) -> Any:
    return getattr(fun, "__code__", None) or type(fun)


def _note_creation(fun: Any) -> None:
    code = _code_of(fun)
    _creations[code] = _creations.get(code, 0) + 1

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

import collections.abc
import contextlib
import copy
import functools
import inspect
import logging
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from .._base import _jax_compat, _stats
from .._base._config import Config
from .._base._errors import StaticArgumentError
from .._keys import _args
from .._keys._args import ARRAY_TYPES as _ARRAY_TYPES
from .._keys._args import STATIC_LEAF as _STATIC_LEAF
from .._keys._hashing import Unpersistable, ndarray_key, static_digest
from .._keys._libraries import script_module
from .._miss import _explain, _tier_up
from .._miss._compile import (
    _abstract_sig,
    _Box,
    _is_static_output,
    _Miss,
    _option_text,
    with_static_outputs,
)
from .._travel import _jax_cache, _pickling
from . import _stages

__all__ = ["JitFunction"]

logger = logging.getLogger("kiln")

_tree_flatten = jax.tree_util.tree_flatten
# Set on the first call (not at import: importing kiln must not start the XLA backend).
_trace_context_token = _jax_compat.trace_context_token
_instances: weakref.WeakSet[JitFunction] = weakref.WeakSet()


def hot_calls() -> int:
    """Calls served from the in-process tables of all live kiln.jit functions."""
    return sum(f._hot_calls for f in list(_instances))


_stats.register_hot_counter(hot_calls)
_PLAIN = object()  # _prepare: hand the call to the plain jax.jit (jax's own errors)



class _TableKey(NamedTuple):
    """A key of the in-process table: one executable per trace context and signature."""

    context: Any  # jax's trace context (config values that change tracing)
    treedef: Any  # of (dynamic args, dynamic kwargs)
    sigs: tuple[Any, ...]  # per leaf: aval (and sharding), Python scalar type
    static_key: tuple[Any, ...]  # static arguments and static leaves, by digest


class _Call(NamedTuple):
    """One call, prepared (``JitFunction._prepare``)."""

    key: Any  # a _TableKey; None under a transformation; _PLAIN for jax.jit's own errors
    leaves: list[Any]  # the array leaves the executable takes
    dyn_args: tuple[Any, ...]
    dyn_kwargs: dict[str, Any]
    statics: tuple[tuple[Any, Any], ...]  # (position or name, value)
    static_key: tuple[Any, ...]
    treedef: Any
    sigs: tuple[Any, ...]


_shared: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()
_shared_lock = threading.Lock()


def _shared_state(
    fun: Any, options: Any
) -> tuple[dict[Any, Any], threading.RLock, list[list[Any]]]:
    """(in-process table, its lock, the (store, key) entries of each miss) for ``fun`` with
    ``options``:
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


class _StaticValue(bytes):
    """A static argument with no hash of its own (a numpy or jax array, a list), as its kiln
    digest, so that jax's C++ dispatcher can key a call on it: the bytes are the digest (hashed
    and compared in C, with no Python call), ``value`` the argument itself."""

    value: Any

    def __new__(cls, value: Any, digest: bytes) -> _StaticValue:
        self = super().__new__(cls, digest)
        self.value = value
        return self


_static_values: dict[bytes, _StaticValue] = {}
_SMALL = 1 << 16  # bytes: arrays up to this size reuse their _StaticValue


def _static_value(v: np.ndarray[Any, Any], digest: bytes) -> _StaticValue:
    """The :class:`_StaticValue` of a numpy array: for a small array, one object per digest, so
    jax's dispatcher finds its key by identity (measured: 8.2 us a call against 12.6 us with a
    new object); its ``value`` is always the array of this call (the miss path reads it)."""
    if v.nbytes > _SMALL:
        return _StaticValue(v, digest)
    got = _static_values.get(digest)
    if got is None:
        if len(_static_values) >= 4096:
            _static_values.clear()
        got = _static_values[digest] = _StaticValue(v, digest)
    else:
        got.value = v
    return got


# static values jax's dispatcher hashes itself, with no need to ask
_HASHABLE = frozenset({int, float, bool, str, bytes, complex, type(None), type,
                       types.FunctionType, types.BuiltinFunctionType})


def _static_caller(
    dispatch: Any, python_call: Callable[..., Any], nums: list[int], names: frozenset[str],
    fname: str,
) -> Callable[..., Any]:
    """``__call__`` of a function with static arguments: the C++ dispatcher, after giving each
    static value that has no hash (an array by value) a :class:`_StaticValue`; anything kiln
    cannot digest goes to the Python path, which raises the error that names it."""

    def give_hash(v: Any, name: str) -> Any:
        t = type(v)
        if t in _HASHABLE:
            return v
        if t is np.ndarray:  # re-hashed on each call (mutable): the raw digest, no dispatch
            return _static_value(v, ndarray_key(v))
        if isinstance(v, collections.abc.Mapping):
            # a mapping is keyed in iteration order, but a hashable one's == ignores the order
            # (flax's FrozenDict, HashableMapping): by its digest, never by hash / ==
            return _StaticValue(v, static_digest(v, argname=name).encode())
        try:
            hash(v)
            return v
        except TypeError:
            return _StaticValue(v, static_digest(v, argname=name).encode())

    name_list = sorted(names)

    def call(*args: Any, **kwargs: Any) -> Any:
        # in the common case every static value is of a type jax hashes itself: nothing to do
        try:
            n = len(args)
            for i in nums:
                if i < n and type(args[i]) not in _HASHABLE:
                    listed = list(args)
                    for j in nums:
                        if j < n:
                            listed[j] = give_hash(listed[j], str(j))
                    args = tuple(listed)
                    break
            if kwargs:  # (a fresh dict on every call: changed in place)
                for k in name_list:
                    if k in kwargs and type(kwargs[k]) not in _HASHABLE:
                        kwargs[k] = give_hash(kwargs[k], k)
        except (Unpersistable, StaticArgumentError):
            return python_call(_unwrapped(args), _unwrapped(kwargs))[0]
        return dispatch(*args, **kwargs)

    call.__name__ = call.__qualname__ = fname
    return call


def _unpickle(fun: Any, ctor: dict[str, Any], entries: list[tuple[str, bytes]]) -> JitFunction:
    """A kiln function pickled by value, made again; its carried entries go to this process's
    store (verified first), where its calls find them."""
    if entries:
        _pickling.store_carried(entries)
    return JitFunction(fun, **ctor)


def _frozen(v: Any) -> Any:
    """A static value as it is now. What is traced from it is kept (per digest) for later
    signatures too, and an unhashable value (a numpy array, a list) may be changed in place
    after this call: keep a copy, so a later trace sees the value the key says."""
    if isinstance(v, jax.Array):
        return v  # immutable
    try:
        hash(v)
        return v
    except TypeError:
        pass
    try:
        return copy.deepcopy(v)
    except Exception:  # noqa: BLE001 - cannot be copied: bound as it is
        return v


def _unwrapped(args: Any) -> Any:
    """``args`` (a tuple or a kwargs dict) with each :class:`_StaticValue` replaced by its
    value."""
    if isinstance(args, dict):
        return {k: v.value if type(v) is _StaticValue else v for k, v in args.items()}
    return tuple(a.value if type(a) is _StaticValue else a for a in args)


def _weakly(jf: JitFunction, method: str) -> Callable[..., Any]:
    """``getattr(jf, method)`` called through a weak reference to ``jf``. The dispatcher lives
    on ``jf`` (its ``_python_call`` for misses, its ``_fun`` for jax's NaN-check re-run): a bound
    method would make a cycle that keeps ``jf`` and what its function closes over alive until
    the garbage collector runs (``jax.jit`` frees them at ``del``)."""
    ref = weakref.ref(jf)

    def call(*args: Any, **kwargs: Any) -> Any:
        target = ref()
        if target is None:  # pragma: no cover - the dispatcher outlived its function
            raise RuntimeError("this kiln.jit function was garbage collected")
        return getattr(target, method)(*args, **kwargs)

    return call




class JitFunction:
    """A function compiled by ``kiln.jit``. Call it like the wrapped function.

    Attributes beyond those of the wrapped function: :meth:`precompile`, :meth:`lower`,
    :meth:`trace`, :meth:`clear_cache`.
    """

    def __init__(
        self,
        fun: Callable[..., Any],
        *,
        static_argnums: int | Sequence[int] | None = None,
        static_argnames: str | Sequence[str] | None = None,
        donate_argnums: int | Sequence[int] | None = None,
        donate_argnames: str | Sequence[str] | None = None,
        keep_unused: bool = False,
        device: Any = None,
        backend: str | None = None,
        inline: bool = False,
        compiler_options: dict[str, Any] | None = None,
        in_shardings: Any = None,
        out_shardings: Any = None,
        _filter: str | None = None,
    ) -> None:
        if callable(fun):
            functools.update_wrapper(self, fun)
        self._fun = fun
        # as given, to make this function again where it is unpickled (by value)
        self._ctor = dict(
            static_argnums=static_argnums, static_argnames=static_argnames,
            donate_argnums=donate_argnums, donate_argnames=donate_argnames,
            keep_unused=keep_unused, device=device, backend=backend, inline=inline,
            compiler_options=compiler_options, in_shardings=in_shardings,
            out_shardings=out_shardings, _filter=_filter,
        )
        # kiln.filter_jit (equinox's contract): its donate mode; None for kiln.jit
        self._filter = _filter
        self._filter_warning = _filter in ("all", "all-except-first")
        nums = _args.normalize_argnums(static_argnums, "static_argnums")
        names = _args.normalize_argnames(static_argnames, "static_argnames")
        dnums = _args.normalize_argnums(donate_argnums, "donate_argnums")
        dnames = _args.normalize_argnames(donate_argnames, "donate_argnames")
        try:
            params = list(inspect.signature(fun).parameters.values())
        except (TypeError, ValueError):
            params = []
        positional = [
            p.name for p in params
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        _args.check_argnames(fun, params, [("static_argnames", n) for n in names]
                       + [("donate_argnames", n) for n in dnames])
        # jax.jit's own checks, with its errors at its time (decoration): out-of-range
        # argnums, positional-only static_argnames, static and donated at once, generator
        # functions, staticmethod objects, non-callables (an unknown argname was named above
        # with the function's parameters and the closest one)
        # jax.jit options passed on to every jax.jit kiln makes of fun (and named in the key)
        self._jit_options: dict[str, Any] = {
            k: v for k, v in (("keep_unused", keep_unused), ("device", device),
                              ("backend", backend), ("inline", inline),
                              ("compiler_options", compiler_options)) if v
        }
        # in_shardings / out_shardings: jax.jit's, applied by kiln per array leaf
        self._in_shardings = in_shardings
        self._out_shardings = out_shardings
        shardings = {k: v for k, v in (("in_shardings", in_shardings),
                                       ("out_shardings", out_shardings)) if v is not None}
        # the plain jax.jit of fun: jax's errors for arguments kiln.jit does not take (a
        # string, a function), with jax's text and argument paths
        self._plain = jax.jit(fun, static_argnums=static_argnums, static_argnames=static_argnames,
                              donate_argnums=donate_argnums, donate_argnames=donate_argnames,
                              **shardings, **self._jit_options)
        try:
            self._signature: inspect.Signature | None = inspect.signature(fun)
        except (TypeError, ValueError):
            self._signature = None
        self._positional = positional
        # Like jax.jit (api_util.infer_argnums_and_argnames): when only one of argnums /
        # argnames is given, the other is inferred, so a parameter is static whether passed by
        # position or by name; when both are given, each is used as given.
        if static_argnums is None:
            nums = tuple(positional.index(n) for n in names if n in positional)
        if static_argnames is None:
            names = tuple(positional[i] for i in nums if 0 <= i < len(positional))
        if donate_argnums is None:
            dnums = tuple(positional.index(n) for n in dnames if n in positional)
        if donate_argnames is None:
            dnames = tuple(positional[i] for i in dnums if 0 <= i < len(positional))
        self._static_argnums = frozenset(nums)
        self._static_argnames = frozenset(names)
        self._donate_argnums = frozenset(dnums)
        self._donate_argnames = tuple(dnames)
        # Like jax.jit, whose caches hang off the function: kiln.jit(f) made again around the
        # same function object with the same options shares the executables of this process
        # (no retrace, no store read). Held while f lives.
        self._table, self._lock, self._entries = _shared_state(fun, (
            self._static_argnums, self._static_argnames, self._donate_argnums,
            self._donate_argnames, repr(sorted(self._jit_options.items())), _filter,
            _option_text(in_shardings), _option_text(out_shardings),
        ))
        # flat jax.jit of fun per static configuration, for top-level misses and nested calls
        # alike (so a function called both ways traces once per signature, as jax.jit does)
        self._flat: dict[Any, tuple[Any, Any, _Box]] = {}
        self._hot_calls = 0
        self._may_tier_up = True  # False for kiln.noinline's own executables
        self._has_statics = bool(self._static_argnums or self._static_argnames)
        _instances.add(self)
        self._name = getattr(fun, "__qualname__", type(fun).__qualname__)
        self._module = script_module(getattr(fun, "__module__", None) or type(fun).__module__)
        # The C++ dispatcher jax.jit uses, static arguments included (hashed and compared by
        # jax as jax.jit's are; those with no hash of their own, arrays by value, by kiln's
        # digest through _StaticValue). Negative static_argnums need the call's length: Python.
        cpp = all(i >= 0 for i in self._static_argnums)
        self._dispatch = (
            _jax_compat.make_dispatcher(
                self._name, _weakly(self, "_python_call"), _weakly(self, "_fun"),
                static_argnums=sorted(self._static_argnums),
                static_argnames=sorted(self._static_argnames))
            if cpp else None
        )
        if self._dispatch is not None:
            # Python looks __call__ up on the type: in a class of its own whose __call__ is the
            # C++ dispatcher, a cached signature runs with no Python frame in between. With a
            # Python __call__ forwarding to it, benchmarks/per_call.py measured 1.12x jax.jit
            # on `x * y + 1` (now 1.02x; docs/benchmarks.md). With static arguments a Python
            # __call__ first gives the unhashable ones a hash (_with_hashable_statics).
            call = (self._dispatch if not self._has_statics else _static_caller(
                self._dispatch, _weakly(self, "_python_call"), sorted(self._static_argnums),
                self._static_argnames, self._name))
            self.__class__ = type(
                "JitFunction", (JitFunction,),
                {"__call__": staticmethod(call), "__slots__": (),
                 "__module__": JitFunction.__module__, "__qualname__": "JitFunction"},
            )
        _note_creation(fun)
        # JAX's own cache into the store too (library-internal jax.jit, eager operations)
        _jax_cache.enable_by_default()

    def __del__(self) -> None:
        # A class is always in a reference cycle (its __mro__ holds it), so the class of its
        # own (above) lives until the garbage collector runs: let go of the dispatcher and
        # its compiled executables now, as jax.jit does when its function is deleted.
        # (no module globals here: at interpreter exit they may already be None)
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
        kind = "kiln.jit" if self._filter is None else "kiln.filter_jit"
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
        return (_unpickle, (_pickling.portable(self._fun), self._ctor,
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

    # -- argument handling -----------------------------------------------------------------
    def _split(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any], tuple[tuple[Any, Any], ...]]:
        statics: list[tuple[Any, Any]] = []
        if self._static_argnums:
            dyn = []
            n = len(args)
            for i, a in enumerate(args):
                if i in self._static_argnums or (i - n) in self._static_argnums:
                    statics.append((i, a.value if type(a) is _StaticValue else a))
                else:
                    dyn.append(a)
            args = tuple(dyn)
        if self._static_argnames and kwargs:
            dkw = {}
            for k, v in kwargs.items():
                if k in self._static_argnames:
                    statics.append((k, v.value if type(v) is _StaticValue else v))
                else:
                    dkw[k] = v
            kwargs = dkw
        return args, kwargs, tuple(statics)

    def _param_name(self, where: Any) -> Any:
        """The key name of a static argument: its parameter name when the signature gives one
        (so ``f(x, t)`` and ``f(x, table=t)`` share an executable), else ``args[i]``; static
        leaves keep their ``("leaf", i)`` position."""
        return _args.param_name(self._positional, where)

    def _static_key(
        self, statics: Sequence[tuple[Any, Any]], names: Sequence[str] | None = None
    ) -> tuple[Any, ...]:
        out: list[tuple[Any, Any]] = []
        for n, (where, value) in enumerate(statics):
            keyname = self._param_name(where)
            name = names[n] if names else (keyname if isinstance(keyname, str) else "leaf")
            try:
                out.append((keyname, static_digest(value, argname=name)))
            except Unpersistable:
                try:
                    hash(value)
                except TypeError:
                    raise StaticArgumentError(
                        f"static argument {name!r} of {self._name} is unhashable "
                        f"({type(value).__name__}); pass a hashable value or make it dynamic"
                    ) from None
                out.append((keyname, ("process-local", value)))
        return tuple(sorted(out, key=lambda kv: str(kv[0])))

    def _merge(self, statics: tuple[tuple[Any, Any], ...], n_dyn: int) -> Callable[..., Any]:
        """``call(dyn_args, dyn_kwargs)`` that re-inserts the static arguments and calls fun."""
        fun = self._fun
        pos = {w: _frozen(v) for w, v in statics if isinstance(w, int)}
        kw = {w: _frozen(v) for w, v in statics if isinstance(w, str)}
        total = n_dyn + len(pos)
        pos = {(w if w >= 0 else total + w): v for w, v in pos.items()}

        def call(dyn: Sequence[Any], dkw: dict[str, Any]) -> Any:
            it = iter(dyn)
            args = [pos[i] if i in pos else next(it) for i in range(total)]
            return fun(*args, **dkw, **kw)

        return call

    def _jitted(self, statics: tuple[tuple[Any, Any], ...], n_dyn: int) -> Any:
        """A plain ``jax.jit`` of fun over the user's argument structure with the statics
        bound: what :meth:`trace` gives with static arguments (static arrays by value, which
        ``jax.jit`` itself refuses)."""
        merge = self._merge(statics, n_dyn)
        dyn_positions = _args.dyn_positions(statics, n_dyn)
        donate = tuple(j for j, i in enumerate(dyn_positions) if i in self._donate_argnums)
        static_names = {w for w, _ in statics if isinstance(w, str)}
        dnames = tuple(n for n in self._donate_argnames if n not in static_names)

        def inner(*dyn: Any, **dkw: Any) -> Any:
            return merge(dyn, dkw)

        inner.__name__ = getattr(self._fun, "__name__", "fun")
        inner.__qualname__ = self._name
        return self._inner_jit(inner, donate_argnums=donate, donate_argnames=dnames or None)

    def _flat_jitted(
        self,
        statics: tuple[tuple[Any, Any], ...],
        n_dyn: int,
        treedef: Any,
        static_leaves: dict[int, Any],
        static_key: tuple[Any, ...],
    ) -> tuple[Callable[..., Any], Any, _Box]:
        """(direct, jitted, box): ``jax.jit`` of ``inner(*array_leaves)``, kiln's calling
        convention for executables, one per static configuration (top-level misses and
        nested calls share it, so jax's trace cache serves both).

        ``static_leaves`` (kiln.filter_jit: leaves that are not arrays, such as an equinox
        Module's functions and ints) are bound here, as ``equinox.filter_jit`` does; so are
        its non-array outputs, recorded in ``box`` per traced signature.
        """
        cache_key = (static_key, n_dyn, treedef)
        got = self._flat.get(cache_key)
        if got is not None:
            return got
        merge = self._merge(statics, n_dyn)
        n_leaves = treedef.num_leaves
        box = _Box()
        filtering = self._filter is not None
        name = self._name  # (inner must not hold self: the cycle would outlive a del)

        def direct(*dyn_leaves: Any) -> Any:
            it = iter(dyn_leaves)
            leaves = [static_leaves[i] if i in static_leaves else next(it) for i in range(n_leaves)]
            dyn_args, dyn_kwargs = treedef.unflatten(leaves)
            return merge(dyn_args, dyn_kwargs)

        def inner(*dyn_leaves: Any) -> Any:
            out = direct(*dyn_leaves)
            if not filtering:
                return out  # jax.jit's contract: jax itself refuses a non-JAX output
            out_leaves, out_tree = _tree_flatten(out)
            static_out = {i: x for i, x in enumerate(out_leaves) if not isinstance(x, _ARRAY_TYPES)}
            if not static_out:
                box.pop(_abstract_sig(dyn_leaves), None)
                return out
            for x in static_out.values():
                if not _is_static_output(x):
                    # jax.jit's error: a traced value escaping in a Python object, a generator
                    raise TypeError(
                        f"function {name} traced for jit returned a value of type "
                        f"{type(x)}, which is not a valid JAX type"
                    )
            # outputs that are not arrays (an equinox Module's functions, ints, strings) are
            # returned outside the executable, as equinox.filter_jit does
            box[_abstract_sig(dyn_leaves)] = (out_tree, static_out)
            return [x for i, x in enumerate(out_leaves) if i not in static_out]

        inner.__name__ = getattr(self._fun, "__name__", "fun")
        inner.__qualname__ = self._name
        donate = self._donated_leaves(statics, n_dyn, treedef, static_leaves)
        shardings = self._flat_shardings(treedef, static_leaves)
        got = self._flat[cache_key] = (
            direct, self._inner_jit(inner, donate_argnums=donate, **shardings), box
        )
        return got

    def _in_shardings_fit(self, dyn_args: tuple[Any, ...], dyn_kwargs: dict[str, Any]) -> bool:
        """in_shardings applies: no dynamic keyword arguments, and one entry per dynamic
        positional argument (else jax.jit's own error is raised)."""
        spec = self._in_shardings
        if dyn_kwargs:
            return False
        return not isinstance(spec, tuple | list) or len(spec) == len(dyn_args)

    def _flat_shardings(self, treedef: Any, static_leaves: dict[int, Any]) -> dict[str, Any]:
        """``in_shardings`` per array leaf (jax.jit's is a prefix of the dynamic positional
        arguments) and ``out_shardings`` as given."""
        out: dict[str, Any] = {}
        if self._out_shardings is not None:
            out["out_shardings"] = self._out_shardings
        if self._in_shardings is None:
            return out
        kids = treedef.children()[0].children()  # (checked by _in_shardings_fit)
        spec = self._in_shardings
        if not isinstance(spec, tuple | list):
            spec = (spec,) * len(kids)
        per_leaf: list[Any] = []
        for prefix, child in zip(spec, kids, strict=True):
            per_leaf += _jax_compat.broadcast_prefix(prefix, child)
        out["in_shardings"] = tuple(x for i, x in enumerate(per_leaf) if i not in static_leaves)
        return out

    def _inner_jit(self, inner: Callable[..., Any], **kwargs: Any) -> Any:
        """``jax.jit`` of one of kiln's wrappers of fun, with the user's jax.jit options (jax
        warned about a deprecated ``device`` / ``backend`` once, at decoration)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "backend and device argument", DeprecationWarning)
            return jax.jit(inner, **kwargs, **self._jit_options)

    def _donated_leaves(
        self,
        statics: tuple[tuple[Any, Any], ...],
        n_dyn: int,
        treedef: Any,
        static_leaves: dict[int, Any],
    ) -> tuple[int, ...]:
        args_def, kwargs_def = treedef.children()
        donated: list[int] = []
        if self._filter in ("all", "warn"):
            donated = list(range(treedef.num_leaves))
        elif self._filter in ("all-except-first", "warn-except-first"):
            kids = args_def.children()
            first = kids[0].num_leaves if kids else 0
            donated = list(range(first, treedef.num_leaves))
        elif not (self._donate_argnums or self._donate_argnames):
            return ()
        dyn_positions = _args.dyn_positions(statics, n_dyn)
        start = 0
        for j, child in enumerate(args_def.children()):
            if dyn_positions[j] in self._donate_argnums:
                donated += range(start, start + child.num_leaves)
            start += child.num_leaves
        names = kwargs_def.node_data()[1] or []
        for name, child in zip(names, kwargs_def.children(), strict=True):
            if name in self._donate_argnames:
                donated += range(start, start + child.num_leaves)
            start += child.num_leaves
        # renumber over dynamic (array) leaves only
        order = [i for i in range(treedef.num_leaves) if i not in static_leaves]
        index = {leaf: k for k, leaf in enumerate(order)}
        return tuple(index[i] for i in donated if i in index)

    # -- calling ------------------------------------------------------------------------------
    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Call:
        """The call's key, array leaves, dynamic and static parts (a :class:`_Call`).

        key is None under a transformation (a tracer among the leaves, or an outer trace
        the function may close over), and _PLAIN for arguments kiln.jit hands to the plain
        jax.jit (a leaf that is not a JAX type: jax's own TypeError)."""
        if _args.MULTI_DEVICE is None:
            _args.MULTI_DEVICE = jax.device_count() > 1
        if self._filter is not None and self._signature is not None:
            # equinox binds to the signature: f(x, y=1) and f(x, 1) are one program
            bound = self._signature.bind(*args, **kwargs)
            args, kwargs = bound.args, bound.kwargs
        if self._static_argnums or self._static_argnames:
            dyn_args, dyn_kwargs, statics = self._split(args, kwargs)
            static_key = self._static_key(statics) if statics else ()
        else:
            dyn_args, dyn_kwargs, statics, static_key = args, kwargs, (), ()
        leaves, treedef = _tree_flatten((dyn_args, dyn_kwargs))
        sigs = tuple(map(_args.leaf_sig if self._filter is None else _args.filter_leaf_sig, leaves))
        key: Any = None
        if self._in_shardings is not None and not self._in_shardings_fit(dyn_args, dyn_kwargs):
            key = _PLAIN  # jax.jit's error for kwargs or a prefix of another length
        elif _STATIC_LEAF in sigs:
            if self._filter is None:
                key = _PLAIN
            else:
                leaf_key, leaves = self._static_leaves(leaves, sigs, treedef)
                static_key = static_key + leaf_key
        if key is None and None not in sigs and _jax_compat.at_top_level():
            # jax's trace context includes jax_disable_jit, x64, matmul precision, ...
            key = _TableKey(_trace_context_token(), treedef, sigs, static_key)
        # else: a tracer among the arguments, or one the function may close over: behave as
        # a nested jax.jit (never compile or store a program that captured a tracer)
        return _Call(key, leaves, dyn_args, dyn_kwargs, statics, static_key, treedef, sigs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # with static arguments; without, __init__ makes the C++ dispatcher (as jax.jit's)
        # __call__: Python only runs on signatures it has not cached
        return self._python_call(args, kwargs)[0]

    def _python_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """(outputs, executable for the C++ cache or None)."""
        key, leaves, dyn_args, dyn_kwargs, statics, static_key, treedef, sigs = self._prepare(
            args, kwargs
        )
        if key is _PLAIN:
            return self._plain(*_unwrapped(args), **_unwrapped(kwargs)), None
        if key is None:
            # Under a transformation (grad, vmap, an outer jit): a nested jax.jit, the same one
            # a top-level miss traces (one trace per signature, as jax.jit)
            with self._donation_warnings():
                return self._nested_call(leaves, sigs, dyn_args, dyn_kwargs, statics,
                                         static_key, treedef), None
        call = self._table.get(key)
        if call is None:
            with self._donation_warnings():
                call = self._miss(key, dyn_args, dyn_kwargs, statics, static_key, treedef)
        else:
            self._hot_calls += 1
        try:
            outs = call(*leaves)
        except _jax_compat.InternalFloatingPointError as e:
            # jax_debug_nans / jax_debug_infs: as jax.jit, re-run op by op to name the
            # operation, raising FloatingPointError (never jax's internal exception)
            _jax_compat.raise_floating_point_error(e, self._fun, _unwrapped(args),
                                                   _unwrapped(kwargs))
        # only a plain executable over all dynamic leaves of (args, kwargs) can be cached in
        # C++ (not with filter_jit's static leaves, nor after it moved keyword arguments)
        cacheable = (isinstance(call, jax.stages.Compiled) and _STATIC_LEAF not in sigs
                     and not (kwargs and self._filter is not None))
        return outs, (call if cacheable else None)

    @contextlib.contextmanager
    def _donation_warnings(self) -> Iterator[None]:
        """filter_jit(donate="all" / "all-except-first") silences jax's warning about donated
        buffers it could not use, as equinox does."""
        if not self._filter_warning:
            yield
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            yield

    def _nested_call(
        self,
        leaves: list[Any],
        sigs: tuple[Any, ...],
        dyn_args: tuple[Any, ...],
        dyn_kwargs: dict[str, Any],
        statics: tuple[tuple[Any, Any], ...],
        static_key: tuple[Any, ...],
        treedef: Any,
    ) -> Any:
        all_leaves = (treedef.flatten_up_to((dyn_args, dyn_kwargs)) if _STATIC_LEAF in sigs
                      else leaves)
        static_leaves = {i: x for i, (x, s) in enumerate(zip(all_leaves, sigs, strict=True))
                         if s is _STATIC_LEAF}
        _, jitted, box = self._flat_jitted(statics, len(dyn_args), treedef, static_leaves,
                                           static_key)
        out = jitted(*leaves)
        static_out = box.get(_abstract_sig(leaves))
        return out if static_out is None else with_static_outputs(out, *static_out)

    def _static_leaves(
        self, leaves: list[Any], sigs: tuple[Any, ...], treedef: Any
    ) -> tuple[tuple[Any, ...], list[Any]]:
        """Split non-JAX leaves off as static (keyed by value), keeping the array leaves."""
        idx = [i for i, s in enumerate(sigs) if s is _STATIC_LEAF]
        paths = None
        try:
            key = self._static_key([(("leaf", i), leaves[i]) for i in idx])
        except StaticArgumentError:
            paths = [
                "args" + jax.tree_util.keystr(p)
                for p, _ in jax.tree_util.tree_flatten_with_path(
                    treedef.unflatten(leaves), is_leaf=lambda x: x is None
                )[0]
            ]
            names = [paths[i] if i < len(paths) else f"leaf {i}" for i in idx]
            key = self._static_key([(("leaf", i), leaves[i]) for i in idx], names)
        return key, [x for x, s in zip(leaves, sigs, strict=True) if s is not _STATIC_LEAF]

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
        key, _, dyn_args, dyn_kwargs, statics, static_key, treedef, _ = self._prepare(
            args, kwargs)
        if key is _PLAIN:
            self._plain.trace(*args, **kwargs)  # jax's TypeError naming the argument
        if key is None or key is _PLAIN:
            raise TypeError("precompile: arguments must be concrete arrays or ShapeDtypeStructs")
        if key not in self._table:
            self._miss(key, dyn_args, dyn_kwargs, statics, static_key, treedef)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """Lower for these arguments, as ``jax.jit(fun).lower(...)``: a :class:`kiln.Lowered`
        (``as_text()``, ``cost_analysis()``, ``compile()``). Its ``compile()`` loads the
        executable from the store, or compiles and stores it, and gives a
        :class:`kiln.Compiled` that takes the dynamic arguments (as ``jax.stages.Compiled``).

        Under a transformation, or with arguments kiln.jit does not take, this is jax.jit's own
        ``lower`` (jax's ``Lowered``, or jax's error).
        """
        key, leaves, dyn_args, dyn_kwargs, statics, static_key, treedef, sigs = self._prepare(
            args, kwargs)
        if key is None or key is _PLAIN:
            return self._plain.lower(*args, **kwargs)
        made: list[_Miss] = []

        def miss() -> _Miss:
            if not made:
                made.append(_Miss(self, dyn_args, dyn_kwargs, statics, static_key, treedef,
                                  key.sigs))
            return made[0]

        def lowering() -> jax.stages.Lowered:
            return miss()._trace_lower()

        def compile(compiler_options: dict[str, Any] | None = None,
                    device_assignment: Any = None) -> _stages.Compiled:
            with self._donation_warnings():
                if compiler_options is None and device_assignment is None:
                    call = self._miss(key, dyn_args, dyn_kwargs, statics, static_key, treedef,
                                      miss() if key not in self._table else None)
                else:  # JAX's compile with per-compile options: not stored
                    call = lowering().compile(compiler_options,
                                              device_assignment=device_assignment)
            return _stages.Compiled(call, self._aot_check(key, treedef, sigs, dyn_args,
                                                          dyn_kwargs, statics), lowering,
                                    lowered)

        def plain() -> jax.stages.Lowered:
            # JAX's own lowering of the call as written (args_info, in_tree, ...); filter_jit's
            # description is its lowering of the leaves, as equinox's
            return self._plain.lower(*args, **kwargs)

        lowered = _stages.Lowered(lowering, compile, plain if self._filter is None else None)
        return lowered

    def _aot_check(
        self, key: Any, treedef: Any, sigs: tuple[Any, ...], dyn_args: Any, dyn_kwargs: Any,
        statics: tuple[tuple[Any, Any], ...],
    ) -> Callable[[tuple[Any, ...], dict[str, Any]], list[Any]]:
        """``check(args, kwargs) -> leaves`` for a :class:`kiln.Compiled`: jax's AOT errors
        for another structure, shape or dtype."""
        if self._filter is not None:
            def check_all(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
                got = self._prepare(args, kwargs)
                if got.treedef != treedef:
                    raise TypeError(_stages.pytree_mismatch(got.treedef, treedef))
                if got.key != key:
                    raise TypeError(_stages.type_mismatch([
                        "arguments differ in an array's shape or dtype, or in a value that is "
                        "not an array (static under filter_jit)"]))
                return list(got.leaves)

            return check_all
        paths = _args.leaf_paths(self._positional, dyn_args, dyn_kwargs, statics)
        names = [f"'{n}'" for n in paths]
        want = [jax.typeof(s()) if isinstance(s, type) else s[0] if isinstance(s, tuple) else s
                for s in sigs]

        def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
            leaves, tree = _tree_flatten((args, kwargs))
            if tree != treedef:
                raise TypeError(_stages.pytree_mismatch(tree, treedef))
            errors = []
            for name, leaf, w in zip(names, leaves, want, strict=True):
                try:
                    a = jax.typeof(leaf)
                except TypeError:
                    raise TypeError(f"Argument {name} of type {type(leaf)} is not a valid JAX "
                                    "type") from None
                if (a.shape, a.dtype) != (w.shape, w.dtype):
                    errors.append(f"Argument {name} compiled with {w.str_short()} and called "
                                  f"with {a.str_short()}")
            if errors:
                raise TypeError(_stages.type_mismatch(errors))
            return leaves

        return check

    def trace(self, *args: Any, **kwargs: Any) -> jax.stages.Traced:
        """``jax.jit(fun).trace(...)``: jax's ``Traced`` (``jaxpr``, ``lower()``) for these
        arguments, with kiln's static argument handling; nothing is stored."""
        key, leaves, dyn_args, dyn_kwargs, statics, static_key, treedef, sigs = self._prepare(
            args, kwargs)
        if key is _PLAIN or (self._filter is None and not statics):
            return self._plain.trace(*args, **kwargs)
        if self._filter is None:
            return self._jitted(statics, len(dyn_args)).trace(*dyn_args, **dyn_kwargs)
        all_leaves = treedef.flatten_up_to((dyn_args, dyn_kwargs))
        static_leaves = {i: x for i, (x, s) in enumerate(zip(all_leaves, sigs, strict=True))
                         if s is _STATIC_LEAF}
        jitted = self._flat_jitted(statics, len(dyn_args), treedef, static_leaves, static_key)[1]
        return jitted.trace(*leaves)  # type: ignore[no-any-return]

    def clear_cache(self) -> None:
        """Forget this process's executables (the store is untouched)."""
        with self._lock:
            if self._dispatch is not None:
                self._dispatch._clear_cache()  # type: ignore[attr-defined]
            self._table.clear()
            self._flat.clear()

    # -- misses -------------------------------------------------------------------------------
    def _miss(
        self,
        key: Any,
        dyn_args: tuple[Any, ...],
        dyn_kwargs: dict[str, Any],
        statics: tuple[tuple[Any, Any], ...],
        static_key: tuple[Any, ...],
        treedef: Any,
        miss: _Miss | None = None,
    ) -> Any:
        with self._lock:
            compiled = self._table.get(key)
            if compiled is not None:
                return compiled
            if miss is None:
                miss = _Miss(self, dyn_args, dyn_kwargs, statics, static_key, treedef, key.sigs)
            if _jax_compat.jit_disabled():
                self._table[key] = miss.uncompiled
                return miss.uncompiled
            miss.memory_reason = self._memory_miss_reason(
                key, dyn_args, dyn_kwargs, statics, miss.cfg
            )
            if miss.memory_reason and "re-created" in miss.memory_reason[1]:
                miss._log_memory_reason()  # costly even when the store hits: say it now
            compiled = miss.run()
            self._table[key] = compiled
            self._entries.append(miss.entries)  # (tier-up may add to it later)
            if miss.start_tier_up:
                _tier_up.start(miss, functools.partial(self._swap_in, key))
            return compiled

    def _swap_in(self, key: Any, compiled: Any) -> None:
        """Put a tier-up's inlined executable in place of the first one for ``key`` (unless
        the table was cleared meanwhile)."""
        with self._lock:
            if key in self._table:
                self._table[key] = compiled
                if self._dispatch is not None:
                    self._dispatch._clear_cache()  # type: ignore[attr-defined]

    def _memory_miss_reason(
        self, key: Any, dyn_args: Any, dyn_kwargs: Any, statics: Any, cfg: Config
    ) -> tuple[str, str] | None:
        """(kind, message) explaining why this call missed the in-process table."""
        if not (cfg.explain or logger.isEnabledFor(logging.DEBUG)):
            return None
        if not self._table:
            n = _creations.get(_code_of(self._fun), 0)
            hint = (
                f" (kiln.jit was applied to {n} function objects with this code in this "
                "process: if it is re-created on every call, hoist the kiln.jit(...) out of the "
                "loop or function)" if n > 2 else ""
            )
            return "new-function", f"{self._name}: first call in this process{hint}"
        paths = _args.leaf_paths(self._positional, dyn_args, dyn_kwargs, statics)
        new = (key.treedef, paths, key.sigs, key.static_key)
        seen = [(k.treedef, paths, k.sigs, k.static_key) for k in self._table]
        return "signature", _explain.describe_signature_change(self._name, new, seen)


_creations: dict[Any, int] = {}


def _code_of(fun: Any) -> Any:
    return getattr(fun, "__code__", None) or id(type(fun))


def _note_creation(fun: Any) -> None:
    code = _code_of(fun)
    _creations[code] = _creations.get(code, 0) + 1

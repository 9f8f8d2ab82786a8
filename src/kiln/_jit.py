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
import difflib
import functools
import inspect
import logging
import os
import sys
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar, overload

import jax
import numpy as np

from . import _explain, _jax_compat, _noinline, _stages, _stats, _tier_up
from ._config import Config, get_config
from ._entry import decode, encode
from ._errors import EntryError, StaticArgumentError, StoreError, StoreWarning, VerifyError
from ._fingerprint import TraceRecorder, check_manifest, fingerprint, manifest_for
from ._hashing import Unpersistable, static_digest
from ._key import environment_parts, make_key
from ._progress import compiling
from .stores import Store, open_store

__all__ = ["jit", "filter_jit", "JitFunction"]

logger = logging.getLogger("kiln")
F = TypeVar("F", bound=Callable[..., Any])

_ArrayImpl = _jax_compat.ArrayImpl
_tree_flatten = jax.tree_util.tree_flatten
# Set on the first call (not at import: importing kiln must not start the XLA backend).
_MULTI_DEVICE: bool | None = None
_trace_context_token = _jax_compat.trace_context_token
_instances: weakref.WeakSet[JitFunction] = weakref.WeakSet()


def hot_calls() -> int:
    """Calls served from the in-process tables of all live kiln.jit functions."""
    return sum(f._hot_calls for f in list(_instances))


_stats.register_hot_counter(hot_calls)
_SCALARS = (int, float, bool, complex)
_VERIFY_ONLY = object()
_PLAIN = object()  # _prepare: hand the call to the plain jax.jit (jax's own errors)


class _Box(dict[Any, Any]):
    """Non-array outputs of a flat jax.jit (kiln.filter_jit), per traced signature
    (``_abstract_sig`` of its array leaves): ``(out_tree, {leaf index: value})``."""
_STATIC_LEAF = "<static leaf>"


def _leaf_sig(x: Any) -> Any:
    """In-process signature of one leaf: its aval (shape, dtype, weak_type, sharding), the
    Python type for Python scalars, None for a tracer, _STATIC_LEAF for a non-JAX value."""
    t = type(x)
    if t is _ArrayImpl:
        # with several devices the sharding (and committed device) picks the executable
        return (x.aval, x.sharding) if _MULTI_DEVICE else x.aval
    if t in _SCALARS:
        return t
    if _jax_compat.is_tracer(x):
        return None
    try:
        aval = jax.typeof(x)
    except TypeError:
        return _STATIC_LEAF  # not a JAX type (a function, a string, ...): static by value
    if not hasattr(aval, "weak_type"):
        return None  # a token (jax.lax.create_token): run as a plain nested jax.jit
    return aval


def _filter_leaf_sig(x: Any) -> Any:
    """``kiln.filter_jit``'s signature of one leaf (equinox's contract): JAX and numpy arrays
    are traced (their aval), a tracer gives None, everything else (Python scalars too) is
    _STATIC_LEAF."""
    t = type(x)
    if t is _ArrayImpl:
        return (x.aval, x.sharding) if _MULTI_DEVICE else x.aval
    if _jax_compat.is_tracer(x):
        return None
    if isinstance(x, _SIG_TYPES):  # (precompile takes structs)
        return jax.typeof(x)
    return _STATIC_LEAF


# equinox.is_array: what filter_jit traces; every other leaf is static
_ARRAY_TYPES = (np.ndarray, np.generic, jax.Array)
_SIG_TYPES = (*_ARRAY_TYPES, jax.ShapeDtypeStruct)  # (precompile takes structs)


def _abstract_sig(leaves: Sequence[Any]) -> tuple[Any, ...]:
    """(shape, dtype, weak_type) per traced leaf: which trace a function's non-array outputs
    came from (one flat jax.jit serves every signature of a static configuration)."""
    out = []
    for x in leaves:
        a = jax.typeof(x)  # a Python scalar as jax traces it (weakly typed)
        out.append((tuple(getattr(a, "shape", ())), str(getattr(a, "dtype", a)),
                    bool(getattr(a, "weak_type", False))))
    return tuple(out)


def _is_jax_value(x: Any) -> bool:
    if isinstance(x, jax.Array | np.ndarray | np.generic | int | float | complex | bool):
        return True
    if _jax_compat.is_tracer(x):
        return True
    try:
        jax.typeof(x)
        return True
    except TypeError:
        return False


_shared: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()
_shared_lock = threading.Lock()


def _shared_state(fun: Any, options: Any) -> tuple[dict[Any, Any], list[Any], threading.RLock]:
    """(in-process table, signatures seen, lock) for ``fun`` with ``options``: one per
    function object and options while the function lives; private when ``fun`` cannot be
    weakly referenced or hashed (a bound method is a new object on every access)."""
    fresh: tuple[dict[Any, Any], list[Any], threading.RLock] = ({}, [], threading.RLock())
    if isinstance(fun, types.MethodType):
        return fresh
    try:
        with _shared_lock:
            return _shared.setdefault(fun, {}).setdefault(options, fresh)  # type: ignore[no-any-return]
    except TypeError:  # not hashable, or no weak references
        return fresh


def _jit_option_text(v: Any) -> str:
    """Canonical text of a jax.jit option for the key: a device by platform, kind and id; a
    dict by sorted items."""
    if isinstance(v, dict):
        return repr(sorted((str(k), repr(x)) for k, x in v.items()))
    if hasattr(v, "platform") and hasattr(v, "id"):
        return f"{v.platform}:{getattr(v, 'device_kind', '?')}:{v.id}"
    return repr(v)


def _option_text(v: Any) -> str | None:
    """Canonical text of ``in_shardings`` / ``out_shardings`` (a pytree of shardings): each
    sharding by mesh, devices and partition spec (``_jax_compat.sharding_text``)."""
    if v is None:
        return None
    leaves, tree = jax.tree_util.tree_flatten(v, is_leaf=lambda x: x is None)
    texts = [
        "None" if x is None else
        _jax_compat.sharding_text(x) if isinstance(x, jax.sharding.Sharding) else repr(x)
        for x in leaves
    ]
    return f"{tree}:{texts}"


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


def _is_static_output(x: Any, depth: int = 4) -> bool:
    """Whether a non-array output leaf can be returned outside the executable (as
    ``equinox.filter_jit`` does): not an iterator or generator, and holding no tracer (a
    traced value inside a Python object would leak out of the trace)."""
    if _jax_compat.is_tracer(x):
        return False
    if isinstance(x, types.GeneratorType | types.CoroutineType | types.AsyncGeneratorType) or (
        hasattr(x, "__next__") and hasattr(x, "__iter__")
    ):
        return False
    if depth == 0:
        return True
    if isinstance(x, list | tuple | set | frozenset):
        return all(_is_static_output(v, depth - 1) for v in x)
    if isinstance(x, dict):
        return all(_is_static_output(v, depth - 1) for v in x.values())
    state = getattr(x, "__dict__", None)
    if isinstance(state, dict) and not isinstance(x, type | types.ModuleType | types.FunctionType):
        return all(_is_static_output(v, depth - 1) for v in state.values())
    return True


def _with_static_outputs(compiled: Any, out_tree: Any, static_out: dict[int, Any]) -> Any:
    """Wrap an executable whose non-JAX outputs were split off at trace time."""
    n = out_tree.num_leaves

    def call(*leaves: Any) -> Any:
        it = iter(compiled(*leaves))
        return out_tree.unflatten([static_out[i] if i in static_out else next(it)
                                   for i in range(n)])

    return call


def _aval_text(sig: Any) -> str:
    """``float32[3]``, ``float32[]~weak``, ``python-float``: canonical, used in keys."""
    if isinstance(sig, type):
        return f"python-{sig.__name__}"
    sharding = ""
    if isinstance(sig, tuple):  # (aval, sharding) when there are several devices
        sig, sharding = sig[0], f"@{_jax_compat.sharding_text(sig[1])}"
    weak = "~weak" if sig.weak_type else ""
    return f"{sig.dtype}{list(sig.shape)}{weak}{sharding}"


def _treedef_parts(treedef: Any) -> tuple[str, list[tuple[str, Any]]]:
    """(structure text with node types only, [(name, aux data)] for the fingerprint)."""
    aux: list[tuple[str, Any]] = []

    def walk(t: Any, path: str) -> str:
        data = t.node_data()
        if data is None:
            return "*"
        typ, node_aux = data
        kids = [walk(c, f"{path}/{i}") for i, c in enumerate(t.children())]
        if typ not in (tuple, list, dict, type(None)):
            aux.append((f"pytree-aux{path}", (typ, node_aux)))
        elif typ is dict:
            aux.append((f"pytree-keys{path}", tuple(node_aux)))
        return f"{typ.__module__}.{typ.__qualname__}({','.join(kids)})"

    return walk(treedef, ""), aux


def check_argnames(
    fun: Callable[..., Any], params: list[inspect.Parameter], names: list[tuple[str, str]],
    prefix: str = "",
) -> None:
    """Refuse an ``(option, name)`` naming no parameter of ``fun`` (unless it takes
    ``**kwargs``, or its signature is unknown: ``params`` empty).

    Raises:
        ValueError: naming the option, the function, its parameters and the closest one.
    """
    known = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not params or any(p.kind == p.VAR_KEYWORD for p in params):
        return
    for option, n in names:
        if n not in known:
            close = difflib.get_close_matches(n, known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"{prefix}{option}: {getattr(fun, '__name__', fun)!r} has no parameter {n!r}; "
                f"its parameters are {known}.{hint}"
            )


def _normalize_argnums(argnums: int | Iterable[int] | None, name: str) -> tuple[int, ...]:
    if argnums is None:
        return ()
    if isinstance(argnums, int):
        return (argnums,)
    try:
        out = tuple(argnums)
    except TypeError:
        raise TypeError(f"{name} must be an int or a sequence of ints, got {argnums!r}") from None
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in out):
        raise TypeError(f"{name} must be an int or a sequence of ints, got {argnums!r}")
    return out


def _normalize_argnames(argnames: str | Iterable[str] | None, name: str) -> tuple[str, ...]:
    if argnames is None:
        return ()
    if isinstance(argnames, str):
        return (argnames,)
    out = tuple(argnames)
    if not all(isinstance(s, str) for s in out):
        raise TypeError(f"{name} must be a str or a sequence of str, got {argnames!r}")
    return out


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
        # kiln.filter_jit (equinox's contract): its donate mode; None for kiln.jit
        self._filter = _filter
        self._filter_warning = _filter in ("all", "all-except-first")
        nums = _normalize_argnums(static_argnums, "static_argnums")
        names = _normalize_argnames(static_argnames, "static_argnames")
        dnums = _normalize_argnums(donate_argnums, "donate_argnums")
        dnames = _normalize_argnames(donate_argnames, "donate_argnames")
        try:
            params = list(inspect.signature(fun).parameters.values())
        except (TypeError, ValueError):
            params = []
        positional = [
            p.name for p in params
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        check_argnames(fun, params, [("static_argnames", n) for n in names]
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
        self._table, self._seen, self._lock = _shared_state(fun, (
            self._static_argnums, self._static_argnames, self._donate_argnums,
            self._donate_argnames, repr(sorted(self._jit_options.items())), _filter,
            _option_text(in_shardings), _option_text(out_shardings),
        ))
        # flat jax.jit of fun per static configuration, for top-level misses and nested calls
        # alike (so a function called both ways traces once per signature, as jax.jit does)
        self._flat: dict[Any, tuple[Any, Any, _Box]] = {}
        self._hot_calls = 0
        self._tier_up = True  # False for kiln.noinline's own executables
        self._has_statics = bool(self._static_argnums or self._static_argnames)
        _instances.add(self)
        self._name = getattr(fun, "__qualname__", type(fun).__qualname__)
        self._module = getattr(fun, "__module__", None) or type(fun).__module__
        self._dispatch = (
            None if self._has_statics
            else _jax_compat.make_dispatcher(self._name, _weakly(self, "_python_call"),
                                         _weakly(self, "_fun"))
        )
        if self._dispatch is not None:
            # Python looks __call__ up on the type: in a class of its own whose __call__ is the
            # C++ dispatcher, a cached signature runs with no Python frame in between. With a
            # Python __call__ forwarding to it, benchmarks/per_call.py measured 1.12x jax.jit
            # on `x * y + 1` (now 1.02x; docs/benchmarks.md).
            self.__class__ = type(
                "JitFunction", (JitFunction,),
                {"__call__": staticmethod(self._dispatch), "__slots__": (),
                 "__module__": JitFunction.__module__, "__qualname__": "JitFunction"},
            )
        _note_creation(fun)

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

    def __reduce__(self) -> str:
        # pickled by reference, as functions and jax.jit's are: a module-level kiln.jit
        # function unpickles as itself; anything else fails naming the function
        return str(getattr(self, "__qualname__", self._name))

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
                    statics.append((i, a))
                else:
                    dyn.append(a)
            args = tuple(dyn)
        if self._static_argnames and kwargs:
            dkw = {}
            for k, v in kwargs.items():
                if k in self._static_argnames:
                    statics.append((k, v))
                else:
                    dkw[k] = v
            kwargs = dkw
        return args, kwargs, tuple(statics)

    def _param_name(self, where: Any) -> Any:
        """The key name of a static argument: its parameter name when the signature gives one
        (so ``f(x, t)`` and ``f(x, table=t)`` share an executable), else ``args[i]``; static
        leaves keep their ``("leaf", i)`` position."""
        if isinstance(where, int):
            if 0 <= where < len(self._positional):
                return self._positional[where]
            return f"args[{where}]"
        return where

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
        pos = {w: v for w, v in statics if isinstance(w, int)}
        kw = {w: v for w, v in statics if isinstance(w, str)}
        total = n_dyn + len(pos)
        pos = {(w if w >= 0 else total + w): v for w, v in pos.items()}

        def call(dyn: Sequence[Any], dkw: dict[str, Any]) -> Any:
            it = iter(dyn)
            args = [pos[i] if i in pos else next(it) for i in range(total)]
            return fun(*args, **dkw, **kw)

        return call

    def _jitted(self, statics: tuple[tuple[Any, Any], ...], n_dyn: int) -> Any:
        """A plain ``jax.jit`` of fun with the statics bound (used under transformations)."""
        merge = self._merge(statics, n_dyn)
        dyn_positions = _dyn_positions(statics, n_dyn)
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
        shardings = self._flat_shardings(statics, n_dyn, treedef, static_leaves)
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

    def _flat_shardings(
        self,
        statics: tuple[tuple[Any, Any], ...],
        n_dyn: int,
        treedef: Any,
        static_leaves: dict[int, Any],
    ) -> dict[str, Any]:
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
        dyn_positions = _dyn_positions(statics, n_dyn)
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
    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """(key, array leaves, dyn_args, dyn_kwargs, statics, static_key, treedef, sigs).

        key is None under a transformation (a tracer among the leaves, or an outer trace
        the function may close over), and _PLAIN for arguments kiln.jit hands to the plain
        jax.jit (a leaf that is not a JAX type: jax's own TypeError)."""
        global _MULTI_DEVICE
        if _MULTI_DEVICE is None:
            _MULTI_DEVICE = jax.device_count() > 1
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
        sigs = tuple(map(_leaf_sig if self._filter is None else _filter_leaf_sig, leaves))
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
            key = (_trace_context_token(), treedef, sigs, static_key)
        # else: a tracer among the arguments, or one the function may close over: behave as
        # a nested jax.jit (never compile or store a program that captured a tracer)
        return key, leaves, dyn_args, dyn_kwargs, statics, static_key, treedef, sigs

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
            return self._plain(*args, **kwargs), None
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
            _jax_compat.raise_floating_point_error(e, self._fun, args, kwargs)
        # only a plain executable over all leaves of (args, kwargs) can be cached in C++ (not
        # after filter_jit moved keyword arguments to their positions)
        cacheable = (isinstance(call, jax.stages.Compiled) and not static_key
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
        if static_out is None:
            return out
        out_tree, values = static_out
        it = iter(out)
        return out_tree.unflatten([values[i] if i in values else next(it)
                                   for i in range(out_tree.num_leaves)])

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
                                  key[2]))
            return made[0]

        def lowering() -> jax.stages.Lowered:
            return miss()._trace_lower()

        def compile() -> _stages.Compiled:
            with self._donation_warnings():
                call = self._miss(key, dyn_args, dyn_kwargs, statics, static_key, treedef,
                                  miss() if key not in self._table else None)
            return _stages.Compiled(call, self._aot_check(key, treedef, sigs, dyn_args,
                                                          dyn_kwargs, statics),
                                    call, lowering)

        return _stages.Lowered(lowering, compile)

    def _aot_check(
        self, key: Any, treedef: Any, sigs: tuple[Any, ...], dyn_args: Any, dyn_kwargs: Any,
        statics: tuple[tuple[Any, Any], ...],
    ) -> Callable[[tuple[Any, ...], dict[str, Any]], list[Any]]:
        """``check(args, kwargs) -> leaves`` for a :class:`kiln.Compiled`: jax's AOT errors
        for another structure, shape or dtype."""
        if self._filter is not None:
            def check_all(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
                got = self._prepare(args, kwargs)
                if got[6] != treedef:
                    raise TypeError(_stages.pytree_mismatch(got[6], treedef))
                if got[0] != key:
                    raise TypeError(_stages.type_mismatch([
                        "arguments differ in an array's shape or dtype, or in a value that is "
                        "not an array (static under filter_jit)"]))
                return list(got[1])

            return check_all
        names = [f"'{n}'" for n in _leaf_paths(self, dyn_args, dyn_kwargs, statics)]
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
            self._seen.clear()
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
                miss = _Miss(self, dyn_args, dyn_kwargs, statics, static_key, treedef, key[2])
            if _jax_compat.jit_disabled():
                self._table[key] = miss.inner
                return miss.inner
            miss.memory_reason = self._memory_miss_reason(
                key, dyn_args, dyn_kwargs, statics, miss.cfg
            )
            if miss.memory_reason and "re-created" in miss.memory_reason[1]:
                miss._log_memory_reason()  # costly even when the store hits: say it now
            compiled = miss.run()
            self._table[key] = compiled
            self._seen.append(key)
            if miss.tier_up:
                _tier_up.start(miss, key)
            return compiled

    def _memory_miss_reason(
        self, key: Any, dyn_args: Any, dyn_kwargs: Any, statics: Any, cfg: Config
    ) -> tuple[str, str] | None:
        """(kind, message) explaining why this call missed the in-process table."""
        if not (cfg.explain or logger.isEnabledFor(logging.DEBUG)):
            return None
        if not self._seen:
            n = _creations.get(_code_of(self._fun), 0)
            hint = (
                f" (kiln.jit was applied to {n} function objects with this code in this "
                "process: if it is re-created on every call, hoist the kiln.jit(...) out of the "
                "loop or function)" if n > 2 else ""
            )
            return "new-function", f"{self._name}: first call in this process{hint}"
        paths = _leaf_paths(self, dyn_args, dyn_kwargs, statics)
        new = (key[1], paths, key[2], key[3])
        seen = [(k[1], paths, k[2], k[3]) for k in self._seen]
        return "signature", _explain.describe_signature_change(self._name, new, seen)


_creations: dict[Any, int] = {}


def _code_of(fun: Any) -> Any:
    return getattr(fun, "__code__", None) or id(type(fun))


def _note_creation(fun: Any) -> None:
    code = _code_of(fun)
    _creations[code] = _creations.get(code, 0) + 1


_KILN_DIR = os.path.dirname(os.path.abspath(__file__))


# Stores (by URL) that already gave this process its one warning (see _Miss._store_fault).
_faulted_stores: set[str] = set()
_faulted_lock = threading.Lock()


def _user_stacklevel() -> int:
    """stacklevel for warnings.warn that points at the first frame outside kiln and jax."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None:
        f = frame.f_code.co_filename
        if not (f.startswith(_KILN_DIR) or f"{os.sep}jax{os.sep}" in f or f"{os.sep}jaxlib" in f):
            return level
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return 1


def _dyn_positions(statics: tuple[tuple[Any, Any], ...], n_dyn: int) -> list[int]:
    """Original positions of the dynamic positional arguments (static positions removed)."""
    pos = [w for w, _ in statics if isinstance(w, int)]
    total = n_dyn + len(pos)
    taken = {w if w >= 0 else total + w for w in pos}
    return [i for i in range(total) if i not in taken]


def _leaf_paths(
    jf: JitFunction, dyn_args: Any, dyn_kwargs: Any, statics: tuple[tuple[Any, Any], ...]
) -> list[str]:
    """Readable path of every leaf of (dyn_args, dyn_kwargs): ``x``, ``model.layers[0].weight``,
    ``kwargs['y']``, using parameter names where the signature gives them."""
    dyn_positions = _dyn_positions(statics, len(dyn_args))
    out = []
    flat = jax.tree_util.tree_flatten_with_path((dyn_args, dyn_kwargs), is_leaf=lambda x: False)
    for path, _ in flat[0]:
        head, rest = path[0].idx, path[1:]  # type: ignore[attr-defined]
        if head == 0:
            j = rest[0].idx  # type: ignore[attr-defined]
            name = jf._param_name(dyn_positions[j]) if j < len(dyn_positions) else f"args[{j}]"
            out.append(name + jax.tree_util.keystr(tuple(rest[1:])))
        else:
            name = str(getattr(rest[0], "key", rest[0]))
            out.append(name + jax.tree_util.keystr(tuple(rest[1:])))
    return out


# Static values whose digest is all there is to them (no code, no class behind them).
_PLAIN_STATIC = (type(None), bool, int, float, complex, str, bytes, np.ndarray, np.generic,
                 jax.Array)


class _Miss:
    """One in-process miss: load from the store or compile, then store."""

    def __init__(
        self,
        jf: JitFunction,
        dyn_args: tuple[Any, ...],
        dyn_kwargs: dict[str, Any],
        statics: tuple[tuple[Any, Any], ...],
        static_key: tuple[Any, ...],
        treedef: Any,
        sigs: tuple[Any, ...],
    ) -> None:
        self.jf = jf
        self.cfg = cfg = get_config()
        all_leaves = treedef.flatten_up_to((dyn_args, dyn_kwargs))
        static_leaves = {i: x for i, (x, s) in enumerate(zip(all_leaves, sigs, strict=True))
                         if s is _STATIC_LEAF}
        self.leaves = [x for i, x in enumerate(all_leaves) if i not in static_leaves]
        self.inner, self.jitted, box = jf._flat_jitted(
            statics, len(dyn_args), treedef, static_leaves, static_key
        )
        self.box, self.box_sig = box, _abstract_sig(self.leaves)
        sigs = tuple(s for s in sigs if s is not _STATIC_LEAF)
        arg_statics = statics
        statics = statics + tuple((("leaf", i), x) for i, x in static_leaves.items())
        self.store: Store = open_store(cfg)
        self.lowered: jax.stages.Lowered | None = None
        self.traced: jax.stages.Traced | None = None
        # tier-up (kiln._tier_up): set when this program calls kiln.noinline functions and its
        # inlined form should be compiled in the background; key / manifest of the entry
        self.tier_up = False
        self.key: str | None = None
        self.fp_key: str | None = None
        self.inlined_size = 0  # equations once its noinline calls are inlined
        self.lowered_digest: str | None = None
        self.lapack = True
        # the inlined form's lowering (tier-up), and its key on the verify path
        self.inlined_lowered: jax.stages.Lowered | None = None
        self.inlined_digest: str | None = None
        self.inlined_lapack = True
        self.inlined_key: str | None = None
        self.candidate: bool | None = None  # memos of _tier_up_candidate, _inline_directly
        self.direct: bool | None = None
        self.calls: set[Any] = set()  # code the cold trace ran (see TraceRecorder)
        self.imported: tuple[str, ...] = ()  # user modules the cold trace imported
        self.trace_seconds = 0.0
        structure, aux = _treedef_parts(treedef)
        self.signature = avals_text = ", ".join(_aval_text(s) for s in sigs)
        extra = list(aux)
        self.unsound: str | None = None
        static_parts = []
        values = {jf._param_name(where): value for where, value in statics}
        leaf_paths = _leaf_paths(jf, dyn_args, dyn_kwargs, statics) if static_leaves else []
        self.static_text = []
        for keyname, digest in static_key:
            value = values[keyname]
            if isinstance(keyname, str):
                name = keyname
            else:
                i = keyname[1]
                name = f"leaf {leaf_paths[i] if i < len(leaf_paths) else i}"
            if isinstance(digest, tuple):
                # callables are fingerprinted by code in the walk below; others are unsound
                if not callable(value):
                    self.unsound = (
                        f"static argument {name} ({type(value).__name__}) has no canonical "
                        "digest, so kiln cannot tell whether a stored executable was built for "
                        "it; give its class a __kiln_digest__ method or make it a frozen "
                        "dataclass of plain values"
                    )
                digest = "see-fingerprint"
            if not isinstance(value, _PLAIN_STATIC):
                # a static value is walked with the function's code, each one: a function's
                # code and closure, a dataclass's methods and class variables count too
                extra.append((f"static:{name}", value))
            static_parts.append((f"static:{name}", str(digest)))
            self.static_text.append(
                f"{name}=(by code)" if digest == "see-fingerprint" else f"{name}={str(digest)[:8]}"
            )
        if self.static_text:
            self.signature += "; static " + ", ".join(self.static_text)
        self.modules_before = set(sys.modules)  # what the static walk below can see
        t0 = time.perf_counter()
        self.fp = fingerprint(jf._fun, extra=extra)
        _stats.bump(fingerprint_seconds=time.perf_counter() - t0)
        if not self.fp.sound and self.unsound is None:
            self.unsound = self.fp.reason
        self.base_parts = environment_parts() + [
            ("function", f"{jf._module}.{jf._name}"),
            ("signature", f"{structure} :: {avals_text}"),
            *static_parts,
            *[(f"jit:{k}", _jit_option_text(v)) for k, v in sorted(jf._jit_options.items())],
            *[(f"jit:{k}", str(_option_text(v))) for k, v in
              (("in_shardings", jf._in_shardings), ("out_shardings", jf._out_shardings))
              if v is not None],
        ]
        donated = jf._donated_leaves(arg_statics, len(dyn_args), treedef,
                                     static_leaves)
        if donated:
            # a donating executable deletes its inputs: never served to a call that keeps them
            self.base_parts.append(("jit:donated-leaves", str(list(donated))))
        if jf._filter is not None:
            # equinox's contract (non-array outputs outside the executable)
            self.base_parts.append(("jit:contract", "filter_jit"))
        self.fp_parts = [("fingerprint", self.fp.digest)]
        self.memory_reason: tuple[str, str] | None = None

    # -- helpers ----------------------------------------------------------------------------
    def _log_memory_reason(self) -> None:
        """Say why this call missed in process, once, and only when kiln will not hit."""
        if self.memory_reason is not None:
            _explain.explain(*self.memory_reason, explain_on=self.cfg.explain)
            self.memory_reason = None

    def _warn(self, message: str, then: str) -> None:
        """A bad entry: a warning pointing at the user's call (``then`` says what kiln does
        next), or with ``KILN_STRICT=1`` a :class:`StoreError`."""
        if self.cfg.strict:
            raise StoreError(f"{message} (KILN_STRICT=1 makes this an error; unset it to warn "
                             "and recompile)")
        warnings.warn(f"{message}; {then}", StoreWarning, stacklevel=_user_stacklevel())

    def _store_fault(self, doing: str, e: BaseException) -> None:
        """The store itself failed (I/O, its index, a refused directory): counted; one warning
        per store per process, then quiet (the program goes on compiling in memory); with
        ``KILN_STRICT=1`` a :class:`StoreError`."""
        _stats.bump(store_errors=1)
        message = f"kiln: cannot {doing} store {self.store.url!r} ({e})"
        if self.cfg.strict:
            raise StoreError(f"{message} (KILN_STRICT=1 makes this an error; unset it to warn "
                             "once and go on without the store)") from None
        with _faulted_lock:
            if self.store.url in _faulted_stores:
                logger.debug("%s", message)
                return
            _faulted_stores.add(self.store.url)
        warnings.warn(
            f"{message}; compiling in memory (further problems with this store are counted in "
            "kiln.stats().store_errors, not repeated)", StoreWarning,
            stacklevel=_user_stacklevel(),
        )

    def _explain(self, kind: str, message: str) -> None:
        _explain.explain(kind, f"{self.jf._name}: {message}", explain_on=self.cfg.explain)

    def _trace(self) -> jax.stages.Traced:
        if self.traced is None:
            t0 = time.perf_counter()
            with TraceRecorder(self.modules_before) as recorded:
                traced = self.traced = self.jitted.trace(*self.leaves)
            self.calls = _jax_compat.codes_in_jaxpr(traced.jaxpr) | recorded.codes
            self.imported = recorded.imported
            _stats.bump(traces=1)
            self.trace_seconds += time.perf_counter() - t0
        return self.traced

    def _trace_lower(self) -> jax.stages.Lowered:
        """The program as traced, lowered with its noinline calls not inlined (the canonical
        lowering: its digest is the verify path's key)."""
        if self.lowered is None:
            traced = self._trace()
            t0 = time.perf_counter()
            self.lowered = traced.lower()
            self.lowered_digest, self.lapack = _jax_compat.lowered_facts(self.lowered)
            self.trace_seconds += time.perf_counter() - t0
        return self.lowered

    def _inlined_lowering(self, args: list[Any] | None = None) -> jax.stages.Lowered:
        """The program as traced, lowered with its noinline calls inlined (tier-up's form);
        ``args``: its abstract arguments, when the leaves may be gone (donated)."""
        if self.inlined_lowered is None:
            self._trace()
            lowered = _tier_up.lower_inlined(self, args or _tier_up.structs(self.leaves))
            self.inlined_digest, self.inlined_lapack = _jax_compat.lowered_facts(lowered)
            self.inlined_lowered = lowered
        return self.inlined_lowered

    def _lowering_of(self, inlined: bool) -> jax.stages.Lowered:
        """A fresh lowering of the program, with its noinline calls inlined (the form of a
        tier-up's entry) or not."""
        return self._inlined_lowering() if inlined else self._trace_lower()

    def _verify_key(self, inlined: bool = False) -> str:
        """The key of the verify path: the lowered module's digest, of the inlined form for
        an entry of tier-up's form (that form holds the noinline functions' code too)."""
        if inlined:
            self._inlined_lowering()
            return make_key(self.base_parts + [("lowered-inlined", str(self.inlined_digest))])
        self._trace_lower()
        return make_key(self.base_parts + [("lowered", str(self.lowered_digest))])

    def _verify_path(self, t_start: float) -> Any:
        """Load or compile under keys of the lowered module (the fingerprint is not sound)."""
        self._trace()
        if self.cfg.tier_up and self._tier_up_candidate():
            # its inlined form (compiled directly or by a tier-up) is stored under its own key
            self.inlined_key = self._verify_key(inlined=True)
            got = self._load(self.inlined_key, t_start)
            if got is not None and got is not _VERIFY_ONLY:
                return got
            if self._inline_directly():
                return self._compile_and_store(self.inlined_key, None, t_start)
        vkey = self._verify_key()
        got = self._load(vkey, t_start)
        if got is not None and got is not _VERIFY_ONLY:
            return got
        return self._compile_and_store(vkey, None, t_start)

    # -- the flow -----------------------------------------------------------------------------
    def run(self) -> Any:
        t_start = time.perf_counter()
        fp_key = None if self.unsound else make_key(self.base_parts + self.fp_parts)
        self.fp_key = fp_key
        if fp_key is not None:
            got = self._load(fp_key, t_start)
            if got is not None and got is not _VERIFY_ONLY:
                return got
            if got is _VERIFY_ONLY:
                self.unsound = "manifest could not be fingerprinted (recorded on the first run)"
        if self.unsound is not None:
            self._explain("verify-path", f"taking the verify path: {self.unsound}")
            return self._verify_path(t_start)
        self._trace()
        t0 = time.perf_counter()
        manifest, reason = manifest_for(self.calls, self.fp, self.imported)
        _stats.bump(fingerprint_seconds=time.perf_counter() - t0)
        assert fp_key is not None  # internal invariant: the fingerprint was sound
        if reason is not None:
            self._explain("verify-path", f"taking the verify path: {reason}")
            marker = {"kind": "verify-only", "function": f"{self.jf._module}.{self.jf._name}",
                      "signature": self.signature, "reason": reason, "created": time.time()}
            self._put(fp_key, marker, {})
            return self._verify_path(t_start)
        return self._compile_and_store(fp_key, manifest, t_start)

    def _load(self, key: str, t_start: float) -> Any:
        try:
            blob = self.store.get(key)
        except (OSError, StoreError) as e:
            self._store_fault("read", e)
            return None
        if blob is None:
            self._log_memory_reason()
            self._explain_persistent_miss(key)
            return None
        try:
            entry = decode(blob, signing_key=self.cfg.signing_key)
            if entry.header.get("key") != key:
                # a valid entry stored under another key (a swapped or copied file)
                raise EntryError(f"entry was written for key {str(entry.header.get('key'))[:12]}")
        except EntryError as e:
            _stats.bump(bad_entries=1)
            self._warn(
                f"kiln: entry {key[:12]} of {self.jf._name} in {self.store.url!r} is unusable "
                f"({e})", "recompiling and replacing it",
            )
            return None
        header = entry.header
        if header.get("kind") == "verify-only":
            return _VERIFY_ONLY
        if header.get("tier") == "noinline" and self.cfg.tier_up and self.jf._tier_up:
            # stored before its inlined form was ready: tier up in this process
            self.tier_up, self.key = True, key
        t0 = time.perf_counter()
        changed = check_manifest(header.get("manifest") or [])
        _stats.bump(fingerprint_seconds=time.perf_counter() - t0)
        if changed is not None:
            self._explain("manifest", f"stored entry is stale: {changed}")
            return None
        t0 = time.perf_counter()
        callbacks = None
        # the form the entry was compiled from (its "lowered" digest is of that form): an
        # inlined entry (tier-up) has other host callbacks than the not-inlined lowering
        inlined_form = header.get("tier") == "inlined"
        if header.get("callbacks") == "trace" or self.cfg.verify:
            lowered = self._lowering_of(inlined_form)
            digest = self.inlined_digest if inlined_form else self.lowered_digest
            if digest != header.get("lowered"):
                if self.cfg.verify:
                    raise VerifyError(
                        f"KILN_VERIFY: stored entry {key[:12]} of {self.jf._name} does not match "
                        f"a fresh lowering (stored module {str(header.get('lowered'))[:12]}, "
                        f"now {str(digest)[:12]}); kiln's key missed a change. "
                        "Please report this with KILN_EXPLAIN=1 output."
                    )
                self._explain("lowered", "stored module differs from the fresh lowering")
                return None
            callbacks = _jax_compat.host_callbacks(lowered)
        out_tree = None
        static_out = None
        if self.traced is not None:
            # Traced in this process (verify path, audit, unpicklable callbacks): what the
            # lowered module does not hold (host callables, non-array outputs, the output
            # tree) comes from this trace, never from the entry.
            if callbacks is None:
                callbacks = _jax_compat.host_callbacks(self._lowering_of(inlined_form))
            out_tree = self.traced.out_tree
            static_out = self.box.get(self.box_sig)
            if ("static_out" in entry.sections) != (static_out is not None):
                self._explain("lowered", "stored entry's outputs differ from the fresh trace")
                return None
        try:
            compiled = _jax_compat.load_compiled(
                entry.sections, callbacks, out_tree, lapack=bool(header.get("lapack", True))
            )
            if "static_out" in entry.sections:
                if static_out is None:
                    static_out = _jax_compat.unpickle_value(entry.sections["static_out"])
                compiled = _with_static_outputs(compiled, *static_out)
        except Exception as e:  # noqa: BLE001 - a bad entry must never crash the program
            _stats.bump(bad_entries=1)
            self._warn(
                f"kiln: entry {key[:12]} of {self.jf._name} could not be loaded "
                f"({type(e).__name__}: {e})", "recompiling and replacing it",
            )
            return None
        load_s = time.perf_counter() - t0
        _stats.bump(hits=1, load_seconds=load_s,
                      saved_seconds=max(0.0, float(header.get("compile_seconds", 0.0)) - load_s))
        logger.debug("kiln: hit %s %s (loaded in %.3f s)", self.jf._name, key[:12], load_s)
        return compiled

    def _explain_persistent_miss(self, key: str) -> None:
        if not (self.cfg.explain or logger.isEnabledFor(logging.DEBUG)):
            return
        fname = f"{self.jf._module}.{self.jf._name}"
        best: list[str] | None = None
        try:
            for other in self.store.iter():
                header = self.store.header(other)
                if not header or header.get("function") != fname:
                    continue
                if header.get("kind") != "executable":  # a verify-only marker: no key parts
                    continue
                diff = _explain.diff_parts(
                    [p for p in self.base_parts if p[0] != "signature"] + list(self.fp.parts),
                    [p for p in header.get("key_parts", []) if p[0] != "signature"]
                    + header.get("fp_parts", []),
                )
                # the argument avals (static values are key parts of their own, diffed above)
                old_avals = str(header.get("signature")).split("; static ")[0]
                avals = self.signature.split("; static ")[0]
                if old_avals != avals:
                    diff.insert(0, f"argument types: {old_avals} -> {avals}")
                if best is None or len(diff) < len(best):
                    best = diff
        except (OSError, StoreError):
            best = None
        if best is None:
            self._explain("persistent-miss", f"no stored entry for {fname} ({self.signature})")
        else:
            self._explain("persistent-miss",
                          "closest stored entry differs in: " + "; ".join(best[:8]))

    def _tier_up_candidate(self) -> bool:
        """Whether this (traced) program calls kiln.noinline functions that tier-up would
        inline (and is small enough once inlined); whether tier-up is on is separate."""
        if self.candidate is None:
            self.candidate = self._is_tier_up_candidate()
        return self.candidate

    def _is_tier_up_candidate(self) -> bool:
        if not self.jf._tier_up or self.traced is None:
            return False
        jaxpr = self.traced.jaxpr.jaxpr
        if not _noinline.calls_in(jaxpr):
            return False
        size = self.inlined_size = _noinline.inlined_size(jaxpr)
        if size > _tier_up.MAX_EQUATIONS:
            self._explain(
                "tier-up",
                f"no tier-up: inlined, the program would have {size} equations (more than "
                f"{_tier_up.MAX_EQUATIONS}); it keeps calling its noinline functions",
            )
            return False
        return True

    def _inline_directly(self) -> bool:
        """Whether to skip the host-callback tier: inlining the noinline calls makes the program
        at most ``DIRECT_RATIO`` times larger than its separately compiled pieces."""
        if self.direct is None:
            self.direct = self._is_inline_directly()
        return self.direct

    def _is_inline_directly(self) -> bool:
        assert self.traced is not None  # internal invariant: called after tracing
        inlined = self.inlined_size  # set by _tier_up_candidate
        separate = _noinline.separate_size(self.traced.jaxpr.jaxpr)
        if inlined > _tier_up.DIRECT_RATIO * separate:
            return False
        self._explain(
            "tier-up",
            f"compiling the program inlined directly: inlined it has {inlined} equations, "
            f"its separately compiled pieces {separate}",
        )
        return True

    def _compile_and_store(self, key: str, manifest: list[list[str]] | None, t_start: float) -> Any:
        self._log_memory_reason()
        self._trace()
        self.key = key
        candidate = self._tier_up_candidate()
        self.tier_up = candidate and self.cfg.tier_up
        if self.tier_up and self._inline_directly():
            # lowered once, inlined: the not-inlined lowering is never made
            self.tier_up = False
            with compiling(f"{self.jf._name} ({self.signature})", self.cfg.progress):
                result = _tier_up.compile_and_store_inlined(
                    self, _tier_up.structs(self.leaves), t_start
                )
            _stats.bump(misses=1)
            return result
        lowered = self._trace_lower()
        t0 = time.perf_counter()
        with compiling(f"{self.jf._name} ({self.signature})", self.cfg.progress):
            compiled = lowered.compile()
        compile_s = time.perf_counter() - t0
        total = time.perf_counter() - t_start
        _stats.bump(misses=1, compiles=1, compile_seconds=total)
        result, sections, mode = self._serialize(compiled)
        if sections is None:
            return result
        header = self._header(mode, manifest, total, compile_s)
        if candidate:
            header["tier"] = "noinline"  # replaced by its inlined form after a tier-up
        self._put(key, header, sections)
        return result

    def _serialize(self, compiled: Any) -> tuple[Any, dict[str, bytes] | None, str]:
        """(the callable, its entry sections or None when it cannot be stored, callbacks mode).
        Must run before the executable's first run (see ``serialize_compiled``)."""
        static_out = self.box.get(self.box_sig)
        result = compiled if static_out is None else _with_static_outputs(compiled, *static_out)
        try:
            sections, mode = _jax_compat.serialize_compiled(compiled)
            if static_out is not None:
                sections["static_out"] = _jax_compat.pickle_value(static_out)
        except _jax_compat.Unserializable as e:
            self._explain("unstorable", f"executable not stored: {e}")
            return result, None, "none"
        return result, sections, mode

    def _header(
        self, mode: str, manifest: list[list[str]] | None, total: float, compile_s: float
    ) -> dict[str, Any]:
        """The header of an executable entry (``manifest`` None: keyed by the lowered module)."""
        header: dict[str, Any] = {
            "kind": "executable",
            "function": f"{self.jf._module}.{self.jf._name}",
            "signature": self.signature,
            "key_parts": [list(p) for p in self.base_parts],
            "fp_parts": [list(p) for p in self.fp.parts] if manifest is not None else [],
            "manifest": manifest or [],
            "callbacks": mode,
            "lowered": self.lowered_digest,
            "lapack": self.lapack,
            "compile_seconds": total,
            "xla_compile_seconds": compile_s,
            "trace_seconds": self.trace_seconds,
            "created": time.time(),
        }
        called = [] if self.traced is None else _noinline.called_names(self.traced.jaxpr.jaxpr)
        if called:
            header["noinline"] = called  # for `kiln ls`: the noinline functions it calls
        return header

    def _put(self, key: str | None, header: dict[str, Any], sections: dict[str, bytes]) -> None:
        if key is None:
            return
        blob = encode({**header, "key": key}, sections, signing_key=self.cfg.signing_key)
        try:
            self.store.put(key, blob)
        except (OSError, StoreError) as e:
            self._store_fault("write to", e)
            return
        _stats.bump(stores_written=1)


@overload
def jit(
    fun: F,
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
) -> JitFunction: ...


@overload
def jit(
    fun: None = None,
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
) -> Callable[[F], JitFunction]: ...


def jit(
    fun: Callable[..., Any] | None = None,
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
) -> Any:
    """Compile ``fun`` with XLA like ``jax.jit``, and keep the executable in a store.

    A drop-in for :func:`jax.jit`: same results for pytrees in and out, keyword arguments,
    equinox Modules and dataclass pytrees. The first call with a given abstract signature
    (pytree structure; per leaf shape, dtype, weak_type; static argument values) compiles and
    writes an entry; any later process with the same store runs that executable without
    tracing, lowering or compiling (see the module docstring for programs with host
    callbacks). A stored executable is used only when nothing it was built from changed: the
    function's code and the code of user helpers it calls, module globals, closure values and
    defaults it reads, static argument values, argument avals and structure, jax config that
    changes tracing, ``XLA_FLAGS``, jax / jaxlib / library versions, backend and device kind.

    Arguments follow ``jax.jit``'s contract: dynamic arguments are pytrees of arrays and
    Python scalars (traced); any other leaf (a string, a function) raises jax's
    ``TypeError``, as ``jax.jit`` does. For equinox's contract (every leaf that is not an
    array static by value), use :func:`kiln.filter_jit`.

    Args:
        fun: the function to compile. Its dynamic arguments are pytrees of arrays.
        static_argnums: positions of static arguments. Unlike ``jax.jit``, numpy arrays, jax
            Arrays, numpy scalars and pytrees of them may be static: they are compared by value,
            bitwise (same shape, dtype and bytes; NaN equals itself; -0.0 differs from 0.0).
        static_argnames: names of static arguments (the same rules).
        donate_argnums: positions of arguments whose buffers the executable may reuse.
        donate_argnames: names of such arguments.
        keep_unused, device, backend, inline, compiler_options: as ``jax.jit`` (jax 0.10 to
            0.12): passed to every ``jax.jit`` kiln makes of ``fun``, and part of the key.
        in_shardings, out_shardings: as ``jax.jit``: ``in_shardings`` is a sharding, or a
            tuple with one pytree prefix of shardings per dynamic positional argument (static
            ones excluded; no dynamic keyword arguments then); ``out_shardings`` a prefix of
            the outputs. Part of the key (mesh shape, axis names, device ids, partition spec).

    Returns:
        A :class:`JitFunction` (or, with ``fun=None``, a decorator making one).

    Raises:
        StaticArgumentError: at call time, a static argument that cannot be hashed by value
            (an object array, a traced value, an unhashable object); the message names the
            argument and its pytree path.
        StoreError: with ``KILN_STRICT=1``, a store that cannot be read or written or an entry
            that is corrupt. Otherwise such problems are a :class:`StoreWarning` and a recompile.
        VerifyError: with ``KILN_VERIFY=1``, a stored entry that differs from a fresh lowering.

    Example:
        >>> import jax.numpy as jnp, kiln
        >>> @kiln.jit(static_argnames="n")
        ... def power(x, n):
        ...     return x**n
        >>> power(jnp.arange(3.0), n=2).tolist()
        [0.0, 1.0, 4.0]
    """

    def make(f: Callable[..., Any]) -> JitFunction:
        return JitFunction(
            f,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            donate_argnums=donate_argnums,
            donate_argnames=donate_argnames,
            keep_unused=keep_unused,
            device=device,
            backend=backend,
            inline=inline,
            compiler_options=compiler_options,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
        )

    return make if fun is None else make(fun)


_FILTER_DONATE = ("all", "all-except-first", "warn", "warn-except-first", "none")


def filter_jit(fun: Callable[..., Any] | None = None, *, donate: str = "none",
               **jitkwargs: Any) -> Any:
    """``equinox.filter_jit`` whose executables outlive the process.

    equinox's contract and signature: every JAX or numpy array leaf of the arguments is
    traced, every other leaf (Python ``int`` /
    ``float`` / ``bool``, functions, strings, an equinox Module's static fields) is static,
    compared by value (kiln's digests; a value with none is compared with ``==`` in this
    process only). Arguments are bound to ``fun``'s signature first, so ``f(x, y=1)`` and
    ``f(x, 1)`` are one program. Outputs that are not arrays are returned as they are,
    outside the executable. So an equinox user swaps ``eqx.filter_jit`` for
    ``kiln.filter_jit`` and nothing else changes; what is stored and when is as for
    :func:`kiln.jit`. One difference: when ``fun`` itself is a Module holding arrays
    (``filter_jit(model)``), equinox traces those arrays, kiln keys them by value (new
    weights compile again): pass the Module as an argument instead.

    Args:
        fun: the function to compile (``None``: a decorator).
        donate: ``"all"`` (donate every array, silence jax's unused-donation warnings),
            ``"all-except-first"`` (all but the first argument's arrays), ``"warn"`` /
            ``"warn-except-first"`` (the same, keeping the warnings), ``"none"`` (default).
        **jitkwargs: ``jax.jit``'s ``keep_unused``, ``device``, ``backend``, ``inline``,
            ``compiler_options``.

    Returns:
        A :class:`JitFunction` (or, with ``fun=None``, a decorator making one).

    Raises:
        ValueError: ``donate`` not one of the above; ``jitkwargs`` holding
            ``static_argnums``, ``static_argnames``, ``donate_argnums``, ``in_shardings`` or
            ``out_shardings`` (equinox's errors).

    Example:
        >>> import jax.numpy as jnp, kiln
        >>> @kiln.filter_jit
        ... def scale(x, factor, name):
        ...     return x * factor, name
        >>> out, name = scale(jnp.arange(3.0), 2, "double")
        >>> out.tolist(), name
        ([0.0, 2.0, 4.0], 'double')
    """
    if any(k in jitkwargs for k in ("static_argnums", "static_argnames", "donate_argnums",
                                   "in_shardings", "out_shardings")):
        raise ValueError(
            "`jitkwargs` cannot contain 'static_argnums', 'static_argnames', "
            "'donate_argnums', 'in_shardings', or 'out_shardings'."
        )
    if donate not in _FILTER_DONATE:
        raise ValueError(
            "`filter_jit(..., donate=...)` must be one of 'all', 'all-except-first', "
            "'warn', 'warn-except-first', or 'none'."
        )
    unknown = set(jitkwargs) - {"keep_unused", "device", "backend", "inline",
                                "compiler_options"}
    if unknown:
        raise TypeError(f"filter_jit() got unexpected keyword arguments {sorted(unknown)}")

    def make(f: Callable[..., Any]) -> JitFunction:
        return JitFunction(f, _filter=donate, **jitkwargs)

    return make if fun is None else make(fun)

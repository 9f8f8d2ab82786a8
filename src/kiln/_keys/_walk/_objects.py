"""The walk of every kind of value but code (:mod:`._code`), each a handler ``(w, name, v,
lenient)``: Python's own (modules, partials, methods, builtin functions, sequences, dicts, sets
and other mappings), random generators, pytree structures and nodes, JAX primitives, numpy
functions, custom derivatives, wrappers, loggers, and any object by what it holds."""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import enum
import functools
import gc
import logging
import os
import random
import sys
import types
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ..._base import StaticArgumentError, _jax_compat
from .._code import hash_seed_fixed, order_is_stable
from .._hashing import Unpersistable, static_digest
from .._libraries import is_user_class, library_version, module_is_user
from .._rngs import global_generator_name
from ._code import class_code

if TYPE_CHECKING:
    from . import Walker

# hashed by value wherever they occur (never "seen": equal values need not be one object)
SCALAR_TYPES = (type(None), bool, int, float, complex, str, bytes)


def walk_module(w: Walker, name: str, v: types.ModuleType, lenient: bool) -> None:
    if module_is_user(v):
        w.add(f"module:{name}", v.__name__)
    else:
        w.add(f"lib:{v.__name__}", library_version(v.__name__))
    w.modules.append(v)  # its attributes named by any walked code: Walker.finish


def walk_partial(w: Walker, name: str, v: functools.partial[Any], lenient: bool) -> None:
    w.add(f"partial:{name}", "")
    w.value(f"{name}.func", v.func)
    for i, a in enumerate(v.args):
        w.value(f"{name}.args[{i}]", a)
    for k, a in sorted(v.keywords.items()):
        w.value(f"{name}.keywords[{k!r}]", a)


def walk_method(w: Walker, name: str, v: types.MethodType, lenient: bool) -> None:
    w.value(f"{name}.__func__", v.__func__)
    w.watched_value(f"{name}.__self__", v.__self__, lenient=lenient)


def walk_builtin(w: Walker, name: str, v: types.BuiltinFunctionType, lenient: bool) -> None:
    mod = getattr(v, "__module__", None) or "builtins"
    w.add(f"lib:{mod}.{getattr(v, '__qualname__', v.__name__)}", library_version(mod))
    owner = getattr(v, "__self__", None)
    if owner is not None and not isinstance(owner, types.ModuleType | type):
        w.value(f"{name}.__self__", owner, lenient=lenient)  # ``rng.normal``


def walk_sequence(w: Walker, name: str, v: tuple[Any, ...] | list[Any], lenient: bool) -> None:
    w.add(f"container:{name}", f"{type(v).__name__}[{len(v)}]")
    for i, item in enumerate(v):
        w.value(f"{name}[{i}]", item)


def walk_dict(w: Walker, name: str, v: collections.abc.Mapping[Any, Any], lenient: bool) -> None:
    """A dict, or a read-only view of a mapping (a dataclass field's ``metadata``): its items
    in insertion order, the order code that iterates it sees."""
    w.add(f"container:{name}", f"{type(v).__name__}[{len(v)}]")
    _walk_items(w, name, v)


def walk_set(w: Walker, name: str, v: set[Any] | frozenset[Any], lenient: bool) -> None:
    """A set: its elements, in the order code that iterates it would see them. That order
    is the same in every process for numbers; for strings it changes with
    ``PYTHONHASHSEED``, so without a fixed seed such a set cannot be keyed by value."""
    if not order_is_stable(v) and not hash_seed_fixed():
        if w.in_library:
            # held by library code, whose iterating counts with its version: by content,
            # or (objects with no value digest) by their classes and the library versions
            try:
                w.add(f"value:{name}", static_digest(v, argname=name))
            except (Unpersistable, StaticArgumentError, TypeError, ValueError):
                classes = sorted({f"{type(e).__module__}.{type(e).__qualname__}" for e in v})
                w.add(f"lib-state:{name}", ",".join(
                    f"{c}={library_version(c)}" for c in classes))
            return
        w.unsound(
            f"{name} is a set of strings or objects: the order code iterating it sees "
            "changes with PYTHONHASHSEED (use a tuple, or set PYTHONHASHSEED)"
        )
        return
    w.add(f"container:{name}", f"{type(v).__name__}[{len(v)}]")
    for i, item in enumerate(v):
        w.value(f"{name}<{i}>", item)


def try_walk_mapping(w: Walker, name: str, v: Any, lenient: bool) -> bool:
    """A dict subclass or an immutable mapping (FrozenDict, HashableMapping): in iteration
    order, before the pytree fallback (FrozenDict's flatten sorts its keys); a class with
    ``__kiln_digest__`` says itself what it is (:func:`walk_object`)."""
    if not (
        isinstance(v, collections.abc.Mapping)
        and (isinstance(v, dict) or type(v).__hash__ is not None)
        and getattr(type(v), "__kiln_digest__", None) is None
    ):
        return False
    cls = type(v)
    class_code(w, cls)
    w.add(f"mapping:{name}", f"{cls.__module__}.{cls.__qualname__}[{len(v)}]")
    if isinstance(v, collections.defaultdict):
        w.value(f"{name}.default_factory", v.default_factory)
    _walk_items(w, name, v)
    return True


def _walk_items(w: Walker, name: str, v: collections.abc.Mapping[Any, Any]) -> None:
    """The keys and values of a mapping, in iteration order. A key that is an object's
    ``id()`` (:func:`is_identity`: absl's ``FlagValues`` keeps its flags by ``id(module)``,
    numpyro's ``MCMC`` its compiled functions by ``id()`` of the arguments) differs in every
    process by construction: it counts as "an identity", its value by value."""
    for i, (k, item) in enumerate(v.items()):
        if is_identity(k):
            w.add(f"identity:{name}.<key {i}>", "id()")
            w.value(f"{name}[{i}]", item)
            continue
        w.value(f"{name}.<key {i}>", k)
        w.value(f"{name}[{k!r}]" if type(k) in SCALAR_TYPES else f"{name}[{i}]", item)


_ADDRESSES = 1 << 32  # (CPython's objects lie above 4 GiB on 64-bit hosts, 8-byte aligned)


def is_identity(k: Any) -> bool:
    """``k`` is, or is a tuple holding, what ``id()`` returns for an object on this host: an
    address (an int above 4 GiB, a multiple of 8). Such a value differs in every process; a
    program whose trace depended on one would be as new in every process (the clock's case)."""
    if type(k) is int:
        return k >= _ADDRESSES and k % 8 == 0 and sys.maxsize > _ADDRESSES
    return type(k) is tuple and any(is_identity(e) for e in k)


RNG_TYPES = (np.random.RandomState, np.random.Generator, random.Random)
PyTreeDef = type(jax.tree_util.tree_structure(0))


def walk_rng(w: Walker, name: str, v: Any, lenient: bool) -> None:
    """A random generator: one the user holds by its state, so a different seed is a
    different program; numpy's and Python's global generators (reached by name:
    ``np.random.normal`` where a function reads ``np.pi`` beside ``jax.random.normal``) by
    what they are only: their state counts where the trace draws from them, which the
    trace's :class:`kiln._keys._rngs.RngWatch` sees (issue 42)."""
    glob = global_generator_name(v)
    if glob is not None:
        w.add(f"rng:{name}", f"global {glob}")
        return
    state = v.getstate() if isinstance(v, random.Random) else (
        v.get_state() if isinstance(v, np.random.RandomState) else v.bit_generator.state)
    w.add(f"rng:{name}", static_digest(state, argname=name))


def walk_treedef(w: Walker, name: str, t: Any, lenient: bool) -> None:
    """A pytree structure: node types, their registered flatten / unflatten functions and
    aux data, node by node."""
    data = t.node_data()
    if data is None:
        w.add(f"treedef:{name}", "*")
        return
    typ, aux = data
    w.add(f"treedef:{name}", f"{typ.__module__}.{typ.__qualname__}/{t.num_leaves}")
    class_code(w, typ)
    w.seen.discard(id(aux))
    w.value(f"{name}.<aux>", aux)
    for i, child in enumerate(t.children()):
        walk_treedef(w, f"{name}/{i}", child, lenient)


def try_walk_logger(w: Walker, name: str, v: Any, lenient: bool) -> bool:
    """A ``logging.Logger``, ``LoggerAdapter`` or ``Handler``: what code that logs reads
    of it (its name, levels, whether it is disabled or propagates; an adapter's
    ``extra``), not what logging keeps (its manager's every logger, a cache of levels
    filled as it logs, handlers' locks and streams), which differs between processes
    and between a cold run and a warm one that skipped a trace (issue 42)."""
    cls = type(v)
    if isinstance(v, logging.LoggerAdapter):
        w.add(f"logger-adapter:{name}", f"{cls.__module__}.{cls.__qualname__}")
        w.value(f"{name}.logger", v.logger)
        w.value(f"{name}.extra", v.extra)
    elif isinstance(v, logging.Logger):
        w.add(f"logger:{name}", f"{cls.__module__}.{cls.__qualname__}:{v.name}:"
              f"{v.level}:{v.getEffectiveLevel()}:{v.disabled}:{v.propagate}")
    elif isinstance(v, logging.Handler):
        w.add(f"log-handler:{name}", f"{cls.__module__}.{cls.__qualname__}:{v.level}")
    else:
        return False
    return True


def try_walk_primitive(w: Walker, name: str, v: Any, lenient: bool) -> bool:
    """A ``jax.extend.core.Primitive``: what it holds (``impl``, ``abstract_eval``) and
    every rule JAX's registries hold for it (lowering, platform lowerings, JVP, transpose,
    batching, partial eval, ...: :func:`kiln._base._jax_compat.primitive_rules`), each by
    value: a user rule by its code, a library rule by name, version and what it holds."""
    if not isinstance(v, _jax_compat.Primitive):
        return False
    cls = type(v)
    class_code(w, cls)  # a Primitive subclass: its methods
    w.add(f"primitive:{name}", f"{cls.__module__}.{cls.__qualname__}:{v.name}")
    with w.mode(library=True):
        for attr, item in sorted(vars(v).items()):
            w.value(f"{name}.{attr}", item)
        for registry, rule in _jax_compat.primitive_rules(v):
            w.value(f"{name}.<{registry}>", rule)
    return True


def try_walk_numpy_function(w: Walker, name: str, v: Any, lenient: bool) -> bool:
    """A ufunc made by ``np.frompyfunc`` (not importable by name, unlike ``np.add``): the
    Python function it calls, which numpy does not expose but reports to the garbage
    collector (``gc.get_referents``); when it reports none, the walk is unsound. An
    ``np.vectorize``: its function and options (``pyfunc``, ``otypes``, ``excluded``,
    ``signature``, ``cache``), not the ufunc it caches on its first call."""
    if isinstance(v, np.vectorize):
        w.add(f"vectorize:{name}", type(v).__qualname__)
        for attr in ("pyfunc", "otypes", "excluded", "signature", "cache"):
            w.value(f"{name}.{attr}", getattr(v, attr, None))
        return True
    if not isinstance(v, np.ufunc):
        return False
    try:
        static_digest(v, argname=name)  # importable: by name and version (walk_object)
        return False
    except (Unpersistable, StaticArgumentError, TypeError, ValueError):
        pass
    funcs = [r for r in gc.get_referents(v) if callable(r) and not isinstance(r, type)]
    if len(funcs) != 1:
        w.unsound(f"{name} is a ufunc made by np.frompyfunc whose Python function "
                  "numpy does not show (use the function itself, or np.vectorize)")
        return True
    w.add(f"frompyfunc:{name}", f"{v.__name__}/{v.nin}/{v.nout}/{v.identity!r}")
    w.value(f"{name}.<function>", funcs[0])
    return True


def try_walk_pytree(w: Walker, name: str, v: Any, lenient: bool) -> bool:
    """Walk a registered pytree node (equinox Module, diffrax term, ...) one level down."""
    if isinstance(v, jax.Array | np.ndarray | np.generic):
        return False
    if getattr(type(v), "_kiln_walk_wrapped", False):
        return False  # kiln.noinline: its code (via __wrapped__), not its handle
    if isinstance(v, types.GeneratorType | types.CoroutineType | types.AsyncGeneratorType):
        return False  # (jax warns when asked to flatten one; it has no value: unsound)
    try:
        children, treedef = jax.tree_util.tree_flatten(v, is_leaf=lambda n: n is not v)
    except Exception:  # noqa: BLE001 - exotic flatten failures: not a pytree for us
        return False
    data = treedef.node_data()  # type: ignore[attr-defined]
    if data is None:
        return False
    typ, aux = data
    if aux is v:
        # jax.tree_util.register_static (an nnx GraphDef): the node is its own aux data,
        # so it is walked as the object it is, field by field
        return False
    class_code(w, typ)
    w.add(f"pytree:{name}", f"{typ.__module__}.{typ.__qualname__}")
    with w.mode(library=not is_user_class(typ)):
        w.value(f"{name}.<aux>", aux)
        for i, child in enumerate(children):
            w.value(f"{name}.<child {i}>", child)
    return True


def try_walk_custom_derivatives(w: Walker, name: str, v: Any, lenient: bool) -> bool:
    """A ``jax.custom_jvp`` / ``jax.custom_vjp``: its function and its rules."""
    rules = [r for r in ("fun", "jvp", "fwd", "bwd") if callable(getattr(v, r, None))]
    if not (rules and type(v).__name__ in ("custom_jvp", "custom_vjp")):
        return False
    w.add(f"custom:{name}", type(v).__name__)
    for r in rules:
        w.value(f"{name}.{r}", getattr(v, r))
    return True


def try_walk_wrapper(w: Walker, name: str, v: Any, lenient: bool) -> bool:
    """jax.jit / kiln.jit / functools.wraps objects: the wrapped function is what runs."""
    wrapped = getattr(v, "__wrapped__", None)
    if wrapped is None or not callable(v) or isinstance(v, type):
        return False
    w.add(f"wrapper:{name}", f"{type(v).__module__}.{type(v).__qualname__}")
    w.value(f"{name}.__wrapped__", wrapped)
    return True


def walk_object(w: Walker, name: str, v: Any, lenient: bool) -> None:
    """Any other object: an annotation by its ``repr``, an enum member, dataclass or user
    object by what it holds, else by its value digest; failing that a library object by
    its class and state, or (``lenient``, or held by a library) by its class alone."""
    cls = type(v)
    user = is_user_class(cls)
    if user:
        class_code(w, cls)  # a user dataclass / object: its methods and class constants too
    if isinstance(v, types.UnionType | types.GenericAlias) or cls.__module__ == "typing":
        w.add(f"typing:{name}", repr(v))  # an annotation: ``Event | None``
        return
    if v is os.environ:
        # held by a library's settings (donfig's ``Config.env``, zarr's): a variable the
        # trace reads is keyed by name and value as it is read (manifest ``<env>``)
        w.add(f"environ:{name}", "")
        return
    if not user and (lenient or w.in_library) and _is_lock(cls):
        # a library's lock (donfig's ``SerializableLock``, whose ``token`` is a uuid made
        # in each process, in zarr.config): it guards state, it is not state; by class
        w.add(f"lock:{name}", f"{cls.__module__}.{cls.__qualname__}")
        return
    if getattr(cls, "__kiln_digest__", None) is None and _try_walk_instance(w, name, v, user):
        return
    try:
        w.add(f"value:{name}", static_digest(v, argname=name))
    except (Unpersistable, TypeError, ValueError) as e:
        if not user and _try_walk_library_object(w, name, v):
            return
        if not user and (lenient or (w.in_library and not w.strict)):
            # an opaque object of a library class (a C object, a lock) held by library
            # code or state: counted with that library, by class name and version
            w.add(f"lib:{cls.__module__}.{cls.__qualname__}", library_version(cls.__module__))
        else:
            w.unsound(f"{name}: {e}")


def _try_walk_instance(w: Walker, name: str, v: Any, user: bool) -> bool:
    """An enum member, or a dataclass instance (user or library) or any user object with
    plain state: what it is, and every value it holds by value (a function in a field by
    its code, attributes set after ``__init__`` too). False for anything else."""
    cls = type(v)
    if isinstance(v, enum.Enum):
        w.add(f"enum:{name}", f"{cls.__module__}.{cls.__qualname__}.{v.name}")
        w.value(f"{name}.value", v.value)
        return True
    if not (user or dataclasses.is_dataclass(v)):
        return False
    if any(b.__module__ == "builtins" and b is not object for b in cls.__mro__):
        return False  # a dict / list subclass: its items are not in its __dict__
    items = state_of(v)
    if items is None:
        return False
    w.add(f"object:{name}", f"{cls.__module__}.{cls.__qualname__}")
    for attr, item in items:
        w.value(f"{name}.{attr}", item)
    return True


def _try_walk_library_object(w: Walker, name: str, v: Any) -> bool:
    """An instance of a library class with no value digest: what it is (its class, by
    name and version) and the values it holds (its ``__dict__``, by value). False when it
    holds nothing Python can see (a C object, a lock): the caller decides."""
    cls = type(v)
    if cls.__module__.partition(".")[0] == "kiln":
        # kiln's own objects say what they are through __kiln_digest__ or __wrapped__;
        # their state (caches of compiled functions) is not what a program is built from
        return False
    if w.strict and not _python_defined(cls):
        return False  # a C type's state (a file, a lock) is not in its __dict__
    items = state_of(v)  # (slots: ``dataclasses.Field``: default, default_factory, ...)
    if items is None:
        return False
    w.add(f"lib-object:{name}", f"{cls.__module__}.{cls.__qualname__}="
          + library_version(cls.__module__))
    with w.mode(library=True):
        for attr, item in items:
            w.value(f"{name}.{attr}", item)
    return True


def state_of(v: Any) -> list[tuple[str, Any]] | None:
    """What ``v`` holds: its ``__dict__`` (sorted) and the ``__slots__`` it has set; None when
    it has neither a dict nor slots."""
    state = getattr(v, "__dict__", None)
    slots = slots_of(type(v))
    if not isinstance(state, dict) and not slots:
        return None
    items = sorted(state.items()) if isinstance(state, dict) else []
    return items + [(a, getattr(v, a)) for a in slots if hasattr(v, a)]


def slots_of(cls: type) -> tuple[str, ...]:
    """The ``__slots__`` of ``cls`` and its bases that hold values (a string slot counts once)."""
    out: list[str] = []
    for c in cls.__mro__:
        names = getattr(c, "__slots__", ())
        for a in (names,) if isinstance(names, str) else names:
            if a not in ("__dict__", "__weakref__") and a not in out:
                out.append(a)
    return tuple(out)


def _python_defined(cls: type) -> bool:
    """Whether every class of ``cls``'s MRO but ``object`` comes from a Python source module,
    so an instance's whole state is in its ``__dict__`` and slots (a C type's,
    ``_io.TextIOWrapper``'s or ``numpy.random.Generator``'s, is not)."""
    files = (getattr(sys.modules.get(c.__module__), "__file__", None) for c in cls.__mro__[:-1])
    return all(isinstance(f, str) and f.endswith(".py") for f in files)


def _is_lock(cls: type) -> bool:
    """A lock-like class: ``acquire``, ``release`` and a context manager (``threading.Lock``,
    ``RLock``, donfig's ``SerializableLock``, ``multiprocessing``'s locks)."""
    return all(callable(getattr(cls, a, None)) for a in ("acquire", "release", "__enter__"))

"""The static walk: a function's code and every value it reaches, as named digest parts.

The walk hashes the function's code object (:mod:`kiln._keys._code`), its defaults, closure
values and every module-level value its code names, recursing into user functions, user
modules' attributes and user classes' methods. Values are hashed by value
(:mod:`kiln._keys._hashing`); library code counts by the library's version
(:mod:`kiln._keys._libraries`), what a library object holds by value.

What the trace reaches besides names, the walk follows by construction: a user class's
``vars`` in full, dunder data too (``__dataclass_fields__``: each ``Field``'s default, factory
and metadata), but for the few attributes in ``_CLASS_NOT_DATA``; the slots of library
objects; relative imports in a function body (``from . import consts``), resolved against its
package; a ``jax.extend.core.Primitive`` with every rule JAX's registries hold for it
(:meth:`Walker.try_walk_primitive`); the Python function behind an ``np.frompyfunc`` ufunc or
an ``np.vectorize``; and the config object of every installed library the walk reaches
(:func:`library_config_object`: ``flax.config``).

A value is walked by the method its exact type names in ``_WALK_EXACT`` (as ``_hashing`` encodes
from its ``_EXACT`` table). A value of any other type goes down the fallbacks in order of
precedence, the first that takes it walking it: ``_WALK_ISINSTANCE`` (subclasses of those types:
a lazy module, a partial subclass, a class with a metaclass), then the ``try_walk_*`` methods
of ``_TRY_WALKS`` (mappings, random generators, pytree nodes, custom derivatives, wrappers),
then :meth:`Walker.walk_object`. ``walk_*`` methods always handle the value they are given;
``try_walk_*`` methods return False when it is not theirs.
"""

from __future__ import annotations

import builtins
import collections
import collections.abc
import dataclasses
import enum
import functools
import gc
import importlib.util
import inspect
import logging
import os
import random
import re
import sys
import types
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import xxhash

from .._base import StaticArgumentError, _jax_compat
from ._callback_roots import callback_only_names, callback_roots, log_only_names
from ._code import (
    code_digest,
    code_names,
    hash_seed_fixed,
    iterated_set_constant,
    module_strings,
    nested_codes,
    order_is_stable,
    relative_imports,
)
from ._constant_fields import constant_fields
from ._hashing import Unpersistable, static_digest
from ._libraries import (
    KILN_ROOT,
    has_file,
    is_user_class,
    is_user_file,
    library_version,
    module_is_user,
    script_module,
)
from ._reads import is_probe
from ._rngs import global_generator_name
from ._watchable import watchable

__all__ = ["Walker", "library_config_object", "module_attr", "slots_of", "walk_failure"]

_MAX_ITEMS = 5000
# hashed by value wherever they occur (never "seen": equal values need not be one object)
_SCALAR_TYPES = (type(None), bool, int, float, complex, str, bytes)
_MISSING = "<missing field>"  # a field a trace read while the object did not hold it
_RNG_TYPES = (np.random.RandomState, np.random.Generator, random.Random)
_PyTreeDef = type(jax.tree_util.tree_structure(0))


def _code_walk(method: Callable[..., None]) -> Callable[..., None]:
    """A walk of code (a class, a function): what its globals hold is walked as any global
    is, not strictly, even inside a static argument's walk (:meth:`Walker.static_value`)."""
    @functools.wraps(method)
    def walk(self: Walker, *args: Any) -> None:
        strict, self.strict = self.strict, False
        try:
            method(self, *args)
        finally:
            self.strict = strict

    return walk


class Walker:
    """One static walk (see the module docstring for the rule it applies).

    Objects that can hold or lead to other objects are visited once (by ``id``: a cycle ends,
    a shared object is walked where it is first met); scalars are hashed wherever they occur,
    so no part depends on whether two equal values happen to be one object.
    """

    def __init__(self) -> None:
        self.parts: list[tuple[str, str]] = []
        self.seen: set[int] = set()
        self.first_name: dict[int, str] = {}  # the name each object was first walked by
        self.classes: list[type] = []  # the user classes walked (see finish: subclasses)
        self.codes: set[types.CodeType] = set()
        self.reason: str | None = None
        # every object walked, in walk order (ids stay stable during the walk; host callbacks
        # refer to the live ones by position: ``_jax_compat.pickle_callbacks``)
        self.keep: list[Any] = []
        self.modules: list[types.ModuleType] = []  # modules reached as values (user and library)
        self.names: set[str] = set()  # every name any walked user code reads
        self.in_library = 0  # > 0 while walking what a library object holds
        # True while walking a static argument's data (see :meth:`static_value`): what holds
        # no value Python can see is unsound there, even inside a library object
        self.strict = False
        # objects keyed by the fields their trace read (kiln._keys._static_reads): name -> the
        # fields (None: the whole state), and the globals and bound methods' ``self`` met
        # that could be (see :meth:`watched_value`)
        self.reads: dict[str, tuple[str, ...] | None] = {}
        self.watchable: list[tuple[str, Any]] = []
        # global SimpleNamespace / dict configs keyed by the constant fields the walked code
        # reads (:meth:`config_global`), by name
        self.configs: dict[str, _Config] = {}

    def finish(self) -> None:
        """Walk the attributes of every module reached (through a global, a closure, a default,
        an argument...) that any walked code names: ``mod.SCALE`` wherever ``mod`` came from,
        and ``jnp.tanh`` (a library name a patch may have replaced). Repeats until no new
        module or name appears."""
        done: set[tuple[str, str]] = set()
        subclassed: set[type] = set()
        changed = True
        while changed:
            changed = False
            if "__subclasses__" in self.names:
                # code that walks a class's subclasses (plugins found that way, issue 43): the
                # subclass tree of every user class walked, each subclass by its code
                for cls in list(self.classes):
                    if cls in subclassed:
                        continue
                    subclassed.add(cls)
                    changed = True
                    subs = _subclasses(cls)
                    qual = f"{script_module(cls.__module__)}.{cls.__qualname__}"
                    self.add(f"subclasses:{qual}", ",".join(
                        f"{c.__module__}.{c.__qualname__}" for c in subs))
                    for sub in subs:
                        if id(sub) not in self.seen:
                            self.seen.add(id(sub))
                            self.klass(sub)
            for mod in list(self.modules):
                user = module_is_user(mod)
                for attr in sorted(self.names):
                    if (mod.__name__, attr) in done:
                        continue
                    done.add((mod.__name__, attr))
                    found, v = module_attr(mod, attr, user)
                    if not found:
                        continue
                    changed = True
                    if not user and not _has_code_or_name(v) and not is_user_class(type(v)):
                        # library state (os.environ, jax.config, a registry): by value when it
                        # has one, else by the library's version (docs/never-stale.md)
                        self.library_state(f"{mod.__name__}.{attr}", v)
                    elif user and _is_config(v) and id(v) not in self.seen:
                        self.config_global(f"{mod.__name__}.{attr}", attr, v)
                    else:
                        self.value(f"{mod.__name__}.{attr}", v, lenient=not user)
            changed |= self.key_configs()
        for top in sorted({n[4:].partition(".")[0] for n, _ in self.parts
                           if n.startswith("lib:")}):
            self.library_config(top)

    def library_config(self, top: str) -> None:
        """The config object of installed library ``top`` (:func:`library_config_object`),
        by value: code of that library reads its flags while tracing (flax's RNG folding reads
        ``flax.config.flax_fix_rng_separator``), so they count with its version."""
        cfg = library_config_object(top)
        if cfg is None:
            return
        self.add(f"lib-config:{top}", library_version(top))
        self.seen.discard(id(cfg))  # (met before as module state, by version only)
        self.in_library += 1
        try:
            self.value(f"{top}.config", cfg, lenient=True)
        finally:
            self.in_library -= 1

    def add(self, name: str, digest: str) -> None:
        self.parts.append((name, digest))

    def digest(self) -> str:
        """The digest of every part, in walk order."""
        h = xxhash.xxh3_128()
        for name, d in self.parts:
            h.update(f"{name}\0{d}\n".encode())
        return h.hexdigest()

    def sound_digest(self) -> str:
        """Finish the walk; the digest of all parts (manifest items).

        Raises:
            Unpersistable: some part has no canonical digest.
        """
        self.finish()
        if self.reason is not None:
            raise Unpersistable(self.reason)
        return self.digest()

    def unsound(self, what: str) -> None:
        if self.reason is None:
            self.reason = what

    def value(self, name: str, v: Any, *, lenient: bool = False) -> None:
        """Add ``v`` by value: what it is, and everything reachable from it.

        ``lenient``: an opaque library object (no value digest, no state Python can see)
        counts by its class name and library version instead of making the walk unsound.
        """
        tp = type(v)
        if tp in _SCALAR_TYPES:
            self.add(f"value:{name}", static_digest(v, argname=name))
            return
        if tp is types.FunctionType and is_probe(v):
            v, tp = v.__wrapped__, type(v.__wrapped__)  # os.stat, as a module imported it
        if id(v) in self.seen:
            # met before: which object it is (the part of a function's first visit names its
            # code, not where it is bound; without this, ``ops.transform`` and ``ops.late``
            # swapping two functions walked to the same parts: a stale hit). Only for code:
            # a value is keyed by its content under its first name, and a repeated dtype in
            # an MJX model's 209 static fields would cost a part each
            if callable(v) or isinstance(v, types.ModuleType):
                self.add(f"same:{name}", self.first_name.get(id(v), ""))
            return
        if len(self.parts) > _MAX_ITEMS:
            self.unsound(f"more than {_MAX_ITEMS} fingerprint parts (at {name})")
            return
        self.seen.add(id(v))
        self.first_name[id(v)] = name
        self.keep.append(v)
        walk = _WALK_EXACT.get(tp)
        if walk is None:
            walk = next((w for t, w in _WALK_ISINSTANCE if isinstance(v, t)), None)
        if walk is not None:
            walk(self, name, v, lenient)
            return
        for try_walk in _TRY_WALKS:
            if try_walk(self, name, v, lenient):
                return
        self.walk_object(name, v, lenient)

    # ----------------------------------------------------------------------------------------
    # walk_*: by type (_WALK_EXACT, _WALK_ISINSTANCE)
    # ----------------------------------------------------------------------------------------
    def walk_module(self, name: str, v: types.ModuleType, lenient: bool) -> None:
        if module_is_user(v):
            self.add(f"module:{name}", v.__name__)
        else:
            self.add(f"lib:{v.__name__}", library_version(v.__name__))
        self.modules.append(v)  # its attributes named by any walked code: finish()

    def walk_partial(self, name: str, v: functools.partial[Any], lenient: bool) -> None:
        self.add(f"partial:{name}", "")
        self.value(f"{name}.func", v.func)
        for i, a in enumerate(v.args):
            self.value(f"{name}.args[{i}]", a)
        for k, a in sorted(v.keywords.items()):
            self.value(f"{name}.keywords[{k!r}]", a)

    def walk_method(self, name: str, v: types.MethodType, lenient: bool) -> None:
        self.value(f"{name}.__func__", v.__func__)
        self.watched_value(f"{name}.__self__", v.__self__, lenient=lenient)

    def walk_function(self, name: str, v: types.FunctionType, lenient: bool) -> None:
        # which function is bound here: its code's part is added only where the code is first
        # met (a class's staticmethod may have met it first), so ``ops.transform`` and
        # ``ops.late`` swapping two functions would otherwise walk to the same parts
        self.add(f"function:{name}", f"{v.__module__}.{v.__qualname__}")
        self.function(v)

    def walk_class(self, name: str, v: type, lenient: bool) -> None:
        self.klass(v)

    def walk_builtin(self, name: str, v: types.BuiltinFunctionType, lenient: bool) -> None:
        mod = getattr(v, "__module__", None) or "builtins"
        self.add(f"lib:{mod}.{getattr(v, '__qualname__', v.__name__)}", library_version(mod))
        owner = getattr(v, "__self__", None)
        if owner is not None and not isinstance(owner, types.ModuleType | type):
            self.value(f"{name}.__self__", owner, lenient=lenient)  # ``rng.normal``

    def walk_sequence(self, name: str, v: tuple[Any, ...] | list[Any], lenient: bool) -> None:
        self.add(f"container:{name}", f"{type(v).__name__}[{len(v)}]")
        for i, item in enumerate(v):
            self.value(f"{name}[{i}]", item)

    def walk_dict(self, name: str, v: dict[Any, Any], lenient: bool) -> None:
        # insertion order: code that iterates a dict sees it in that order
        self.add(f"container:{name}", f"dict[{len(v)}]")
        self.walk_items(name, v)

    def walk_mappingproxy(self, name: str, v: types.MappingProxyType[Any, Any],
                          lenient: bool) -> None:
        """A read-only view of a mapping (a dataclass field's ``metadata``): its items in
        order."""
        self.add(f"container:{name}", f"mappingproxy[{len(v)}]")
        self.walk_items(name, v)

    def walk_set(self, name: str, v: set[Any] | frozenset[Any], lenient: bool) -> None:
        """A set: its elements, in the order code that iterates it would see them. That order
        is the same in every process for numbers; for strings it changes with
        ``PYTHONHASHSEED``, so without a fixed seed such a set cannot be keyed by value."""
        if not order_is_stable(v) and not hash_seed_fixed():
            if self.in_library:
                # held by library code, whose iterating counts with its version: by content,
                # or (objects with no value digest) by their classes and the library versions
                try:
                    self.add(f"value:{name}", static_digest(v, argname=name))
                except (Unpersistable, StaticArgumentError, TypeError, ValueError):
                    classes = sorted({f"{type(e).__module__}.{type(e).__qualname__}" for e in v})
                    self.add(f"lib-state:{name}", ",".join(
                        f"{c}={library_version(c)}" for c in classes))
                return
            self.unsound(
                f"{name} is a set of strings or objects: the order code iterating it sees "
                "changes with PYTHONHASHSEED (use a tuple, or set PYTHONHASHSEED)"
            )
            return
        self.add(f"container:{name}", f"{type(v).__name__}[{len(v)}]")
        for i, item in enumerate(v):
            self.value(f"{name}<{i}>", item)

    def walk_treedef(self, name: str, t: Any, lenient: bool) -> None:
        """A pytree structure: node types, their registered flatten / unflatten functions and
        aux data, node by node."""
        data = t.node_data()
        if data is None:
            self.add(f"treedef:{name}", "*")
            return
        typ, aux = data
        self.add(f"treedef:{name}", f"{typ.__module__}.{typ.__qualname__}/{t.num_leaves}")
        self.klass(typ)
        self.seen.discard(id(aux))
        self.value(f"{name}.<aux>", aux)
        for i, child in enumerate(t.children()):
            self.walk_treedef(f"{name}/{i}", child, lenient)

    def walk_rng(self, name: str, v: Any, lenient: bool) -> None:
        """A random generator: one the user holds by its state, so a different seed is a
        different program; numpy's and Python's global generators (reached by name:
        ``np.random.normal`` where a function reads ``np.pi`` beside ``jax.random.normal``) by
        what they are only: their state counts where the trace draws from them, which the
        trace's :class:`kiln._keys._rngs.RngWatch` sees (issue 42)."""
        glob = global_generator_name(v)
        if glob is not None:
            self.add(f"rng:{name}", f"global {glob}")
            return
        state = v.getstate() if isinstance(v, random.Random) else (
            v.get_state() if isinstance(v, np.random.RandomState) else v.bit_generator.state)
        self.add(f"rng:{name}", static_digest(state, argname=name))

    def walk_items(self, name: str, v: collections.abc.Mapping[Any, Any]) -> None:
        """The keys and values of a mapping, in iteration order."""
        for i, (k, item) in enumerate(v.items()):
            self.value(f"{name}.<key {i}>", k)
            self.value(f"{name}[{k!r}]" if type(k) in _SCALAR_TYPES else f"{name}[{i}]", item)

    # ----------------------------------------------------------------------------------------
    # try_walk_*: by what an object is or does (_TRY_WALKS, in order), then walk_object
    # ----------------------------------------------------------------------------------------
    def try_walk_logger(self, name: str, v: Any, lenient: bool) -> bool:
        """A ``logging.Logger``, ``LoggerAdapter`` or ``Handler``: what code that logs reads
        of it (its name, levels, whether it is disabled or propagates; an adapter's
        ``extra``), not what logging keeps (its manager's every logger, a cache of levels
        filled as it logs, handlers' locks and streams), which differs between processes
        and between a cold run and a warm one that skipped a trace (issue 42)."""
        if isinstance(v, logging.LoggerAdapter):
            self.add(f"logger-adapter:{name}", f"{type(v).__module__}.{type(v).__qualname__}")
            self.value(f"{name}.logger", v.logger)
            self.value(f"{name}.extra", v.extra)
            return True
        cls = type(v)
        if isinstance(v, logging.Logger):
            self.add(f"logger:{name}", f"{cls.__module__}.{cls.__qualname__}:{v.name}:"
                     f"{v.level}:{v.getEffectiveLevel()}:{v.disabled}:{v.propagate}")
            return True
        if isinstance(v, logging.Handler):
            self.add(f"log-handler:{name}", f"{cls.__module__}.{cls.__qualname__}:{v.level}")
            return True
        return False

    def try_walk_mapping(self, name: str, v: Any, lenient: bool) -> bool:
        """A dict subclass or an immutable mapping (FrozenDict, HashableMapping): in iteration
        order, before the pytree fallback (FrozenDict's flatten sorts its keys); a class with
        ``__kiln_digest__`` says itself what it is (:meth:`walk_object`)."""
        if not (
            isinstance(v, collections.abc.Mapping)
            and (isinstance(v, dict) or type(v).__hash__ is not None)
            and getattr(type(v), "__kiln_digest__", None) is None
        ):
            return False
        cls = type(v)
        self.klass(cls)
        self.add(f"mapping:{name}", f"{cls.__module__}.{cls.__qualname__}[{len(v)}]")
        if isinstance(v, collections.defaultdict):
            self.value(f"{name}.default_factory", v.default_factory)
        self.walk_items(name, v)
        return True

    def try_walk_rng(self, name: str, v: Any, lenient: bool) -> bool:
        """An instance of a subclass of a random generator (``random.SystemRandom``)."""
        if not isinstance(v, _RNG_TYPES):
            return False
        self.walk_rng(name, v, lenient)
        return True

    def try_walk_pytree(self, name: str, v: Any, lenient: bool) -> bool:
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
        self.klass(typ)
        self.add(f"pytree:{name}", f"{typ.__module__}.{typ.__qualname__}")
        library = not is_user_class(typ)
        self.in_library += library
        try:
            self.value(f"{name}.<aux>", aux)
            for i, child in enumerate(children):
                self.value(f"{name}.<child {i}>", child)
        finally:
            self.in_library -= library
        return True

    def try_walk_primitive(self, name: str, v: Any, lenient: bool) -> bool:
        """A ``jax.extend.core.Primitive``: what it holds (``impl``, ``abstract_eval``) and
        every rule JAX's registries hold for it (lowering, platform lowerings, JVP, transpose,
        batching, partial eval, ...: :func:`kiln._base._jax_compat.primitive_rules`), each by
        value: a user rule by its code, a library rule by name, version and what it holds."""
        if not isinstance(v, _jax_compat.Primitive):
            return False
        cls = type(v)
        self.klass(cls)  # a Primitive subclass: its methods
        self.add(f"primitive:{name}", f"{cls.__module__}.{cls.__qualname__}:{v.name}")
        self.in_library += 1
        try:
            for attr, item in sorted(vars(v).items()):
                self.value(f"{name}.{attr}", item)
            for registry, rule in _jax_compat.primitive_rules(v):
                self.value(f"{name}.<{registry}>", rule)
        finally:
            self.in_library -= 1
        return True

    def try_walk_numpy_function(self, name: str, v: Any, lenient: bool) -> bool:
        """A ufunc made by ``np.frompyfunc`` (not importable by name, unlike ``np.add``): the
        Python function it calls, which numpy does not expose but reports to the garbage
        collector (``gc.get_referents``); when it reports none, the walk is unsound. An
        ``np.vectorize``: its function and options (``pyfunc``, ``otypes``, ``excluded``,
        ``signature``, ``cache``), not the ufunc it caches on its first call."""
        if isinstance(v, np.vectorize):
            self.add(f"vectorize:{name}", type(v).__qualname__)
            for attr in ("pyfunc", "otypes", "excluded", "signature", "cache"):
                self.value(f"{name}.{attr}", getattr(v, attr, None))
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
            self.unsound(f"{name} is a ufunc made by np.frompyfunc whose Python function "
                         "numpy does not show (use the function itself, or np.vectorize)")
            return True
        self.add(f"frompyfunc:{name}", f"{v.__name__}/{v.nin}/{v.nout}/{v.identity!r}")
        self.value(f"{name}.<function>", funcs[0])
        return True

    def try_walk_custom_derivatives(self, name: str, v: Any, lenient: bool) -> bool:
        """A ``jax.custom_jvp`` / ``jax.custom_vjp``: its function and its rules."""
        rules = [r for r in ("fun", "jvp", "fwd", "bwd") if callable(getattr(v, r, None))]
        if not (rules and type(v).__name__ in ("custom_jvp", "custom_vjp")):
            return False
        self.add(f"custom:{name}", type(v).__name__)
        for r in rules:
            self.value(f"{name}.{r}", getattr(v, r))
        return True

    def try_walk_wrapper(self, name: str, v: Any, lenient: bool) -> bool:
        """jax.jit / kiln.jit / functools.wraps objects: the wrapped function is what runs."""
        wrapped = getattr(v, "__wrapped__", None)
        if wrapped is None or not callable(v) or isinstance(v, type):
            return False
        self.add(f"wrapper:{name}", f"{type(v).__module__}.{type(v).__qualname__}")
        self.value(f"{name}.__wrapped__", wrapped)
        return True

    def walk_object(self, name: str, v: Any, lenient: bool) -> None:
        """Any other object: an annotation by its ``repr``, an enum member, dataclass or user
        object by what it holds, else by its value digest; failing that a library object by
        its class and state, or (``lenient``, or held by a library) by its class alone."""
        cls = type(v)
        user = is_user_class(cls)
        if user:
            self.klass(cls)  # a user dataclass / object: its methods and class constants too
        if isinstance(v, types.UnionType | types.GenericAlias) or cls.__module__ == "typing":
            self.add(f"typing:{name}", repr(v))  # an annotation: ``Event | None``
            return
        if v is os.environ:
            # held by a library's settings (donfig's ``Config.env``, zarr's): a variable the
            # trace reads is keyed by name and value as it is read (manifest ``<env>``)
            self.add(f"environ:{name}", "")
            return
        if not user and (lenient or self.in_library) and _is_lock(cls):
            # a library's lock (donfig's ``SerializableLock``, whose ``token`` is a uuid made
            # in each process, in zarr.config): it guards state, it is not state; by class
            self.add(f"lock:{name}", f"{cls.__module__}.{cls.__qualname__}")
            return
        if getattr(cls, "__kiln_digest__", None) is None and self.try_walk_instance(name, v, user):
            return
        try:
            self.add(f"value:{name}", static_digest(v, argname=name))
        except (Unpersistable, TypeError, ValueError) as e:
            if user:
                self.unsound(f"{name}: {e}")
            elif self.try_walk_library_object(name, v):
                pass
            elif lenient or (self.in_library and not self.strict):
                # an opaque object of a library class (a C object, a lock) held by library
                # code or state: counted with that library, by class name and version
                self.add(f"lib:{cls.__module__}.{cls.__qualname__}",
                         library_version(cls.__module__))
            else:
                self.unsound(f"{name}: {e}")

    def try_walk_instance(self, name: str, v: Any, user: bool) -> bool:
        """An enum member, or a dataclass instance (user or library) or any user object with
        plain state: what it is, and every value it holds by value (a function in a field by
        its code, attributes set after ``__init__`` too). False for anything else."""
        cls = type(v)
        if isinstance(v, enum.Enum):
            self.add(f"enum:{name}", f"{cls.__module__}.{cls.__qualname__}.{v.name}")
            self.value(f"{name}.value", v.value)
            return True
        if not (user or dataclasses.is_dataclass(v)):
            return False
        if any(b.__module__ == "builtins" and b is not object for b in cls.__mro__):
            return False  # a dict / list subclass: its items are not in its __dict__
        state = getattr(v, "__dict__", None)
        slots = slots_of(cls)
        if not isinstance(state, dict) and not slots:
            return False
        self.add(f"object:{name}", f"{cls.__module__}.{cls.__qualname__}")
        items = sorted(state.items()) if isinstance(state, dict) else []
        items += [(a, getattr(v, a)) for a in slots if hasattr(v, a)]
        for attr, item in items:
            self.value(f"{name}.{attr}", item)
        return True

    def try_walk_library_object(self, name: str, v: Any) -> bool:
        """An instance of a library class with no value digest: what it is (its class, by
        name and version) and the values it holds (its ``__dict__``, by value). False when it
        holds nothing Python can see (a C object, a lock): the caller decides."""
        cls = type(v)
        state = getattr(v, "__dict__", None)
        slots = slots_of(cls)  # (``dataclasses.Field``: default, default_factory, metadata...)
        if not (isinstance(state, dict) or slots) or cls.__module__.partition(".")[0] == "kiln":
            # kiln's own objects say what they are through __kiln_digest__ or __wrapped__;
            # their state (caches of compiled functions) is not what a program is built from
            return False
        if self.strict and not _python_defined(cls):
            return False  # a C type's state (a file, a lock) is not in its __dict__
        self.add(f"lib-object:{name}", f"{cls.__module__}.{cls.__qualname__}="
                 + library_version(cls.__module__))
        items = sorted(state.items()) if isinstance(state, dict) else []
        items += [(a, getattr(v, a)) for a in slots if hasattr(v, a)]
        self.in_library += 1
        try:
            for attr, item in items:
                self.value(f"{name}.{attr}", item)
        finally:
            self.in_library -= 1
        return True

    def static_value(self, name: str, v: Any) -> None:
        """A static argument (or static ``self``) that has no canonical digest of its own:
        keyed by its class (a user class by its code, a library class by name and version) and
        its state, by value, whether or not it defines ``__kiln_digest__`` or is a dataclass
        (a gymnax environment, an evosax strategy: issue 42). Strictly: what in its state has
        no value Python can see (an open file, a lock, a C object) makes the walk unsound, and
        the reason names its field (``static:self.lock``)."""
        strict, self.strict = self.strict, True
        try:
            self.value(name, v)
        finally:
            self.strict = strict

    def static_fields(self, name: str, v: Any, fields: tuple[str, ...]) -> None:
        """A static object keyed by its class and the ``fields`` its trace read
        (:mod:`kiln._keys._static_reads`): each by value, strictly, as :meth:`static_value`
        walks the whole state; a field the object does not hold counts as missing."""
        cls = type(v)
        self.seen.add(id(v))
        self.keep.append(v)
        if is_user_class(cls):
            self.klass(cls)
            self.add(f"object:{name}", f"{cls.__module__}.{cls.__qualname__}")
        else:
            self.add(f"lib-object:{name}", f"{cls.__module__}.{cls.__qualname__}="
                     + library_version(cls.__module__))
        self.add(f"static-reads:{name}", ",".join(fields))
        state = vars(v)
        strict, self.strict = self.strict, True
        self.in_library += not is_user_class(cls)
        try:
            for attr in fields:
                self.value(f"{name}.{attr}", state[attr] if attr in state else _MISSING)
        finally:
            self.in_library -= not is_user_class(cls)
            self.strict = strict

    def watched_value(self, name: str, v: Any, *, lenient: bool = False) -> None:
        """A global the walked code names, or a bound method's ``self`` (``jax.jit(self.step)``):
        an object that can be watched (:func:`kiln._keys._watchable.watchable`: a trainer, a
        config ``argparse.Namespace``, a dataclass instance) is keyed by the fields its trace
        read where ``reads`` names them (the caller watches the trace, issue 42: a run id or
        start time it holds and never reads does not count), else by its whole state."""
        if id(v) not in self.seen and watchable(v) and not _walked_by_kind(v):
            self.watchable.append((name, v))
            fields = self.reads.get(name)
            if fields is not None:
                self.static_fields(name, v, fields)
                return
        self.value(name, v, lenient=lenient)

    def config_global(self, name: str, gname: str, v: Any) -> None:
        """A global ``types.SimpleNamespace`` or ``dict`` (``CFG.lr``, ``CONFIG["lr"]``):
        keyed by the fields that the walked code reads by constant name, or whole where some
        use is not such a read (:func:`kiln._keys._constant_fields.constant_fields`), once the
        walk knows all the code (:meth:`key_configs`, from :meth:`finish`). A builtin class
        cannot be watched as :meth:`watched_value` watches a trainer, and a run name it holds
        and the program never reads made every warm start miss (issue 42). Not marked seen:
        met again another way (a static argument, a closure), it is walked whole there."""
        if name not in self.configs:
            self.configs[name] = _Config(gname, v, isinstance(v, dict))
            self.keep.append(v)
            self.add(f"config:{name}", type(v).__name__)

    def key_configs(self) -> bool:
        """Key the fields of each :meth:`config_global` read by the code walked so far (or
        the whole container); True when that added something."""
        changed = False
        for name, c in list(self.configs.items()):  # (walking a field may add a config)
            if c.whole:
                continue
            fields = constant_fields(self.codes, c.gname, mapping=c.mapping)
            if fields is None:
                c.whole, changed = True, True
                self.add(f"config-whole:{name}", "")
                self.value(name, c.v)
                continue
            state = c.v if c.mapping else vars(c.v)
            for f in sorted(fields - c.fields):
                c.fields.add(f)
                changed = True
                self.value(f"{name}.{f}", state.get(f, _MISSING))
        return changed

    def library_state(self, name: str, v: Any) -> None:
        """A module-level object of a library that is not code (``jnp.pi``, ``os.environ``)."""
        if id(v) in self.seen:
            return
        self.seen.add(id(v))
        self.keep.append(v)
        try:
            self.add(f"value:{name}", static_digest(v, argname=name))
        except (Unpersistable, TypeError, ValueError):
            cls = type(v)
            self.add(f"lib-state:{name}", f"{cls.__module__}.{cls.__qualname__}="
                     + library_version(cls.__module__))

    # ----------------------------------------------------------------------------------------
    # Code: classes, functions, what they close over and the globals they read
    # ----------------------------------------------------------------------------------------
    @_code_walk
    def klass(self, cls: type) -> None:
        """A class: what it is and, for a user class, its methods and class variables; for a
        pytree node type, the flatten / unflatten functions registered for it."""
        mod = script_module(cls.__module__)
        for i, fn in enumerate(_jax_compat.pytree_node_functions(cls)):
            self.value(f"{mod}.{cls.__qualname__}.<pytree {i}>", fn)
        if not has_file(cls) or not is_user_file(inspect.getfile(cls)):
            # a library class (jnp.float32, optax.GradientTransformation): by name and version
            self.add(f"lib:{mod}.{cls.__qualname__}", library_version(mod))
            return
        self.add(f"class:{mod}.{cls.__qualname__}", cls.__qualname__)
        self.classes.append(cls)
        for base in (*cls.__mro__[1:], type(cls)):  # bases and the metaclass
            if base not in (object, type) and id(base) not in self.seen:
                self.seen.add(id(base))
                self.klass(base)
        for attr, member in sorted(vars(cls).items()):
            if isinstance(member, staticmethod | classmethod):
                member = member.__func__
            if isinstance(member, property):
                for accessor in (member.fget, member.fset, member.fdel):
                    if isinstance(accessor, types.FunctionType):
                        self.function(accessor)
                continue
            if isinstance(member, types.FunctionType):
                if member.__qualname__ != f"{cls.__qualname__}.{attr}":
                    # bound from elsewhere (``transform = staticmethod(host_square)``): which
                    # one (see walk_function)
                    self.add(f"function:{mod}.{cls.__qualname__}.{attr}",
                             f"{member.__module__}.{member.__qualname__}")
                self.function(member)  # every method, dunders too (__getitem__, __get__)
            elif attr == "__doc__" and isinstance(member, str):
                # a docstring: a generated one (a dataclass's signature, flax's Module) shows
                # its defaults' reprs, with addresses that differ in every process
                self.add(f"doc:{mod}.{cls.__qualname__}", static_digest(
                    _ADDRESS.sub("", member), argname=f"{cls.__qualname__}.__doc__"))
            elif attr not in _CLASS_NOT_DATA:
                # class constants and ClassVars (``Cfg.FACTOR``, enum members, frozensets,
                # partials, modules) and dunder data (``__dataclass_fields__``: the fields'
                # defaults, factories and metadata; ``__annotations__``, ``__slots__``): by
                # value; what has no value digest makes the walk unsound
                self.value(f"{mod}.{cls.__qualname__}.{attr}", member, lenient=True)

    @_code_walk
    def function(self, fn: types.FunctionType) -> None:
        """A function: a user function by its code, the globals it reads and what it holds;
        a library function by :meth:`library_function`; kiln's own by what it holds."""
        code = fn.__code__
        mod = script_module(fn.__module__ or "<no module>")
        if os.path.realpath(code.co_filename).startswith(KILN_ROOT):
            # kiln's own wrappers (noinline's flat and derived functions): their code is
            # covered by kiln's version; what they close over (the user's function, the
            # pytree structure, batching axes) is walked
            self.add(f"kiln:{fn.__qualname__}", "")
            self.cells(f"{mod}.{fn.__qualname__}", fn)
            return
        if not is_user_file(code.co_filename):
            self.library_function(fn)
            return
        qual = f"{mod}.{fn.__qualname__}"
        for attr, item in sorted(vars(fn).items()):  # ``helper.K = 2.0`` set on the function
            self.value(f"{qual}.{attr}", item)
        if code not in self.codes:
            # its nested functions (lambdas, local defs) too: their code is in this code's
            # digest, the globals they read in its names, and what they close over in its cells
            # names that only a host callback or a log line reads are no names the program
            # reads: neither its globals nor another module's attributes of that name
            unread = callback_only_names(fn) | log_only_names(fn)
            self.codes |= nested_codes(code)
            self.names |= code_names(code) - unread
            self.add(f"code:{qual}", code_digest(code))
            iterated = iterated_set_constant(code)
            if iterated and not hash_seed_fixed():
                self.unsound(f"{qual}: {iterated}, in an order that changes with PYTHONHASHSEED")
            self.globals_of(code, fn.__globals__, qual, callback_roots(fn), unread)
        # every function object: two closures of one factory share code, not cells
        self.cells(qual, fn)

    def cells(self, qual: str, fn: types.FunctionType) -> None:
        """Defaults, keyword-only defaults and closure cells of ``fn``, by value.

        A bare ``object()`` sentinel (``jax.vmap``'s "no axis name") has no value; it is
        named by the global of ``fn``'s module that holds it, since code compares it by
        identity with that global."""
        values: list[tuple[str, Any]] = []
        if fn.__defaults__:
            values += [(f"{qual}.__defaults__[{i}]", d) for i, d in enumerate(fn.__defaults__)]
        if fn.__kwdefaults__:
            values += [(f"{qual}.__kwdefaults__[{k!r}]", d)
                       for k, d in sorted(fn.__kwdefaults__.items())]
        roots = callback_roots(fn)
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
            # the cell itself: a callback made while tracing (a lambda closing over the same
            # variable) shares it, and a warm start must bind that callback to the live cell
            self.keep.append(cell)
            try:
                v = cell.cell_contents
            except ValueError:  # empty cell
                continue
            if var in roots:
                self.callback_target(f"{qual}.<closure {var}>", v, roots[var])
            else:
                values.append((f"{qual}.<closure {var}>", v))
        for name, v in values:
            where = _sentinel_name(fn.__globals__, v) if type(v) is object else None
            if where is not None:
                self.add(f"sentinel:{name}", where)
            else:
                self.value(name, v)

    def callback_target(self, name: str, v: Any, attrs: frozenset[str] = frozenset()) -> None:
        """A callback root (:mod:`kiln._keys._callback_roots`): the function only hands ``v``
        (or ``v.attr`` for each of ``attrs``) to a host-callback API as the callable, so the
        program does not depend on what ``v`` holds or runs (a warm start calls the live
        ``v``). It counts by its type; it is kept (not marked seen) so the host callbacks can
        refer to it and a use elsewhere is walked by value.

        ``v.attr`` held by ``v`` itself (a module's global, an instance's own attribute, a
        class's attribute; not a method reached through an instance's class) can be rebound
        while ``v`` stays what it is (``ops.transform = host_cube``): it counts by its type
        and name, and is kept too, so a warm start calls what ``v.attr`` is now, as a trace
        now would (issue 43)."""
        self.keep.append(v)
        cls = type(v)
        self.add(f"callback:{name}", f"{cls.__module__}.{cls.__qualname__}")
        state = getattr(v, "__dict__", None)
        for attr in sorted(attrs):
            if not isinstance(state, dict | types.MappingProxyType) or attr not in state:
                continue
            try:
                member = getattr(v, attr)  # (a class's staticmethod: the function)
            except Exception:  # noqa: BLE001 - what the trace would meet: by the stored one
                member = state[attr]
            self.keep.append(member)
            mcls = type(member)
            self.add(f"callback:{name}.{attr}", f"{mcls.__module__}.{mcls.__qualname__}:"
                     f"{getattr(member, '__module__', '')}."
                     f"{getattr(member, '__qualname__', '')}")

    def library_function(self, fn: types.FunctionType) -> None:
        """A function defined in an installed library: its code counts by the library's
        version, but it is identified by module and qualified name, and what it holds counts
        by value: closure cells (``optax.sgd(0.1)``'s learning rate, ``jax.grad(f)``'s ``f``),
        defaults and ``__wrapped__``. A function that its name does not import back to (made
        by a factory, or renamed by ``functools.wraps``) is also identified by its code."""
        code = fn.__code__
        module = fn.__globals__.get("__name__") or fn.__module__ or "?"
        ident = f"{module}.{code.co_qualname}"
        self.add(f"lib:{ident}", library_version(module))
        if _resolve_name(module, code.co_qualname) is not fn:
            self.add(f"lib-code:{ident}", code_digest(code))
        self.in_library += 1
        try:
            self.cells(ident, fn)
            wrapped = getattr(fn, "__wrapped__", None)
            if wrapped is not None:
                self.value(f"{ident}.__wrapped__", wrapped)
        finally:
            self.in_library -= 1

    def globals_of(self, code: types.CodeType, g: dict[str, Any], qual: str,
                   roots: dict[str, frozenset[str]] | None = None,
                   callback_only: frozenset[str] = frozenset()) -> None:
        """The globals ``code`` names (in ``g``, else an imported user module or a builtin),
        and the attributes it names of the user modules among them. ``callback_only``: names
        that only a host callback the code makes reads when the program runs
        (:func:`kiln._keys._callback_roots.callback_only_names`), not keyed."""
        names = code_names(code) - callback_only
        modname = script_module(g.get("__name__", "?"))
        modules = []
        for name in sorted(names | module_strings(code)):
            if roots and name in roots and name in g:
                self.callback_target(f"{modname}.{name}", g[name], roots[name])
            elif name in g:
                v = g[name]
                if _is_config(v) and id(v) not in self.seen:
                    self.config_global(f"{modname}.{name}", name, v)
                    continue
                self.watched_value(f"{modname}.{name}", v)
                if isinstance(v, types.ModuleType) and module_is_user(v):
                    modules.append(v)
            elif name in sys.modules and module_is_user(sys.modules[name]):
                # ``import helper`` / ``from helper import h`` inside the function body, or
                # ``importlib.import_module("helper")``
                modules.append(sys.modules[name])
                self.add(f"module:{name}", name)
                self.modules.append(sys.modules[name])
            elif name in _BUILTINS:
                v = _BUILTINS[name]
                if v is _ORIGINAL_BUILTINS.get(name, _BUILTINS):
                    self.add(f"lib:builtins.{name}", library_version("builtins"))
                else:
                    self.value(f"builtins.{name}", v)  # a patched builtin: by what it is now
        for mod in _relative_imports(code, g):
            # ``from . import consts`` / ``from .sub import X`` / ``from .. import y`` inside
            # the function: resolved against its package, as the import statement will be (a
            # module the trace imports first is in the manifest: the recorder's ``imported``)
            modules.append(mod)
            self.add(f"module:{mod.__name__}", mod.__name__)
            self.modules.append(mod)
        done: set[str] = set()
        while modules:
            mod = modules.pop(0)
            if mod.__name__ in done:
                continue
            done.add(mod.__name__)
            for attr in sorted(names):
                found, v = module_attr(mod, attr, True)
                if found and _is_config(v) and id(v) not in self.seen:
                    self.config_global(f"{mod.__name__}.{attr}", attr, v)
                elif found:
                    self.watched_value(f"{mod.__name__}.{attr}", v)
                    if isinstance(v, types.ModuleType) and module_is_user(v):
                        modules.append(v)  # ``import pkg.sub`` then ``pkg.sub.CONST``


def _is_config(v: Any) -> bool:
    """A global config container: exactly a ``types.SimpleNamespace`` or a ``dict``."""
    return type(v) in (types.SimpleNamespace, dict)


@dataclasses.dataclass
class _Config:
    """A global config container met by :meth:`Walker.config_global`: the global's name in
    code, the container, whether it is a mapping, the fields keyed so far, keyed whole."""

    gname: str
    v: Any
    mapping: bool
    fields: set[str] = dataclasses.field(default_factory=set)
    whole: bool = False


_Walk = Callable[[Walker, str, Any, bool], None]
_TryWalk = Callable[[Walker, str, Any, bool], bool]

_WALK_EXACT: dict[type, _Walk] = {
    types.ModuleType: Walker.walk_module,
    functools.partial: Walker.walk_partial,
    types.MethodType: Walker.walk_method,
    types.FunctionType: Walker.walk_function,
    type: Walker.walk_class,
    types.BuiltinFunctionType: Walker.walk_builtin,  # (the type of builtin methods too)
    tuple: Walker.walk_sequence,
    list: Walker.walk_sequence,
    dict: Walker.walk_dict,
    types.MappingProxyType: Walker.walk_mappingproxy,
    set: Walker.walk_set,
    frozenset: Walker.walk_set,
    _PyTreeDef: Walker.walk_treedef,
    **dict.fromkeys(_RNG_TYPES, Walker.walk_rng),
}
# A value of any other type, in order: an instance of a subclass of one of these (a tuple,
# list, dict or set subclass is none of them: it is a mapping, a pytree node or an object), ...
_WALK_ISINSTANCE: tuple[tuple[type, _Walk], ...] = (
    (types.ModuleType, Walker.walk_module),
    (functools.partial, Walker.walk_partial),
    (types.MethodType, Walker.walk_method),
    (types.FunctionType, Walker.walk_function),
    (type, Walker.walk_class),
    (types.BuiltinFunctionType, Walker.walk_builtin),
    (_PyTreeDef, Walker.walk_treedef),
)
# ... then the first of these that takes it, else Walker.walk_object
_TRY_WALKS: tuple[_TryWalk, ...] = (
    Walker.try_walk_logger,
    Walker.try_walk_mapping,
    Walker.try_walk_primitive,
    Walker.try_walk_numpy_function,
    Walker.try_walk_rng,
    Walker.try_walk_pytree,
    Walker.try_walk_custom_derivatives,
    Walker.try_walk_wrapper,
)

# Attributes of a user class that are not data its code reads, or restate what the walk keys
# already (everything else in its ``vars``, dunders included, is walked by value):
_CLASS_NOT_DATA = frozenset({
    "__dict__", "__weakref__",  # descriptors giving instances their dict and weakref slots
    "__module__", "__qualname__",  # the class's name: in its ``class:`` part
    "__firstlineno__",  # (3.13) a line number: moving code changes no key
    "__static_attributes__",  # (3.13) names assigned to ``self.*``: derived from the methods
    # derived from what is walked (and sets of strings, whose order comes from the hash seed):
    "__abstractmethods__",  # from the methods
    "__slotnames__",  # copyreg's cache of ``__slots__``, set when an instance is first copied
    "__protocol_attrs__", "__non_callable_proto_members__",  # typing.Protocol: from the body
    "__required_keys__", "__optional_keys__",  # TypedDict: from ``__annotations__``
    "__readonly_keys__", "__mutable_keys__",
})
# (``__doc__`` is walked, without the ``at 0x...`` of reprs: a function's docstring is the
# first constant of its code, so in its digest, and a class's counts the same way; editing it
# costs a recompile, never staleness.)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")

_BUILTINS = vars(builtins)
_ORIGINAL_BUILTINS = dict(_BUILTINS)  # as at import: a later assignment is a patch


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
    for c in cls.__mro__[:-1]:
        mod = sys.modules.get(c.__module__)
        f = getattr(mod, "__file__", None)
        if not (isinstance(f, str) and f.endswith(".py")):
            return False
    return True


def _has_code_or_name(v: Any) -> bool:
    """Functions, classes, modules, partials, custom_jvp and jitted wrappers: what the walk
    follows into; anything else in a library module is that library's state."""
    return (
        isinstance(v, types.FunctionType | types.BuiltinFunctionType | types.MethodType | type
                   | types.ModuleType | functools.partial)
        or (callable(v) and (getattr(v, "__wrapped__", None) is not None
                             or type(v).__name__ in ("custom_jvp", "custom_vjp")))
        or isinstance(v, _RNG_TYPES)
    )


_SENTINELS: dict[int, tuple[object, str]] = {}


def _sentinel_name(g: dict[str, Any], v: object) -> str | None:
    """``module.name`` of the global holding sentinel ``v``: in the module of globals ``g``, or
    one module further (``core.no_axis_name`` read by ``jax.vmap``). None when not found."""
    known = _SENTINELS.get(id(v))
    if known is not None and known[0] is v:
        return known[1]
    spaces = [g] + [vars(m) for m in list(g.values()) if isinstance(m, types.ModuleType)]
    for space in spaces:
        for k, item in list(space.items()):
            if item is v:
                where = f"{space.get('__name__')}.{k}"
                _SENTINELS[id(v)] = (v, where)  # holds v: the id is never reused
                return where
    return None


# Libraries whose config object the walk leaves out: jax's (``jax.config``) holds what changes
# tracing, keyed by kiln as jax's trace context, what feeds the compile options, keyed as
# those, and the rest (cache directories, which kiln itself sets, logging, ...) builds no
# program; kiln's own holds its store settings.
_CONFIG_KEYED_ELSEWHERE = frozenset({"jax", "jaxlib", "kiln"})


def _subclasses(cls: type) -> list[type]:
    """The live subclasses of ``cls`` (``type.__subclasses__``), in their creation order."""
    try:
        return list(type.__subclasses__(cls))
    except TypeError:
        return []


def _walked_by_kind(v: Any) -> bool:
    """An object the walk keys by what kind of thing it is rather than field by field (a
    logger by its settings, not the level cache it fills as it logs; a mapping; a pytree node
    by its children; a wrapper or custom-derivative function by what it wraps): not watched
    for the fields a trace reads (:meth:`Walker.watched_value`)."""
    if isinstance(v, logging.Logger | logging.LoggerAdapter | logging.Handler
                  | collections.abc.Mapping) or hasattr(v, "__wrapped__"):
        return True
    try:
        _, treedef = jax.tree_util.tree_flatten(v, is_leaf=lambda n: n is not v)
        data = treedef.node_data()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - not a pytree for the walk either
        return False
    return data is not None and data[1] is not v


def _is_lock(cls: type) -> bool:
    """A lock-like class: ``acquire``, ``release`` and a context manager (``threading.Lock``,
    ``RLock``, donfig's ``SerializableLock``, ``multiprocessing``'s locks)."""
    return all(callable(getattr(cls, a, None)) for a in ("acquire", "release", "__enter__"))


def library_config_object(top: str) -> Any:
    """The config object of installed top-level package ``top``, or None: the attribute
    ``config`` of the package (``flax.config``), when it is state rather than code (not a
    module, function, class or callable wrapper). The general rule for library flags that the
    library's own code reads; the stdlib and jax (see ``_CONFIG_KEYED_ELSEWHERE``) have none."""
    if top in _CONFIG_KEYED_ELSEWHERE or top in sys.stdlib_module_names:
        return None
    mod = sys.modules.get(top)
    cfg = vars(mod).get("config") if isinstance(mod, types.ModuleType) else None
    if cfg is None or _has_code_or_name(cfg) or callable(cfg) or type(cfg) in _SCALAR_TYPES:
        return None
    return cfg


def module_attr(mod: types.ModuleType, attr: str, user: bool) -> tuple[bool, Any]:
    """``(True, value)`` of attribute ``attr`` of ``mod``, looked up as code reading
    ``mod.attr`` would: its globals, then (user modules only) a module ``__getattr__``
    (PEP 562). ``(False, None)`` when there is no such attribute."""
    d = vars(mod)
    if attr in d:
        return True, d[attr]
    if user and callable(d.get("__getattr__")):
        try:
            return True, getattr(mod, attr)
        except Exception:  # noqa: BLE001 - AttributeError or the hook failing: not there
            return False, None
    return False, None


def _relative_imports(code: types.CodeType, g: dict[str, Any]) -> list[types.ModuleType]:
    """The loaded user modules that the relative imports in ``code`` name, resolved against
    the package of globals ``g``: for ``from .sub import X`` the module ``pkg.sub`` (and
    ``pkg.sub.X`` if that is a module), for ``from . import consts`` the package and
    ``pkg.consts``."""
    found = relative_imports(code)
    if not found:
        return []
    package = g.get("__package__")
    if package is None:  # (set by the import system; derived as importlib derives it)
        name = g.get("__name__") or ""
        package = name if "__path__" in g else name.rpartition(".")[0]
    out = []
    for level, name, fromlist in found:
        try:
            base = importlib.util.resolve_name("." * level + name, package)
        except (ImportError, ValueError):  # beyond the top-level package: the import fails
            continue
        for modname in (base, *(f"{base}.{f}" for f in fromlist)):
            mod = sys.modules.get(modname)
            if isinstance(mod, types.ModuleType) and module_is_user(mod) and mod not in out:
                out.append(mod)
    return out


def _resolve_name(module: str, qualname: str) -> Any:
    """The object that ``module`` + ``qualname`` names now, or None."""
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        if obj is None or part == "<locals>":
            return None
        obj = getattr(obj, part, None)
    return obj


def walk_failure(e: BaseException) -> str:
    """The reason a walk that raised gives (an object kiln has no rule for): the verify path."""
    if isinstance(e, Unpersistable):
        return str(e)
    return f"the fingerprint walk failed ({type(e).__name__}: {e})"

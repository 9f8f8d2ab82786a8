"""Function fingerprints: what a stored executable was built from, and a manifest to re-check.

A fingerprint has two layers (as ccache's direct mode does for headers):

1. **Static walk** (part of the persistent key): the function's code object (bytecode, constants
   including nested code, names; not line numbers), its defaults, closure values, and every
   module-level value its code names, recursing into user functions, user modules' attributes
   and user classes' methods. Values are hashed by value (:mod:`kiln._keys._hashing`).
2. **Manifest** (stored in the entry, re-checked on a warm lookup): after tracing cold, every
   user-code function that emitted part of the program is read off the equations' source
   tracebacks. Functions the static walk could not see (methods reached through objects,
   callbacks held in data structures) are stored as ``(module, qualname, digest)`` and must
   hash the same before an entry is used.

"User code" is any Python file outside the interpreter's stdlib and site-packages. Installed
libraries count by distribution name + version (``importlib.metadata``), never by code.

Anything that cannot be fingerprinted soundly (a global holding an object with no canonical
value digest, a function that ran but cannot be found again by module + qualname) makes the
fingerprint *unsound*: kiln then never trusts a fingerprint key for that function and takes the
verify path (trace + lower, key by the lowered module, skip only the compile).
"""

from __future__ import annotations

import builtins
import collections
import collections.abc
import dataclasses
import dis
import enum
import functools
import importlib.metadata
import inspect
import os
import random
import sys
import threading
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import xxhash

from .._base import _jax_compat
from .._base._errors import StaticArgumentError
from ._hashing import Unpersistable, static_digest
from ._reads import DIR, FILE, LIB_ROOTS, ReadRecorder, check_read

__all__ = ["Fingerprint", "fingerprint", "manifest_for", "check_manifest"]

_KILN_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep  # src/kiln/
_MAX_ITEMS = 5000
_PLAIN = (type(None), bool, int, float, complex, str, bytes, tuple, list, dict)
_PyTreeDef = type(jax.tree_util.tree_structure(0))


@functools.lru_cache(maxsize=4096)
def is_user_file(filename: str) -> bool:
    """True if ``filename`` is user code: not stdlib, not site-packages, not kiln itself.

    Code compiled from a string (``python -c``, ``exec``, ``<stdin>``, notebook cells) is user
    code: its bytecode is hashed like any other.
    """
    if not filename or filename.startswith("<"):
        return True
    real = os.path.realpath(filename)
    return not real.startswith(LIB_ROOTS) and not real.startswith(_KILN_ROOT)


@functools.lru_cache(maxsize=1)
def _packages_distributions() -> dict[str, list[str]]:
    return dict(importlib.metadata.packages_distributions())


def library_version(module_name: str) -> str:
    """``dist==version`` of the installed distribution that provides ``module_name``."""
    return _top_level_version(module_name.partition(".")[0])


@functools.lru_cache(maxsize=1024)
def _top_level_version(top: str) -> str:
    """``dist==version`` of the distribution of top-level package ``top`` (one metadata read
    per package: a cold fit's walk names ~30 modules of ~6 packages)."""
    if not top:
        return "unknown==unknown"
    if top == "__main__":  # a script run from site-packages: no distribution names it
        return "__main__==unknown"
    if top in sys.stdlib_module_names or top == "builtins":
        return f"python=={sys.version.split()[0]}"
    # Most distributions are named like their top-level package (jax, numpy, equinox): ask
    # for that first; scanning every installed distribution costs ~0.4 s.
    candidates = [top, top.replace("_", "-")]
    for name in candidates:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if top in (dist.read_text("top_level.txt") or top).split() or _provides(dist, top):
            meta = dist.metadata  # (parsed on each access: once here)
            return f"{meta['Name']}=={meta['Version']}"
    dists = _packages_distributions().get(top)
    if not dists:
        return f"{top}==unknown"
    name = sorted(dists)[0]
    try:
        return f"{name}=={importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{name}==unknown"


def _provides(dist: importlib.metadata.Distribution, top: str) -> bool:
    files = dist.files or []
    return any(f.parts and f.parts[0] in (top, f"{top}.py") for f in files[:2000])


def _module_is_user(mod: types.ModuleType) -> bool:
    f = getattr(mod, "__file__", None)
    return bool(f) and is_user_file(f)


@functools.lru_cache(maxsize=8192)
def _code_names(code: types.CodeType) -> frozenset[str]:
    """Names ``code`` reads (globals, attributes) and identifier-like string constants
    (``getattr(mod, "SCALE")``), nested code included."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
        elif type(c) is str and c.isidentifier():
            names.add(c)
    return frozenset(names)


def _nested_codes(code: types.CodeType) -> set[types.CodeType]:
    """``code`` and every code object nested in it (lambdas, local functions, comprehensions)."""
    out = {code}
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _nested_codes(c)
    return out


@functools.lru_cache(maxsize=8192)
def code_digest(code: types.CodeType) -> str:
    """Digest of a code object: bytecode, constants (nested code recursively), names, arity.

    Line numbers and file names are left out, so moving code does not change its digest.
    Constants are hashed canonically (:func:`kiln._keys._hashing.static_digest`), never by ``repr``:
    a ``frozenset`` constant (``x in {"a", "b"}``) has the same digest under every
    ``PYTHONHASHSEED``.
    """
    h = xxhash.xxh3_128()
    _feed_code(h, code)
    return h.hexdigest()


def _feed_code(h: Any, code: types.CodeType) -> None:
    h.update(code.co_code)
    h.update(repr((code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount,
                   code.co_flags, code.co_names, code.co_varnames, code.co_freevars,
                   code.co_cellvars, code.co_name)).encode())
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            h.update(b"<code>")
            _feed_code(h, c)
        else:
            h.update(type(c).__name__.encode())
            try:
                h.update(static_digest(c, argname="constant").encode())
            except (Unpersistable, StaticArgumentError):  # Ellipsis and other singletons
                h.update(repr(c).encode())


@functools.lru_cache(maxsize=8192)
def iterated_set_constant(code: types.CodeType) -> str | None:
    """A ``for`` loop over a set literal whose order depends on the hash seed, if ``code`` (or
    code nested in it) has one: ``for n in {"a", "b"}`` iterates a frozenset constant in an
    order that changes with ``PYTHONHASHSEED`` (membership tests do not care)."""
    prev: Any = None
    # (disassembled only when it holds such a constant: dis costs ~0.5 ms per code object)
    unstable = any(isinstance(c, frozenset) and not _order_is_stable(c) for c in code.co_consts)
    for ins in dis.get_instructions(code) if unstable else ():
        if ins.opname == "GET_ITER" and prev is not None and prev.opname == "LOAD_CONST" \
                and isinstance(prev.argval, frozenset) and not _order_is_stable(prev.argval):
            return f"{code.co_qualname} iterates the set {sorted(map(repr, prev.argval))[:4]}"
        prev = ins
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            found = iterated_set_constant(c)
            if found:
                return found
    return None


def _order_is_stable(items: Any) -> bool:
    """Whether a set of ``items`` iterates in the same order in every process: their hashes
    do not depend on ``PYTHONHASHSEED`` or on memory addresses (numbers, None, tuples of them)."""
    return all(
        type(e) in (int, float, bool, complex, type(None))
        or (type(e) is tuple and _order_is_stable(e))
        for e in items
    )


def _hash_seed_fixed() -> bool:
    """``PYTHONHASHSEED`` is set to a number: str and bytes hashes repeat across processes
    started with the same value."""
    return os.environ.get("PYTHONHASHSEED", "random").isdigit()


@dataclass
class Fingerprint:
    """Result of the static walk.

    Attributes:
        digest: 32 hex characters over every part, in walk order.
        parts: (name, digest) pairs, e.g. ``("code:mod.helper", "ab..")`` or
            ``("global:mod.SCALE", "..")`` or ``("lib:diffrax", "diffrax==0.7.2")``; stored in
            the entry header so ``KILN_EXPLAIN`` can name what changed.
        sound: False if some part could not be digested (then ``reason`` says which).
        codes: code objects covered by the walk (the manifest skips them).
        names: every name the walked code reads (globals and attributes).
    """

    digest: str
    parts: list[tuple[str, str]]
    sound: bool = True
    reason: str | None = None
    codes: set[types.CodeType] = field(default_factory=set)
    names: set[str] = field(default_factory=set)


_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_RNGS = (np.random.RandomState, np.random.Generator, random.Random)


class _Walker:
    """One static walk (see the module docstring for the rule it applies).

    Objects that can hold or lead to other objects are visited once (by ``id``: a cycle ends,
    a shared object is walked where it is first met); scalars are hashed wherever they occur,
    so no part depends on whether two equal values happen to be one object.
    """

    def __init__(self) -> None:
        self.parts: list[tuple[str, str]] = []
        self.seen: set[int] = set()
        self.codes: set[types.CodeType] = set()
        self.reason: str | None = None
        self.keep: list[Any] = []  # keep ids stable during the walk
        self.modules: list[types.ModuleType] = []  # modules reached as values (user and library)
        self.names: set[str] = set()  # every name any walked user code reads
        self.in_library = 0  # > 0 while walking what a library object holds

    def finish(self) -> None:
        """Walk the attributes of every module reached (through a global, a closure, a default,
        an argument...) that any walked code names: ``mod.SCALE`` wherever ``mod`` came from,
        and ``jnp.tanh`` (a library name a patch may have replaced). Repeats until no new
        module or name appears."""
        done: set[tuple[str, str]] = set()
        changed = True
        while changed:
            changed = False
            for mod in list(self.modules):
                user = _module_is_user(mod)
                for attr in sorted(self.names):
                    if (mod.__name__, attr) in done:
                        continue
                    done.add((mod.__name__, attr))
                    found, v = _module_attr(mod, attr, user)
                    if not found:
                        continue
                    changed = True
                    if not user and not _has_code_or_name(v) and not _is_user_class(type(v)):
                        # library state (os.environ, jax.config, a registry): by value when it
                        # has one, else by the library's version (README: what kiln cannot see)
                        self.library_state(f"{mod.__name__}.{attr}", v)
                    else:
                        self.value(f"{mod.__name__}.{attr}", v, lenient=not user)

    def add(self, name: str, digest: str) -> None:
        self.parts.append((name, digest))

    def sound_digest(self) -> str:
        """Finish the walk; the digest of all parts (manifest items).

        Raises:
            Unpersistable: some part has no canonical digest.
        """
        self.finish()
        if self.reason is not None:
            raise Unpersistable(self.reason)
        h = xxhash.xxh3_128()
        for name, d in self.parts:
            h.update(f"{name}\0{d}\n".encode())
        return h.hexdigest()

    def unsound(self, what: str) -> None:
        if self.reason is None:
            self.reason = what

    def value(self, name: str, v: Any, *, lenient: bool = False) -> None:
        """Add ``v`` by value: what it is, and everything reachable from it."""
        if type(v) in _SCALARS:
            self.add(f"value:{name}", static_digest(v, argname=name))
            return
        if id(v) in self.seen:
            return
        if len(self.parts) > _MAX_ITEMS:
            self.unsound(f"more than {_MAX_ITEMS} fingerprint parts (at {name})")
            return
        self.seen.add(id(v))
        self.keep.append(v)
        if isinstance(v, types.ModuleType):
            if _module_is_user(v):
                self.add(f"module:{name}", v.__name__)
            else:
                self.add(f"lib:{v.__name__}", library_version(v.__name__))
            self.modules.append(v)  # its attributes named by any walked code: finish()
            return
        if isinstance(v, functools.partial):
            self.add(f"partial:{name}", "")
            self.value(f"{name}.func", v.func)
            for i, a in enumerate(v.args):
                self.value(f"{name}.args[{i}]", a)
            for k, a in sorted(v.keywords.items()):
                self.value(f"{name}.keywords[{k!r}]", a)
            return
        if isinstance(v, types.MethodType):
            self.value(f"{name}.__func__", v.__func__)
            self.value(f"{name}.__self__", v.__self__, lenient=lenient)
            return
        if isinstance(v, types.FunctionType):
            self.function(v)
            return
        if isinstance(v, type):
            self.klass(v)
            return
        if isinstance(v, types.BuiltinFunctionType | types.BuiltinMethodType):
            mod = getattr(v, "__module__", None) or "builtins"
            self.add(f"lib:{mod}.{getattr(v, '__qualname__', v.__name__)}", library_version(mod))
            owner = getattr(v, "__self__", None)
            if owner is not None and not isinstance(owner, types.ModuleType | type):
                self.value(f"{name}.__self__", owner, lenient=lenient)  # ``rng.normal``
            return
        if type(v) in (tuple, list):
            self.add(f"container:{name}", f"{type(v).__name__}[{len(v)}]")
            for i, item in enumerate(v):
                self.value(f"{name}[{i}]", item)
            return
        if type(v) is dict:
            # insertion order: code that iterates a dict sees it in that order
            self.add(f"container:{name}", f"dict[{len(v)}]")
            for i, (k, item) in enumerate(v.items()):
                self.value(f"{name}.<key {i}>", k)
                self.value(f"{name}[{k!r}]" if type(k) in _SCALARS else f"{name}[{i}]", item)
            return
        if type(v) in (set, frozenset):
            self.set_value(name, v)
            return
        if isinstance(v, _PyTreeDef):
            self.treedef(name, v)
            return
        if (
            isinstance(v, collections.abc.Mapping)
            and (isinstance(v, dict) or type(v).__hash__ is not None)
            and getattr(type(v), "__kiln_digest__", None) is None
        ):
            # a dict subclass or an immutable mapping (FrozenDict, HashableMapping): in
            # iteration order, before the pytree branch (FrozenDict's flatten sorts its keys);
            # a class with __kiln_digest__ says itself what it is (below)
            cls = type(v)
            self.klass(cls)
            self.add(f"mapping:{name}", f"{cls.__module__}.{cls.__qualname__}[{len(v)}]")
            if isinstance(v, collections.defaultdict):
                self.value(f"{name}.default_factory", v.default_factory)
            for i, (k, item) in enumerate(v.items()):
                self.value(f"{name}.<key {i}>", k)
                self.value(f"{name}[{k!r}]" if type(k) in _SCALARS else f"{name}[{i}]", item)
            return
        if isinstance(v, _RNGS):
            # a random generator read while tracing (``np.random.randn`` building a constant):
            # its state, so a different seed is a different program
            state = v.getstate() if isinstance(v, random.Random) else (
                v.get_state() if isinstance(v, np.random.RandomState) else v.bit_generator.state)
            self.add(f"rng:{name}", static_digest(state, argname=name))
            return
        if self.pytree(name, v):
            return
        rules = [r for r in ("fun", "jvp", "fwd", "bwd") if callable(getattr(v, r, None))]
        if rules and type(v).__name__ in ("custom_jvp", "custom_vjp"):
            self.add(f"custom:{name}", type(v).__name__)
            for r in rules:
                self.value(f"{name}.{r}", getattr(v, r))
            return
        wrapped = getattr(v, "__wrapped__", None)
        if wrapped is not None and callable(v) and not isinstance(v, type):
            # jax.jit / kiln.jit / functools.wraps objects: the wrapped function is what runs.
            self.add(f"wrapper:{name}", f"{type(v).__module__}.{type(v).__qualname__}")
            self.value(f"{name}.__wrapped__", wrapped)
            return
        cls = type(v)
        user = _is_user_class(cls)
        if user:
            self.klass(cls)  # a user dataclass / object: its methods and class constants too
        if isinstance(v, types.UnionType | types.GenericAlias) or cls.__module__ == "typing":
            self.add(f"typing:{name}", repr(v))  # an annotation: ``Event | None``
            return
        if getattr(cls, "__kiln_digest__", None) is None and self.instance(name, v, user):
            return
        try:
            self.add(f"value:{name}", static_digest(v, argname=name))
        except (Unpersistable, TypeError, ValueError) as e:
            if user:
                self.unsound(f"{name}: {e}")
            elif self.library_object(name, v):
                pass
            elif lenient or self.in_library:
                # an opaque object of a library class (a C object, a lock) held by library
                # code or state: counted with that library, by class name and version
                self.add(f"lib:{cls.__module__}.{cls.__qualname__}",
                         library_version(cls.__module__))
            else:
                self.unsound(f"{name}: {e}")

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

    def instance(self, name: str, v: Any, user: bool) -> bool:
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
        slots = [a for c in cls.__mro__ for a in getattr(c, "__slots__", ())
                 if a not in ("__dict__", "__weakref__")]
        if not isinstance(state, dict) and not slots:
            return False
        self.add(f"object:{name}", f"{cls.__module__}.{cls.__qualname__}")
        items = sorted(state.items()) if isinstance(state, dict) else []
        items += [(a, getattr(v, a)) for a in slots if hasattr(v, a)]
        for attr, item in items:
            self.value(f"{name}.{attr}", item)
        return True

    def library_object(self, name: str, v: Any) -> bool:
        """An instance of a library class with no value digest: what it is (its class, by
        name and version) and the values it holds (its ``__dict__``, by value). False when it
        holds nothing Python can see (a C object, a lock): the caller decides."""
        cls = type(v)
        state = getattr(v, "__dict__", None)
        if not isinstance(state, dict) or cls.__module__.partition(".")[0] == "kiln":
            # kiln's own objects say what they are through __kiln_digest__ or __wrapped__;
            # their state (caches of compiled functions) is not what a program is built from
            return False
        self.add(f"lib-object:{name}", f"{cls.__module__}.{cls.__qualname__}="
                 + library_version(cls.__module__))
        self.in_library += 1
        try:
            for attr, item in sorted(state.items()):
                self.value(f"{name}.{attr}", item)
        finally:
            self.in_library -= 1
        return True

    def set_value(self, name: str, v: set[Any] | frozenset[Any]) -> None:
        """A set: its elements, in the order code that iterates it would see them. That order
        is the same in every process for numbers; for strings it changes with
        ``PYTHONHASHSEED``, so without a fixed seed such a set cannot be keyed by value."""
        if not _order_is_stable(v) and not _hash_seed_fixed():
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

    def treedef(self, name: str, t: Any) -> None:
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
            self.treedef(f"{name}/{i}", child)

    def pytree(self, name: str, v: Any) -> bool:
        """Walk a registered pytree node (equinox Module, diffrax term, ...) one level down."""
        if isinstance(v, jax.Array | np.ndarray | np.generic) or type(v) in _PLAIN:
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
        library = not _is_user_class(typ)
        self.in_library += library
        try:
            self.value(f"{name}.<aux>", aux)
            for i, child in enumerate(children):
                self.value(f"{name}.<child {i}>", child)
        finally:
            self.in_library -= library
        return True

    def klass(self, cls: type) -> None:
        """A class: what it is and, for a user class, its methods and class variables; for a
        pytree node type, the flatten / unflatten functions registered for it."""
        mod = script_module(cls.__module__)
        for i, fn in enumerate(_jax_compat.pytree_node_functions(cls)):
            self.value(f"{mod}.{cls.__qualname__}.<pytree {i}>", fn)
        if not _has_file(cls) or not is_user_file(inspect.getfile(cls)):
            # a library class (jnp.float32, optax.GradientTransformation): by name and version
            self.add(f"lib:{mod}.{cls.__qualname__}", library_version(mod))
            return
        self.add(f"class:{mod}.{cls.__qualname__}", cls.__qualname__)
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
                self.function(member)  # every method, dunders too (__getitem__, __get__)
            elif not (attr.startswith("_") and attr.endswith("_")):
                # class constants and ClassVars (``Cfg.FACTOR``, enum members, frozensets,
                # partials, modules): by value; what has no value digest makes the walk unsound
                self.value(f"{mod}.{cls.__qualname__}.{attr}", member, lenient=True)

    def function(self, fn: types.FunctionType) -> None:
        code = fn.__code__
        mod = script_module(fn.__module__ or "<no module>")
        if os.path.realpath(code.co_filename).startswith(_KILN_ROOT):
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
            self.codes |= _nested_codes(code)
            self.names |= _code_names(code)
            self.add(f"code:{qual}", code_digest(code))
            iterated = iterated_set_constant(code)
            if iterated and not _hash_seed_fixed():
                self.unsound(f"{qual}: {iterated}, in an order that changes with PYTHONHASHSEED")
            self.globals_of(code, fn.__globals__, qual)
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
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
            try:
                values.append((f"{qual}.<closure {var}>", cell.cell_contents))
            except ValueError:  # empty cell
                continue
        for name, v in values:
            where = _sentinel_name(fn.__globals__, v) if type(v) is object else None
            if where is not None:
                self.add(f"sentinel:{name}", where)
            else:
                self.value(name, v)

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

    def globals_of(self, code: types.CodeType, g: dict[str, Any], qual: str) -> None:
        names = _code_names(code)
        modname = script_module(g.get("__name__", "?"))
        modules = []
        for name in sorted(names | _module_strings(code)):
            if name in g:
                v = g[name]
                self.value(f"{modname}.{name}", v)
                if isinstance(v, types.ModuleType) and _module_is_user(v):
                    modules.append(v)
            elif name in sys.modules and _module_is_user(sys.modules[name]):
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
        done: set[str] = set()
        while modules:
            mod = modules.pop(0)
            if mod.__name__ in done:
                continue
            done.add(mod.__name__)
            for attr in sorted(names):
                found, v = _module_attr(mod, attr, True)
                if found:
                    self.value(f"{mod.__name__}.{attr}", v)
                    if isinstance(v, types.ModuleType) and _module_is_user(v):
                        modules.append(v)  # ``import pkg.sub`` then ``pkg.sub.CONST``


_BUILTINS = vars(builtins)
_ORIGINAL_BUILTINS = dict(_BUILTINS)  # as at import: a later assignment is a patch


def _has_code_or_name(v: Any) -> bool:
    """Functions, classes, modules, partials, custom_jvp and jitted wrappers: what the walk
    follows into; anything else in a library module is that library's state."""
    return (
        isinstance(v, types.FunctionType | types.BuiltinFunctionType | types.MethodType | type
                   | types.ModuleType | functools.partial)
        or (callable(v) and (getattr(v, "__wrapped__", None) is not None
                             or type(v).__name__ in ("custom_jvp", "custom_vjp")))
        or isinstance(v, _RNGS)
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


def _module_attr(mod: types.ModuleType, attr: str, user: bool) -> tuple[bool, Any]:
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


def _module_strings(code: types.CodeType) -> set[str]:
    """String constants of ``code`` that name imported modules (``import_module("mod")``)."""
    out = {c for c in code.co_consts if type(c) is str and c in sys.modules}
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _module_strings(c)
    return out


def _resolve_name(module: str, qualname: str) -> Any:
    """The object that ``module`` + ``qualname`` names now, or None."""
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        if obj is None or part == "<locals>":
            return None
        obj = getattr(obj, part, None)
    return obj


def _is_user_class(cls: type) -> bool:
    """Defined in a user file (classes of C extensions and builtins have no file)."""
    return _has_file(cls) and is_user_file(inspect.getfile(cls))


def _has_file(obj: Any) -> bool:
    try:
        inspect.getfile(obj)
        return True
    except (TypeError, OSError):
        return False


def fingerprint(fun: Callable[..., Any], *, extra: list[tuple[str, Any]] = ()) -> Fingerprint:  # type: ignore[assignment]
    """Static-walk fingerprint of ``fun`` and of the named ``extra`` values (see module doc).

    ``extra`` holds values that shape the trace besides ``fun``: static arguments and the aux
    data of the arguments' pytree nodes. Functions among them are fingerprinted by code.
    """
    w = _Walker()
    try:
        w.value(getattr(fun, "__qualname__", type(fun).__qualname__), fun)
        if not isinstance(fun, types.FunctionType | functools.partial | types.MethodType):
            w.klass(type(fun))  # a callable object: its class's __call__ and methods
        for name, v in extra:
            w.add(f"extra:{name}", "")
            w.seen.discard(id(v))
            w.value(name, v)
        w.finish()
    except Exception as e:  # noqa: BLE001 - the walk never raises into the user's call
        w.unsound(_walk_failure(e))
    h = xxhash.xxh3_128()
    for name, d in w.parts:
        h.update(name.encode())
        h.update(b"\0")
        h.update(d.encode())
        h.update(b"\n")
    return Fingerprint(h.hexdigest(), w.parts, w.reason is None, w.reason, w.codes, w.names)


# ----------------------------------------------------------------------------------------
# Recording a cold trace
# ----------------------------------------------------------------------------------------
_monitoring: Any = getattr(sys, "monitoring", None)  # Python 3.12+
_recorders: list[TraceRecorder] = []
_tool_id: int | None = None
_recorders_lock = threading.Lock()


class TraceRecorder:
    """Records what a cold trace used that a static walk before it cannot predict.

    - ``imported``: user modules imported while tracing (``from mod import X`` inside the
      function: before the trace ``mod`` is not even loaded);
    - ``codes``: on Python 3.12+, the code of every function that ran in this thread while
      tracing (``sys.monitoring`` PY_START, each code object reported once and then disabled,
      which costs nothing measurable: a 3.5 s diffrax trace took no longer). Python 3.11 has
      no such hook at a bearable price (``sys.setprofile`` added 60% to that trace), so there
      the manifest holds the functions that emitted equations only.

    - ``reads``: files this thread opened and directories it listed while tracing, as
      manifest items (:mod:`kiln._keys._reads`); ``read_reason`` says why they cannot be keyed
      (a socket, a pipe, a file that changed during the trace), else None.

    Use as a context manager around the trace; nests (a kiln.jit called while tracing another).
    ``modules_before``: the modules loaded when the static walk ran (default: at entry); a
    module imported since (by a manifest check, say) was not seen by the walk either.
    ``ignore``: directories whose files are not the program's inputs (kiln's store, JAX's
    cache directory).
    """

    def __init__(self, modules_before: set[str] | None = None,
                 ignore: tuple[str, ...] = ()) -> None:
        self.codes: set[types.CodeType] = set()
        self.imported: tuple[str, ...] = ()
        self.reads: list[list[str]] = []
        self.read_reason: str | None = None
        self.thread = threading.get_ident()
        self._before: set[str] = modules_before or set()
        self._reads = ReadRecorder(ignore)

    def __enter__(self) -> TraceRecorder:
        self._before = self._before or set(sys.modules)
        if _monitoring is not None:
            with _recorders_lock:
                if _start_monitoring():
                    _recorders.append(self)
        self._reads.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._reads.__exit__(*exc)
        if exc[0] is None:
            self.reads = self._reads.items()
            self.read_reason = self._reads.unkeyable
        if _monitoring is not None:
            with _recorders_lock:
                if self in _recorders:
                    _recorders.remove(self)
                if not _recorders:
                    _stop_monitoring()
        self.imported = tuple(sorted(
            name for name, mod in list(sys.modules.items())
            if name not in self._before and isinstance(mod, types.ModuleType)
            and _module_is_user(mod)
        ))


def _start_monitoring() -> bool:
    """Switch PY_START events on for kiln's tool (a free ``sys.monitoring`` tool id)."""
    global _tool_id
    mon = _monitoring
    if _tool_id is None:
        for tid in range(6):  # ids 0-5; debuggers, coverage and profilers take fixed ones
            if mon.get_tool(tid) is None:
                mon.use_tool_id(tid, "kiln")
                mon.register_callback(tid, mon.events.PY_START, _on_py_start)
                _tool_id = tid
                break
        else:
            return False
    if not _recorders:
        mon.restart_events()  # codes disabled by an earlier recording report again
        mon.set_events(_tool_id, mon.events.PY_START)
    return True


def _stop_monitoring() -> None:
    if _tool_id is not None:
        _monitoring.set_events(_tool_id, 0)


def _on_py_start(code: types.CodeType, offset: int) -> Any:
    me = threading.get_ident()
    seen = False
    for r in list(_recorders):
        if r.thread == me:
            r.codes.add(code)
            seen = True
    # reported once per recording; another thread's code stays on (it may run here later)
    return _monitoring.DISABLE if seen else None


# ----------------------------------------------------------------------------------------
# Manifest: what ran while tracing.
# ----------------------------------------------------------------------------------------
def _module_names_by_file() -> dict[str, str]:
    out: dict[str, str] = {}
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if f and name not in ("__mp_main__",):
            out.setdefault(os.path.realpath(f), name)
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file:
        out[os.path.realpath(main_file)] = "__main__"
    return out


def script_module(name: str) -> str:
    """A module's name as keys spell it: the script is ``__main__`` also where a spawned worker
    (multiprocessing, ProcessPoolExecutor) re-imported it as ``__mp_main__``, so the worker
    finds the entries its parent wrote (``sys.modules["__main__"]`` is that module there)."""
    return "__main__" if name == "__mp_main__" else name


def _resolve(module: str, qualname: str, namespaces: dict[str, Any] | None = None) -> Any:
    """The object at ``module`` + ``qualname``; for ``a.<locals>.b`` the enclosing ``a``.

    Decorated functions (``kiln.jit``, ``jax.jit``, ``functools.wraps``) resolve to the function
    they wrap. A module not imported yet is imported (it is user code the program imports while
    tracing). ``namespaces``: module name -> the globals the compiled function itself runs with
    (for a function unpickled by value, not the module of that name in this process). Returns
    None when nothing is found.
    """
    mod = namespaces.get(module) if namespaces else None
    if mod is None:
        mod = sys.modules.get(module)
    if mod is None and module != "__main__":
        try:
            mod = importlib.import_module(module)
        except Exception:  # noqa: BLE001 - a module that no longer imports: not found
            return None
    if mod is None:
        return None
    obj: Any = mod
    for part in qualname.split(".<locals>.")[0].split("."):
        obj = inspect.getattr_static(obj, part, None)
        if isinstance(obj, staticmethod | classmethod):
            obj = obj.__func__
        if obj is None:
            return None
    if isinstance(obj, property):
        obj = obj.fget
    for _ in range(10):
        if isinstance(obj, types.FunctionType | type):
            break
        wrapped = getattr(obj, "__wrapped__", None)
        if wrapped is None:
            break
        obj = wrapped
    return obj


def _find_in_module(module: str, code: types.CodeType) -> str | None:
    """Name of a module global function whose code is (or contains) ``code``: a module-level
    lambda assigned to a name has qualname ``<lambda>``, which does not resolve."""
    mod = sys.modules.get(module)
    for name, v in sorted(vars(mod).items()) if mod is not None else ():
        if isinstance(v, types.FunctionType) and _contains(v.__code__, code):
            return name
    return None


def _contains(outer: types.CodeType, code: types.CodeType) -> bool:
    if outer is code:
        return True
    return any(isinstance(c, types.CodeType) and _contains(c, code) for c in outer.co_consts)


def _walk_failure(e: BaseException) -> str:
    """The reason a walk that raised gives (an object kiln has no rule for): the verify path."""
    if isinstance(e, Unpersistable):
        return str(e)
    return f"the fingerprint walk failed ({type(e).__name__}: {e})"


def _shallow_digest(fn: types.FunctionType) -> str:
    """Full static walk of one manifest function: code, defaults, closure, globals, helpers.

    Raises:
        Unpersistable: some part has no canonical digest (or the walk failed on it).
    """
    w = _Walker()
    try:
        w.function(fn)
        return w.sound_digest()
    except Exception as e:  # noqa: BLE001 - never into the user's call
        raise Unpersistable(_walk_failure(e)) from None


def manifest_for(
    codes: set[types.CodeType],
    fp: Fingerprint,
    imported: tuple[str, ...] = (),
    reads: Sequence[list[str]] = (),
    read_reason: str | None = None,
) -> tuple[list[list[str]], str | None]:
    """Manifest items for what the cold trace used that the static walk ``fp`` could not see.

    - ``[module, qualname, digest]`` for each user function whose code is in ``codes`` (the
      frames that emitted the program's equations, :func:`kiln._base._jax_compat.codes_in_jaxpr`,
      and on Python 3.12+ every user function that ran, :class:`TraceRecorder`) and that the
      walk did not cover;
    - ``[module, "<module>", digest, names]`` for each user module in ``imported`` (imported
      while tracing, so the walk before the trace could not see it): the attributes ``names``
      that any walked code reads, by value;
    - ``reads``: the files and directories the trace read (``[path, "<file>" | "<dir>",
      digest, stat]``, :class:`kiln._keys._reads.ReadRecorder`), or ``read_reason`` why they cannot
      be keyed.

    Returns (items, reason): ``reason`` is not None when some of that code cannot be found
    again by module + qualname, or some read cannot be keyed (the fingerprint is then
    unsound).
    """
    if read_reason is not None:
        return [], read_reason
    covered = fp.codes
    modules: list[list[str]] = []
    names = set(fp.names)
    for code in codes:
        if is_user_file(code.co_filename):
            names |= _code_names(code)
    for mname in sorted(imported):
        mod = sys.modules.get(mname)
        if mod is None or not _module_is_user(mod):
            continue
        attrs = sorted(a for a in names if _module_attr(mod, a, True)[0])
        try:
            modules.append([mname, "<module>", _module_digest(mod, attrs), ",".join(attrs)])
        except Unpersistable as e:
            return [], f"module {mname} (imported while tracing): {e}"
    items: dict[tuple[str, str], str] = {}
    by_file: dict[str, str] | None = None
    for code in sorted(codes, key=lambda c: (c.co_filename, c.co_qualname)):
        if code in covered or not is_user_file(code.co_filename) or code.co_name == "<module>":
            continue
        if code.co_filename.startswith("<"):
            # code compiled from a string: a ``python -c`` / notebook function is found in
            # __main__ by qualname; generated code (dataclass ``__init__`` in jax, ...) is
            # derived from classes the walk covers by their own code, and is skipped
            fn = _resolve("__main__", code.co_qualname)
            if isinstance(fn, types.FunctionType) and _contains(fn.__code__, code):
                items.setdefault(("__main__", fn.__qualname__), _shallow_digest(fn))
            continue
        if by_file is None:
            by_file = _module_names_by_file()
        module = by_file.get(os.path.realpath(code.co_filename))
        if module is None:
            return [], f"{code.co_qualname} ({code.co_filename}) is not in an imported module"
        fn = _resolve(module, code.co_qualname)
        if isinstance(fn, type):
            continue  # a class body running at import: its attributes are walked by klass()
        qualname = code.co_qualname
        if not isinstance(fn, types.FunctionType) or not _contains(fn.__code__, code):
            name = _find_in_module(module, code)
            if name is None:
                return [], f"{module}.{qualname} ran while tracing but cannot be found again"
            fn, qualname = vars(sys.modules[module])[name], name
        else:
            qualname = fn.__qualname__
        key = (module, qualname)
        if key in items or fn.__code__ in covered:
            continue
        try:
            items[key] = _shallow_digest(fn)
        except Unpersistable as e:
            return [], f"{module}.{qualname}: {e}"
    return [[m, q, d] for (m, q), d in sorted(items.items())] + modules + list(reads), None


def _module_digest(mod: types.ModuleType, attrs: list[str]) -> str:
    """Digest of attributes ``attrs`` of user module ``mod``, by value (a full walk each).

    Raises:
        Unpersistable: some part has no canonical digest.
    """
    w = _Walker()
    w.add(f"module:{mod.__name__}", ",".join(attrs))
    try:
        for attr in attrs:
            found, v = _module_attr(mod, attr, True)
            w.value(f"{mod.__name__}.{attr}", v if found else "<missing>")
        return w.sound_digest()
    except Exception as e:  # noqa: BLE001 - never into the user's call
        raise Unpersistable(_walk_failure(e)) from None





def check_manifest(
    items: list[list[str]], fun_globals: tuple[str, dict[str, Any]] | None = None
) -> str | None:
    """None if every manifest item still hashes the same, else a description of the first change.

    A module item names a module the cold trace imported; one this process has not imported yet
    is imported here (as the trace it replaces would have), so its values can be compared.
    ``fun_globals``: (module name, globals) of the compiled function: names of that module are
    looked up where the function itself looks them up (a function unpickled by value carries its
    own globals, and this process's module of that name may not hold them).
    """
    namespaces = None
    if fun_globals is not None:
        namespaces = {fun_globals[0]: types.SimpleNamespace(**fun_globals[1])}
    for module, qualname, digest, *rest in items:
        if qualname in (FILE, DIR):
            # a file or directory the cold trace read: ``module`` is its path
            changed = check_read(module, qualname, digest, rest[0] if rest else "")
            if changed is not None:
                return changed
            continue
        if qualname == "<module>":
            # a module the cold trace imported: import it now if this process has not
            try:
                mod = sys.modules.get(module) or importlib.import_module(module)
                now = _module_digest(mod, rest[0].split(",") if rest and rest[0] else [])
            except Exception as e:  # noqa: BLE001 - a module that no longer imports: stale
                return f"module {module}: {type(e).__name__}: {e}"
            if now != digest:
                return f"values read from module {module} changed"
            continue
        fn = _resolve(module, qualname, namespaces)
        if not isinstance(fn, types.FunctionType):
            return f"{module}.{qualname} no longer exists"
        try:
            now = _shallow_digest(fn)
        except Unpersistable as e:
            return f"{module}.{qualname}: {e}"
        if now != digest:
            return f"code or globals of {module}.{qualname} changed"
    return None

"""The static walk: a function's code and every value it reaches, as named digest parts.

The walk hashes the function's code object (:mod:`kiln._keys._code`), its defaults, closure
values and every module-level value its code names, recursing into user functions, user
modules' attributes and user classes' methods (:mod:`._code`). Values are hashed by value
(:mod:`kiln._keys._hashing`); library code counts by the library's version
(:mod:`kiln._keys._libraries`), what a library object holds by value.

What the trace reaches besides names, the walk follows by construction: a user class's
``vars`` in full, dunder data too (``__dataclass_fields__``: each ``Field``'s default, factory
and metadata), but for the few attributes in ``_code._CLASS_NOT_DATA``; the slots of library
objects; relative imports in a function body (``from . import consts``), resolved against its
package; a ``jax.extend.core.Primitive`` with every rule JAX's registries hold for it
(:func:`._objects.try_walk_primitive`); the Python function behind an ``np.frompyfunc`` ufunc
or an ``np.vectorize``; and the config object of every installed library the walk reaches
(:func:`library_config_object`: ``flax.config``).

A value is walked by a handler ``(walker, name, value, lenient)``, one per kind of object (code
in :mod:`._code`, every other kind in :mod:`._objects`), found by type as ``_hashing`` finds
its encoders (the tables ``_BY_TYPE``, ``_BY_BASE`` and ``_TRY_WALKS`` below say in which
order). A new kind of object is a new handler and a row of a table.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

import jax
import xxhash

from .._constant_fields import constant_fields
from .._hashing import Unpersistable, static_digest
from .._libraries import is_user_class, library_version, module_is_user, script_module
from .._reads import is_probe
from .._watchable import watchable
from . import _objects as o
from ._code import class_code, function_code, module_attr, resolve_name, walk_function
from ._objects import state_of

__all__ = ["class_code", "function_code", "library_config_object", "module_attr", "resolve_name",
           "state_of", "strict_digest", "Walker", "walk_failure"]

_MAX_ITEMS = 5000
_MISSING = "<missing field>"  # a field a trace read while the object did not hold it
_CONFIG_TYPES = (types.SimpleNamespace, dict)  # global config containers (config_global)


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

    def mode(self, *, strict: bool | None = None, library: bool = False) -> _Mode:
        """While walking inside (``with``): :attr:`strict` set to ``strict`` (None: as it is),
        and ``library``: what is walked is held by library code (:attr:`in_library`)."""
        return _Mode(self, strict, library)

    def add(self, name: str, digest: str) -> None:
        self.parts.append((name, digest))

    def unsound(self, what: str) -> None:
        if self.reason is None:
            self.reason = what

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

    def value(self, name: str, v: Any, *, lenient: bool = False) -> None:
        """Add ``v`` by value: what it is, and everything reachable from it, by the handler
        of its kind (see the module docstring).

        ``lenient``: an opaque library object (no value digest, no state Python can see)
        counts by its class name and library version instead of making the walk unsound.
        """
        tp = type(v)
        if tp in o.SCALAR_TYPES:
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
        walk = _BY_TYPE.get(tp) or next((w for t, w in _BY_BASE if isinstance(v, t)), None)
        if walk is not None:
            walk(self, name, v, lenient)
            return
        for try_walk in _TRY_WALKS:
            if try_walk(self, name, v, lenient):
                return
        o.walk_object(self, name, v, lenient)

    def static_value(self, name: str, v: Any) -> None:
        """A static argument (or static ``self``) that has no canonical digest of its own:
        keyed by its class (a user class by its code, a library class by name and version) and
        its state, by value, whether or not it defines ``__kiln_digest__`` or is a dataclass
        (a gymnax environment, an evosax strategy: issue 42). Strictly: what in its state has
        no value Python can see (an open file, a lock, a C object) makes the walk unsound, and
        the reason names its field (``static:self.lock``)."""
        with self.mode(strict=True):
            self.value(name, v)

    def static_fields(self, name: str, v: Any, fields: tuple[str, ...]) -> None:
        """A static object keyed by its class and the ``fields`` its trace read
        (:mod:`kiln._keys._static_reads`): each by value, strictly, as :meth:`static_value`
        walks the whole state; a field the object does not hold counts as missing."""
        cls = type(v)
        user = is_user_class(cls)
        self.seen.add(id(v))
        self.keep.append(v)
        if user:
            class_code(self, cls)
            self.add(f"object:{name}", f"{cls.__module__}.{cls.__qualname__}")
        else:
            self.add(f"lib-object:{name}", f"{cls.__module__}.{cls.__qualname__}="
                     + library_version(cls.__module__))
        self.add(f"static-reads:{name}", ",".join(fields))
        state = vars(v)
        with self.mode(strict=True, library=not user):
            for attr in fields:
                self.value(f"{name}.{attr}", state[attr] if attr in state else _MISSING)

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

    def global_value(self, name: str, gname: str, v: Any) -> None:
        """A global called ``gname`` that walked user code names: a config container by the
        fields read (:meth:`config_global`), anything else by :meth:`watched_value`."""
        if type(v) in _CONFIG_TYPES and id(v) not in self.seen:
            self.config_global(name, gname, v)
        else:
            self.watched_value(name, v)

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
        for name, cfg in list(self.configs.items()):  # (walking a field may add a config)
            if cfg.whole:
                continue
            fields = constant_fields(self.codes, cfg.gname, mapping=cfg.mapping)
            if fields is None:
                cfg.whole, changed = True, True
                self.add(f"config-whole:{name}", "")
                self.value(name, cfg.v)
                continue
            state = cfg.v if cfg.mapping else vars(cfg.v)
            for f in sorted(fields - cfg.fields):
                cfg.fields.add(f)
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

    def library_config(self, top: str) -> None:
        """The config object of installed library ``top`` (:func:`library_config_object`),
        by value: code of that library reads its flags while tracing (flax's RNG folding reads
        ``flax.config.flax_fix_rng_separator``), so they count with its version."""
        cfg = library_config_object(top)
        if cfg is None:
            return
        self.add(f"lib-config:{top}", library_version(top))
        self.seen.discard(id(cfg))  # (met before as module state, by version only)
        with self.mode(library=True):
            self.value(f"{top}.config", cfg, lenient=True)

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
                        f"{s.__module__}.{s.__qualname__}" for s in subs))
                    for sub in subs:
                        if id(sub) not in self.seen:
                            self.seen.add(id(sub))
                            class_code(self, sub)
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
                    elif user and type(v) in _CONFIG_TYPES and id(v) not in self.seen:
                        self.config_global(f"{mod.__name__}.{attr}", attr, v)
                    else:
                        self.value(f"{mod.__name__}.{attr}", v, lenient=not user)
            changed |= self.key_configs()
        for top in sorted({n[4:].partition(".")[0] for n, _ in self.parts
                           if n.startswith("lib:")}):
            self.library_config(top)


class _Mode:
    """:meth:`Walker.mode` (a class, not a generator: it is entered for every code walked)."""

    def __init__(self, w: Walker, strict: bool | None, library: bool) -> None:
        self.w, self.strict, self.library, self.was = w, strict, library, w.strict

    def __enter__(self) -> None:
        if self.strict is not None:
            self.w.strict = self.strict
        self.w.in_library += self.library

    def __exit__(self, *exc: object) -> None:
        self.w.in_library -= self.library
        self.w.strict = self.was


@dataclasses.dataclass
class _Config:
    """A global config container met by :meth:`Walker.config_global`: the global's name in
    code, the container, whether it is a mapping, the fields keyed so far, keyed whole."""

    gname: str
    v: Any
    mapping: bool
    fields: set[str] = dataclasses.field(default_factory=set)
    whole: bool = False


_Walk = Callable[[Walker, str, Any, bool], Any]  # (try_walk_*: True when it took the value)
# A value of one of these types, or of a subclass (in this order; a tuple, list, dict or set
# subclass is none of them: it is a mapping, a pytree node or an object) ...
_BY_BASE: tuple[tuple[type | tuple[type, ...], _Walk], ...] = (
    (types.ModuleType, o.walk_module),
    (functools.partial, o.walk_partial),
    (types.MethodType, o.walk_method),
    (types.FunctionType, walk_function),
    (type, lambda w, name, v, lenient: class_code(w, v)),
    (types.BuiltinFunctionType, o.walk_builtin),  # (the type of builtin methods too)
    (o.PyTreeDef, o.walk_treedef),
    (o.RNG_TYPES, o.walk_rng),
)
# ... found by its exact type first, with these, which take no subclass ...
_BY_TYPE: dict[type, _Walk] = {
    **{t: walk for ts, walk in _BY_BASE for t in (ts if isinstance(ts, tuple) else (ts,))},
    tuple: o.walk_sequence,
    list: o.walk_sequence,
    dict: o.walk_dict,
    types.MappingProxyType: o.walk_dict,
    set: o.walk_set,
    frozenset: o.walk_set,
}
# ... else the first of these that takes it, else _objects.walk_object
_TRY_WALKS: tuple[_Walk, ...] = (
    o.try_walk_logger,
    o.try_walk_mapping,
    o.try_walk_primitive,
    o.try_walk_numpy_function,
    o.try_walk_pytree,
    o.try_walk_custom_derivatives,
    o.try_walk_wrapper,
)

# Libraries whose config object the walk leaves out: jax's (``jax.config``) holds what changes
# tracing, keyed by kiln as jax's trace context, what feeds the compile options, keyed as
# those, and the rest (cache directories, which kiln itself sets, logging, ...) builds no
# program; kiln's own holds its store settings.
_CONFIG_KEYED_ELSEWHERE = frozenset({"jax", "jaxlib", "kiln"})


def library_config_object(top: str) -> Any:
    """The config object of installed top-level package ``top``, or None: the attribute
    ``config`` of the package (``flax.config``), when it is state rather than code (not a
    module, function, class or callable wrapper). The general rule for library flags that the
    library's own code reads; the stdlib and jax (see ``_CONFIG_KEYED_ELSEWHERE``) have none."""
    if top in _CONFIG_KEYED_ELSEWHERE or top in sys.stdlib_module_names:
        return None
    mod = sys.modules.get(top)
    cfg = vars(mod).get("config") if isinstance(mod, types.ModuleType) else None
    if cfg is None or _has_code_or_name(cfg) or callable(cfg) or type(cfg) in o.SCALAR_TYPES:
        return None
    return cfg


def _has_code_or_name(v: Any) -> bool:
    """Functions, classes, modules, partials, custom_jvp and jitted wrappers: what the walk
    follows into; anything else in a library module is that library's state."""
    return (
        isinstance(v, types.FunctionType | types.BuiltinFunctionType | types.MethodType | type
                   | types.ModuleType | functools.partial)
        or (callable(v) and (getattr(v, "__wrapped__", None) is not None
                             or type(v).__name__ in ("custom_jvp", "custom_vjp")))
        or isinstance(v, o.RNG_TYPES)
    )


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
                  | Mapping) or hasattr(v, "__wrapped__"):
        return True
    try:
        _, treedef = jax.tree_util.tree_flatten(v, is_leaf=lambda n: n is not v)
        data = treedef.node_data()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - not a pytree for the walk either
        return False
    return data is not None and data[1] is not v


def strict_digest(name: str, v: Any) -> tuple[str, str | None]:
    """The digest of a strict walk of ``v`` alone (:meth:`Walker.static_value`'s rule), and
    why it is unsound, or None."""
    w = Walker()
    w.strict = True
    try:
        w.value(name, v)
        w.finish()
    except Exception as e:  # noqa: BLE001 - never into the user's call
        w.unsound(walk_failure(e))
    return w.digest(), w.reason


def walk_failure(e: BaseException) -> str:
    """The reason a walk that raised gives (an object kiln has no rule for): the verify path."""
    if isinstance(e, Unpersistable):
        return str(e)
    return f"the fingerprint walk failed ({type(e).__name__}: {e})"

"""Function fingerprints: what a stored executable was built from, and a manifest to re-check.

A fingerprint has two layers (as ccache's direct mode does for headers):

1. **Static walk** (part of the persistent key): the function's code object (bytecode, constants
   including nested code, names; not line numbers), its defaults, closure values, and every
   module-level value its code names, recursing into user functions, user modules' attributes
   and user classes' methods. Values are hashed by value (:mod:`kiln._hashing`).
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

import functools
import importlib.metadata
import inspect
import os
import sys
import sysconfig
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import xxhash

from ._hashing import Unpersistable, static_digest

__all__ = ["Fingerprint", "fingerprint", "manifest_for", "check_manifest"]

_LIB_ROOTS = tuple(
    os.path.realpath(p) + os.sep
    for p in {
        sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")
    }
    | {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
)
_KILN_ROOT = os.path.dirname(os.path.realpath(__file__)) + os.sep
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
    return not real.startswith(_LIB_ROOTS) and not real.startswith(_KILN_ROOT)


@functools.lru_cache(maxsize=1)
def _packages_distributions() -> dict[str, list[str]]:
    return dict(importlib.metadata.packages_distributions())


@functools.lru_cache(maxsize=1024)
def library_version(module_name: str) -> str:
    """``dist==version`` of the installed distribution that provides ``module_name``."""
    top = module_name.partition(".")[0]
    if not top:
        return "unknown==unknown"
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
            return f"{dist.metadata['Name']}=={dist.version}"
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


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


@functools.lru_cache(maxsize=8192)
def code_digest(code: types.CodeType) -> str:
    """Digest of a code object: bytecode, constants (nested code recursively), names, arity.

    Line numbers and file names are left out, so moving code does not change its digest.
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
            h.update(repr(c).encode())


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
    """

    digest: str
    parts: list[tuple[str, str]]
    sound: bool = True
    reason: str | None = None
    codes: set[types.CodeType] = field(default_factory=set)


class _Walker:
    def __init__(self) -> None:
        self.parts: list[tuple[str, str]] = []
        self.seen: set[int] = set()
        self.codes: set[types.CodeType] = set()
        self.reason: str | None = None
        self.keep: list[Any] = []  # keep ids stable during the walk
        self.modules: list[types.ModuleType] = []  # user modules reached as values
        self.names: set[str] = set()  # every name any walked code reads

    def finish(self) -> None:
        """Walk the attributes of every user module reached (through a global, a closure, a
        default, an argument...) that any walked code names: ``mod.SCALE`` wherever ``mod``
        came from. Repeats until no new module or name appears."""
        done: set[tuple[str, str]] = set()
        changed = True
        while changed:
            changed = False
            for mod in list(self.modules):
                for attr in sorted(self.names):
                    if (mod.__name__, attr) in done or attr not in vars(mod):
                        continue
                    done.add((mod.__name__, attr))
                    changed = True
                    self.value(f"{mod.__name__}.{attr}", vars(mod)[attr])

    def add(self, name: str, digest: str) -> None:
        self.parts.append((name, digest))

    def unsound(self, what: str) -> None:
        if self.reason is None:
            self.reason = what

    def value(self, name: str, v: Any, *, lenient: bool = False) -> None:
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
                self.modules.append(v)  # its attributes named by any walked code: finish()
            else:
                self.add(f"lib:{v.__name__}", library_version(v.__name__))
            return
        if isinstance(v, functools.partial):
            self.value(f"{name}.func", v.func)
            for i, a in enumerate(v.args):
                self.value(f"{name}.args[{i}]", a)
            for k, a in sorted(v.keywords.items()):
                self.value(f"{name}.keywords[{k!r}]", a)
            return
        if isinstance(v, types.MethodType):
            self.value(f"{name}.__func__", v.__func__)
            self.value(f"{name}.__self__", v.__self__)
            return
        if isinstance(v, types.FunctionType):
            self.function(v)
            return
        if isinstance(v, type):
            self.klass(v)
            return
        if isinstance(v, types.BuiltinFunctionType | types.BuiltinMethodType):
            mod = getattr(v, "__module__", None) or "builtins"
            self.add(f"lib:{mod}", library_version(mod))
            return
        if type(v) in (tuple, list):
            self.add(f"container:{name}", f"{type(v).__name__}[{len(v)}]")
            for i, item in enumerate(v):
                self.value(f"{name}[{i}]", item)
            return
        if type(v) is dict:
            self.add(f"container:{name}", f"dict[{len(v)}]")
            try:
                items = sorted(v.items(), key=lambda kv: static_digest(kv[0], argname=name))
            except (Unpersistable, TypeError) as e:
                self.unsound(f"{name}: dict key {e}")
                return
            for k, item in items:
                self.value(f"{name}[{k!r}]", item)
            return
        if isinstance(v, _PyTreeDef):
            self.treedef(name, v)
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
        if _is_user_class(cls):
            self.klass(cls)  # a user dataclass / object: its methods and class constants too
        try:
            self.add(f"value:{name}", static_digest(v, argname=name))
        except Unpersistable as e:
            if not _is_user_class(cls) and (callable(v) or lenient):
                # an instance of a library class (a jax custom_jvp function; a class attribute
                # such as abc's _abc_impl): counted by the library's version
                self.add(f"lib:{cls.__module__}", library_version(cls.__module__))
                return
            self.unsound(f"{name}: {e}")
        except TypeError as e:
            self.unsound(f"{name}: {e}")

    def treedef(self, name: str, t: Any) -> None:
        """A pytree structure: node types and aux data, node by node."""
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
        try:
            children, treedef = jax.tree_util.tree_flatten(v, is_leaf=lambda n: n is not v)
        except Exception:  # noqa: BLE001 - exotic flatten failures: not a pytree for us
            return False
        data = treedef.node_data()  # type: ignore[attr-defined]
        if data is None:
            return False
        typ, aux = data
        self.klass(typ)
        self.add(f"pytree:{name}", f"{typ.__module__}.{typ.__qualname__}")
        self.value(f"{name}.<aux>", aux)
        for i, child in enumerate(children):
            self.value(f"{name}.<child {i}>", child)
        return True

    def klass(self, cls: type) -> None:
        mod = cls.__module__
        if not _has_file(cls) or not is_user_file(inspect.getfile(cls)):
            self.add(f"lib:{mod}", library_version(mod))
            return
        self.add(f"class:{mod}.{cls.__qualname__}", cls.__qualname__)
        for base in cls.__mro__[1:]:
            if base is not object and id(base) not in self.seen:
                self.seen.add(id(base))
                self.klass(base)
        for attr, member in sorted(vars(cls).items()):
            if attr.startswith("__") and attr not in ("__call__", "__init__", "__post_init__"):
                continue
            if isinstance(member, staticmethod | classmethod):
                member = member.__func__
            if isinstance(member, property):
                member = member.fget
            if isinstance(member, types.FunctionType):
                self.function(member)
            elif not (attr.startswith("_") and attr.endswith("_")):
                # class constants (``Cfg.FACTOR``, enum members, frozensets, partials,
                # modules): by value; what has no value digest makes the walk unsound
                self.value(f"{mod}.{cls.__qualname__}.{attr}", member, lenient=True)

    def function(self, fn: types.FunctionType) -> None:
        code = fn.__code__
        if code in self.codes:
            return
        mod = fn.__module__ or "<no module>"
        if os.path.realpath(code.co_filename).startswith(_KILN_ROOT):
            # kiln's own wrappers (noinline's flat and derived functions): their code is
            # covered by kiln's version; what they close over (the user's function, the
            # pytree structure, batching axes) is walked
            self.add(f"kiln:{fn.__qualname__}", "")
            for var, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True):
                try:
                    contents = cell.cell_contents
                except ValueError:
                    continue
                self.value(f"{mod}.{fn.__qualname__}.<closure {var}>", contents)
            return
        if not is_user_file(code.co_filename):
            self.add(f"lib:{mod}", library_version(mod))
            return
        self.codes.add(code)
        self.names |= _code_names(code)
        qual = f"{mod}.{fn.__qualname__}"
        self.add(f"code:{qual}", code_digest(code))
        if fn.__defaults__:
            self.value(f"{qual}.__defaults__", fn.__defaults__)
        if fn.__kwdefaults__:
            self.value(f"{qual}.__kwdefaults__", dict(fn.__kwdefaults__))
        if fn.__closure__:
            for var, cell in zip(code.co_freevars, fn.__closure__, strict=True):
                try:
                    contents = cell.cell_contents
                except ValueError:  # empty cell
                    continue
                self.value(f"{qual}.<closure {var}>", contents)
        self.globals_of(code, fn.__globals__, qual)

    def globals_of(self, code: types.CodeType, g: dict[str, Any], qual: str) -> None:
        names = _code_names(code)
        modname = g.get("__name__", "?")
        modules = []
        for name in sorted(names):
            if name in g:
                v = g[name]
                self.value(f"{modname}.{name}", v)
                if isinstance(v, types.ModuleType) and _module_is_user(v):
                    modules.append(v)
            elif name in sys.modules and _module_is_user(sys.modules[name]):
                # ``import helper`` / ``from helper import h`` inside the function body
                modules.append(sys.modules[name])
                self.add(f"module:{name}", name)
        done: set[str] = set()
        while modules:
            mod = modules.pop(0)
            if mod.__name__ in done:
                continue
            done.add(mod.__name__)
            for attr in sorted(names):
                if attr in vars(mod):
                    v = vars(mod)[attr]
                    self.value(f"{mod.__name__}.{attr}", v)
                    if isinstance(v, types.ModuleType) and _module_is_user(v):
                        modules.append(v)  # ``import pkg.sub`` then ``pkg.sub.CONST``


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
    w.value(getattr(fun, "__qualname__", type(fun).__qualname__), fun)
    if not isinstance(fun, types.FunctionType | functools.partial | types.MethodType):
        w.klass(type(fun))  # a callable object: its class's __call__ and methods
    for name, v in extra:
        w.add(f"extra:{name}", "")
        w.seen.discard(id(v))
        w.value(name, v)
    w.finish()
    h = xxhash.xxh3_128()
    for name, d in w.parts:
        h.update(name.encode())
        h.update(b"\0")
        h.update(d.encode())
        h.update(b"\n")
    return Fingerprint(h.hexdigest(), w.parts, w.reason is None, w.reason, w.codes)


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


def _resolve(module: str, qualname: str) -> Any:
    """The object at ``module`` + ``qualname``; for ``a.<locals>.b`` the enclosing ``a``.

    Decorated functions (``kiln.jit``, ``jax.jit``, ``functools.wraps``) resolve to the function
    they wrap. A module not imported yet is imported (it is user code the program imports while
    tracing). Returns None when nothing is found.
    """
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


def _shallow_digest(fn: types.FunctionType) -> str:
    """Full static walk of one manifest function: code, defaults, closure, globals, helpers.

    Raises:
        Unpersistable: some part has no canonical digest.
    """
    w = _Walker()
    w.function(fn)
    w.finish()
    if w.reason is not None:
        raise Unpersistable(w.reason)
    h = xxhash.xxh3_128()
    for name, d in w.parts:
        h.update(f"{name}\0{d}\n".encode())
    return h.hexdigest()


def manifest_for(
    codes: set[types.CodeType], covered: set[types.CodeType]
) -> tuple[list[list[str]], str | None]:
    """Manifest items ``[module, qualname, digest]`` for user code that ran while tracing.

    ``codes``: code objects of the frames that emitted the program's equations
    (:func:`kiln._jax_compat.codes_in_jaxpr`). Those the static walk ``covered`` are skipped.

    Returns (items, reason): ``reason`` is not None when some of that code cannot be found
    again by module + qualname (the fingerprint is then unsound).
    """
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
    return [[m, q, d] for (m, q), d in sorted(items.items())], None


def check_manifest(items: list[list[str]]) -> str | None:
    """None if every manifest item still hashes the same, else a description of the first change."""
    for module, qualname, digest in items:
        fn = _resolve(module, qualname)
        if not isinstance(fn, types.FunctionType):
            return f"{module}.{qualname} no longer exists"
        try:
            now = _shallow_digest(fn)
        except Unpersistable as e:
            return f"{module}.{qualname}: {e}"
        if now != digest:
            return f"code or globals of {module}.{qualname} changed"
    return None

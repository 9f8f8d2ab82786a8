"""The manifest: what a cold trace used that the static walk could not see, re-checked on a
warm start before an entry is used.

Items (built by :func:`manifest_for`, checked by :func:`check_manifest`):

- ``[module, qualname, digest]``: a user function that ran while tracing, by a full static walk
  of it (:class:`kiln._keys._walk.Walker`);
- ``[module, "<module>", digest, names]``: a user module imported while tracing, by the values
  of the attributes ``names``;
- ``[path, "<file>" | "<dir>", digest, stat]``: a file or directory the trace read, and
  ``[path, "<stat>", value, how]``: a path it checked without opening it
  (:mod:`kiln._keys._reads`);
- ``[name, "<rng>", digest]``: a global random generator the trace drew from
  (``numpy.random.mtrand._rand``, ``random._inst``), by its state before the trace
  (:mod:`kiln._keys._rngs`);
- ``[name, "<env>", digest]``: an environment variable the trace read, by its value's digest
  (``"absent"``: not set), and ``["<environ>", "<env>", digest, "all"]``: the trace iterated
  the whole environment (:mod:`kiln._keys._environ`);
- ``[module, "<libglobals>", digest, names]``: an installed library's module whose code ran
  while tracing, by the plain values of the globals ``names`` that code reads (a setting the
  library read at import, equinox's ``EQX_ON_ERROR``; :func:`kiln._keys._environ.library_globals`);
- ``["<jaxpr>", "<primitives>", digest, names]``: the rules JAX's registries hold for every
  primitive the program binds whose rules reach user code (lowering, JVP, transpose,
  batching, ...), found again by name:
  what JAX runs while lowering and transforming is code too, and a user can register or edit
  a rule for any primitive, jax's own included (:func:`_primitives_digest`);
- ``[package, "<config>", digest]``: the config object of an installed library whose code
  ran while tracing (``flax.config``), by value
  (:func:`kiln._keys._walk.library_config_object`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import xxhash

from .._base import _jax_compat
from ._code import code_names
from ._environ import ENV, LIBGLOBALS, check_env, check_library_globals, library_globals
from ._fingerprint import Fingerprint
from ._hashing import Unpersistable
from ._libraries import installed_path, is_user_class, is_user_file, module_is_user
from ._reads import DIR, FILE, STAT, check_read, check_stat
from ._rngs import RNG, check_rng
from ._walk import Walker, function_code, library_config_object, module_attr, state_of, walk_failure

__all__ = ["check_manifest", "manifest_for"]

PRIMITIVES, CONFIG = "<primitives>", "<config>"


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


def _resolve(module: str, qualname: str, namespaces: dict[str, Any] | None = None) -> Any:
    """The object at ``module`` + ``qualname``; for ``a.<locals>.b`` the enclosing ``a``.

    Decorated functions (``kiln.jit``, ``jax.jit``, ``functools.wraps``) resolve to the function
    they wrap. A module not imported yet is imported (it is user code the program imports while
    tracing). ``namespaces``: module name -> the globals the compiled function itself runs with
    (for a function unpickled by value, not the module of that name in this process). Returns
    None when nothing is found.
    """
    mod = (namespaces or {}).get(module) or sys.modules.get(module)
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
    return outer is code or any(isinstance(c, types.CodeType) and _contains(c, code)
                                for c in outer.co_consts)


def _walked_digest(walk: Callable[[Walker], None]) -> str:
    """The sound digest of a fresh :class:`Walker` after ``walk(w)``.

    Raises:
        Unpersistable: some part has no canonical digest, or the walk failed on it (nothing
            else: the walk never raises into the user's call).
    """
    w = Walker()
    try:
        walk(w)
        return w.sound_digest()
    except Exception as e:  # noqa: BLE001 - never into the user's call
        raise Unpersistable(walk_failure(e)) from None


def _function_digest(fn: types.FunctionType) -> str:
    """Full static walk of one manifest function: code, defaults, closure, globals, helpers
    (raises as :func:`_walked_digest`)."""
    return _walked_digest(lambda w: function_code(w, fn))


def manifest_for(
    codes: set[types.CodeType],
    fp: Fingerprint,
    imported: tuple[str, ...] = (),
    reads: Sequence[list[str]] = (),
    read_reason: str | None = None,
    primitives: Sequence[Any] = (),
    library_codes: set[types.CodeType] | None = None,
) -> tuple[list[list[str]], str | None]:
    """Manifest items (the module docstring's kinds) for what the cold trace used that the
    static walk ``fp`` could not see: each user function whose code is in ``codes`` (the frames
    that emitted the program's equations, :func:`kiln._base._jax_compat.codes_in_jaxpr`, and on
    Python 3.12+ every user function that ran, :class:`TraceRecorder`) that the walk did not
    cover; each user module ``imported`` while tracing, by the attributes any walked code reads;
    the ``reads`` (:class:`kiln._keys._reads.ReadRecorder`), or ``read_reason`` why they cannot
    be keyed; the rules of the ``primitives`` bound in the program
    (:func:`kiln._base._jax_compat.primitives_in`); the config objects and plain module globals
    of the installed libraries whose code is in ``codes``.

    ``library_codes``: the code whose library globals are keyed (default ``codes``); the
    functions that emitted the program's equations, on every Python (on 3.12+ ``codes`` also
    holds every library function that ran, and some keep run-time state in plain globals:
    keyed, a warm start of an unchanged program missed).

    Returns (items, reason): ``reason`` is not None when some of that code cannot be found
    again by module + qualname, or some read cannot be keyed (the fingerprint is then
    unsound).
    """
    if read_reason is not None:
        return [], read_reason
    names = set(fp.names)
    for code in codes:
        if is_user_file(code.co_filename):
            names |= code_names(code)
    modules: list[list[str]] = []
    for mname in sorted(imported):
        mod = sys.modules.get(mname)
        if mod is None or not module_is_user(mod):
            continue
        attrs = sorted(a for a in names if module_attr(mod, a, True)[0])
        try:
            modules.append([mname, "<module>", _module_digest(mod, attrs), ",".join(attrs)])
        except Unpersistable as e:
            return [], f"module {mname} (imported while tracing): {e}"
    functions, reason = _function_items(codes, fp.codes)
    if reason is not None:
        return [], reason
    try:
        tail = _library_items(codes, primitives, library_codes)
    except Unpersistable as e:
        return [], str(e)
    return functions + modules + list(reads) + tail, None


def _function_items(codes: set[types.CodeType],
                    covered: set[types.CodeType]) -> tuple[list[list[str]], str | None]:
    """``[module, qualname, digest]`` for each user function in ``codes`` the walk did not
    cover, found again by module and qualname."""
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
                items.setdefault(("__main__", fn.__qualname__), _function_digest(fn))
            continue
        if by_file is None:
            by_file = _module_names_by_file()
        module = by_file.get(os.path.realpath(code.co_filename))
        if module is None:
            return [], f"{code.co_qualname} ({code.co_filename}) is not in an imported module"
        fn = _resolve(module, code.co_qualname)
        if isinstance(fn, type):
            continue  # a class body running at import: its attributes are walked by class_code
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
            items[key] = _function_digest(fn)
        except Unpersistable as e:
            return [], f"{module}.{qualname}: {e}"
    return [[m, q, d] for (m, q), d in sorted(items.items())], None


def _library_items(codes: set[types.CodeType], primitives: Sequence[Any],
                   library_codes: set[types.CodeType] | None) -> list[list[str]]:
    """The rules of the primitives bound, the config objects and the plain globals of the
    installed libraries whose code ran.

    Raises:
        Unpersistable: some part has no canonical digest.
    """
    tail: list[list[str]] = []
    # only primitives whose rules reach user code (a custom primitive, a rule you
    # registered for one of jax's): a library's own rules count with its version, and
    # some are registered lazily, by a lowering in another thread (tier-up), so keying
    # them made a warm start miss at random (seen on Python 3.12, jax 0.12)
    bound = sorted({p.name for p in primitives if _reaches_user(p)})
    if bound:
        tail.append(["<jaxpr>", PRIMITIVES, _primitives_digest(bound), ",".join(bound)])
    # the top-level packages of the installed libraries whose code ran (flax of its core/scope.py)
    tops = {p.split(os.sep, 1)[0].removesuffix(".py") for c in codes
            if (p := installed_path(c.co_filename)) is not None}
    for top in sorted(t for t in tops if t.isidentifier() and t not in sys.stdlib_module_names):
        if library_config_object(top) is not None:
            tail.append([top, CONFIG, _config_digest(top)])
    return tail + library_globals(codes if library_codes is None else library_codes)


def _config_digest(top: str) -> str:
    return _walked_digest(lambda w: w.library_config(top))


def _rule_shapes(prim: Any) -> list[tuple[str, str | None]]:
    """``(where, shape)`` of the primitive's own attributes and of every rule JAX's
    registries hold for it (:func:`_shape_of`: None where it reaches user code)."""
    rules = [*sorted(vars(prim).items()), *_jax_compat.primitive_rules(prim)]
    return [(where, _shape_of(rule)) for where, rule in rules]


def _reaches_user(prim: Any) -> bool:
    """A user primitive, or one some registry holds a rule of user code for."""
    return is_user_class(type(prim)) or any(sh is None for _, sh in _rule_shapes(prim))


def _primitives_digest(names: Iterable[str]) -> str:
    """Digest of what JAX holds for each primitive called one of ``names``: the primitive's
    own ``impl`` and ``abstract_eval``, and every rule its registries hold for it
    (:func:`kiln._base._jax_compat.primitive_rules`).

    A primitive whose rules are library code through and through (jax's ``sin``) counts by
    the shape of those rules (:func:`_library_shape`: which library functions, with which
    plain arguments; a rule registered in its place is another shape), one that reaches user
    code (a custom primitive, or a rule the user registered for one of jax's) by a full walk.

    Raises:
        Unpersistable: a part of a rule with no canonical digest.
    """
    names = list(names)
    found = _jax_compat.primitives_named(set(names))

    def walk(w: Walker) -> None:
        for name in names:
            prims = found.get(name, [])
            if not prims:  # (lowered by other means; not loaded yet in a warm process: a miss)
                w.add(f"rules:{name}", "none registered")
            for i, prim in enumerate(prims):
                shapes = _rule_shapes(prim)
                if is_user_class(type(prim)) or any(sh is None for _, sh in shapes):
                    w.value(f"{name}[{i}]", prim)  # the full walk (_objects.try_walk_primitive)
                    continue
                cls = type(prim)
                w.add(f"primitive:{name}[{i}]", f"{cls.__module__}.{cls.__qualname__}")
                for where, sh in shapes:
                    w.add(f"rules:{name}[{i}].<{where}>", str(sh))

    return _walked_digest(walk)


_PLAIN = (type(None), bool, int, float, complex, str, bytes)
# id -> (rule, shape) of the library rules seen in this process: a library's rule object is
# taken as fixed once registered (registering another rule puts another object in its place),
# so a process with several functions shapes jax's rules once
_SHAPES: dict[int, tuple[Any, str | None]] = {}


def _shape_of(rule: Any) -> str | None:
    known = _SHAPES.get(id(rule))
    if known is not None and known[0] is rule:
        return known[1]
    shape = _library_shape(rule)
    if shape is not None and type(rule) not in _PLAIN:
        _SHAPES[id(rule)] = (rule, shape)  # (holds the rule: its id is never reused)
    return shape


def _library_shape(rule: Any) -> str | None:
    """What a library rule is, cheaply (a full walk of every rule of a program's ~60
    primitives costs ~0.1 s; this ~3 ms): the library functions and classes it is made of,
    by module and qualified name, and the plain values it holds (through partials, closure
    cells, defaults, bound methods, tuples and objects' attributes; a dict's items are left
    out: in a library's rule they are caches). None when it reaches user code (a function or
    class of a user file), or is nested too deep to tell: the caller walks it in full."""
    h = xxhash.xxh3_128()
    seen: set[int] = set()
    quiet = 0  # > 0 inside a dict: its items only say whether they reach user code

    def add(text: str) -> None:
        if not quiet:
            h.update(text.encode())

    def feed(v: Any, depth: int) -> bool:
        nonlocal quiet
        tp = type(v)
        if tp in _PLAIN:
            add(f"{tp.__name__}:{v!r};")
            return True
        if depth > 24:
            return False
        if id(v) in seen:
            add("@;")
            return True
        seen.add(id(v))
        if isinstance(v, _jax_compat.Primitive):
            add(f"primitive:{v.name};")
            return True
        if tp is types.FunctionType:
            code = v.__code__
            if is_user_file(code.co_filename):
                return False
            add(f"fn:{v.__module__}.{code.co_qualname};")
            cells = []
            for cell in v.__closure__ or ():
                try:
                    cells.append(cell.cell_contents)
                except ValueError:  # empty cell
                    cells.append(None)
            return all(feed(x, depth + 1) for x in (
                *cells, *(v.__defaults__ or ()), *(v.__kwdefaults__ or {}).items(),
                *sorted(vars(v).items(), key=lambda kv: kv[0])))
        if tp is functools.partial:
            return all(feed(x, depth + 1) for x in (v.func, *v.args, *v.keywords.items()))
        if tp is types.MethodType:
            return feed(v.__func__, depth + 1) and feed(v.__self__, depth + 1)
        if isinstance(v, tuple | list):  # (a NamedTuple: mlir's LoweringRuleEntry)
            add(f"{tp.__module__}.{tp.__qualname__}[{len(v)}];")
            return all(feed(x, depth + 1) for x in v)
        if isinstance(v, dict):
            add("dict;")
            quiet += 1
            try:
                return all(feed(k, depth + 1) and feed(x, depth + 1) for k, x in list(v.items()))
            finally:
                quiet -= 1
        if isinstance(v, type):
            if is_user_class(v):
                return False
            add(f"class:{v.__module__}.{v.__qualname__};")
            return True
        if is_user_class(tp):
            return False
        try:
            add(f"{tp.__module__}.{tp.__qualname__}:{getattr(v, '__module__', '')}."
                f"{getattr(v, '__qualname__', '')};")
            items = state_of(v) or []
        except Exception:  # noqa: BLE001 - an attribute hook failing: walked in full
            return False
        return all(feed(x, depth + 1) for x in items)

    return h.hexdigest() if feed(rule, 0) else None


def _module_digest(mod: types.ModuleType, attrs: list[str]) -> str:
    """Digest of attributes ``attrs`` of user module ``mod``, by value (a full walk each;
    raises as :func:`_walked_digest`)."""
    def walk(w: Walker) -> None:
        w.add(f"module:{mod.__name__}", ",".join(attrs))
        for attr in attrs:
            found, v = module_attr(mod, attr, True)
            w.value(f"{mod.__name__}.{attr}", v if found else "<missing>")

    return _walked_digest(walk)


def check_manifest(
    items: list[list[str]], fun_globals: tuple[str, dict[str, Any]] | None = None
) -> str | None:
    """None if every manifest item still hashes the same, else a description of the first change.

    A module item names a module the cold trace imported; one this process has not imported yet
    is imported here (as the trace it replaces would have), so its values can be compared.
    ``fun_globals``: (module name, globals) of the compiled function: names of that module are
    looked up where the function itself looks them up first (a function unpickled by value
    carries its own globals, and this process's module of that name may not hold them), then in
    the module.
    """
    namespaces = {fun_globals[0]: types.SimpleNamespace(**fun_globals[1])} if fun_globals else None
    for module, qualname, digest, *rest in items:
        check = _CHECKS.get(qualname)
        if check is not None:
            changed = check(module, digest, rest[0] if rest else "")
            if changed is not None:
                return changed
            continue
        # a user function that ran while tracing
        fn = _resolve(module, qualname, namespaces)
        if not isinstance(fn, types.FunctionType) and namespaces:
            # not among the compiled function's own globals (a function kiln derived from the
            # user's, such as a noinline function's jvp, runs with kiln's): the module's
            fn = _resolve(module, qualname)
        if not isinstance(fn, types.FunctionType):
            return f"{module}.{qualname} no longer exists"
        try:
            now = _function_digest(fn)
        except Unpersistable as e:
            return f"{module}.{qualname}: {e}"
        if now != digest:
            return f"code or globals of {module}.{qualname} changed"
    return None


def _check_primitives(_: str, digest: str, names: str) -> str | None:
    try:
        now = _primitives_digest(names.split(",") if names else [])
    except Unpersistable as e:
        return f"rules of the program's primitives: {e}"
    return None if now == digest else (
        "a rule registered for one of the program's primitives changed")


def _check_config(module: str, digest: str, _: str) -> str | None:
    try:
        if module not in sys.modules:
            importlib.import_module(module)
        now = _config_digest(module)
    except Exception as e:  # noqa: BLE001 - a library that no longer imports: stale
        return f"config of {module}: {type(e).__name__}: {e}"
    return None if now == digest else f"{module}.config changed"


def _check_module(module: str, digest: str, names: str) -> str | None:
    """A module the cold trace imported: imported now if this process has not."""
    try:
        mod = sys.modules.get(module) or importlib.import_module(module)
        now = _module_digest(mod, names.split(",") if names else [])
    except Exception as e:  # noqa: BLE001 - a module that no longer imports: stale
        return f"module {module}: {type(e).__name__}: {e}"
    return None if now == digest else f"values read from module {module} changed"


# the check of each kind of item but a function's: (module or path, digest, its 4th field)
_CHECKS: dict[str, Callable[[str, str, str], str | None]] = {
    FILE: lambda path, digest, stat: check_read(path, FILE, digest, stat),
    DIR: lambda path, digest, stat: check_read(path, DIR, digest, stat),
    STAT: check_stat,  # a path the cold trace checked (os.path.exists, os.stat): by how
    RNG: lambda name, digest, _: check_rng(name, digest),  # a global generator drawn from
    ENV: lambda name, digest, whole: check_env(name, digest, whole == "all"),
    LIBGLOBALS: check_library_globals,  # plain globals of a library module its code reads
    PRIMITIVES: _check_primitives,
    CONFIG: _check_config,
    "<module>": _check_module,
}

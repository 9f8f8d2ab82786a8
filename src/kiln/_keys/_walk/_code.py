"""The walk of code: a class by its methods and class variables, a function by its code, what
it closes over and the globals it reads (a library function by name and version). What code
holds is walked as any global is, not strictly, even inside a static argument's walk."""

from __future__ import annotations

import builtins
import importlib.util
import os
import re
import sys
import types
from typing import TYPE_CHECKING, Any

from ..._base import _jax_compat
from .._callback_roots import callback_only_names, callback_roots, log_only_names
from .._code import (
    code_digest,
    code_names,
    hash_seed_fixed,
    iterated_set_constant,
    module_strings,
    nested_codes,
    relative_imports,
)
from .._hashing import static_digest
from .._libraries import (
    KILN_ROOT,
    is_user_class,
    is_user_file,
    library_version,
    module_is_user,
    script_module,
)

if TYPE_CHECKING:
    from . import Walker

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
_SENTINELS: dict[int, tuple[object, str]] = {}


def walk_function(w: Walker, name: str, v: types.FunctionType, lenient: bool) -> None:
    # which function is bound here: its code's part is added only where the code is first
    # met (a class's staticmethod may have met it first), so ``ops.transform`` and
    # ``ops.late`` swapping two functions would otherwise walk to the same parts
    w.add(f"function:{name}", f"{v.__module__}.{v.__qualname__}")
    function_code(w, v)


def class_code(w: Walker, cls: type) -> None:
    """A class: what it is and, for a user class, its methods and class variables; for a
    pytree node type, the flatten / unflatten functions registered for it."""
    with w.mode(strict=False):
        mod = script_module(cls.__module__)
        for i, fn in enumerate(_jax_compat.pytree_node_functions(cls)):
            w.value(f"{mod}.{cls.__qualname__}.<pytree {i}>", fn)
        if not is_user_class(cls):
            # a library class (jnp.float32, optax.GradientTransformation): by name and version
            w.add(f"lib:{mod}.{cls.__qualname__}", library_version(mod))
            return
        w.add(f"class:{mod}.{cls.__qualname__}", cls.__qualname__)
        w.classes.append(cls)
        for base in (*cls.__mro__[1:], type(cls)):  # bases and the metaclass
            if base not in (object, type) and id(base) not in w.seen:
                w.seen.add(id(base))
                class_code(w, base)
        for attr, member in sorted(vars(cls).items()):
            if isinstance(member, staticmethod | classmethod):
                member = member.__func__
            if isinstance(member, property):
                for accessor in (member.fget, member.fset, member.fdel):
                    if isinstance(accessor, types.FunctionType):
                        function_code(w, accessor)
                continue
            if isinstance(member, types.FunctionType):
                if member.__qualname__ != f"{cls.__qualname__}.{attr}":
                    # bound from elsewhere (``transform = staticmethod(host_square)``): which
                    # one (see walk_function)
                    w.add(f"function:{mod}.{cls.__qualname__}.{attr}",
                          f"{member.__module__}.{member.__qualname__}")
                function_code(w, member)  # every method, dunders too (__getitem__, __get__)
            elif attr == "__doc__" and isinstance(member, str):
                # a docstring: a generated one (a dataclass's signature, flax's Module) shows
                # its defaults' reprs, with addresses that differ in every process
                w.add(f"doc:{mod}.{cls.__qualname__}", static_digest(
                    _ADDRESS.sub("", member), argname=f"{cls.__qualname__}.__doc__"))
            elif attr not in _CLASS_NOT_DATA:
                # class constants and ClassVars (``Cfg.FACTOR``, enum members, frozensets,
                # partials, modules) and dunder data (``__dataclass_fields__``: the fields'
                # defaults, factories and metadata; ``__annotations__``, ``__slots__``): by
                # value; what has no value digest makes the walk unsound
                w.value(f"{mod}.{cls.__qualname__}.{attr}", member, lenient=True)


def function_code(w: Walker, fn: types.FunctionType) -> None:
    """A function: a user function by its code, the globals it reads and what it holds;
    a library function by :func:`_library_function`; kiln's own by what it holds."""
    with w.mode(strict=False):
        code = fn.__code__
        mod = script_module(fn.__module__ or "<no module>")
        if os.path.realpath(code.co_filename).startswith(KILN_ROOT):
            # kiln's own wrappers (noinline's flat and derived functions): their code is
            # covered by kiln's version; what they close over (the user's function, the
            # pytree structure, batching axes) is walked
            w.add(f"kiln:{fn.__qualname__}", "")
            _cells(w, f"{mod}.{fn.__qualname__}", fn)
            return
        if not is_user_file(code.co_filename):
            _library_function(w, fn)
            return
        qual = f"{mod}.{fn.__qualname__}"
        for attr, item in sorted(vars(fn).items()):  # ``helper.K = 2.0`` set on the function
            w.value(f"{qual}.{attr}", item)
        if code not in w.codes:
            # its nested functions (lambdas, local defs) too: their code is in this code's
            # digest, the globals they read in its names, and what they close over in its
            # cells. Names that only a host callback or a log line reads are no names the
            # program reads: neither its globals nor another module's attributes of that name
            unread = callback_only_names(fn) | log_only_names(fn)
            w.codes |= nested_codes(code)
            w.names |= code_names(code) - unread
            w.add(f"code:{qual}", code_digest(code))
            iterated = iterated_set_constant(code)
            if iterated and not hash_seed_fixed():
                w.unsound(f"{qual}: {iterated}, in an order that changes with PYTHONHASHSEED")
            _globals_of(w, code, fn.__globals__, callback_roots(fn), unread)
        # every function object: two closures of one factory share code, not cells
        _cells(w, qual, fn)


def _cells(w: Walker, qual: str, fn: types.FunctionType) -> None:
    """Defaults, keyword-only defaults and closure cells of ``fn``, by value.

    A bare ``object()`` sentinel (``jax.vmap``'s "no axis name") has no value; it is
    named by the global of ``fn``'s module that holds it, since code compares it by
    identity with that global."""
    values: list[tuple[str, Any]] = [
        (f"{qual}.__defaults__[{i}]", d) for i, d in enumerate(fn.__defaults__ or ())]
    values += [(f"{qual}.__kwdefaults__[{k!r}]", d)
               for k, d in sorted((fn.__kwdefaults__ or {}).items())]
    roots = callback_roots(fn)
    for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        # the cell itself: a callback made while tracing (a lambda closing over the same
        # variable) shares it, and a warm start must bind that callback to the live cell
        w.keep.append(cell)
        try:
            v = cell.cell_contents
        except ValueError:  # empty cell
            continue
        if var in roots:
            _callback_target(w, f"{qual}.<closure {var}>", v, roots[var])
        else:
            values.append((f"{qual}.<closure {var}>", v))
    for name, v in values:
        where = _sentinel_name(fn.__globals__, v) if type(v) is object else None
        if where is not None:
            w.add(f"sentinel:{name}", where)
        else:
            w.value(name, v)


def _callback_target(w: Walker, name: str, v: Any, attrs: frozenset[str]) -> None:
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
    w.keep.append(v)
    cls = type(v)
    w.add(f"callback:{name}", f"{cls.__module__}.{cls.__qualname__}")
    state = getattr(v, "__dict__", None)
    for attr in sorted(attrs):
        if not isinstance(state, dict | types.MappingProxyType) or attr not in state:
            continue
        try:
            member = getattr(v, attr)  # (a class's staticmethod: the function)
        except Exception:  # noqa: BLE001 - what the trace would meet: by the stored one
            member = state[attr]
        w.keep.append(member)
        mcls = type(member)
        w.add(f"callback:{name}.{attr}", f"{mcls.__module__}.{mcls.__qualname__}:"
              f"{getattr(member, '__module__', '')}.{getattr(member, '__qualname__', '')}")


def _library_function(w: Walker, fn: types.FunctionType) -> None:
    """A function defined in an installed library: its code counts by the library's
    version, but it is identified by module and qualified name, and what it holds counts
    by value: closure cells (``optax.sgd(0.1)``'s learning rate, ``jax.grad(f)``'s ``f``),
    defaults and ``__wrapped__``. A function that its name does not import back to (made
    by a factory, or renamed by ``functools.wraps``) is also identified by its code."""
    code = fn.__code__
    module = fn.__globals__.get("__name__") or fn.__module__ or "?"
    ident = f"{module}.{code.co_qualname}"
    w.add(f"lib:{ident}", library_version(module))
    if resolve_name(module, code.co_qualname) is not fn:
        w.add(f"lib-code:{ident}", code_digest(code))
    with w.mode(library=True):
        _cells(w, ident, fn)
        wrapped = getattr(fn, "__wrapped__", None)
        if wrapped is not None:
            w.value(f"{ident}.__wrapped__", wrapped)


def _globals_of(w: Walker, code: types.CodeType, g: dict[str, Any],
                roots: dict[str, frozenset[str]], callback_only: frozenset[str]) -> None:
    """The globals ``code`` names (in ``g``, else an imported user module or a builtin),
    and the attributes it names of the user modules among them. ``callback_only``: names
    that only a host callback the code makes reads when the program runs
    (:func:`kiln._keys._callback_roots.callback_only_names`), not keyed."""
    names = code_names(code) - callback_only
    modname = script_module(g.get("__name__", "?"))
    modules = []
    for name in sorted(names | module_strings(code)):
        if name in roots and name in g:
            _callback_target(w, f"{modname}.{name}", g[name], roots[name])
        elif name in g:
            v = g[name]
            w.global_value(f"{modname}.{name}", name, v)
            if isinstance(v, types.ModuleType) and module_is_user(v):
                modules.append(v)
        elif name in sys.modules and module_is_user(sys.modules[name]):
            # ``import helper`` / ``from helper import h`` inside the function body, or
            # ``importlib.import_module("helper")``
            modules.append(sys.modules[name])
            w.add(f"module:{name}", name)
            w.modules.append(sys.modules[name])
        elif name in _BUILTINS:
            v = _BUILTINS[name]
            if v is _ORIGINAL_BUILTINS.get(name, _BUILTINS):
                w.add(f"lib:builtins.{name}", library_version("builtins"))
            else:
                w.value(f"builtins.{name}", v)  # a patched builtin: by what it is now
    for mod in _relative_imports(code, g):
        # ``from . import consts`` / ``from .sub import X`` / ``from .. import y`` inside
        # the function: resolved against its package, as the import statement will be (a
        # module the trace imports first is in the manifest: the recorder's ``imported``)
        modules.append(mod)
        w.add(f"module:{mod.__name__}", mod.__name__)
        w.modules.append(mod)
    done: set[str] = set()
    while modules:
        mod = modules.pop(0)
        if mod.__name__ in done:
            continue
        done.add(mod.__name__)
        for attr in sorted(names):
            found, v = module_attr(mod, attr, True)
            if found:
                w.global_value(f"{mod.__name__}.{attr}", attr, v)
                if isinstance(v, types.ModuleType) and module_is_user(v):
                    modules.append(v)  # ``import pkg.sub`` then ``pkg.sub.CONST``


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


def resolve_name(module: str, qualname: str) -> Any:
    """The object that ``module`` + ``qualname`` names now, or None."""
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        if obj is None or part == "<locals>":
            return None
        obj = getattr(obj, part, None)
    return obj

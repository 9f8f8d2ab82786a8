"""The jax.jit swap: every ``jax.jit`` made outside JAX itself is a :func:`kiln.jit`.

Turned on by :func:`replace_jax_jit` (``kiln run`` and ``pytest --kiln`` by default, unless
``--no-jit`` / ``--kiln-no-jit`` or ``KILN_REPLACE_JIT=0``; ``KILN_REPLACE_JIT=1`` from
``import kiln`` on in any process), it sets the ``jax`` module's ``jit`` attribute
to :func:`swapped_jit`, so ``jax.jit(f)``, ``@jax.jit``, ``@jax.jit(static_argnums=...)``,
``functools.partial(jax.jit, ...)`` and a ``from jax import jit`` run after it, in the
program's code and in the libraries it imports (flax, optax, equinox's ``filter_jit``), make a
:class:`SwappedJit`: a kiln.jit whose warm start skips tracing, lowering and compiling.

What is left to the original ``jax.jit`` (the function it returns is jax's own), each with its
reason (``KILN_EXPLAIN=1`` says it, ``kiln.stats().reasons`` counts ``jit-swap-jax``):

- the caller is JAX itself, or kiln (the caller's module: ``jax``, ``jaxlib``, ``jax_plugins``,
  ``kiln`` and their submodules): JAX's internals keep their own jit;
- what the user excluded: ``KILN_JIT_EXCLUDE`` / ``replace_jax_jit(exclude=...)`` (a module
  prefix, matched against the caller's module and the function's, or ``module:qualname``),
  and functions marked with :func:`keep_jax_jit`;
- an option kiln.jit does not take (one a later jax adds), extra positional arguments, a
  function kiln.jit refuses where jax.jit does not (jax's own error is raised where jax
  raises one), or one no weak reference can be made to (jax.jit's calls of it raise
  TypeError, kiln.jit's would run it);
- at call time, arguments kiln.jit refuses where jax.jit might not (a static argument kiln
  cannot hash): that function is jax.jit from then on;
- at call time, a static argument with no hash (a numpy array, a list): the call is jax.jit's,
  which refuses it ("Non-hashable static arguments are not supported"), where a kiln.jit
  keys it by value.

A swapped function's ``lower``, ``trace``, ``eval_shape`` and any other attribute of jax.jit's
functions kiln has not (``_cache_size`` aside) are those of the plain ``jax.jit`` of the
function (jax's ``Lowered`` / ``Traced``, as a library expects; ``jit-swap-attribute``); its
calls stay kiln.jit's. ``clear_cache`` clears both.

The one difference a program can observe is the one of any warm start: trace-time Python side
effects (a ``print`` in a jitted function, a counter, a log line) do not run on a store hit.
"""

from __future__ import annotations

import functools
import logging
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import jax

from .._base import StaticArgumentError, get_config
from .._miss import _explain
from .._travel import disable_eager, enable_eager
from ._dispatch import unwrapped
from ._function import JitFunction
from ._options import JIT_DEFAULTS

__all__ = ["SwappedJit", "keep_jax_jit", "replace_at_import", "replace_jax_jit",
           "restore_jax_jit", "swapped_jit", "is_replaced"]

logger = logging.getLogger("kiln")

# jax.jit as JAX defines it, when kiln was imported
_ORIGINAL: Callable[..., Any] = jax.jit

# callers whose jax.jit stays jax's: JAX itself, and kiln (whose own jax.jit calls make the
# programs it compiles)
_INTERNAL = ("jax", "jaxlib", "jax_plugins", "kiln", "kiln_pytest")

# jax.jit's keyword options kiln.jit takes (jax 0.10 to 0.12: all of them)
_KILN_OPTIONS = frozenset(JIT_DEFAULTS)

_KEEP = "__kiln_keep_jax_jit__"
_NOT_GIVEN: Any = object()

# the process's exclusions given to replace_jax_jit(exclude=...)
_extra_exclude: tuple[str, ...] = ()


def _explain_swap(kind: str, message: str) -> None:
    try:
        explain_on = get_config().explain
    except Exception:  # noqa: BLE001 - a bad KILN_* setting is reported where it is used
        explain_on = False
    _explain.explain(kind, message, explain_on=explain_on)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _name_of(fun: Any) -> tuple[str, str]:
    module = getattr(fun, "__module__", None) or type(fun).__module__
    qualname = getattr(fun, "__qualname__", None) or type(fun).__qualname__
    return str(module), str(qualname)


def _excluded(fun: Any, caller: str) -> str | None:
    """Why the user left ``fun`` (wrapped by code of module ``caller``) to jax.jit, or None."""
    if getattr(fun, _KEEP, False):
        return "marked with kiln.keep_jax_jit"
    try:
        rules = get_config().jit_exclude + _extra_exclude
    except Exception:  # noqa: BLE001
        rules = _extra_exclude
    if not rules:
        return None
    module, qualname = _name_of(fun)
    for rule in rules:
        mod, colon, qual = rule.partition(":")  # "module:qualname", or a module prefix
        if (module == mod and (qualname == qual or qualname.startswith(qual + ".")) if colon
                else _under(caller, rule) or _under(module, rule)):
            return f"excluded by {rule!r} (KILN_JIT_EXCLUDE)"
    return None


class SwappedJit(JitFunction):
    """A ``jax.jit`` the swap made a :func:`kiln.jit`: its calls are kiln.jit's; ``lower``,
    ``trace``, ``eval_shape`` and jax.jit's other attributes are those of the plain
    ``jax.jit`` of the function (jax's ``Lowered``, ``Traced``, ...)."""

    _jax_only: str | None = None  # why calls went back to jax.jit (at call time), or None
    # static arguments as jax.jit takes them: one with no hash (a numpy array, a list) is
    # jax.jit's to refuse, not kiln's to key by value (_dispatch.install reads it)
    _statics_by_value = False
    # never slower than JAX's cache, which keys by the lowered module: a fingerprint miss whose
    # lowering is the module compiled last loads it (kiln._miss._compile._Miss._same_program)
    _same_program_alias = True
    _said: frozenset[tuple[str, str | None]] = frozenset()  # what its explanations said

    def _say_once(self, said: tuple[str, str | None]) -> bool:
        if said in self._said:
            return False
        self._said = self._said | {said}
        return True

    def _python_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if self._jax_only is None and not _unhashable_static(self._options, args, kwargs):
            try:
                return super()._python_call(args, kwargs)
            except StaticArgumentError as e:
                # jax.jit's own behaviour for what kiln.jit refuses (its error, or its result)
                self._back_to_jax(str(e))
        return self._jax_jit(*unwrapped(args), **unwrapped(kwargs)), None

    def _back_to_jax(self, reason: str) -> None:
        self._jax_only = reason
        cls = type(self)
        if cls is not SwappedJit and "__call__" in cls.__dict__:
            # the class of its own (the C++ dispatcher's): calls go straight to jax.jit
            cls.__call__ = staticmethod(self._jax_jit)  # type: ignore[method-assign,assignment]
        _explain_swap("jit-swap-jax", f"{self._module}.{self._name}: jax.jit from now on: "
                      f"kiln.jit refused a call: {reason}")

    def _miss(self, call: Any, miss: Any = None) -> Any:
        executable = super()._miss(call, miss)
        if self._say_once(("kiln", self._verify_reason)):
            name = f"{self._module}.{self._name}"
            if self._verify_reason is None:
                _explain_swap("jit-swap-kiln", f"{name}: jax.jit made kiln.jit")
            else:
                _explain_swap("jit-swap-verify", f"{name}: jax.jit made kiln.jit, on the verify "
                              f"path (trace + lower, no compile): {self._verify_reason}")
        return executable

    def _jax_attribute(self, attribute: str) -> Any:
        value = getattr(self._jax_jit, attribute)
        if self._say_once(("attribute", attribute)):
            _explain_swap("jit-swap-attribute", f"{self._module}.{self._name}: .{attribute} "
                          "is the plain jax.jit's (calls stay kiln.jit's)")
        return value

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit(fun).lower(...)``: jax's ``Lowered``."""
        return self._jax_attribute("lower")(*args, **kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit(fun).trace(...)``: jax's ``Traced``."""
        return self._jax_attribute("trace")(*args, **kwargs)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit(fun).eval_shape(...)``."""
        return self._jax_attribute("eval_shape")(*args, **kwargs)

    def clear_cache(self) -> None:
        """Forget this process's executables, kiln's and the plain jax.jit's."""
        super().clear_cache()
        self._jax_jit.clear_cache()

    def __getattr__(self, attribute: str) -> Any:
        # only for what kiln.jit has not: jax.jit's other attributes (_cache_miss, _jit_info,
        # _clear_cache, ...)
        if attribute.startswith("__") or "_jax_jit" not in self.__dict__:
            raise AttributeError(attribute)
        return self._jax_attribute(attribute)

    def __repr__(self) -> str:
        return f"<kiln.jit (for jax.jit) {self._module}.{self._name}>"


def _unhashable_static(options: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a static argument of this call has no hash: jax.jit refuses it ("Non-hashable
    static arguments are not supported"), so the call is jax.jit's (its error is raised)."""
    if not options.has_statics:
        return False
    n = len(args)
    values = [args[i] for i in options.static_argnums if -n <= i < n]
    values += [kwargs[k] for k in options.static_argnames if k in kwargs]
    for v in values:
        try:
            hash(v)
        except TypeError:
            return True
    return False


def _weakly_referenceable(fun: Any) -> bool:
    try:
        weakref.ref(fun)
    except TypeError:
        return False
    return True


def _make(fun: Any, options: dict[str, Any], caller: str) -> Any:
    """``jax.jit(fun, **options)`` called from module ``caller``, swapped where it can be."""
    reason = _excluded(fun, caller)
    if reason is None:
        unknown = sorted(set(options) - _KILN_OPTIONS)
        if unknown:
            reason = f"kiln.jit does not take option {', '.join(unknown)}"
        elif callable(fun) and not _weakly_referenceable(fun):
            # jax.jit's cache holds its function weakly: its calls of this one raise
            # TypeError ("cannot create weak reference"), kiln.jit's would run it
            reason = f"no weak reference can be made to it ({type(fun).__name__})"
    if reason is None:
        try:
            return SwappedJit(fun, **options)
        except Exception as e:  # noqa: BLE001 - jax.jit decides: its error, or its function
            reason = f"kiln.jit refused it: {type(e).__name__}: {e}"
    jitted = _ORIGINAL(fun, **options)  # jax's error where jax raises one
    module, qualname = _name_of(fun)
    _explain_swap("jit-swap-jax", f"{module}.{qualname}: left to jax.jit: {reason}")
    return jitted


@functools.wraps(_ORIGINAL)
def swapped_jit(fun: Any = _NOT_GIVEN, /, *args: Any, **options: Any) -> Any:
    """``jax.jit`` under the swap (see the module docstring)."""
    caller = str(sys._getframe(1).f_globals.get("__name__", ""))
    if args or any(_under(caller, p) for p in _INTERNAL):
        return _ORIGINAL(*args, **options) if fun is _NOT_GIVEN else _ORIGINAL(
            fun, *args, **options)
    if fun is _NOT_GIVEN:
        _ORIGINAL(**options)  # jax's checks of the options (an unknown keyword: TypeError)
        return functools.partial(_make, options=options, caller=caller)
    return _make(fun, options, caller)


def is_replaced() -> bool:
    """Whether ``jax.jit`` is kiln's swap now."""
    return jax.jit is swapped_jit


def replace_jax_jit(*, exclude: Iterable[str] = ()) -> bool:
    """Make every ``jax.jit`` outside JAX itself a :func:`kiln.jit`, from now on.

    After this call, ``jax.jit`` (the ``jax`` module's attribute: ``jax.jit(f)``, ``@jax.jit``,
    ``functools.partial(jax.jit, ...)``, and ``from jax import jit`` run afterwards) makes a
    kiln.jit in the program's code and in the libraries it imports, so an unchanged program's
    warm start skips tracing, lowering and compiling, not only the compile. Call it first
    thing: a module that ran ``from jax import jit`` before keeps jax's own. JAX's internals
    (a caller in ``jax``, ``jaxlib``) keep jax's; what kiln.jit cannot take (an option it
    lacks, a static argument it cannot hash) stays jax.jit, with the reason explained
    (``KILN_EXPLAIN=1``); a function kiln cannot fingerprint takes the verify path (trace and
    lower, no compile). JAX's own eager work (``jnp`` functions, primitives applied outside a
    trace) is loaded from the store with no trace or lowering too (``KILN_EAGER=0`` leaves it
    to JAX; :mod:`kiln._travel._eager`). The kiln:// route (JAX's cache in kiln's store) stays
    on for the rest.

    The one difference from jax.jit: a warm start does not run the function's Python, so
    trace-time side effects (a ``print``, a counter) happen on a cold start only. Leave a
    function to jax.jit with :func:`kiln.keep_jax_jit`, or a module with ``exclude``.

    Args:
        exclude: left to jax.jit, added to ``KILN_JIT_EXCLUDE``: module prefixes (``"mylib"``:
            jax.jit calls made in ``mylib`` or its submodules, and their functions) or
            ``"module:qualname"`` (one function, or the methods of a class).

    Returns:
        True if this call replaced ``jax.jit``; False if it was replaced already (the
        exclusions are added all the same).

    Example:
        >>> import jax, kiln
        >>> kiln.replace_jax_jit()  # (in a program's code, jax.jit(f) is now a kiln.jit)
        True
        >>> kiln.restore_jax_jit()
        True
    """
    global _extra_exclude
    _extra_exclude = tuple(dict.fromkeys(_extra_exclude + tuple(exclude)))
    if is_replaced():
        return False
    jax.jit = swapped_jit
    enable_eager()
    return True


def restore_jax_jit() -> bool:
    """Put JAX's own ``jax.jit`` back (functions already made stay what they are).

    Returns:
        True if the swap was on.
    """
    if not is_replaced():
        return False
    jax.jit = _ORIGINAL
    disable_eager()
    return True


def keep_jax_jit(fun: Any) -> Any:
    """Leave ``fun`` to JAX's own ``jax.jit`` under the swap (:func:`replace_jax_jit`).

    For a function whose trace-time side effects the program relies on (it counts or logs its
    traces, appends to a list while tracing): apply it under ``@jax.jit`` (``fun`` marked, so
    jax.jit keeps it), or to what ``jax.jit`` returned (the plain ``jax.jit`` of the function
    is given back). Without the swap it changes nothing.

    Example:
        >>> import jax, kiln
        >>> @jax.jit
        ... @kiln.keep_jax_jit
        ... def traced_each_time(x):
        ...     return x * 2
    """
    if isinstance(fun, SwappedJit):
        module, qualname = _name_of(fun._fun)
        _explain_swap("jit-swap-jax", f"{module}.{qualname}: left to jax.jit: "
                      "marked with kiln.keep_jax_jit")
        return fun._jax_jit
    try:
        setattr(fun, _KEEP, True)
    except (AttributeError, TypeError):
        raise TypeError(f"keep_jax_jit: cannot mark {fun!r} (no attributes can be set on "
                        f"{type(fun).__name__}); exclude it with KILN_JIT_EXCLUDE="
                        "module:qualname instead") from None
    return fun


def replace_at_import() -> None:
    """The swap from ``import kiln`` on when ``KILN_REPLACE_JIT=1``. Never raises."""
    try:
        if get_config().replace_jit:
            replace_jax_jit()
    except Exception as e:  # noqa: BLE001 - never stop import kiln over it
        logger.debug("kiln: jax.jit not replaced at import: %s", e)

"""The program of one call: its flat ``jax.jit`` traced once, and lowered in each form, each
made on first use and kept.

Words (the same in ``_compile``, ``_reader``, ``_writer``, ``_tier_up`` and ``kiln._jit``):

- *lowered*: the program lowered with each :func:`kiln.noinline` call kept a call into the
  function's own executable (a host callback). The canonical lowering: its digest is the
  verify path's key and an entry header's ``lowered``.
- *inlined*: the program lowered with those calls inlined (tier-up's form; an entry header's
  ``tier: inlined``, the verify path's ``lowered-inlined`` key part).
- (``kiln._jit``) *JAX's lowering*: ``jax.jit(fun).lower(*args, **kwargs)`` of the call as the
  user wrote it, for what describes the call (``args_info``, ``in_tree``, ...).
"""

from __future__ import annotations

import functools
import sys
import time
import warnings
from typing import Any

import jax

from .._base import Config, _gc, _jax_compat, _stats
from .._keys import Guard, StaticReadWatch, TraceRecorder, guard_snapshot
from . import _noinline_p
from ._outputs import Box, abstract_sig

__all__ = ["Program", "arg_avals", "structs"]

# JAX's warnings while lowering that describe the program (not the run), replayed when its
# stored executable is loaded: jax._src.interpreters.mlir (jax 0.10 to 0.12)
_LOWERING_WARNINGS = ("Some donated buffers were not usable",)


def structs(leaves: list[Any]) -> list[jax.ShapeDtypeStruct]:
    """Abstract arguments of a program (sharded ones keep their sharding)."""
    multi = jax.device_count() > 1
    return [
        jax.ShapeDtypeStruct(
            x.shape, x.dtype, weak_type=jax.typeof(x).weak_type,
            sharding=x.sharding if multi and isinstance(x, jax.Array) and x.committed
            else None,
        )
        for x in leaves
    ]


def arg_avals(stage: jax.stages.Traced | jax.stages.Lowered) -> list[str]:
    """The abstract values of a traced or lowered program's arguments, as text."""
    return [str(a._aval) for a in jax.tree_util.tree_leaves(stage.args_info)]


class Program:
    """One call's program: ``jitted`` (the flat jax.jit of the function) over ``leaves``.

    ``modules_before``: the modules loaded when the function was fingerprinted (a trace that
    imports more records them in the manifest). ``box``: where the trace leaves kiln.filter_jit's
    non-array outputs; ``treedef`` / ``input_statics``: the call's inputs (what they hold besides
    arrays is referred to by position in an entry).
    """

    def __init__(self, name: str, jitted: Any, leaves: list[Any], box: Box, treedef: Any,
                 input_statics: tuple[tuple[Any, Any], ...], cfg: Config) -> None:
        self.name = name
        self.jitted = jitted
        self.leaves = leaves
        self.box, self.box_sig = box, abstract_sig(leaves)
        self.treedef, self.input_statics = treedef, input_statics  # (static leaves included)
        self.cfg = cfg
        self.modules_before = set(sys.modules)
        self.traced: jax.stages.Traced | None = None
        # how many values the trace closed over that jax.jit passes as inputs (_Miss._jax_runs_it)
        self.extra_inputs = 0
        self._recorded: set[Any] = set()  # code the recorder saw run (see TraceRecorder)
        self._callers: frozenset[Any] = frozenset()  # library code that called the trace
        self._calls: set[Any] | None = None  # (see calls)
        self._primitives: list[Any] | None = None  # (see primitives)
        self.imported: tuple[str, ...] = ()  # user modules the cold trace imported
        # the static objects keyed by the fields their trace reads (CallKeys.watched), and
        # after a trace the fields each one's trace read (None: its whole state)
        self.watched: tuple[tuple[str, Any], ...] = ()
        self.static_reads: dict[str, tuple[str, ...] | None] = {}
        self.static_changed: str | None = None  # a field of one the trace changed
        self.reads: list[list[str]] = []  # files and directories the cold trace read
        self.read_reason: str | None = None  # why those cannot be keyed (kiln._keys._reads)
        self.trace_seconds = 0.0  # tracing and lowering
        self.lowered: jax.stages.Lowered | None = None
        # JAX's warnings from lowering that a warm start replays (see _LOWERING_WARNINGS)
        self.lower_warnings: list[str] = []
        self.inlined_lowered: jax.stages.Lowered | None = None
        self._inlined_facts: tuple[str, bool] | None = None  # (see inlined_facts)

    def static_out(self) -> Any:
        """``(out_tree, {leaf index: value})`` of the non-array outputs the trace of these
        leaves split off (kiln.filter_jit), or None."""
        return self.box.get(self.box_sig)

    def input_objects(self) -> list[Any]:
        """What this call's inputs hold besides arrays (``_jax_compat.input_objects``): an
        output's tree structure refers to them by position in its entry."""
        return _jax_compat.input_objects(self.treedef, self.input_statics)

    @functools.cached_property
    def guard(self) -> Guard:
        """The process's inputs as the call missed (``kiln._keys._guard``): made at the first
        use, before the trace of a cold call (a warm hit never needs it)."""
        return guard_snapshot()

    def trace(self) -> jax.stages.Traced:
        if self.traced is None:
            t0 = time.perf_counter()
            recorder = TraceRecorder(self.modules_before, ignore=self._not_inputs())
            runs = getattr(getattr(self.jitted, "__wrapped__", None), "_kiln_runs", None)
            watch = StaticReadWatch(self.watched, (lambda: runs[0]) if runs else None)
            with recorder, watch, _gc.relaxed():
                traced = self.traced = self.jitted.trace(*self.leaves)
            self.static_reads, self.static_changed = watch.reads, watch.changed
            self._recorded, self._callers = recorder.codes, recorder.callers
            self.imported = recorder.imported
            self.reads = recorder.reads
            self.read_reason = recorder.read_reason
            self.extra_inputs = _jax_compat.traced_extra_inputs(traced)
            _stats.bump(traces=1)
            self.trace_seconds += time.perf_counter() - t0
        return self.traced

    def _not_inputs(self) -> tuple[str, ...]:
        """Directories whose files a trace may read that are not inputs of the program:
        kiln's local store, and JAX's own cache directory (eager operations while tracing)."""
        dirs = [str(self.cfg.cache_dir)]
        jax_dir = getattr(jax.config, "jax_compilation_cache_dir", None)
        if isinstance(jax_dir, str) and "://" not in jax_dir:
            dirs.append(jax_dir)
        return tuple(dirs)

    def lower(self) -> jax.stages.Lowered:
        """The program as traced, lowered (its noinline calls kept as calls)."""
        if self.lowered is None:
            traced = self.trace()
            t0 = time.perf_counter()
            with _gc.relaxed(), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.lowered = traced.lower()
            self.trace_seconds += time.perf_counter() - t0
            self.lower_warnings = [str(w.message) for w in caught  # for the entry's header
                                   if str(w.message).startswith(_LOWERING_WARNINGS)]
            for w in caught:  # shown as JAX showed them
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno,
                                       source=w.source)
        return self.lowered

    def lower_inlined(self, args: list[Any] | None = None) -> jax.stages.Lowered:
        """The program as traced, lowered with its noinline calls inlined (same calling
        convention and donation as the lowered one); ``args``: its abstract arguments, when
        the leaves may be gone (donated)."""
        if self.inlined_lowered is None:
            traced = self.trace()
            run = _jax_compat.jaxpr_as_fun(traced.jaxpr)

            def inlined(*leaves: Any) -> Any:
                return run(*leaves)

            # a fresh function: jax's trace and lowering caches cannot hand back the lowered one
            inlined.__name__ = inlined.__qualname__ = self.name
            args_info = jax.tree_util.tree_leaves(traced.args_info)
            donate = tuple(i for i, a in enumerate(args_info) if a.donated)
            with _noinline_p.inlining(), _gc.relaxed():
                lowered = jax.jit(inlined, donate_argnums=donate).trace(
                    *(args or structs(self.leaves))).lower()
            self._inlined_facts = _jax_compat.lowered_facts(lowered)
            self.inlined_lowered = lowered
        return self.inlined_lowered

    def lower_form(self, inlined: bool) -> jax.stages.Lowered:
        """The lowering an entry of this form (``tier: inlined`` or not) was compiled from."""
        return self.lower_inlined() if inlined else self.lower()

    # -- facts of the traced program (each computed once, on first use) ---------------------
    @property
    def calls(self) -> set[Any]:
        """The code the cold trace ran (see TraceRecorder): the functions that emitted the
        program's equations, and what the recorder saw run. Made from the traced jaxpr on
        first use: only a manifest needs it (a load that stores nothing under the fingerprint
        makes none). The equations' tracebacks also name the library code below the trace
        (its callers: pytest, an outer jax.jit), which is left out."""
        if self._calls is None:
            if self.traced is None:
                return set()
            self._calls = self.emitted | self._recorded
        return self._calls

    @property
    def emitted(self) -> set[Any]:
        """The code that emitted the program's equations (not the recorder's: see
        ``manifest_for``'s ``library_codes``)."""
        if self.traced is None:
            return set()
        return _jax_compat.codes_in_jaxpr(self.traced.jaxpr) - self._callers

    @property
    def primitives(self) -> list[Any]:
        """The primitives the program binds (their rules count in the manifest), from the
        traced jaxpr on first use."""
        if self._primitives is None:
            if self.traced is None:
                return []
            self._primitives = _jax_compat.primitives_in(self.traced.jaxpr)
        return self._primitives

    @functools.cached_property
    def lowered_facts(self) -> tuple[str, bool]:
        """(sha256 of the lowered module's text, whether it calls LAPACK): the verify path's
        key and the entry header's ``lowered`` / ``lapack``."""
        return _jax_compat.lowered_facts(self.lower())

    @property
    def inlined_facts(self) -> tuple[str, bool]:
        """(sha256 of the inlined module's text, whether it calls LAPACK), taken when it is
        lowered: the verify path's ``lowered-inlined`` key part and the header of an entry of
        tier-up's form."""
        self.lower_inlined()
        assert self._inlined_facts is not None  # internal invariant: set with the lowering
        return self._inlined_facts

    @functools.cached_property
    def called_names(self) -> list[str]:
        """The kiln.noinline functions the traced program calls (for ``kiln ls``)."""
        return [] if self.traced is None else _noinline_p.called_names(self.traced.jaxpr.jaxpr)

    @functools.cached_property
    def inlined_size(self) -> int:
        """Equations of the traced program once its tier-up noinline calls are inlined."""
        assert self.traced is not None  # internal invariant: asked after tracing
        return _noinline_p.inlined_size(self.traced.jaxpr.jaxpr)

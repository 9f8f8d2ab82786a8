"""The miss path of a kiln function: fingerprint and key, load from the store (digest, manifest,
deserialize), or trace -> lower -> compile -> serialize -> store; and the tier-up policy (which
programs compile their noinline calls inlined, directly or in the background).

One :class:`_Miss` per in-process miss of one signature. It knows its function through the
attributes ``kiln._jit._function.JitFunction`` gives it (``_fun``, ``_name``,
``_flat_jitted``, ...), and never imports ``_jit``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
import sys
import threading
import time
import types
import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np

from .._base import _gc, _jax_compat, _stats
from .._base._config import get_config
from .._base._errors import (
    EntryError,
    KilnWarning,
    StoreError,
    StoreWarning,
    UnverifiableEntry,
    VerifyError,
)
from .._keys import _args
from .._keys._fingerprint import fingerprint
from .._keys._key import environment_parts, make_key
from .._keys._manifest import check_manifest, manifest_for
from .._keys._recorder import TraceRecorder
from .._travel._jax_cache import kiln_compiling
from ..stores import (
    Held,
    Leasable,
    Lease,
    RemoteSkipped,
    Store,
    await_or_lease,
    open_store,
    store_fault,
    user_stacklevel,
)
from ..stores._entry import decode, encode, short_key
from . import _explain, _noinline_p
from ._progress import compiling

logger = logging.getLogger("kiln")


class Program(Protocol):
    """What the miss path reads of the function it compiles
    (``kiln._jit._function.JitFunction``)."""

    _fun: Any
    _name: str
    _module: str
    _positional: list[str]
    _jit_options: dict[str, Any]
    _in_shardings: Any
    _out_shardings: Any
    _filter: str | None
    _may_tier_up: bool

    def _param_name(self, where: Any) -> Any: ...

    def _flat_jitted(self, statics: tuple[tuple[Any, Any], ...], n_dyn: int, treedef: Any,
                     static_leaves: dict[int, Any], static_key: tuple[Any, ...]) -> Any: ...

    def _donated_leaves(self, statics: tuple[tuple[Any, Any], ...], n_dyn: int, treedef: Any,
                        static_leaves: dict[int, Any]) -> tuple[int, ...]: ...


_tree_flatten = jax.tree_util.tree_flatten
_STATIC_LEAF = _args.STATIC_LEAF


class Outcome(enum.Enum):
    """What a store lookup found (``_Miss._load``)."""

    HIT = "hit"  # a usable entry, loaded
    ABSENT = "absent"  # no entry under the key
    STALE = "stale"  # an entry built from something that has changed since
    UNUSABLE = "unusable"  # a corrupt, foreign or tampered entry, or a store that failed
    VERIFY_ONLY = "verify-only"  # a marker: this function takes the verify path
    # a short-lived marker: the process that compiled it could not store it; compile here now
    # (waiters do not take the key over one after another: issue 24)
    NOT_STORABLE = "not-storable"


@dataclasses.dataclass(frozen=True)
class Loaded:
    outcome: Outcome
    executable: Any = None  # the callable executable, on a HIT


_ABSENT, _STALE, _UNUSABLE = Loaded(Outcome.ABSENT), Loaded(Outcome.STALE), Loaded(Outcome.UNUSABLE)


@contextlib.contextmanager
def _holding(lease: Lease | None, seconds: float) -> Any:
    """Hold ``lease`` (if any) for the block (see :class:`kiln.stores.Held`)."""
    if lease is None:
        yield
        return
    held = Held(lease, seconds)
    try:
        yield
    finally:
        held.release()


class _Box(dict[Any, Any]):
    """Non-array outputs of a flat jax.jit (kiln.filter_jit), per traced signature
    (``_abstract_sig`` of its array leaves): ``(out_tree, {leaf index: value})``."""


def _abstract_sig(leaves: Sequence[Any]) -> tuple[Any, ...]:
    """(shape, dtype, weak_type) per traced leaf: which trace a function's non-array outputs
    came from (one flat jax.jit serves every signature of a static configuration)."""
    out = []
    for x in leaves:
        a = jax.typeof(x)  # a Python scalar as jax traces it (weakly typed)
        out.append((tuple(getattr(a, "shape", ())), str(getattr(a, "dtype", a)),
                    bool(getattr(a, "weak_type", False))))
    return tuple(out)


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


# Above this many equations once inlined (a recursive noinline function grows exponentially),
# a program keeps calling its noinline functions instead of tiering up.
MAX_EQUATIONS = 50_000

# Compile the inlined program directly, with no host-callback tier first, when inlining makes
# the program at most this many times larger than compiling its pieces separately (a small
# vector field inside a big solver: the callbacks would only slow the first run down).
DIRECT_RATIO = 2.0

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


def lower_inlined(miss: _Miss, args: list[Any]) -> jax.stages.Lowered:
    """``miss``'s traced jaxpr lowered with its noinline calls inlined (same calling convention
    and donation as the first executable)."""
    assert miss.traced is not None  # internal invariant
    run = _jax_compat.jaxpr_as_fun(miss.traced.jaxpr)

    def inlined(*leaves: Any) -> Any:
        return run(*leaves)

    # a fresh function, so jax's trace and lowering caches cannot hand back the first lowering
    inlined.__name__ = inlined.__qualname__ = miss.jf._name
    args_info = jax.tree_util.tree_leaves(miss.traced.args_info)
    donate = tuple(i for i, a in enumerate(args_info) if a.donated)
    with _noinline_p.inlining(), _gc.relaxed():
        return jax.jit(inlined, donate_argnums=donate).trace(*args).lower()


def compile_and_store_inlined(miss: _Miss, args: list[Any], t0: float) -> Any:
    """Compile ``miss``'s program with its noinline calls inlined, store it (header ``tier:
    inlined``) under its fingerprint key, or on the verify path under the inlined module's key,
    and return the callable executable."""
    assert miss.traced is not None  # internal invariant
    lowered = miss._inlined_lowering(args)
    want, got = _arg_avals(miss.traced), _arg_avals(lowered)
    if want != got:  # never swap in or store an executable of another signature
        raise RuntimeError(f"inlined program takes {got}, the program {want}")
    with kiln_compiling():
        compiled = _jax_compat.with_out_tree(_jax_compat.compile_to_store(lowered),
                                             miss.traced.out_tree)
    seconds = time.perf_counter() - t0
    _stats.bump(compiles=1, compile_seconds=seconds)
    result, sections, mode = miss._serialize(compiled)
    if sections is None:
        return result
    if miss.key is not None and miss.key == miss.fp_key:
        # the inlined executable also depends on the noinline functions' own code
        codes = set(miss.calls)
        for _, sub_jaxpr in _noinline_p.calls_in(miss.traced.jaxpr.jaxpr):
            codes |= _jax_compat.codes_in_jaxpr(sub_jaxpr)
        manifest, reason = manifest_for(codes, miss.fp, miss.imported, miss.reads,
                                        miss.read_reason)
        if reason is not None:
            miss._explain("tier-up", f"inlined program not stored: {reason}")
            return result
        key = miss.key
    elif miss.inlined_key is not None:
        # the verify path: keyed by this very inlined module, which holds all of the code
        key, manifest = miss.inlined_key, None
    else:
        return result
    # the digest of what was compiled: a warm process checks it (audit mode, callbacks
    # rebuilt by tracing) against its own inlined lowering
    assert miss.inlined_digest is not None  # internal invariant: set with the lowering
    header = miss._header(mode, manifest, seconds, seconds,
                          miss.inlined_digest, miss.inlined_lapack)
    header["tier"] = "inlined"
    miss._put(key, header, sections)
    return result


def _arg_avals(stage: jax.stages.Traced | jax.stages.Lowered) -> list[str]:
    return [str(a._aval) for a in jax.tree_util.tree_leaves(stage.args_info)]


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


def with_static_outputs(outs: Any, out_tree: Any, static_out: dict[int, Any]) -> Any:
    """The full output: the array leaves ``outs`` of an executable, with the non-array leaves
    that were split off at trace time put back in their places."""
    it = iter(outs)
    return out_tree.unflatten([static_out[i] if i in static_out else next(it)
                               for i in range(out_tree.num_leaves)])


def _with_static_outputs(compiled: Any, out_tree: Any, static_out: dict[int, Any]) -> Any:
    """Wrap an executable whose non-JAX outputs were split off at trace time."""

    def call(*leaves: Any) -> Any:
        return with_static_outputs(compiled(*leaves), out_tree, static_out)

    return call


def _aval_text(sig: Any) -> str:
    """``float32[3]``, ``float32[]~weak``, ``python-float``: canonical, used in keys."""
    if isinstance(sig, type):
        return f"python-{sig.__name__}"
    sharding = ""
    if isinstance(sig, tuple):  # (aval, sharding) when there are several devices
        if sig[1] is not None:  # (None: an uncommitted array, placed where jax.jit puts it)
            sharding = f"@{_jax_compat.sharding_text(sig[1])}"
        sig = sig[0]
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


# Static values whose digest is all there is to them (no code, no class behind them).
_PLAIN_STATIC = (type(None), bool, int, float, complex, str, bytes, np.ndarray, np.generic,
                 jax.Array)


def _advice(reason: str) -> str:
    """What to do about an executable that cannot be stored, by its reason."""
    if "large constants" in reason:
        return ("pass the array it closes over as an argument (traced) or as a static "
                "argument (by value)")
    if "tree structure" in reason:
        return ("return arrays and objects the inputs hold (a TrainState's apply_fn and tx "
                "come back as the caller's own) or objects cloudpickle can carry")
    if "mutable array" in reason:
        return "pass the array ref as an argument"
    return "KILN_EXPLAIN=1 says more"


# JAX's warnings while lowering that describe the program (not the run), replayed when its
# stored executable is loaded: jax._src.interpreters.mlir (jax 0.10 to 0.12)
_LOWERING_WARNINGS = ("Some donated buffers were not usable",)


class _Miss:
    """One in-process miss: load from the store or compile, then store."""

    def __init__(
        self,
        jf: Program,
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
        # uncompiled: the function of the array leaves as plain Python (jax.disable_jit);
        # jitted: its jax.jit, which this miss traces, lowers and compiles
        self.uncompiled, self.jitted, box = jf._flat_jitted(
            statics, len(dyn_args), treedef, static_leaves, static_key
        )
        self.box, self.box_sig = box, _abstract_sig(self.leaves)
        sigs = tuple(s for s in sigs if s is not _STATIC_LEAF)
        arg_statics = statics
        statics = statics + tuple((("leaf", i), x) for i, x in static_leaves.items())
        self.store: Store = open_store(cfg)
        self.lowered: jax.stages.Lowered | None = None
        # JAX's warnings from lowering that a warm start replays (see _LOWERING_WARNINGS)
        self.lower_warnings: list[str] = []
        self.traced: jax.stages.Traced | None = None
        # tier-up (kiln._miss._tier_up): set when this program calls kiln.noinline functions and its
        # inlined form should be compiled in the background; key / manifest of the entry
        self.start_tier_up = False
        self.key: str | None = None
        self.fp_key: str | None = None
        # the inlined form's lowering (tier-up), and its key on the verify path
        self.inlined_lowered: jax.stages.Lowered | None = None
        self.inlined_digest: str | None = None
        self.inlined_lapack = True
        self.inlined_key: str | None = None
        self.calls: set[Any] = set()  # code the cold trace ran (see TraceRecorder)
        self.imported: tuple[str, ...] = ()  # user modules the cold trace imported
        self.reads: list[list[str]] = []  # files and directories the cold trace read
        self.read_reason: str | None = None  # why those cannot be keyed (kiln._keys._reads)
        self.trace_seconds = 0.0
        self.not_storable_reason = ""  # why the executable could not be stored (_serialize)
        # (store, key) of the executable entries this miss loaded or wrote (tier-up's too):
        # what a kiln function pickled by value carries with it
        self.entries: list[tuple[Store, str]] = []
        # keys whose stored entry was found stale or unusable: written with the store's
        # replace (a remote store's put is create-only)
        self.replace_keys: set[str] = set()
        self.keep_keys: set[str] = set()  # signed entries this process cannot check: left alone
        self.no_flight: set[str] = set()  # keys under a not-storable marker: no single flight
        self._quiet = False  # polling for another process's entry: no miss explanations
        self.treedef, self.input_statics = treedef, statics  # (static leaves included)
        structure, aux = _treedef_parts(treedef)
        self.signature = avals_text = ", ".join(_aval_text(s) for s in sigs)
        extra = list(aux)
        self.unsound: str | None = None
        static_parts = []
        values = {jf._param_name(where): value for where, value in statics}
        leaf_paths = (_args.leaf_paths(jf._positional, dyn_args, dyn_kwargs, statics)
                      if static_leaves else [])
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
        if _args.MULTI_DEVICE and not any(
                isinstance(s, tuple) and s[1] is not None for s in sigs) \
                and jf._in_shardings is None:
            # no committed argument: jax.jit runs the program on this process's default
            # device, so the executable is bound to it (in a multi-process job each process
            # has its own); with a committed argument its sharding decides (in the signature)
            self.base_parts.append(("default-device", _jax_compat.default_device_text()))
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
        warnings.warn(f"{message}; {then}", StoreWarning, stacklevel=user_stacklevel())

    def _bad_entry(self, message: str, then: str = "recompiling and replacing it") -> None:
        """Count and warn about a bad entry, once per key (not again when single-flight
        looks at the same entry once more)."""
        if self._quiet:
            return
        _stats.bump(bad_entries=1)
        self._explain("bad-entry", f"{message.removeprefix('kiln: ')}; {then}")
        self._warn(message, then)

    def _store_fault(self, doing: str, e: BaseException) -> None:
        store_fault(self.store, doing, e, strict=self.cfg.strict)

    def _input_objects(self) -> list[Any]:
        """What this call's inputs hold besides arrays (``_jax_compat.input_objects``): an
        output's tree structure refers to them by position in its entry."""
        return _jax_compat.input_objects(self.treedef, self.input_statics)

    def _explain(self, kind: str, message: str) -> None:
        if self._quiet:
            return
        _explain.explain(kind, f"{self.jf._name}: {message}", explain_on=self.cfg.explain)

    def _trace(self) -> jax.stages.Traced:
        if self.traced is None:
            t0 = time.perf_counter()
            recorder = TraceRecorder(self.modules_before, ignore=self._not_inputs())
            with recorder, _gc.relaxed():
                traced = self.traced = self.jitted.trace(*self.leaves)
            self.calls = _jax_compat.codes_in_jaxpr(traced.jaxpr) | recorder.codes
            self.imported = recorder.imported
            self.reads, self.read_reason = recorder.reads, recorder.read_reason
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

    def _trace_lower(self) -> jax.stages.Lowered:
        """The program as traced, lowered with its noinline calls not inlined (the canonical
        lowering: its digest is the verify path's key)."""
        if self.lowered is None:
            traced = self._trace()
            t0 = time.perf_counter()
            with _gc.relaxed(), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.lowered = traced.lower()
            self.trace_seconds += time.perf_counter() - t0
            for w in caught:  # shown as JAX showed them, and kept for the entry's header
                if str(w.message).startswith(_LOWERING_WARNINGS):
                    self.lower_warnings.append(str(w.message))
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno,
                                       source=w.source)
        return self.lowered

    def _inlined_lowering(self, args: list[Any] | None = None) -> jax.stages.Lowered:
        """The program as traced, lowered with its noinline calls inlined (tier-up's form);
        ``args``: its abstract arguments, when the leaves may be gone (donated)."""
        if self.inlined_lowered is None:
            self._trace()
            lowered = lower_inlined(self, args or structs(self.leaves))
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
        return make_key(self.base_parts + [("lowered", self.lowered_facts[0])])

    def _verify_path(self, t_start: float) -> Any:
        """Load or compile under keys of the lowered module (the fingerprint is not sound)."""
        self._trace()
        if self.cfg.tier_up and self.tier_up_candidate:
            # its inlined form (compiled directly or by a tier-up) is stored under its own key
            self.inlined_key = self._verify_key(inlined=True)
            got = self._load(self.inlined_key, t_start)
            if got.outcome is Outcome.HIT:
                return got.executable
            if self.inline_directly:
                return self._compile_and_store(self.inlined_key, None, t_start)
        vkey = self._verify_key()
        got = self._load(vkey, t_start)
        if got.outcome is Outcome.HIT:
            return got.executable
        return self._compile_and_store(vkey, None, t_start)

    # -- the flow -----------------------------------------------------------------------------
    def run(self) -> Any:
        t_start = time.perf_counter()
        fp_key = None if self.unsound else make_key(self.base_parts + self.fp_parts)
        self.fp_key = fp_key
        if fp_key is not None:
            got = self._load(fp_key, t_start)
            if got.outcome is Outcome.HIT:
                return got.executable
            if got.outcome is Outcome.VERIFY_ONLY:
                self.unsound = "manifest could not be fingerprinted (recorded on the first run)"
        if self.unsound is None:
            assert fp_key is not None  # internal invariant: the fingerprint was sound
            # single-flight before tracing: a process that waits for another's compile has
            # nothing to do but load its entry (tracing first cost each waiter seconds)
            other, lease = self._await_or_lease(fp_key, t_start)
            if other is not None and other.outcome is Outcome.HIT:
                return other.executable
            if other is not None and other.outcome is Outcome.VERIFY_ONLY:
                self.unsound = "manifest could not be fingerprinted (recorded on the first run)"
            else:
                with _holding(lease, self.cfg.lease_seconds):
                    return self._trace_and_compile(fp_key, t_start)
        self._explain("verify-path", f"taking the verify path: {self.unsound}")
        return self._verify_path(t_start)

    def _trace_and_compile(self, fp_key: str, t_start: float) -> Any:
        """The cold path under a sound fingerprint (holding ``fp_key``'s lease, if any): trace,
        record the manifest, compile and store under ``fp_key`` (or, when the manifest cannot
        be recorded, write a verify-only marker there and take the verify path)."""
        self._trace()
        t0 = time.perf_counter()
        manifest, reason = manifest_for(self.calls, self.fp, self.imported, self.reads,
                                        self.read_reason)
        _stats.bump(fingerprint_seconds=time.perf_counter() - t0)
        if reason is not None:
            self._explain("verify-path", f"taking the verify path: {reason}")
            marker = {"kind": "verify-only", "function": f"{self.jf._module}.{self.jf._name}",
                      "signature": self.signature, "reason": reason, "created": time.time()}
            self._put(fp_key, marker, {})
            return self._verify_path(t_start)
        return self._compile_and_store(fp_key, manifest, t_start, leased=True)

    def _load(self, key: str, t_start: float) -> Loaded:
        """Look ``key`` up in the store: a hit (deserialized, ready to run), or why not."""
        t0 = time.perf_counter()
        try:
            blob = self.store.get(key)
        except (OSError, StoreError) as e:
            self._store_fault("read", e)
            return _UNUSABLE
        finally:
            _stats.bump(read_seconds=time.perf_counter() - t0)
        if blob is None:
            if not self._quiet:
                self._log_memory_reason()
                self._explain_persistent_miss(key)
            return _ABSENT
        got = self._use(key, blob, t_start)
        if got.outcome in (Outcome.STALE, Outcome.UNUSABLE) and key not in self.keep_keys:
            self.replace_keys.add(key)
        return got

    def _use(self, key: str, blob: bytes, t_start: float) -> Loaded:
        """Verify and deserialize the entry ``blob`` found under ``key``, or say why not."""
        try:
            entry = decode(blob, signing_key=self.cfg.signing_key,
                           old_keys=self.cfg.signing_keys_old, key=key)
        except UnverifiableEntry as e:
            # most likely a good entry of a signed fleet store, and this process the one
            # without the key: compile here, and leave the entry alone (never replaced)
            self.keep_keys.add(key)
            self._bad_entry(f"kiln: entry {short_key(key)} of {self.jf._name} in "
                            f"{self.store.url!r} is not loaded ({e})",
                            then="compiling here, leaving the entry as it is")
            return _UNUSABLE
        except EntryError as e:
            self._bad_entry(f"kiln: entry {short_key(key)} of {self.jf._name} in "
                            f"{self.store.url!r} is unusable ({e})")
            return _UNUSABLE
        header = entry.header
        if header.get("kind") == "verify-only":
            return Loaded(Outcome.VERIFY_ONLY)
        if header.get("kind") == "not-storable":
            self.replace_keys.add(key)  # (a real entry, if one can be made later, replaces it)
            if time.time() < float(header.get("expires", 0.0)):
                self.no_flight.add(key)
                self._explain("single-flight", f"{short_key(key)}: the process that compiled it "
                              f"could not store it ({header.get('reason', '?')}); compiling "
                              "here without waiting")
                return Loaded(Outcome.NOT_STORABLE)
            return _ABSENT
        if header.get("tier") == "noinline" and self.cfg.tier_up and self.jf._may_tier_up:
            # stored before its inlined form was ready: tier up in this process
            self.start_tier_up, self.key = True, key
        t0 = time.perf_counter()
        fun_globals = getattr(self.jf._fun, "__globals__", None)
        changed = check_manifest(
            header.get("manifest") or [],
            (self.jf._module, fun_globals) if isinstance(fun_globals, dict) else None,
        )
        _stats.bump(fingerprint_seconds=time.perf_counter() - t0)
        if changed is not None:
            self._explain("manifest", f"stored entry is stale: {changed}")
            return _STALE
        t0 = time.perf_counter()
        callbacks = None
        # the form the entry was compiled from (its "lowered" digest is of that form): an
        # inlined entry (tier-up) has other host callbacks than the not-inlined lowering
        inlined_form = header.get("tier") == "inlined"
        if header.get("callbacks") == "trace" or self.cfg.verify:
            lowered = self._lowering_of(inlined_form)
            digest = self.inlined_digest if inlined_form else self.lowered_facts[0]
            if digest != header.get("lowered"):
                if self.cfg.verify:
                    raise VerifyError(
                        f"KILN_VERIFY: stored entry {short_key(key)} of {self.jf._name} does not "
                        f"match a fresh lowering (stored module "
                        f"{short_key(header.get('lowered'))}, now {short_key(digest)}); kiln's key "
                        "missed a change. "
                        "Please report this with KILN_EXPLAIN=1 output."
                    )
                self._explain("lowered", "stored module differs from the fresh lowering")
                return _STALE
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
                return _STALE
        try:
            compiled = _jax_compat.load_compiled(
                entry.sections, callbacks, out_tree, lapack=bool(header.get("lapack", True)),
                inputs=self._input_objects(),
            )
            if "static_out" in entry.sections:
                if static_out is None:
                    static_out = _jax_compat.unpickle_tree(entry.sections["static_out"],
                                                           self._input_objects())
                compiled = _with_static_outputs(compiled, *static_out)
        except Exception as e:  # noqa: BLE001 - a bad entry must never crash the program
            self._bad_entry(f"kiln: entry {short_key(key)} of {self.jf._name} could not be loaded "
                            f"({type(e).__name__}: {e})")
            return _UNUSABLE
        load_s = time.perf_counter() - t0
        for message in header.get("warnings", ()):
            # JAX warns while lowering ("Some donated buffers were not usable"), which a
            # load skips: the same warning, as jax.jit gives it once per process and signature
            warnings.warn(str(message), UserWarning, stacklevel=user_stacklevel())
        _stats.bump(hits=1, load_seconds=load_s,
                      saved_seconds=max(0.0, float(header.get("compile_seconds", 0.0)) - load_s))
        logger.debug("kiln: hit %s %s (loaded in %.3f s)", self.jf._name, short_key(key), load_s)
        self.entries.append((self.store, key))
        return Loaded(Outcome.HIT, compiled)

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

    # -- derived facts of the traced program (each computed once, on first use) -----------
    @functools.cached_property
    def lowered_facts(self) -> tuple[str, bool]:
        """(sha256 of the not-inlined lowered module's text, whether it calls LAPACK): the
        verify path's key and the entry header's ``lowered`` / ``lapack``."""
        return _jax_compat.lowered_facts(self._trace_lower())

    @functools.cached_property
    def called_names(self) -> list[str]:
        """The kiln.noinline functions the traced program calls (for ``kiln ls``)."""
        return [] if self.traced is None else _noinline_p.called_names(self.traced.jaxpr.jaxpr)

    @functools.cached_property
    def inlined_size(self) -> int:
        """Equations of the traced program once its tier-up noinline calls are inlined."""
        assert self.traced is not None  # internal invariant: asked after tracing
        return _noinline_p.inlined_size(self.traced.jaxpr.jaxpr)

    @functools.cached_property
    def tier_up_candidate(self) -> bool:
        """Whether this (traced) program calls kiln.noinline functions that tier-up would
        inline, and is small enough once inlined; whether tier-up is on is separate."""
        assert self.traced is not None  # internal invariant: asked after tracing
        if not self.jf._may_tier_up or not _noinline_p.calls_in(self.traced.jaxpr.jaxpr):
            return False
        if self.inlined_size > MAX_EQUATIONS:
            self._explain(
                "tier-up",
                f"no tier-up: inlined, the program would have {self.inlined_size} equations "
                f"(more than {MAX_EQUATIONS}); it keeps calling its noinline functions",
            )
            return False
        return True

    @functools.cached_property
    def inline_directly(self) -> bool:
        """Whether to skip the host-callback tier: inlining the noinline calls makes the program
        at most ``DIRECT_RATIO`` times larger than its separately compiled pieces."""
        assert self.traced is not None  # internal invariant: asked after tracing
        separate = _noinline_p.separate_size(self.traced.jaxpr.jaxpr)
        if self.inlined_size > DIRECT_RATIO * separate:
            return False
        self._explain(
            "tier-up",
            f"compiling the program inlined directly: inlined it has {self.inlined_size} "
            f"equations, its separately compiled pieces {separate}",
        )
        return True

    # -- single-flight ----------------------------------------------------------------------
    def _await_or_lease(self, key: str, t_start: float) -> tuple[Loaded | None, Lease | None]:
        """Single-flight before compiling ``key``: one process compiles, the others wait for
        its entry. Returns (what another process stored: a HIT, or a verify-only marker; None)
        or (None, the lease this process now holds, or None where the store leases nothing or
        failed).

        A waiter polls the store; it takes the key over when the holder's lease runs out (the
        holder died: a local file lock is freed by the OS at once, a remote lease after
        ``lease_seconds``), and gives up waiting after ``lease_wait`` seconds.
        """
        if not isinstance(self.store, Leasable) or key in self.no_flight:
            return None, None
        cfg = self.cfg
        try:
            lease = self.store.lease(key, cfg.lease_seconds)
        except (OSError, StoreError) as e:
            # (a read-only store: no lease, and its put will say why it cannot store)
            logger.debug("kiln: no lease on %s in %r (%s)", short_key(key), self.store.url, e)
            return None, None

        def look() -> tuple[bool, Loaded | None]:
            self._quiet = True  # (polling: no miss explanations, no second warning)
            try:
                got = self._load(key, t_start)
            finally:
                self._quiet = False
            if got.outcome in (Outcome.HIT, Outcome.VERIFY_ONLY, Outcome.NOT_STORABLE):
                return True, got
            return got.outcome not in (Outcome.ABSENT, Outcome.STALE), None

        def waiting() -> contextlib.AbstractContextManager[None]:
            self._explain("single-flight", f"another process is compiling {short_key(key)} "
                          f"({self.signature}); waiting for its entry")
            return compiling(f"{self.jf._name} ({self.signature})", cfg.progress,
                             doing="waiting for another process compiling")

        try:
            flight = await_or_lease(lease, look, seconds=cfg.lease_seconds,
                                    wait=cfg.lease_wait, waiting=waiting)
        except (OSError, StoreError) as e:
            logger.debug("kiln: no lease on %s in %r (%s)", short_key(key), self.store.url, e)
            return None, None
        if flight.waited and flight.found is None:
            self._explain("single-flight", f"{short_key(key)}: no entry from the other process "
                          f"({'its lease ended' if flight.held else 'stopped waiting'}); "
                          "compiling it here")
        return flight.found, lease if flight.held else None

    def _compile_and_store(
        self, key: str, manifest: list[list[str]] | None, t_start: float, *, leased: bool = False
    ) -> Any:
        """Compile and store under ``key``, single-flight (``leased``: the caller already
        holds, or tried for, the key's lease)."""
        got, lease = (None, None) if leased else self._await_or_lease(key, t_start)
        if got is not None and got.outcome is Outcome.HIT:
            return got.executable
        with _holding(lease, self.cfg.lease_seconds):
            return self._compile_and_store_held(key, manifest, t_start)

    def _compile_and_store_held(
        self, key: str, manifest: list[list[str]] | None, t_start: float
    ) -> Any:
        self._log_memory_reason()
        self._trace()
        self.key = key
        candidate = self.tier_up_candidate
        self.start_tier_up = candidate and self.cfg.tier_up
        if self.start_tier_up and self.inline_directly:
            # lowered once, inlined: the not-inlined lowering is never made
            self.start_tier_up = False
            with compiling(f"{self.jf._name} ({self.signature})", self.cfg.progress):
                result = compile_and_store_inlined(
                    self, structs(self.leaves), t_start
                )
            _stats.bump(misses=1)
            return result
        lowered = self._trace_lower()
        # The header's facts (the lowered module's digest, the noinline calls) are Python work
        # XLA's compile does not wait on: computed on a thread while compile runs without the
        # GIL (~0.05 s of the Lotka-Volterra fit's cold start off the critical path).
        facts = threading.Thread(target=self._header_facts, name="kiln-header-facts",
                                 daemon=True)
        facts.start()
        t0 = time.perf_counter()
        try:
            with compiling(f"{self.jf._name} ({self.signature})", self.cfg.progress), \
                    kiln_compiling():
                compiled = _jax_compat.compile_to_store(lowered)
        finally:
            facts.join()
        compile_s = time.perf_counter() - t0
        total = time.perf_counter() - t_start
        _stats.bump(misses=1, compiles=1, compile_seconds=total)
        result, sections, mode = self._serialize(compiled)
        if sections is None:
            self._put_not_storable(key)
            return result
        header = self._header(mode, manifest, total, compile_s, *self.lowered_facts)
        if candidate:
            header["tier"] = "noinline"  # replaced by its inlined form after a tier-up
        self._put(key, header, sections)
        return result

    def _header_facts(self) -> None:
        try:
            self.lowered_facts, self.called_names  # noqa: B018 - cached on first use
        except Exception:  # noqa: BLE001, S110 - raised again where the header reads them
            pass

    def _serialize(self, compiled: Any) -> tuple[Any, dict[str, bytes] | None, str]:
        """(the callable, its entry sections or None when it cannot be stored, callbacks mode).
        Must run before the executable's first run (see ``serialize_compiled``)."""
        static_out = self.box.get(self.box_sig)
        result = compiled if static_out is None else _with_static_outputs(compiled, *static_out)
        try:
            inputs = self._input_objects()
            sections, mode = _jax_compat.serialize_compiled(compiled, inputs)
            if static_out is not None:
                sections["static_out"] = _jax_compat.pickle_tree(static_out, inputs)
        except _jax_compat.Unserializable as e:
            self._explain("unstorable", f"executable not stored: {e}")
            self.not_storable_reason = str(e)
            self._not_stored(str(e))
            return result, None, "none"
        return result, sections, mode

    def _put_not_storable(self, key: str | None) -> None:
        """Under the key this process just compiled and could not store (while it still holds
        the key's lease): a marker that lasts ``lease_seconds``. The processes waiting for the
        entry read it and compile at once, together, instead of taking the key over one after
        another (N waiters: N compiles in sequence; issue 24). Once it has expired a process
        tries to store the executable again (another version of a library may manage)."""
        if key is None:
            return
        now = time.time()
        marker = {"kind": "not-storable", "function": f"{self.jf._module}.{self.jf._name}",
                  "signature": self.signature, "reason": self.not_storable_reason,
                  "created": now, "expires": now + self.cfg.lease_seconds}
        self.replace_keys.add(key)  # (an expired marker may be there: a remote put keeps it)
        self._put(key, marker, {}, counted=False)

    def _not_stored(self, reason: str) -> None:
        """Never silent (issue 23): a function whose executable cannot be stored warns once per
        process with the reason and what to do, and leaves a marker (kind ``unstorable``) that
        ``kiln stats`` and ``kiln ls`` list."""
        jf = self.jf
        if getattr(jf, "_warned_not_stored", False):
            return
        jf._warned_not_stored = True  # type: ignore[attr-defined]
        warnings.warn(
            f"kiln: {jf._name}: its executable is not stored ({reason}), so every process "
            f"compiles it again; {_advice(reason)}",
            KilnWarning, stacklevel=user_stacklevel(),
        )
        function = f"{jf._module}.{jf._name}"
        marker = {"kind": "unstorable", "function": function, "signature": self.signature,
                  "reason": reason, "created": time.time()}
        key = make_key([("kind", "unstorable"), ("function", function)])
        try:
            self.store.put(key, encode({**marker, "key": key}, {},
                                       signing_key=self.cfg.signing_key))
        except (OSError, StoreError) as e:
            self._store_fault("write to", e)

    def _header(
        self, mode: str, manifest: list[list[str]] | None, total: float, compile_s: float,
        lowered: str, lapack: bool,
    ) -> dict[str, Any]:
        """The header of an executable entry (``manifest`` None: keyed by the lowered module;
        ``lowered``, ``lapack``: the facts of the module it was compiled from)."""
        header: dict[str, Any] = {
            "kind": "executable",
            "function": f"{self.jf._module}.{self.jf._name}",
            "signature": self.signature,
            "key_parts": [list(p) for p in self.base_parts],
            "fp_parts": [list(p) for p in self.fp.parts] if manifest is not None else [],
            "manifest": manifest or [],
            "callbacks": mode,
            "lowered": lowered,
            "lapack": lapack,
            "compile_seconds": total,
            "xla_compile_seconds": compile_s,
            "trace_seconds": self.trace_seconds,
            "created": time.time(),
        }
        if self.lower_warnings:
            header["warnings"] = self.lower_warnings  # replayed by every load (_use)
        if self.called_names:
            header["noinline"] = self.called_names  # for `kiln ls`: the noinline functions it calls
        return header

    def _put(self, key: str | None, header: dict[str, Any], sections: dict[str, bytes], *,
             counted: bool = True) -> None:
        if key is None:
            return
        blob = encode({**header, "key": key}, sections, signing_key=self.cfg.signing_key)
        write = self.store.put
        if key in self.replace_keys:  # (a remote store's put keeps what it holds)
            write = getattr(self.store, "replace", write)
        try:
            write(key, blob)
        except RemoteSkipped:
            return  # (a remote-only store skipped since its fault, warned about then)
        except (OSError, StoreError) as e:
            self._store_fault("write to", e)
            return
        if counted:
            _stats.bump(stores_written=1)
        if header.get("kind") == "executable":
            self.entries.append((self.store, key))



"""Executables: serialising and loading compiled programs (host callbacks and CPU kernels
included), what a lowering holds, JAX's persistent cache around kiln's compiles.

Part of the JAX gate (:mod:`kiln._base._jax_compat`)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import jax

from ._errors import Unserializable
from ._pickling import _Pickler, _Unpickler
from ._private import _compiler, _jax_config, _stages
from ._values import pickle_callbacks, pickle_tree, unpickle_callbacks, unpickle_tree

logger = logging.getLogger("kiln")

__all__ = [
    "host_callbacks",
    "lowered_facts",
    "serialize_compiled",
    "sections_for_trace",
    "load_compiled",
    "with_out_tree",
    "reset_compilation_cache",
    "no_persistent_cache_writes",
    "compile_to_store",
]


def host_callbacks(lowered: jax.stages.Lowered) -> list[Any]:
    """The Python callables a lowering registered as host callbacks, in registration order.

    ``Lowered._lowering.compile_args['host_callbacks']`` (jax 0.4.14+): the order is the one
    ``Client.deserialize_executable(..., host_callbacks=...)`` needs.
    """
    return list(lowered._lowering.compile_args.get("host_callbacks", ()))  # type: ignore[attr-defined]


def lowered_facts(lowered: jax.stages.Lowered) -> tuple[str, bool]:
    """(sha256 of the lowered StableHLO module's text, no debug locations; whether it calls
    jaxlib's LAPACK kernels: ``@lapack_*`` custom calls)."""
    text = lowered.as_text()
    return hashlib.sha256(text.encode()).hexdigest(), "@lapack_" in text


def serialize_compiled(
    compiled: jax.stages.Compiled, inputs: Sequence[Any] = (), *,
    live: Sequence[Any] = (), is_user: Callable[[Any], bool] | None = None,
    codes: Collection[Any] = (),
) -> tuple[dict[str, bytes], str]:
    """Split a freshly compiled program into entry sections.

    Must run before the executable's first execution (on CPU the executable of a program with
    a sort refuses to serialize once it has run: "UNIMPLEMENTED: `LessThan` is not
    serializable"; jax 0.10.2 and 0.12).

    Returns:
        (sections, callbacks_mode): sections ``exec`` (XLA executable bytes), ``meta`` (pickled
        call metadata: shardings, avals, layouts, args_info, out_tree) and, when the program has
        host callbacks that can be stored (:func:`pickle_callbacks`), ``callbacks``.
        ``callbacks_mode`` is ``"none"``, ``"stored"`` (warm start needs no tracing) or
        ``"trace"`` (the callables could not be stored without copying the user's objects: a
        warm start must trace and lower to rebuild them, then loads the executable instead of
        compiling). ``live``, ``is_user``, ``codes``: see :func:`pickle_callbacks`.

    Raises:
        Unserializable: the program closes over large constants (``const_args``) or mutable
            array refs, or its executable cannot be serialized.
    """
    executable = compiled._executable  # MeshExecutable (jax 0.4+)
    if id(executable) in _reloaded:
        raise Unserializable("XLA cannot serialize again an executable JAX's persistent cache "
                             "loaded (its kernels would be missing)")
    unloaded = getattr(executable, "_unloaded_executable", None)
    if unloaded is None:
        raise Unserializable("this executable kind does not support serialization")
    if compiled._params.const_args:
        raise Unserializable("the program closes over large constants (const_args)",
                             advice="pass the array it closes over as an argument (traced) or "
                             "as a static argument (by value)")
    if getattr(unloaded, "mut", None) is not None and unloaded.mut.in_mut:
        raise Unserializable("the program closes over a mutable array ref",
                             advice="pass the array ref as an argument")
    sections, mode = _callback_sections(list(unloaded.host_callbacks), live, is_user, codes)
    buf = io.BytesIO()
    pickler = _Pickler(buf, unloaded.host_callbacks, tuple(d.id for d in unloaded.device_list))
    try:
        pickler.dump((unloaded, compiled.args_info, None, compiled._no_kwargs))
    except Exception as e:  # noqa: BLE001
        raise Unserializable(f"{type(e).__name__}: {e}") from None
    sections["out_tree"] = pickle_tree(compiled.out_tree, inputs)
    if pickler.executable is None:  # pragma: no cover
        raise Unserializable("no XLA executable found in the compiled program")
    sections["exec"] = pickler.executable
    sections["meta"] = buf.getvalue()
    return sections, mode


def _callback_sections(callbacks: list[Any], live: Sequence[Any],
                       is_user: Callable[[Any], bool] | None,
                       codes: Collection[Any]) -> tuple[dict[str, bytes], str]:
    """(the ``callbacks`` section, if stored; callbacks mode) of a program's host callbacks
    (see :func:`serialize_compiled`)."""
    if not callbacks:
        return {}, "none"
    try:
        return {"callbacks": pickle_callbacks(callbacks, live, is_user, codes)}, "stored"
    except Unserializable as e:  # the callables must be rebuilt by tracing
        logger.debug("kiln: host callbacks rebuilt by tracing on a warm start: %s", e)
        return {}, "trace"


def sections_for_trace(
    sections: dict[str, bytes], callbacks: list[Any], out_tree: Any, static_out: Any,
    inputs: Sequence[Any] = (), *, live: Sequence[Any] = (),
    is_user: Callable[[Any], bool] | None = None, codes: Collection[Any] = (),
) -> tuple[dict[str, bytes], str]:
    """Another entry's executable (``sections``: its ``exec`` and ``meta``, of the same lowered
    module) with what this process's trace gives and the lowered module does not hold: host
    callbacks (from this lowering, bound to ``live``), the output tree and kiln.filter_jit's
    non-array outputs (``static_out``, or None) pickled against ``inputs``. Returns (sections,
    callbacks mode) as :func:`serialize_compiled` does; the executable is never serialized
    again (XLA would drop the kernels of a reloaded one)."""
    new, mode = _callback_sections(callbacks, live, is_user, codes)
    new.update(exec=sections["exec"], meta=sections["meta"],
               out_tree=pickle_tree(out_tree, inputs))
    if static_out is not None:
        new["static_out"] = pickle_tree(static_out, inputs)
    return new, mode


def load_compiled(
    sections: dict[str, bytes],
    callbacks: Sequence[Any] | None = None,
    out_tree: Any = None,
    *,
    lapack: bool = False,
    inputs: Sequence[Any] = (),
    live: Sequence[Any] = (),
) -> jax.stages.Compiled:
    """Rebuild a callable ``jax.stages.Compiled`` from entry sections (no trace, no compile).

    ``callbacks`` / ``out_tree``: from a fresh lowering when there is one (the verify path, or
    callables that could not be pickled); ``None`` takes them from the entry, the output tree's
    references to the inputs resolved in ``inputs`` (``input_objects`` of this call) and the
    callbacks' references to the user's objects in ``live`` (:func:`unpickle_callbacks`).
    ``lapack``: the executable calls LAPACK kernels, which must be registered first (~0.4 s, once).
    Only call this on sections whose entry digest has verified: it unpickles.
    """
    if lapack:
        _ensure_cpu_kernels()
    if callbacks is None:
        callbacks = unpickle_callbacks(sections["callbacks"], live) if "callbacks" in sections \
            else []
    unloaded, args_info, _, no_kwargs = _Unpickler(
        io.BytesIO(sections["meta"]), sections["exec"], list(callbacks)
    ).load()
    if out_tree is None:
        out_tree = unpickle_tree(sections["out_tree"], inputs)
    return _stages.Compiled(unloaded.load(), [], args_info, out_tree, no_kwargs=no_kwargs)


def with_out_tree(compiled: jax.stages.Compiled, out_tree: Any) -> jax.stages.Compiled:
    """``compiled`` returning ``out_tree`` (its flat outputs unflattened): tier-up compiles a
    program from its flat jaxpr and gives it the first executable's output structure."""
    return _stages.Compiled(
        compiled._executable, compiled._params.const_args, compiled.args_info, out_tree,
        no_kwargs=compiled._no_kwargs,
    )


_cpu_kernels_ready = False


def _ensure_cpu_kernels() -> None:
    """Register jaxlib's LAPACK kernels before loading a CPU executable that may call them.

    jax registers them lazily when it lowers a linalg op; a process that only loads an
    executable never lowers one, and the executable then crashes on its first LAPACK call
    (jax-ml/jax #28908). ``jax._src.lax.linalg.initialize_lapack`` (jax 0.4.30+).
    """
    global _cpu_kernels_ready
    if not _cpu_kernels_ready:
        from jax._src.lax import linalg as _linalg

        _linalg.initialize_lapack()
        _cpu_kernels_ready = True


def reset_compilation_cache() -> None:
    """Make JAX's persistent compilation cache read its configuration again at the next compile
    (it initializes once per process: ``jax._src.compilation_cache.reset_cache``)."""
    from jax._src import compilation_cache

    compilation_cache.reset_cache()


@contextlib.contextmanager
def no_persistent_cache_writes() -> Iterator[None]:
    """In this thread, JAX's persistent cache writes nothing: its minimum compile time to
    write (``jax_persistent_cache_min_compile_time_secs``, a thread-local override) is
    infinite. JAX checks it before it serializes and compresses the executable, so kiln's own
    compiles (stored in kiln's entry) are not serialized a second time for a write the route
    would drop (0.011 s for a small program, ``python benchmarks/cold_breakdown.py``; the
    Lotka-Volterra fit's 1.6 MB executable alone takes XLA 0.16 s to serialize)."""
    with _jax_config.persistent_cache_min_compile_time_secs(float("inf")):
        yield


# A CPU executable that JAX's persistent cache deserialized serializes again without its
# kernels: loading those bytes gives an executable that fails on its first run with "NOT_FOUND:
# Function <fusion> not found (type id: 1)" (jaxlib 0.10.2 and 0.12; JAX's own api_test
# test_jit_forwarding_correctness under kiln; the route in a multi-process job).
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_watch = threading.local()
_watch_lock = threading.Lock()
_watching = False
_reloaded: set[int] = set()  # ids of MeshExecutables compile_to_store could not get fresh


def _on_cache_event(event: str, **kwargs: Any) -> None:
    if event == _CACHE_HIT and getattr(_watch, "on", False):
        _watch.hit = True


def watch_cache_hits() -> None:
    """Listen for JAX's persistent-cache hits (``_watch.hit`` is set in the thread where one
    happens while ``_watch.on``)."""
    global _watching
    if not _watching:
        with _watch_lock:
            if not _watching:
                jax.monitoring.register_event_listener(_on_cache_event)
                _watching = True


# XLA executables kiln compiled in this process, by (module name, compile options, devices,
# client), each with its lowered module's digest: another lowering of the very same module (a
# signature that differs only where the module does not, weak types: evosax's ``ask`` called
# again with its state made strong) gets the executable XLA already made, as JAX's persistent
# cache would give it, and one kiln can serialize (a reloaded one it cannot). Each is held by a
# weak reference to JAX's ``MeshExecutable`` around it (XLA's executables take none): kiln keeps
# no executable alive that the program let go (``clear_cache``; JAX's api_test
# ``test_jit_cache_clear`` counts the client's live executables).
_same_module: OrderedDict[tuple[Any, ...], list[tuple[str, Any]]] = OrderedDict()
_SAME_MODULE_KEPT = 16
_same_lock = threading.Lock()
_compiling = threading.local()
# JAX's function as it was when kiln first compiled (a patch someone put there before is kept
# under kiln's; one put there after replaces kiln's, which is then never put back)
_ORIGINAL_BACKEND_COMPILE = _compiler.backend_compile_and_load
_reuse_installed = [False]


def _backend_compile_and_load(backend: Any, module: Any, executable_devices: Any, options: Any,
                              host_callbacks: Sequence[Any]) -> Any:
    """JAX's ``compiler.backend_compile_and_load``; inside :func:`compile_to_store` given the
    module's digest, an executable of the same module, options and devices made earlier in
    this process and still alive is given back instead of compiling it again (none with host
    callbacks: those are bound to one trace's Python objects)."""
    digest_of = getattr(_compiling, "digest_of", None)
    if digest_of is None or host_callbacks:
        return _ORIGINAL_BACKEND_COMPILE(backend, module, executable_devices, options,
                                         host_callbacks)
    key = (str(module.operation.attributes["sym_name"]), options.SerializeAsString(),
           tuple(d.id for d in executable_devices), id(backend))
    with _same_lock:
        earlier = [(d, ref()) for d, ref in _same_module.get(key, ())]
    earlier = [(d, mesh) for d, mesh in earlier if mesh is not None]
    if earlier:  # (the digest only where there is something to compare it with)
        digest = digest_of()
        for seen, mesh in earlier:
            if seen == digest:
                return mesh.xla_executable
    executable = _ORIGINAL_BACKEND_COMPILE(backend, module, executable_devices, options,
                                           host_callbacks)
    # (kept once JAX has wrapped it: compile_to_store)
    _compiling.made = (key, digest_of, executable)
    return executable


def _keep(compiled: Any) -> None:
    """Keep the executable this thread's compile made (if any) for another lowering of its
    module, by a weak reference to ``compiled``'s ``MeshExecutable``."""
    made, _compiling.made = getattr(_compiling, "made", None), None
    mesh = getattr(compiled, "_executable", None)
    if made is None or getattr(mesh, "xla_executable", None) is not made[2]:
        return
    key, digest_of, _ = made
    digest = digest_of()  # (most often made already, on the header's thread, during compile)
    with _same_lock:
        kept = [(d, r) for d, r in _same_module.get(key, ()) if r() is not None]
        _same_module[key] = [*kept, (digest, weakref.ref(mesh))]
        _same_module.move_to_end(key)
        while sum(len(v) for v in _same_module.values()) > _SAME_MODULE_KEPT:
            oldest = next(iter(_same_module))
            _same_module[oldest].pop(0)
            if not _same_module[oldest]:
                del _same_module[oldest]


def compile_to_store(lowered: Any, digest_of: Callable[[], str] | None = None) -> Any:
    """``lowered.compile()``, never an executable JAX's persistent cache deserialized.

    kiln serializes what it compiles into its entry; XLA serializes a reloaded executable
    without its kernels, so an entry made from a JAX cache hit would crash every later load.
    A hit (``jax.monitoring`` event ``/jax/compilation_cache/cache_hits`` in this thread) is
    compiled again with a compiler option at its default value
    (``xla_embed_ir_in_executable=False``): the same executable under another JAX cache key,
    so XLA compiles it.

    ``digest_of``: gives the sha256 of the lowered module's text (:func:`lowered_facts`). With
    it, a module this process compiled before (same text, compile options and devices, no host
    callbacks) is not compiled again: XLA's executable is shared, wrapped by JAX for this
    lowering (its avals, weak types and output tree).
    """
    watch_cache_hits()
    if not _reuse_installed[0]:
        global _ORIGINAL_BACKEND_COMPILE
        with _same_lock:
            if not _reuse_installed[0]:
                _ORIGINAL_BACKEND_COMPILE = _compiler.backend_compile_and_load
                _compiler.backend_compile_and_load = _backend_compile_and_load
                _reuse_installed[0] = True
    _watch.on, _watch.hit = True, False
    _compiling.digest_of, _compiling.made = digest_of, None
    try:
        compiled = lowered.compile()
        if not _watch.hit:
            if digest_of is not None:
                _keep(compiled)
            return compiled
        _watch.hit = False
        compiled = lowered.compile(compiler_options={"xla_embed_ir_in_executable": False})
        if _watch.hit:  # a JAX cache value under that key too: runs, but is never stored
            _reloaded.add(id(compiled._executable))
        return compiled
    finally:
        _watch.on = False
        _compiling.digest_of, _compiling.made = None, None

"""Everything kiln needs from JAX's private modules, in one place (checked on jax 0.10.2).

Each private name used here says what it is and since when it has that shape. Nothing else in
kiln imports ``jax._src``; when jax changes, this is the one file to port.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import logging
import os
import pickle
import re
import sys
import threading
import types
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import cloudpickle
import jax

# jax._src.cache_key: JAX's persistent-cache key. _hash_serialized_compile_options(hash,
# options, strip_device_assignment) digests compile options with the debug options that do not
# change the executable (dump paths and switches, the CUDA path, the forced CPU device count)
# cleared, and xla_flags_to_exclude_from_cache_key names the same flags as XLA_FLAGS words;
# both in jax 0.10.2 and 0.12 (checked; the lists grow: 0.12 adds the GPU autotune-cache dir).
from jax._src import cache_key as _cache_key

# jax._src.compiler.get_compile_options(num_replicas, num_partitions, device_assignment,
# env_options_overrides, fdo_profile, detailed_logging, backend): the xla_client.CompileOptions
# jax builds from its config for every compile (pxla.create_compile_options calls it per
# program); these keywords in jax 0.10.2 and 0.12 (checked; older versions not).
from jax._src import compiler as _compiler

# jax._src.config.trace_context / trace_context_names: the tuple of config values that jax's
# own jit cache keys on (x64, default matmul precision, dtype promotion, ...). Names since
# jaxlib extension 455 (jax 0.7); both present in 0.10.2.
from jax._src import config as _jax_config

# jax._src.{core,dtypes,sharding_impls,tree_util}: abstract_token, extended dtypes,
# physical_sharding and the C++ dispatch registry, as used by create_cpp_call (jax 0.10.2).
from jax._src import core as _core
from jax._src import dtypes as _dtypes
from jax._src import sharding_impls as _sharding_impls

# jax._src.stages.Compiled(executable, const_args, args_info, out_tree, no_kwargs): the AOT
# compiled object whose __call__ has a C++ fast path. Constructor shape as of jax 0.8-0.10.
from jax._src import stages as _stages
from jax._src import tree_util as _tree_util

# jax._src.xla_bridge: backends_are_initialized() and _init_backend(platform), which makes one
# backend through its factory: the moment XLA reads XLA_FLAGS (once per process; libtpu reads
# LIBTPU_INIT_ARGS as it starts); xla_bridge.backends() calls it by its module-global name.
# Both in jax 0.10.2 and 0.12 (checked).
from jax._src import xla_bridge as _xla_bridge

# jax._src.interpreters.pxla: MeshExecutable internals for the C++ dispatch fast path
# (ExecuteReplicated, MeshExecutableFastpathData, JitGlobalCppCacheKeys, cc_shard_arg,
# reflatten_outputs_for_dispatch); shapes as of jax 0.8-0.10 (see MeshExecutable.create_cpp_call).
from jax._src.interpreters import pxla as _pxla

# jax._src.lib._jax.pjit: the C++ jit dispatcher (signature check + executable call in C++).
from jax._src.lib import _jax as _jaxlib_ext

# jax._src.lib.xla_client: Client, Device, DeviceList, LoadedExecutable types (jaxlib 0.4+).
from jax._src.lib import xla_client as _xc

# jaxlib's concrete array class (``jax.Array`` is its abstract base): exact type checks on the
# hot path. Exposed as xla_client.ArrayImpl since jaxlib 0.4.
ArrayImpl = _xc.ArrayImpl

# jax._src.core's Primitive, jaxpr_as_fun and jaxprs_in_params: what ``jax.extend.core``
# re-exports (0.4 to 0.12). Taken from jax._src.core, already imported by jax, because importing
# ``jax.extend`` imports all of it, pallas included: 18 ms of every ``import kiln``.
Primitive = _core.Primitive
jaxpr_as_fun = _core.jaxpr_as_fun

__all__ = [  # every name kiln uses (the rest is private to this shim)
    "ArrayImpl",
    "Primitive",
    "jaxpr_as_fun",
    "InternalFloatingPointError",
    "Unserializable",
    "apply_local_config",
    "at_top_level",
    "broadcast_prefix",
    "codes_in_jaxpr",
    "compile_options_digest",
    "eqns_in",
    "flags_at_backend_start",
    "flags_left_out_of_jax_key",
    "host_callbacks",
    "is_tracer",
    "api_boundary",
    "on_clear_caches",
    "traced_extra_inputs",
    "give_debug_info",
    "jit_disabled",
    "load_compiled",
    "local_config",
    "lowered_facts",
    "lowered_text",
    "make_dispatcher",
    "compile_to_store",
    "input_objects",
    "pickle_tree",
    "unpickle_tree",
    "fun_name",
    "no_persistent_cache_writes",
    "write_from_every_process",
    "ordered_effects",
    "pickle_value",
    "primitive_rules",
    "primitives_in",
    "primitives_named",
    "pytree_differences",
    "pytree_node_functions",
    "raise_floating_point_error",
    "reset_compilation_cache",
    "sections_for_trace",
    "serialize_compiled",
    "sharding_text",
    "trace_context",
    "trace_context_token",
    "unpickle_value",
    "uses_lapack",
    "unpickle_callbacks",
    "with_out_tree",
    "LiveObjectMissing",
]

_ADDR = re.compile(r" at 0x[0-9a-fA-F]+")
logger = logging.getLogger("kiln")


class Unserializable(Exception):
    """This compiled program cannot be written as an entry (and why).

    ``advice``: what the user can do about it (the warning says it), or ``""``."""

    def __init__(self, reason: str, advice: str = "") -> None:
        super().__init__(reason)
        self.advice = advice


class LiveObjectMissing(Exception):
    """A stored host callback refers to a live object this process's walk did not give (the
    callbacks are then rebuilt by tracing: :func:`unpickle_callbacks`)."""


def trace_context_token() -> Any:
    """A hashable token of jax's trace context (for in-process cache keys; ~0.4 us)."""
    return _jax_config.trace_context()


def trace_context() -> list[tuple[str, str]]:
    """(name, repr) of every jax config value that changes tracing, addresses stripped."""
    values = _jax_config.trace_context()
    try:
        names = list(_jax_config.trace_context_names())
    except NotImplementedError:  # pragma: no cover - older jaxlib
        names = [f"trace_context[{i}]" for i in range(len(values))]
    return [(n, _context_text(v)) for n, v in zip(names, values, strict=True)]


def _context_text(v: Any) -> str:
    """Canonical text of one trace-context value: its repr, except for objects whose repr is
    only an address (``jax._src.core.AxisEnv``: the axis names and sizes of enclosing
    ``vmap`` / ``shard_map`` / ``pmap``, which ``jax.lax.axis_size`` reads), spelled out by
    their slots or attributes, sets sorted (no order from the hash seed)."""
    text = repr(v)
    if " object at 0x" not in text:
        return _ADDR.sub("", text)
    fields = [f for f in getattr(type(v), "__slots__", ()) if f != "__weakref__"] or sorted(
        getattr(v, "__dict__", {}))
    parts = []
    for f in fields:
        item = getattr(v, f, None)
        if isinstance(item, set | frozenset):
            item = sorted(map(repr, item))
        elif item is not None and hasattr(item, "items"):
            item = sorted((repr(k), repr(x)) for k, x in item.items())
        parts.append(f"{f}={_ADDR.sub('', repr(item))}")
    return f"{type(v).__module__}.{type(v).__qualname__}({', '.join(parts)})"


_OPTIONS_CACHE: list[Any] = [None, ""]  # [the config values it was made under, the digest]

# debug options that hold paths into JAX's cache directory while JAX's persistent cache is on
# (get_compile_options, jax 0.10 to 0.12; jax 0.12's cache key clears the first, 0.10's none):
# kiln's keys never depend on where a store lives
_CACHE_PATH_OPTIONS = ("xla_gpu_per_fusion_autotune_cache_dir", "xla_gpu_kernel_cache_file")


def compile_options_digest(backend: Any) -> str:
    """sha256 hex of the compile options JAX gives XLA for a program on ``backend``, as JAX's
    own cache key digests them.

    They come from JAX's own ``get_compile_options`` (every config option that feeds the
    compile: ``jax_disable_most_optimizations``, the optimization and memory-fitting efforts and
    levels, ``jax_compiler_enable_remat_pass``, the shardy partitioner, the XLA-AutoFDO profile
    version, ...), and their debug options are XLA's flags as XLA parsed them when the backend
    started (``XLA_FLAGS``, a flags file by its contents). Cleared as JAX's cache key clears
    them: what does not change the executable (dump settings, the CUDA path, the forced CPU
    device count). Cleared by kiln too: the paths into JAX's cache directory (the ``kiln://``
    route's, or another), and what the key holds elsewhere: the device assignment and counts
    (made for one device here; shardings and devices are in the signature), a program's own
    ``compiler_options`` (``jit:compiler_options``), and whether XLA logs in detail (JAX decides
    by the program's size; it only changes logs).

    Remade only when a jax config value changed since the last call: it runs on every miss of
    the process's table, and costs 62-74 us to make, 7-10 us when reused (the config values
    read and compared; medians of 3 runs of ``python benchmarks/compile_options_digest.py`` on
    a busy 2-core machine).
    """
    # jax.config._value_holders: option name -> its State or Flag, every jax config option
    # (jax 0.10.2 and 0.12); .value is this thread's value. The public jax.config.values builds a
    # dict of the same values (slower)
    holders = jax.config._value_holders  # type: ignore[attr-defined]
    values = tuple([h.value for h in holders.values()])
    cached = _OPTIONS_CACHE
    try:
        if cached[0] is not None and cached[0] == values:
            return str(cached[1])
    except Exception:  # noqa: BLE001 - a config value that does not compare: make it again
        pass
    options = _compiler.get_compile_options(
        num_replicas=1, num_partitions=1, detailed_logging=True, backend=backend)
    debug = options.executable_build_options.debug_options  # (options must outlive it)
    for name in _CACHE_PATH_OPTIONS:
        if hasattr(debug, name):  # set even when empty: a field set serializes apart
            setattr(debug, name, "")  # from one never set (jaxlib 0.10.2)
    h = hashlib.sha256()
    _cache_key._hash_serialized_compile_options(h, options, strip_device_assignment=True)
    digest = h.hexdigest()
    _OPTIONS_CACHE[:] = [values, digest]
    return digest


def flags_left_out_of_jax_key() -> frozenset[str]:
    """The XLA flags (``--name``) JAX's own cache key leaves out: dump settings and others that
    do not change the executable (``cache_key.xla_flags_to_exclude_from_cache_key``)."""
    return frozenset(getattr(_cache_key, "xla_flags_to_exclude_from_cache_key", ()))


_FLAG_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
_start_flags: dict[str, str] | None = None
_start_lock = threading.Lock()


def _flags_text(value: str) -> str:
    """The text XLA parses flags from for an environment variable's ``value``: the value when
    it starts (after white space) with ``-``, else the contents of the file it names (XLA's
    ``parse_flags_from_env.cc``; XLA has no ``--flagfile=``: it stops on it as an unknown flag)."""
    if not value.strip(" \t\r\n") or value.lstrip(" \t\r\n").startswith("-"):
        return value
    try:
        with open(value, encoding="utf-8", errors="surrogateescape") as f:
            return f.read()
    except OSError:  # XLA stops the process on it (XLA_FLAGS); libtpu: keep the text
        return value


def _capture_start_flags() -> dict[str, str]:
    global _start_flags
    with _start_lock:
        if _start_flags is None:  # XLA reads its flags once per process: a later backend
            # (after jax.clear_backends(), another platform) runs under the first ones
            flags = {var: _flags_text(os.environ.get(var, "")) for var in _FLAG_VARIABLES}
            prefixes = ("--xla", *getattr(_cache_key, "get_flag_prefixes", list)())
            flags["argv"] = " ".join(a for a in sys.argv if a.startswith(prefixes))
            _start_flags = flags
        return _start_flags


def flags_at_backend_start() -> dict[str, str]:
    """The text of ``XLA_FLAGS`` and ``LIBTPU_INIT_ARGS`` (a file's contents where the value
    names a file) as JAX's first backend started, and the ``--xla`` words of ``sys.argv``
    (JAX's cache key holds them too) at that moment.

    XLA reads its flags once, as the first backend starts; a change of ``os.environ`` after
    that never reaches it, and a flags file can change after it was read. kiln is imported
    before the backend starts in most programs (nothing in ``import kiln`` starts it): the
    wrapper of ``xla_bridge._init_backend`` takes the values right before the factory reads
    them. When the backend already ran before kiln was imported, the values at kiln's import
    are the best evidence left (a change in between is not seen here; the flags XLA parsed
    still reach the key through the compile options' debug options:
    :func:`compile_options_digest`).
    """
    # (taken now if the hook never ran: jax moved _init_backend, the values now are the evidence)
    return dict(_start_flags if _start_flags is not None else _capture_start_flags())


def _install_start_hook() -> None:
    original = getattr(_xla_bridge, "_init_backend", None)
    if callable(original) and not getattr(original, "_kiln_wrapped", False):
        def _init_backend(platform: str) -> Any:
            _capture_start_flags()
            return original(platform)

        _init_backend._kiln_wrapped = True  # type: ignore[attr-defined]
        _xla_bridge._init_backend = _init_backend
    try:
        started = _xla_bridge.backends_are_initialized()
    except Exception:  # noqa: BLE001 - a jax without it: take the values at first use
        started = False
    if started:
        _capture_start_flags()  # XLA read its flags before kiln was imported


_install_start_hook()


def local_config() -> list[tuple[Any, Any]]:
    """This thread's jax config overrides (``jax.enable_x64(True)`` blocks, ``default_device``,
    ...): config states are thread-local, so work done for this thread in another thread (a
    tier-up) must apply them there (:func:`apply_local_config`)."""
    unset = _jax_config.config_ext.unset
    out = []
    for state in _jax_config.config_states.values():
        value = state.get_local()
        if value is not unset:
            out.append((state, value))
    return out


@contextlib.contextmanager
def apply_local_config(items: list[tuple[Any, Any]]) -> Iterator[None]:
    """Enter the thread-local config overrides ``items`` in this thread (as ``State(value)``
    context managers do, jax 0.10.2 ``config.StateContextManager``)."""
    unset = _jax_config.config_ext.unset
    previous = []
    try:
        for state, value in items:
            previous.append((state, state.swap_local(value)))
            if state._update_thread_local_hook:
                state._update_thread_local_hook(value)
        yield
    finally:
        for state, prev in reversed(previous):
            state.set_local(prev)
            if state._update_thread_local_hook:
                state._update_thread_local_hook(None if prev is unset else prev)


def ordered_effects(effects: Any) -> list[Any]:
    """The ordered effects among ``effects`` (``jax.debug.print(..., ordered=True)``,
    ``io_callback(..., ordered=True)``): they thread a runtime token through the program."""
    from jax._src import effects as _effects

    return list(_effects.ordered_effects.filter_in(effects))


def sharding_text(sharding: Any) -> str:
    """A canonical description of a sharding for keys: its repr without memory addresses,
    plus the device ids it spans."""
    ids = sorted(d.id for d in sharding.device_set)
    return f"{_ADDR.sub('', repr(sharding))}{ids}"


def union_vma(avals: Sequence[Any]) -> frozenset[Any]:
    """The mesh axes (inside a ``shard_map`` body) any of ``avals`` varies over:
    ``ShapedArray.manual_axis_type.varying`` (jax 0.10 and 0.12; ``ShapedArray.vma`` on jax
    0.6 to 0.9). Empty outside a ``shard_map`` body."""
    out: frozenset[Any] = frozenset()
    for a in avals:
        mat = getattr(a, "manual_axis_type", None)
        out |= mat.varying if mat is not None else getattr(a, "vma", frozenset())
    return out


def with_vma(aval: Any, vma: frozenset[Any], like: Sequence[Any]) -> Any:
    """``aval`` varying over the mesh axes ``vma`` (see :func:`union_vma`), on the (abstract,
    manual) mesh of the operands ``like`` (jax 0.10+ requires a sharding with a mesh for a
    non-empty ``manual_axis_type``), replicated over its other axes."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is None:
        return aval.update(vma=vma)
    src = next(a for a in like if getattr(a, "manual_axis_type", None) is not None
               and a.manual_axis_type.varying)
    spec = jax.sharding.PartitionSpec(*([None] * len(aval.shape)))
    return aval.update(sharding=jax.sharding.NamedSharding(src.sharding.mesh, spec),
                       manual_axis_type=src.manual_axis_type.update(varying=vma))


def default_device_text() -> str:
    """The device a program with no committed argument runs on in this process: the
    ``jax_default_device`` setting, else this process's first local device (its id is global:
    another process of a ``jax.distributed`` job has another one)."""
    d = jax.config.jax_default_device or jax.local_devices()[0]  # type: ignore[attr-defined]
    if isinstance(d, str):  # a platform name ("cpu")
        d = jax.local_devices(backend=d)[0]
    return f"{d.platform}:{d.id}"


def jit_disabled() -> bool:
    """``jax.disable_jit()`` is in force (``jax_disable_jit`` config)."""
    return bool(_jax_config.disable_jit.value)


def host_callbacks(lowered: jax.stages.Lowered) -> list[Any]:
    """The Python callables a lowering registered as host callbacks, in registration order.

    ``Lowered._lowering.compile_args['host_callbacks']`` (jax 0.4.14+): the order is the one
    ``Client.deserialize_executable(..., host_callbacks=...)`` needs.
    """
    return list(lowered._lowering.compile_args.get("host_callbacks", ()))  # type: ignore[attr-defined]


def lowered_text(lowered: jax.stages.Lowered) -> str:
    """The lowered StableHLO module as text (no debug locations), for audit digests."""
    return lowered.as_text()


def lowered_facts(lowered: jax.stages.Lowered) -> tuple[str, bool]:
    """(sha256 of the lowered module's text, whether it calls LAPACK)."""
    text = lowered_text(lowered)
    return hashlib.sha256(text.encode()).hexdigest(), uses_lapack(text)


_singletons: dict[type, dict[int, str]] = {}
_NOT_SINGLETON_MODULES = frozenset({"builtins", "numpy", "jaxlib._jax", "jax._src.tree_util"})


def _singleton_id(obj: Any) -> tuple[str, str, str] | None:
    """("global", module, name) for a module-level instance such as equinox's ``MISSING``.

    Sentinels compared by identity (``x is MISSING``) must unpickle as the very same object,
    not a copy; pytree aux data holds them (equinox ``_Missing``).
    """
    t = type(obj)
    if not isinstance(obj, type | types.FunctionType | types.BuiltinFunctionType):
        named = _named_global(obj)  # jax.nn.relu: a custom_jvp named in its own module
        if named is not None:
            return ("global", *named)
    module = getattr(t, "__module__", None)
    if module is None or module in _NOT_SINGLETON_MODULES or isinstance(obj, type):
        return None
    table = _singletons.get(t)
    if table is None:
        mod = sys.modules.get(module)
        table = {}
        for name, v in (list(vars(mod).items()) if mod is not None else []):
            if type(v) is t:
                table[id(v)] = name
        _singletons[t] = table
    found = table.get(id(obj))
    if found is None or getattr(sys.modules.get(module), found, None) is not obj:
        return None
    return ("global", module, found)


def _load_singleton(pid: Any) -> Any:
    _, module, name = pid
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _named_global(obj: Any) -> tuple[str, str] | None:
    """``(module, qualname)`` when importing that name gives back ``obj`` itself."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    target: Any = sys.modules.get(module)
    for part in qualname.split("."):
        target = getattr(target, part, None) if target is not None else None
    return (module, qualname) if target is obj else None


class _Pickler(pickle.Pickler):
    """Pickles an UnloadedMeshExecutable with the XLA executable, devices and client as ids."""

    def __init__(self, file: io.BytesIO, callbacks: list[Any],
                 devices: tuple[int, ...] | None = None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._callbacks = callbacks
        self._devices = devices
        self.executable: bytes | None = None

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _xc.LoadedExecutable):
            self.executable = obj.client.serialize_executable(obj)
            # the program's global device assignment (UnloadedMeshExecutable.device_list), as
            # JAX's cache deserializes with it: in a multi-process job each process then loads
            # the executable onto its own local devices (its local_devices() are only the
            # compiling process's)
            ids = self._devices or tuple(d.id for d in obj.local_devices())
            return ("exec", ids)
        if isinstance(obj, _xc.Device):
            return ("device", obj.id)
        if isinstance(obj, _xc.Client):
            return ("client",)
        if isinstance(obj, _xc.DeviceList):
            return ("devices", tuple(d.id for d in obj))
        if obj is self._callbacks:
            return ("callbacks",)
        for i, cb in enumerate(self._callbacks):
            if obj is cb:  # a callback also held elsewhere (emit_python_callback's keepalive)
                return ("callback", i)
        return _singleton_id(obj)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, executable: bytes, callbacks: list[Any]) -> None:
        super().__init__(file)
        self._backend = jax.devices()[0].client
        self._by_id = {d.id: d for d in self._backend.devices()}
        self._executable = executable
        self._callbacks = callbacks

    def persistent_load(self, pid: Any) -> Any:
        kind = pid[0]
        if kind == "exec":
            # the devices the executable was compiled for (one for a single-device program)
            ids = pid[1] if len(pid) > 1 else tuple(self._by_id)
            devices = _xc.DeviceList(tuple(self._by_id[i] for i in ids))
            return self._backend.deserialize_executable(
                self._executable, devices, None, host_callbacks=self._callbacks
            )
        if kind == "device":
            return self._by_id[pid[1]]
        if kind == "client":
            return self._backend
        if kind == "devices":
            return _xc.DeviceList(tuple(self._by_id[i] for i in pid[1]))
        if kind == "callbacks":
            return self._callbacks
        if kind == "callback":
            return self._callbacks[pid[1]]
        if kind == "global":
            return _load_singleton(pid)
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


_ATOMS = (str, bytes, int, float, bool, complex, type(None))
_PyTreeDef = type(jax.tree_util.tree_structure(0))


def input_objects(treedef: Any, statics: Sequence[tuple[Any, Any]] = ()) -> list[Any]:
    """The objects a call's inputs hold outside their arrays, in a fixed order: each node's
    class and auxiliary data in ``treedef`` (a flax ``TrainState``'s ``apply_fn`` and ``tx``, a
    dict's keys) and the static arguments' values, with the items of tuples, lists and dicts among
    them. Two calls under one key give equal lists (the key holds them by value).

    Tree structures among the static values (equinox's ``filter_jit`` under the jax.jit swap
    passes ``(static leaves, treedef)`` pairs: the class of a Module defined in a function is in
    that treedef) are walked as ``treedef`` is, after everything else, so that the positions
    of what comes before stay those of entries written before they were walked."""
    out: list[Any] = []
    static_trees: list[Any] = []

    def add(obj: Any, depth: int) -> None:
        if isinstance(obj, _ATOMS) or depth > 8:
            return
        out.append(obj)
        if isinstance(obj, _PyTreeDef):
            static_trees.append(obj)
        elif isinstance(obj, tuple | list):
            for item in obj:
                add(item, depth + 1)
        elif isinstance(obj, dict):
            for item in obj.values():
                add(item, depth + 1)

    def walk(td: Any) -> None:
        data = td.node_data()
        if data is not None:
            add(data[0], 0)  # the node's class (an equinox Module defined in a function)
            add(data[1], 0)
        for child in td.children():
            walk(child)

    walk(treedef)
    for _, value in statics:
        add(value, 0)
    for tree in static_trees:
        walk(tree)
    return out


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
    device_list = getattr(unloaded, "device_list", None)  # jax 0.4.31+: a DeviceList
    pickler = _Pickler(buf, unloaded.host_callbacks,
                       tuple(d.id for d in device_list) if device_list is not None else None)
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


def uses_lapack(lowered_text: str) -> bool:
    """The lowered module calls jaxlib's LAPACK kernels (``@lapack_*`` custom calls)."""
    return "@lapack_" in lowered_text


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
    cbs = list(callbacks)
    unloaded, args_info, _, no_kwargs = _Unpickler(
        io.BytesIO(sections["meta"]), sections["exec"], cbs
    ).load()
    tree = out_tree
    if tree is None:
        tree = unpickle_tree(sections["out_tree"], inputs)
    return _stages.Compiled(unloaded.load(), [], args_info, tree, no_kwargs=no_kwargs)


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


def eqns_in(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` and of its sub-jaxprs (scan, while, cond, custom_jvp, pjit
    bodies), each sub-jaxpr once."""

    stack, seen = [jaxpr], set()
    while stack:
        j = stack.pop()
        if id(j) in seen:
            continue
        seen.add(id(j))
        for eqn in j.eqns:
            yield eqn
            stack.extend(getattr(s, "jaxpr", s) for s in _core.jaxprs_in_params(eqn.params))


def codes_in_jaxpr(closed_jaxpr: Any) -> set[Any]:
    """Code objects of every Python frame that emitted an equation of ``closed_jaxpr``.

    Each equation's ``source_info.traceback`` (jax 0.4+) is a jaxlib ``Traceback`` holding the
    full Python stack at the moment the primitive was bound; ``raw_frames()`` returns its code
    objects. Sub-jaxprs (scan, while, cond, custom_jvp, pjit bodies) are walked too. Far cheaper
    than a ``sys.settrace`` hook while tracing (which doubled a diffrax program's trace time).
    """
    codes: set[Any] = set()
    seen_tb: set[int] = set()
    for eqn in eqns_in(closed_jaxpr.jaxpr):
        tb = getattr(eqn.source_info, "traceback", None)
        if tb is not None and id(tb) not in seen_tb:
            seen_tb.add(id(tb))
            codes.update(tb.raw_frames()[0])
    return codes


# The rule registries of jax's interpreters: module-level dicts keyed by Primitive in jax's
# own modules (jax 0.4-0.10: ``jax._src.interpreters.mlir._lowerings`` and
# ``_platform_specific_lowerings[platform]``, ``ad.primitive_jvps`` / ``primitive_transposes``
# / ``fancy_transposes``, ``batching.fancy_primitive_batchers`` (``primitive_batchers`` is a
# view of it), ``partial_eval.custom_partial_eval_rules`` / ``dce_rules`` / ..., state
# discharge rules, ...). Found by scanning the modules rather than listed, so a registry jax
# adds is keyed too: a dict counts when a key is a Primitive (or, one level down, a key of
# each of its dict values); empty dicts are looked at again on each use until they fill.
_registries: dict[int, tuple[str, dict[Any, Any], bool]] = {}  # id -> (name, dict, nested)
_registry_candidates: dict[int, tuple[str, dict[Any, Any]]] = {}  # empty so far
_scanned: set[str] = set()
_registries_lock = threading.Lock()


def _is_registry(d: dict[Any, Any]) -> bool | None:
    """True: keyed by primitives; "nested": False (see _scan); None: cannot tell (empty)."""
    if not d:
        return None
    return isinstance(next(iter(d)), _core.Primitive)


_registry_list: list[tuple[str, dict[Any, Any], bool]] = []
_modules_scanned = 0  # len(sys.modules) at the last scan (modules are scanned once each)


def _scan_registries() -> list[tuple[str, dict[Any, Any], bool]]:
    global _modules_scanned, _registry_list
    if len(sys.modules) == _modules_scanned and not any(
            v for _, v in _registry_candidates.values()):
        return _registry_list
    with _registries_lock:
        _modules_scanned = len(sys.modules)
        for modname, mod in list(sys.modules.items()):
            # (jax._src holds every registry; ``jax.interpreters.*`` re-export some of them)
            if modname in _scanned or not modname.startswith("jax._src."):
                continue
            _scanned.add(modname)
            if not isinstance(mod, types.ModuleType):
                continue
            for attr, v in list(vars(mod).items()):
                if not isinstance(v, dict) or id(v) in _registries:
                    continue
                where = f"{modname.replace('jax._src.', '')}.{attr}"
                kind = _is_registry(v)
                if kind is None:
                    _registry_candidates[id(v)] = (where, v)
                elif kind:
                    _registries[id(v)] = (where, v, False)
                elif all(isinstance(x, dict) for x in v.values()) and any(
                        _is_registry(x) for x in v.values()):
                    _registries[id(v)] = (where, v, True)  # by platform
        for i, (where, v) in list(_registry_candidates.items()):
            if v:
                del _registry_candidates[i]
                if _is_registry(v):
                    _registries[i] = (where, v, False)
        _registry_list = sorted(_registries.values(), key=lambda r: r[0])
        return _registry_list


def primitive_rules(prim: Any) -> list[tuple[str, Any]]:
    """``(registry, rule)`` for every rule jax's registries hold for primitive ``prim``
    (``mlir._lowerings``, ``mlir._platform_specific_lowerings['cpu']``, ``ad.primitive_jvps``,
    ...), in registry-name order."""
    out = []
    for where, d, nested in _scan_registries():
        if nested:
            for platform, inner in sorted(d.items(), key=lambda kv: str(kv[0])):
                if isinstance(inner, dict) and prim in inner:
                    out.append((f"{where}[{platform!r}]", inner[prim]))
        elif prim in d:
            out.append((where, d[prim]))
    return out


def primitives_named(names: set[str]) -> dict[str, list[Any]]:
    """For each of ``names``, the primitives of that name that some registry holds rules for
    (the primitives a stored program's manifest names, found again in this process), in
    registry order."""
    out: dict[str, list[Any]] = {}
    for _, d, nested in _scan_registries():
        for inner in (d.values() if nested else (d,)):
            for p in inner if isinstance(inner, dict) else ():
                name = getattr(p, "name", None)
                if name in names:
                    found = out.setdefault(name, [])
                    if not any(p is q for q in found):
                        found.append(p)
    return out


def primitives_in(closed_jaxpr: Any) -> list[Any]:
    """Every primitive bound in ``closed_jaxpr`` and its sub-jaxprs, once each."""
    seen: dict[int, Any] = {}
    for eqn in eqns_in(closed_jaxpr.jaxpr):
        seen.setdefault(id(eqn.primitive), eqn.primitive)
    return list(seen.values())


def make_dispatcher(
    name: str,
    cache_miss: Callable[[tuple[Any, ...], dict[str, Any]], tuple[Any, Any]],
    fun: Callable[..., Any],
    static_argnums: Sequence[int] = (),
    static_argnames: Sequence[str] = (),
) -> Callable[..., Any]:
    """A C++ dispatcher like ``jax.jit``'s: after the first call with a signature, later calls
    with that signature (and the same jax trace context) run the executable without Python.

    ``cache_miss(args, kwargs) -> (outputs, compiled_or_None)`` runs on every signature the C++
    cache has not seen (and under transformations, ``disable_jit``, non-array arguments); when it
    returns a ``jax.stages.Compiled`` whose calling convention is the flat leaves of
    ``(args, kwargs)``, that executable is cached in C++ for the signature. Mirrors
    ``MeshExecutable.create_cpp_call`` (jax 0.10.2). ``fun``: the user's function, which
    jax's NaN check (``jax_debug_nans``, ``api._nan_check_posthook``) re-runs op by op as
    ``dispatcher._fun`` to name the operation that produced a NaN. ``static_argnums`` /
    ``static_argnames``: left out of the flat leaves, and hashed and compared (with their
    types) into the cache key, as jax.jit's.
    """

    # (jax's own cache_miss is an API boundary too)
    @api_boundary
    def miss(*args: Any, **kwargs: Any) -> Any:
        outs, compiled = cache_miss(args, kwargs)
        return outs, (None if compiled is None else _fastpath_data(compiled, outs)), False

    @api_boundary
    def fallback(*args: Any, **kwargs: Any) -> Any:  # under jax.disable_jit()
        return cache_miss(args, kwargs)[0]

    dispatcher = _jaxlib_ext.pjit(
        name, fallback, miss, list(static_argnums), list(static_argnames),
        _pxla.JitGlobalCppCacheKeys(),
        jax.tree_util.dispatch_registry if hasattr(jax.tree_util, "dispatch_registry")
        else _tree_util.dispatch_registry,
        _pxla.cc_shard_arg,
    )
    dispatcher._fun = fun
    return dispatcher  # type: ignore[no-any-return]


def _fastpath_data(compiled: jax.stages.Compiled, outs: Any) -> Any:
    executable: Any = compiled._executable
    call = getattr(executable, "unsafe_call", None)
    if not (
        isinstance(call, _pxla.ExecuteReplicated)
        and not call.has_unordered_effects
        and not call.has_host_callbacks
        and not compiled._params.const_args
        and not getattr(executable, "_mut", None)
    ):
        return None
    out_flat, out_tree = jax.tree_util.tree_flatten(outs)
    same_tree: bool = out_tree == compiled.out_tree  # type: ignore[operator]
    if not same_tree or not all(isinstance(x, _xc.ArrayImpl) for x in out_flat):
        return None
    out_flat, out_tree_dispatch = _pxla.reflatten_outputs_for_dispatch(out_tree, out_flat)
    # all flat arguments, including those XLA pruned as unused (in_avals holds only kept ones)
    n_args = len(jax.tree_util.tree_leaves(compiled.args_info))
    in_shardings = [
        _sharding_impls.physical_sharding(a, s)
        if a is not _core.abstract_token and _dtypes.issubdtype(a.dtype, _dtypes.extended)
        else s
        for s, a in zip(executable._in_shardings, executable.in_avals, strict=True)
    ]
    return _pxla.MeshExecutableFastpathData(
        executable.xla_executable, out_tree_dispatch, in_shardings,
        executable._out_shardings, [o.aval for o in out_flat],
        [o._committed for o in out_flat],
        [i in executable._kept_var_idx for i in range(n_args)],
        executable._dispatch_in_layouts, [],
    )


class _ValuePickler(cloudpickle.Pickler):
    """cloudpickle, except that whatever its module and qualified name import back to (in this
    process) is pickled by reference, ``__main__`` included: a class or function of the running
    script must come back as the very object of the process that loads it (``isinstance`` of a
    NamedTuple, an equinox Module's fields, a function leaf's identity), not a copy."""

    def persistent_id(self, obj: Any) -> Any:
        return _singleton_id(obj)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type | types.FunctionType) and _named_global(obj) is not None:
            return NotImplemented  # pickle's own save_global: by module and name
        return super().reducer_override(obj)


class _ValueUnpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and pid and pid[0] == "global":
            return _load_singleton(pid)
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


class _TreePickler(_ValuePickler):
    """An output's tree structure: what the inputs hold (``input_objects``) by position, so a
    warm result holds the caller's own objects as a cold one does; anything else by value
    (cloudpickle: an optimizer's local functions a step made itself come back as copies)."""

    def __init__(self, file: io.BytesIO, inputs: Sequence[Any]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._inputs: dict[int, int] = {}
        for i, obj in enumerate(inputs):
            self._inputs.setdefault(id(obj), i)

    def persistent_id(self, obj: Any) -> Any:
        i = self._inputs.get(id(obj))
        if i is not None and not isinstance(obj, _ATOMS):
            return ("input", i)
        return super().persistent_id(obj)

    def reducer_override(self, obj: Any) -> Any:
        if (isinstance(obj, type) and "<locals>" in getattr(obj, "__qualname__", "")
                and _named_global(obj) is None):
            # a copy of a class is not the class: an equinox Module rebuilt from a cloudpickled
            # class loses its fields (seen on examples/eqx_transformer.py)
            raise pickle.PicklingError(
                f"the class {obj.__qualname__} is defined inside a function and is not one "
                "the inputs hold")
        return super().reducer_override(obj)


class _TreeUnpickler(_ValueUnpickler):
    def __init__(self, file: io.BytesIO, inputs: Sequence[Any]) -> None:
        super().__init__(file)
        self._inputs = inputs

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and pid and pid[0] == "input":
            if not 0 <= pid[1] < len(self._inputs):
                raise pickle.UnpicklingError(f"input object {pid[1]} is not in this call")
            return self._inputs[pid[1]]
        return super().persistent_load(pid)


def pickle_tree(value: Any, inputs: Sequence[Any]) -> bytes:
    """Pickle an output's structure (a tree, static outputs) with what the call's ``inputs``
    hold by position (``input_objects``), anything else as ``pickle_value`` does, except
    classes defined inside a function.

    Raises:
        Unserializable: it cannot be pickled.
    """
    buf = io.BytesIO()
    try:
        _TreePickler(buf, inputs).dump(value)
    except Exception as e:  # noqa: BLE001
        raise Unserializable(f"the output's tree structure cannot be pickled: "
                             f"{type(e).__name__}: {e}",
                             advice="return arrays and objects the inputs hold (a TrainState's "
                             "apply_fn and tx come back as the caller's own) or objects "
                             "cloudpickle can carry") from None
    return buf.getvalue()


def unpickle_tree(data: bytes, inputs: Sequence[Any]) -> Any:
    """The value :func:`pickle_tree` pickled, its input references taken from ``inputs``."""
    return _TreeUnpickler(io.BytesIO(data), inputs).load()


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


def _type_name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


class _CallbackPickler(_ValuePickler):
    """Host callbacks, with every object of the user's live world they reach by reference:
    ``("live", i, type)`` for the ``i``-th object of the function's walk, named functions and
    classes by module and name (``_ValuePickler``). ``copied`` names the first user object
    (``is_user``) that would be pickled by value instead: a copy of it could differ from the
    live one (a closure's list, a simulator's state), so the callbacks are not stored."""

    def __init__(self, file: io.BytesIO, live: Sequence[Any],
                 is_user: Callable[[Any], bool] | None, codes: Collection[Any]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._live: dict[int, int] = {}
        for i, obj in enumerate(live):
            self._live.setdefault(id(obj), i)
        self._is_user = is_user
        self._codes = codes
        self.copied: str | None = None

    def persistent_id(self, obj: Any) -> Any:
        i = self._live.get(id(obj))
        if i is not None and not isinstance(obj, _ATOMS):
            return ("live", i, _type_name(obj))
        pid = super().persistent_id(obj)
        if (pid is None and self.copied is None and self._is_user is not None
                and not isinstance(obj, _ATOMS) and _named_global(obj) is None
                and self._is_user(obj) and not self._made_while_tracing(obj)):
            self.copied = (f"{getattr(obj, '__qualname__', None) or type(obj).__qualname__} "
                           f"({_type_name(obj)})")
        return pid

    def reducer_override(self, obj: Any) -> Any:
        if (isinstance(obj, types.FunctionType) and _named_global(obj) is None
                and self._made_while_tracing(obj) and _module_of_globals(obj) is not None):
            # bound to its module's live globals when loaded, as the cold run's function is
            return (_live_function, (obj.__code__, _module_of_globals(obj), obj.__name__,
                                     obj.__qualname__, obj.__defaults__, obj.__kwdefaults__,
                                     obj.__closure__))
        return super().reducer_override(obj)

    def _made_while_tracing(self, obj: Any) -> bool:
        """A function the trace made (``lambda v: log.append(v)`` in the function's body): its
        code is the walked code's own and every variable it closes over is a live cell, so a
        copy acts on the same objects."""
        if not (isinstance(obj, types.FunctionType) and obj.__code__ in self._codes
                and all(id(c) in self._live for c in obj.__closure__ or ())):
            return False
        if _module_of_globals(obj) is not None:
            return True  # its globals: its module's, live (:func:`_live_function`)
        # the globals it reads travel as a copy of their bindings: only names that a program
        # does not rebind (modules, classes, functions) may be among them
        g = obj.__globals__
        return all(isinstance(g[n], types.ModuleType | type | types.FunctionType
                              | types.BuiltinFunctionType)
                   for n in _code_names(obj.__code__) if n in g)


def _module_of_globals(fn: types.FunctionType) -> str | None:
    """The name of the imported module whose namespace is ``fn.__globals__``, or None."""
    name = fn.__globals__.get("__name__")
    mod = sys.modules.get(name) if isinstance(name, str) else None
    return name if mod is not None and vars(mod) is fn.__globals__ else None


def _live_function(code: types.CodeType, module: str, name: str, qualname: str,
                   defaults: Any, kwdefaults: Any, closure: Any) -> types.FunctionType:
    """A function a cold trace made (a callback's ``lambda v: print(RUN_ID, v)``), bound to the
    live globals of its module in this process: it reads ``RUN_ID`` when it runs, as the cold
    run's function does (issue 42).

    Raises:
        LiveObjectMissing: the module is not imported here.
    """
    mod = sys.modules.get(module)
    if mod is None:
        raise LiveObjectMissing(f"module {module} (of a host callback) is not imported")
    fn = types.FunctionType(code, vars(mod), name, defaults, closure)
    fn.__qualname__, fn.__kwdefaults__ = qualname, kwdefaults
    return fn


class _CallbackUnpickler(_ValueUnpickler):
    def __init__(self, file: io.BytesIO, live: Sequence[Any]) -> None:
        super().__init__(file)
        self._liveobjs = live

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and pid and pid[0] == "live":
            i, name = pid[1], pid[2]
            if not 0 <= i < len(self._liveobjs) or _type_name(self._liveobjs[i]) != name:
                raise LiveObjectMissing(f"live object {i} ({name}) is not in this walk")
            return self._liveobjs[i]
        return super().persistent_load(pid)


def pickle_callbacks(callbacks: Sequence[Any], live: Sequence[Any] = (),
                     is_user: Callable[[Any], bool] | None = None,
                     codes: Collection[Any] = ()) -> bytes:
    """Pickle a program's host callbacks so that a warm start calls the user's live objects,
    exactly as a cold run does (a ``jax.debug.callback`` appending to a list made in
    ``main()``, an ``io_callback(sim.advance, ...)`` stepping the user's simulator).

    ``live``: the objects the function's static walk visited, in walk order
    (``Fingerprint.objects``); a warm process whose key matched walked the same sequence, so
    each object the callbacks reach that is among them is stored as its position and comes
    back as that process's own object. Functions and classes importable by module and name
    come back by reference; JAX's own wrappers by value (made fresh by each lowering), and a
    user function the trace made by value when its code is among the walked ``codes`` and all
    it closes over is live.

    Raises:
        Unserializable: the callbacks cannot be pickled, or would hold a copy of a user object
            (``is_user``) that is not among ``live``: a copy could differ from what the cold
            run acts on, so a warm start rebuilds them by tracing instead.
    """
    buf = io.BytesIO()
    pickler = _CallbackPickler(buf, live, is_user, codes)
    try:
        pickler.dump(list(callbacks))
    except Exception as e:  # noqa: BLE001
        raise Unserializable(f"cannot pickle the host callbacks: {e}") from None
    if pickler.copied is not None:
        raise Unserializable(f"a host callback holds {pickler.copied}, which the function's "
                             "walk does not reach: a stored copy could differ from the live one")
    return buf.getvalue()


def unpickle_callbacks(data: bytes, live: Sequence[Any] = ()) -> list[Any]:
    """The callbacks :func:`pickle_callbacks` stored, bound to this process's ``live``
    objects. Only for entries whose digest verified.

    Raises:
        LiveObjectMissing: a referenced live object is not in ``live`` (the caller rebuilds
            the callbacks by tracing).
    """
    return list(_CallbackUnpickler(io.BytesIO(data), live).load())


def pickle_value(value: Any) -> bytes:
    """cloudpickle ``value`` (functions by reference when importable, else by value; module
    level sentinels by reference).

    Raises:
        Unserializable: it cannot be pickled.
    """
    buf = io.BytesIO()
    try:
        _ValuePickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except Exception as e:  # noqa: BLE001
        raise Unserializable(f"cannot pickle {type(value).__name__}: {e}") from None
    return buf.getvalue()


def unpickle_value(data: bytes) -> Any:
    """Inverse of :func:`pickle_value`; only for entries whose digest verified."""
    return _ValueUnpickler(io.BytesIO(data)).load()


def at_top_level() -> bool:
    """Whether no transformation or trace is running in this thread (jax's current trace is
    the eval trace). ``jax._src.core.trace_ctx.is_top_level()``, jax 0.4.36 to 0.10.2. Under
    ``jax.jvp`` / ``vmap`` / an outer ``jit`` a function can close over a tracer while its
    arguments are plain values, so the arguments alone cannot tell."""
    return bool(_core.trace_ctx.is_top_level())


def is_tracer(x: Any) -> bool:
    """True for a JAX tracer (abstract value under a transformation)."""
    return isinstance(x, jax.core.Tracer)


# jax._src.traceback_util.api_boundary(fun) and register_exclusion(path), and
# jax._src.source_info_util.register_exclusion(path): the frames jax removes from the traceback
# of an error raised below an API boundary ("JAX has removed its internal frames", unless
# JAX_TRACEBACK_FILTERING=off), and the files jax does not take for the user's when it names
# where a value was made or a function called (equinox registers its own files the same way);
# all three in jax 0.4 to 0.12 (checked on 0.10.2 and 0.12). kiln's files count as JAX's: an
# error while tracing a kiln.jit function shows the frames a jax.jit one shows.
from jax._src import source_info_util as _source_info_util  # noqa: E402
from jax._src import traceback_util as _traceback_util  # noqa: E402

_KILN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_traceback_util.register_exclusion(_KILN_DIR)
_source_info_util.register_exclusion(_KILN_DIR)


def api_boundary(fun: Callable[..., Any]) -> Callable[..., Any]:
    """``fun`` as jax's API boundary: an error raised below it has jax's and kiln's frames
    removed from its traceback, as an error raised in a jax.jit call has."""
    return _traceback_util.api_boundary(fun)  # type: ignore[no-any-return]


class _OnClearCaches:
    """What ``jax.clear_caches()`` clears, as jax's own caches are: ``cache_clear()``."""

    def __init__(self, clear: Callable[[], None]) -> None:
        self._clear = clear

    def cache_clear(self) -> None:
        self._clear()

    def cache_info(self) -> None:
        return None

    def cache_keys(self) -> list[Any]:
        return []


def on_clear_caches(clear: Callable[[], None]) -> Any:
    """Have ``jax.clear_caches()`` call ``clear``; returns the registration, which the caller
    holds (jax holds it weakly). ``jax._src.util.register_cache(cache, for_what)``: a cache
    ``clear_all_caches`` (what ``jax.clear_caches`` calls first) clears by its
    ``cache_clear()``; jax 0.4.36 to 0.12 (checked on 0.10.2 and 0.12)."""
    from jax._src import util as _util

    hook = _OnClearCaches(clear)
    _util.register_cache(hook, "kiln.jit in-process executables")
    return hook


def traced_extra_inputs(traced: jax.stages.Traced) -> int:
    """How many inputs the traced program takes besides its arguments: what it closed over
    that jax.jit passes as leading arguments, not as constants (a tracer leaked from another
    trace, a value with quasi-dynamic data such as a hijax ref). ``Traced._consts``, jax 0.7
    to 0.12 (checked on 0.10.2 and 0.12): jax.jit's call passes them (and raises
    UnexpectedTracerError for a tracer), the AOT ``Compiled`` of the trace expects them as
    inputs."""
    return len(getattr(traced, "_consts", None) or ())


def pytree_node_functions(typ: type) -> tuple[Any, ...]:
    """The flatten / unflatten callables registered for pytree node type ``typ`` (empty for a
    type with no Python-side registration: builtins, or a type jax does not know).

    ``jax._src.tree_util._registry`` maps each type registered through
    ``register_pytree_node`` / ``register_pytree_with_keys`` / ``register_dataclass`` to a
    ``_RegistryEntry(to_iter, from_iter)`` (jax 0.4 to 0.10.2). They run whenever an argument of
    that type is flattened or rebuilt inside the trace, so they are part of what a program is
    built from.
    """
    entry = getattr(_tree_util, "_registry", {}).get(typ)
    if entry is None:
        return ()
    return tuple(f for f in (getattr(entry, "to_iter", None), getattr(entry, "from_iter", None))
                 if f is not None)


# jax._src.api_util.InternalFloatingPointError(name, ty): raised by an executable's output check
# under jax_debug_nans / jax_debug_infs; jax.jit turns it into FloatingPointError through
# api_util.maybe_recursive_nan_check (re-runs the function op by op). Both in jax 0.4 to 0.10.2.
from jax._src import api_util as _api_util  # noqa: E402

InternalFloatingPointError = _api_util.InternalFloatingPointError


def raise_floating_point_error(e: Exception, fun: Any, args: Any, kwargs: Any) -> None:
    """Raise the ``FloatingPointError`` ``jax.jit`` raises for ``e`` (naming the operation that
    produced the NaN or inf when the de-optimized re-run finds it)."""
    _api_util.maybe_recursive_nan_check(e, fun, args, kwargs)  # raises when it finds the op
    raise FloatingPointError(
        f"invalid value ({getattr(e, 'ty', 'nan')}) encountered in {getattr(e, 'name', fun)}"
    ) from None


def give_debug_info(wrapper: Any, fun: Any, args: Sequence[Any], kwargs: dict[str, Any],
                    static_argnums: Sequence[int], static_argnames: Sequence[str],
                    n_leaves: int, keep: Sequence[int] | None = None) -> None:
    """Make ``jax.jit(wrapper)`` name ``fun`` and its arguments where jax names them (its
    errors: "while tracing the function f at file:line ... the argument y['a']"; the lowered
    module; jax_explain_cache_misses), as ``jax.jit(fun)`` called with ``args`` / ``kwargs``
    would, when ``wrapper`` takes the ``n_leaves`` array leaves of that call (``keep``: the
    indices, among the leaves of the non-static arguments, of those it takes; all when None).

    ``jax._src.api_util.debug_info(traced_for, fun, args, kwargs, static_argnums=,
    static_argnames=)`` makes jax.jit's ``DebugInfo``, whose ``arg_names`` has one name per
    leaf of the non-static arguments, and ``debug_info`` returns a function's
    ``__fun_debug_info__`` when it has one (what jax's own wrappers set, through
    ``save_wrapped_fun_debug_info``); both in jax 0.10.2 and 0.12 (checked). Where the names do
    not fit the wrapper's leaves one to one, or jax cannot name them, nothing is set (jax
    names the wrapper, as before)."""
    try:
        dbg = _api_util.debug_info("jit", fun, args, kwargs, static_argnums=static_argnums,
                                   static_argnames=static_argnames)
        names = dbg.arg_names
        if names is None:
            return
        if keep is not None:
            names = tuple(names[i] for i in keep if i < len(names))
        if len(names) != n_leaves:
            return
        wrapper.__fun_debug_info__ = dbg._replace(arg_names=tuple(names))
    except Exception as e:  # noqa: BLE001 - jax's own names are a nicety, never a failure
        logger.debug("kiln: jax's debug info for %r not given: %s", fun, e)


class _Slot:
    """A placeholder leaf (``broadcast_prefix`` needs a tree, kiln has a treedef)."""


def broadcast_prefix(prefix: Any, treedef: Any) -> list[Any]:
    """jax.jit's rule for ``in_shardings``: ``prefix`` (a pytree prefix; None leaves are
    kept, meaning "unspecified") broadcast to one entry per leaf of ``treedef``.
    ``jax._src.tree_util.broadcast_prefix`` (0.10 to 0.12)."""
    full = treedef.unflatten([_Slot()] * treedef.num_leaves)
    return list(_tree_util.broadcast_prefix(prefix, full, is_leaf=lambda x: x is None))


def pytree_differences(got: Any, want: Any) -> list[Any]:
    """(path, got, want, explanation) per difference of two treedefs, as jax's AOT error
    lists them (``jax._src.tree_util.equality_errors_pytreedef``, 0.10 to 0.12)."""
    return list(_tree_util.equality_errors_pytreedef(got, want))


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


class _ProcessZero:
    """``jax._src.distributed.global_state`` as ``compiler._cache_write`` sees it while
    :func:`write_from_every_process` lets this thread write: process 0. Every other attribute,
    and ``process_id`` in every other thread, is the real state's."""

    def __getattr__(self, name: str) -> Any:
        from jax._src import distributed

        if name == "process_id" and getattr(_writing, "on", False):
            return 0
        return getattr(distributed.global_state, name)


class _DistributedSeenByCompiler(types.ModuleType):
    """``jax._src.distributed`` as ``jax._src.compiler`` sees it (its module global
    ``distributed``): the same module, with :class:`_ProcessZero` as ``global_state``."""

    def __getattr__(self, name: str) -> Any:
        from jax._src import distributed

        if name == "global_state":
            return _ProcessZero()
        return getattr(distributed, name)


_writing = threading.local()
_every_process: Callable[[], bool] | None = None


def write_from_every_process(when: Callable[[], bool]) -> bool:
    """Let every process of a ``jax.distributed`` job write JAX's persistent cache while
    ``when()`` is true (kiln's route is on).

    JAX writes its cache from process 0 only ("Not writing persistent cache entry since
    process_id != 0", ``jax._src.compiler._cache_write``, jax 0.10 to 0.12), against write
    contention on file systems such as GCS. A program only process 1 compiles (its eager work
    on its own devices: a key of its own) is then compiled by process 1 in every run, and
    process 0 waits for it at the job's first collective. kiln's store takes
    concurrent writes of one key (atomic rename; a remote store's put keeps what it holds),
    so under the route each process writes what it compiled. JAX's other checks (host
    callbacks, the minimum compile time) are JAX's own. Returns whether it is installed (False
    when jax's private names moved: JAX's behaviour stays).
    """
    global _every_process
    from jax._src import compiler

    if _every_process is not None:
        _every_process = when
        return True
    original = getattr(compiler, "_cache_write", None)
    if original is None or getattr(compiler, "distributed", None) is None:
        return False

    def _cache_write(*args: Any, **kwargs: Any) -> Any:
        _writing.on = _every_process is not None and _every_process()
        try:
            return original(*args, **kwargs)
        finally:
            _writing.on = False

    _every_process = when
    compiler.distributed = _DistributedSeenByCompiler("jax._src.distributed")
    compiler._cache_write = _cache_write
    return True


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


def compile_to_store(lowered: Any) -> Any:
    """``lowered.compile()``, never an executable JAX's persistent cache deserialized.

    kiln serializes what it compiles into its entry; XLA serializes a reloaded executable
    without its kernels, so an entry made from a JAX cache hit would crash every later load.
    A hit (``jax.monitoring`` event ``/jax/compilation_cache/cache_hits`` in this thread) is
    compiled again with a compiler option at its default value
    (``xla_embed_ir_in_executable=False``): the same executable under another JAX cache key,
    so XLA compiles it.
    """
    global _watching
    if not _watching:
        with _watch_lock:
            if not _watching:
                jax.monitoring.register_event_listener(_on_cache_event)
                _watching = True
    _watch.on, _watch.hit = True, False
    try:
        compiled = lowered.compile()
        if not _watch.hit:
            return compiled
        _watch.hit = False
        compiled = lowered.compile(compiler_options={"xla_embed_ir_in_executable": False})
        if _watch.hit:  # a JAX cache value under that key too: runs, but is never stored
            _reloaded.add(id(compiled._executable))
        return compiled
    finally:
        _watch.on = False


def fun_name(fun: Any) -> str:
    """The name JAX gives ``fun`` (a partial's function's, unless the partial has its own
    ``__name__``; ``jax._src.util.fun_name``, jax 0.10 to 0.12)."""
    from jax._src import util as _util

    return str(_util.fun_name(fun))

"""The private modules of JAX the gate imports, each with what kiln uses of it and since when
it has that shape (checked on jax 0.10.2 and 0.12). Only this folder imports ``jax._src``."""

from __future__ import annotations

# jax._src.api_util.InternalFloatingPointError(name, ty): raised by an executable's output check
# under jax_debug_nans / jax_debug_infs; jax.jit turns it into FloatingPointError through
# api_util.maybe_recursive_nan_check (re-runs the function op by op). Both in jax 0.4 to 0.10.2.
from jax._src import api_util as _api_util

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
# For JAX's eager work (_eager): jax._src.dispatch.apply_primitive (jits a ``prim_fun``
# closing over ``prim`` and ``params``, marked ``_apply_primitive``) and check_arg;
# jax._src.pjit._infer_params and _run_python_pjit, the two module globals jax.jit's
# ``cache_miss`` calls (same shape in jax 0.10.2, 0.11.2 and 0.12.1, checked);
# jax._src.interpreters.mlir's lowering-rule tables (_lowerings, _platform_specific_lowerings);
# jax._src.lib.jax_jit.parse_arguments (jaxlib 0.4 to 0.12).
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import dtypes as _dtypes
from jax._src import pjit as _pjit
from jax._src import sharding_impls as _sharding_impls

# jax._src.traceback_util.api_boundary(fun) and register_exclusion(path), and
# jax._src.source_info_util.register_exclusion(path): the frames jax removes from the traceback
# of an error raised below an API boundary ("JAX has removed its internal frames", unless
# JAX_TRACEBACK_FILTERING=off), and the files jax does not take for the user's when it names
# where a value was made or a function called (equinox registers its own files the same way);
# all three in jax 0.4 to 0.12 (checked on 0.10.2 and 0.12). kiln's files count as JAX's: an
# error while tracing a kiln.jit function shows the frames a jax.jit one shows.
from jax._src import source_info_util as _source_info_util

# jax._src.stages.Compiled(executable, const_args, args_info, out_tree, no_kwargs): the AOT
# compiled object whose __call__ has a C++ fast path. Constructor shape as of jax 0.8-0.10.
from jax._src import stages as _stages
from jax._src import traceback_util as _traceback_util
from jax._src import tree_util as _tree_util

# jax._src.xla_bridge: backends_are_initialized() and _init_backend(platform), which makes one
# backend through its factory: the moment XLA reads XLA_FLAGS (once per process; libtpu reads
# LIBTPU_INIT_ARGS as it starts); xla_bridge.backends() calls it by its module-global name.
# Both in jax 0.10.2 and 0.12 (checked).
from jax._src import xla_bridge as _xla_bridge
from jax._src.interpreters import mlir as _mlir

# jax._src.interpreters.pxla: MeshExecutable internals for the C++ dispatch fast path
# (ExecuteReplicated, MeshExecutableFastpathData, JitGlobalCppCacheKeys, cc_shard_arg,
# reflatten_outputs_for_dispatch); shapes as of jax 0.8-0.10 (see MeshExecutable.create_cpp_call).
from jax._src.interpreters import pxla as _pxla

# jax._src.lib._jax.pjit: the C++ jit dispatcher (signature check + executable call in C++).
from jax._src.lib import _jax as _jaxlib_ext
from jax._src.lib import jax_jit as _jax_jit

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

__all__ = [
    "ArrayImpl",
    "Primitive",
    "jaxpr_as_fun",
    "_api_util",
    "_cache_key",
    "_compiler",
    "_core",
    "_dispatch",
    "_dtypes",
    "_jax_config",
    "_jax_jit",
    "_jaxlib_ext",
    "_mlir",
    "_pjit",
    "_pxla",
    "_sharding_impls",
    "_source_info_util",
    "_stages",
    "_traceback_util",
    "_tree_util",
    "_xc",
    "_xla_bridge",
]

"""Everything kiln needs from JAX's private modules, in one place (checked on jax 0.10.2 and
0.12): the JAX gate. Nothing else in kiln imports ``jax._src`` (``tests/test_layers.py``); when
jax changes, this folder is what to port. Each private name used says what it is and since when
it has that shape. One file per concern, this module their face (every caller reads
``_jax_compat.name``):

- ``_private``: the private modules imported, each with what is used of it;
- ``_trace``: the trace context and config as a trace sees them, tracers, the API boundary;
- ``_flags``: compile options and XLA flags (their digest; what the backend read at start);
- ``_executables``: serialising and loading compiled programs, JAX's cache around kiln's
  compiles;
- ``_pickling`` and ``_values``: what an entry holds by reference (JAX's singletons, a call's
  inputs), and values, output trees and host callbacks pickled with cloudpickle;
- ``_jaxprs``: equations, the code they run, effects, primitive rule registries;
- ``_dispatch``: the C++ dispatcher of a stored executable and what jax.jit does at a call;
- ``_eager``: JAX's eager work (its own jits and primitives applied outside a trace) answered
  from stored executables;
- ``_patches``: JAX's modules as they were when eager work was turned on, and the names a
  function reads that the program has patched since;
- ``_distributed``: which processes of a multi-host job write;
- ``_errors``: the gate's exceptions.
"""

from __future__ import annotations

from ._dispatch import (
    InternalFloatingPointError,
    broadcast_prefix,
    fun_name,
    give_debug_info,
    make_dispatcher,
    on_clear_caches,
    pytree_differences,
    pytree_node_functions,
    raise_floating_point_error,
    traced_extra_inputs,
)
from ._distributed import coordinator_address, write_from_every_process
from ._eager import (
    StoredCall,
    avals_text_of,
    call_facts,
    ctx_mesh_empty,
    eager_installed,
    install_eager,
    load_eager,
    lowering_overrides,
    lowering_rules,
    primitive_of,
    remember_facts,
    serialize_eager,
    uninstall_eager,
)
from ._errors import Unserializable
from ._executables import (
    compile_to_store,
    host_callbacks,
    load_compiled,
    lowered_facts,
    no_persistent_cache_writes,
    reset_compilation_cache,
    sections_for_trace,
    serialize_compiled,
    with_out_tree,
)
from ._flags import _flags_text as _flags_text  # (read by tests)
from ._flags import (
    compile_options_digest,
    flags_at_backend_start,
    flags_left_out_of_jax_key,
)
from ._jaxprs import (
    codes_in_jaxpr,
    eqns_in,
    ordered_effects,
    primitive_rules,
    primitives_in,
    primitives_named,
    union_vma,
    with_vma,
)
from ._patches import patched_reads, snapshot_jax_modules
from ._pickling import input_objects
from ._private import (
    ArrayImpl,
    Primitive,
    jaxpr_as_fun,
)
from ._trace import (
    api_boundary,
    apply_local_config,
    at_top_level,
    default_device_text,
    is_tracer,
    jit_disabled,
    local_config,
    sharding_text,
    trace_context,
    trace_context_token,
)
from ._values import (
    pickle_callbacks,
    pickle_tree,
    unpickle_callbacks,
    unpickle_tree,
)

__all__ = [
    "StoredCall", "avals_text_of", "call_facts", "ctx_mesh_empty", "eager_installed",
    "install_eager", "load_eager", "lowering_overrides", "lowering_rules",
    "patched_reads", "primitive_of", "remember_facts", "serialize_eager", "snapshot_jax_modules",
    "uninstall_eager",
    "api_boundary",
    "apply_local_config",
    "ArrayImpl",
    "at_top_level",
    "broadcast_prefix",
    "codes_in_jaxpr",
    "compile_options_digest", "coordinator_address",
    "compile_to_store",
    "default_device_text",
    "eqns_in",
    "flags_at_backend_start",
    "flags_left_out_of_jax_key",
    "fun_name",
    "give_debug_info",
    "host_callbacks",
    "input_objects",
    "InternalFloatingPointError",
    "is_tracer",
    "jaxpr_as_fun",
    "jit_disabled",
    "load_compiled",
    "local_config",
    "lowered_facts",
    "make_dispatcher",
    "no_persistent_cache_writes",
    "on_clear_caches",
    "ordered_effects",
    "pickle_callbacks",
    "pickle_tree",
    "Primitive",
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
    "traced_extra_inputs",
    "union_vma",
    "unpickle_callbacks",
    "unpickle_tree",
    "Unserializable",
    "with_out_tree",
    "with_vma",
    "write_from_every_process",
]

"""Keys: what a call is keyed by.

``_args`` (the call's arguments: avals, static values, pytree structure), ``_hashing`` (static
values hashed by value: arrays by shape, dtype and bytes), ``_fingerprint`` (the code and data a
trace used: the static walk of ``_walk`` over code digested by ``_code``, libraries counted
by version as ``_libraries`` tells them from user code), ``_recorder`` and ``_manifest`` (what
ran while tracing, as a manifest checked on a warm start), ``_reads`` (files and directories a
trace read), ``_environ`` (environment variables a trace read, and installed libraries'
settings in their module globals), ``_static_reads`` (the fields a static object's trace
read), ``_machine`` (the kind of machine an executable was compiled for) and ``_key`` (the
store key made from all of these).
"""

from ._args import ARRAY_TYPES as ARRAY_TYPES
from ._args import STATIC_LEAF as STATIC_LEAF
from ._args import check_argnames as check_argnames
from ._fingerprint import Fingerprint as Fingerprint
from ._fingerprint import fingerprint as fingerprint
from ._guard import Guard as Guard
from ._guard import check as check_guard
from ._guard import snapshot as guard_snapshot
from ._hashing import Unpersistable as Unpersistable
from ._hashing import ndarray_key as ndarray_key
from ._hashing import static_digest as static_digest
from ._hashing import static_digest_by_code as static_digest_by_code
from ._key import KeyParts as KeyParts
from ._key import avals_text as avals_text
from ._key import environment_parts as environment_parts
from ._key import machine as machine
from ._key import make_key as make_key
from ._key import option_text as option_text
from ._key import treedef_parts as treedef_parts
from ._libraries import is_user_object as is_user_object
from ._libraries import library_version as library_version
from ._libraries import script_module as script_module
from ._manifest import check_manifest as check_manifest
from ._manifest import manifest_for as manifest_for
from ._recorder import TraceRecorder as TraceRecorder
from ._static_reads import StaticReadWatch as StaticReadWatch
from ._watchable import watchable as watchable

__all__ = ["ARRAY_TYPES", "avals_text", "check_argnames", "check_guard", "check_manifest",
           "environment_parts", "Fingerprint", "fingerprint", "Guard", "guard_snapshot",
           "is_user_object", "KeyParts",
           "library_version", "machine", "make_key",
           "manifest_for",
           "ndarray_key", "option_text", "script_module", "static_digest", "StaticReadWatch",
           "static_digest_by_code", "STATIC_LEAF",
           "TraceRecorder", "treedef_parts", "Unpersistable",
           "watchable"]

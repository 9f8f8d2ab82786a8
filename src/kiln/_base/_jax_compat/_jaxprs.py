"""Jaxprs and primitives: equations and the code they run, effects and varying-manual axes, the
primitive rule registries.

Part of the JAX gate (:mod:`kiln._base._jax_compat`)."""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from ._private import _core

__all__ = [
    "ordered_effects",
    "union_vma",
    "with_vma",
    "eqns_in",
    "codes_in_jaxpr",
    "primitive_rules",
    "primitives_named",
    "primitives_in",
]


def ordered_effects(effects: Any) -> list[Any]:
    """The ordered effects among ``effects`` (``jax.debug.print(..., ordered=True)``,
    ``io_callback(..., ordered=True)``): they thread a runtime token through the program."""
    from jax._src import effects as _effects

    return list(_effects.ordered_effects.filter_in(effects))


def union_vma(avals: Sequence[Any]) -> frozenset[Any]:
    """The mesh axes (inside a ``shard_map`` body) any of ``avals`` varies over:
    ``ShapedArray.manual_axis_type.varying`` (jax 0.10 and 0.12). Empty outside a
    ``shard_map`` body."""
    mats = [getattr(a, "manual_axis_type", None) for a in avals]
    return frozenset().union(*(mat.varying for mat in mats if mat is not None))


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
# id -> (the module's namespace, the attribute): a table rebound to another dict (kiln's eager
# route makes mlir's lowering tables versioned ones: _eager._watch_rule_tables) is followed
_homes: dict[int, tuple[dict[str, Any], str]] = {}
_scanned: set[str] = set()
_registries_lock = threading.Lock()
_registry_list: list[tuple[str, dict[Any, Any], bool]] = []
_modules_scanned = 0  # len(sys.modules) at the last scan (modules are scanned once each)


def _is_registry(d: dict[Any, Any]) -> bool | None:
    """True: keyed by primitives; "nested": False (see _scan); None: cannot tell (empty)."""
    if not d:
        return None
    return isinstance(next(iter(d)), _core.Primitive)


def _rebound() -> bool:
    """Whether a table found before is no longer its module's attribute (rebound)."""
    return any(space.get(attr) is not _registries.get(i, _registry_candidates.get(i, (0, 0)))[1]
               for i, (space, attr) in _homes.items())


def _scan_registries() -> list[tuple[str, dict[Any, Any], bool]]:
    global _modules_scanned, _registry_list
    if len(sys.modules) == _modules_scanned and not _rebound() and not any(
            v for _, v in _registry_candidates.values()):
        return _registry_list
    with _registries_lock:
        for i, (space, attr) in list(_homes.items()):
            found = _registries.get(i) or _registry_candidates.get(i)
            now = space.get(attr)
            if found is not None and now is found[1]:
                continue
            _registries.pop(i, None)
            _registry_candidates.pop(i, None)
            del _homes[i]
            if isinstance(now, dict) and found is not None:
                _note(found[0], now, space, attr)
        _modules_scanned = len(sys.modules)
        for modname, mod in list(sys.modules.items()):
            # (jax._src holds every registry; ``jax.interpreters.*`` re-export some of them)
            if modname in _scanned or not modname.startswith("jax._src."):
                continue
            _scanned.add(modname)
            if not isinstance(mod, types.ModuleType):
                continue
            space = vars(mod)
            for attr, v in list(space.items()):
                if isinstance(v, dict) and id(v) not in _registries:
                    _note(f"{modname.replace('jax._src.', '')}.{attr}", v, space, attr)
        for i, (where, v) in list(_registry_candidates.items()):
            if v:
                del _registry_candidates[i]
                if _is_registry(v):
                    _registries[i] = (where, v, False)
                else:
                    _homes.pop(i, None)
        _registry_list = sorted(_registries.values(), key=lambda r: r[0])
        return _registry_list


def _note(where: str, v: dict[Any, Any], space: dict[str, Any], attr: str) -> None:
    """Dict ``v``, attribute ``attr`` of the module whose namespace is ``space``: a registry,
    one by platform, a candidate (empty), or nothing."""
    kind = _is_registry(v)
    if kind is None:
        _registry_candidates[id(v)] = (where, v)
    elif kind:
        _registries[id(v)] = (where, v, False)
    elif all(isinstance(x, dict) for x in v.values()) and any(
            _is_registry(x) for x in v.values()):
        _registries[id(v)] = (where, v, True)  # by platform
    else:
        return
    _homes[id(v)] = (space, attr)


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

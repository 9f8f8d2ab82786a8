"""The static walk never raises: every public object of jax and the libraries kiln meets, and
live objects a program holds (a used mesh, devices, keys, optimizer states, a lock, modules),
closed over or read as a global by a small function, gives a fingerprint (sound, or unsound
and then the verify path), and ``kiln.jit`` of that function returns what ``jax.jit`` returns.

Per object and per variant (closure cell, module global) the walk alone runs
(:func:`kiln._keys._fingerprint.fingerprint`, ~0.2 ms); ``kiln.jit`` runs (a cold compile, ~50 ms) for
every live object, every object whose walk raised or is unsound, and a sample of each library
covering each kind of object (module, class, function, builtin, other instance). Each test
prints how many calls took the verify path (``kiln.stats().reasons["verify-path"]``, counted by
``_Miss.run``); run with ``pytest -s`` to see it. A failure lists the objects grouped by cause.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import dataclasses
import functools
import importlib
import os
import threading
import traceback
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kiln
from kiln._keys._fingerprint import fingerprint

LIBRARIES = [
    "jax",
    "jax.numpy",
    "jax.lax",
    "jax.nn",
    "jax.random",
    "jax.sharding",
    "jax.tree_util",
    "flax.linen",
    "flax.nnx",
    "equinox",
    "optax",
    "diffrax",
    "optimistix",
]
_PER_KIND = 2  # objects of each kind per library that also get a full kiln.jit call
_KILN_DIR = os.path.dirname(os.path.realpath(kiln.__file__)) + os.sep
# the modules of the walk (kiln._keys._fingerprint and what it calls)
_WALK_FILES = ("_fingerprint.py", "_walk/__init__.py", "_code.py", "_objects.py",
               "_libraries.py")


# ----------------------------------------------------------------------------------------------
# The functions under test: one closes over the object, one reads it as a module global
# ----------------------------------------------------------------------------------------------
def _closure(obj: Any) -> Callable[[jax.Array], jax.Array]:
    def f(x):
        _ = obj  # the closure cell holds obj, so the walk visits it
        return x * 2.0 + 1.0

    return f


def _reads_global(x):
    _ = OBJ  # noqa: F821 - defined in the globals _global() gives this code
    return x * 2.0 + 1.0


def _global(obj: Any) -> Callable[[jax.Array], jax.Array]:
    """``_reads_global``'s code with globals of its own, where ``OBJ`` is ``obj``."""
    g = {"OBJ": obj, "__name__": "kiln_walk_probe", "__builtins__": builtins}
    return types.FunctionType(_reads_global.__code__, g, "f")


VARIANTS: dict[str, Callable[[Any], Callable[[jax.Array], jax.Array]]] = {
    "closure": _closure,
    "global": _global,
}


# ----------------------------------------------------------------------------------------------
# The objects
# ----------------------------------------------------------------------------------------------
def _public(modname: str) -> tuple[list[tuple[str, Any]], list[str]]:
    """``(name, object)`` for each public name of ``modname`` (``__all__`` where defined), and
    the names that ``getattr`` refuses (removed deprecated aliases)."""
    mod = importlib.import_module(modname)
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n in dir(mod) if not n.startswith("_")]
    out, missing = [], []
    for name in sorted(set(names)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # jax's deprecated aliases warn on access
            try:
                out.append((name, getattr(mod, name)))
            except Exception:  # noqa: BLE001 - a name listed but gone: not an object to walk
                missing.append(name)
    return out, missing


def _live() -> list[tuple[str, Any]]:
    """Objects a program holds at run time; the mesh as a program leaves it after using it
    (an array placed on it, jit with its shardings, shard_map, ``Array.devices()``)."""
    import equinox as eqx
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

    mesh = jax.make_mesh((1,), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    arr = jax.device_put(jnp.arange(4.0), sharding)
    jitted = jax.jit(lambda a: a * 2.0, in_shardings=sharding, out_shardings=sharding)
    mapped = jax.shard_map(lambda a: a * 2.0, mesh=mesh, in_specs=PartitionSpec("d"),
                           out_specs=PartitionSpec("d"))
    jax.block_until_ready((jitted(arr), mapped(arr)))
    linear = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    # asking where an array lives (Array.devices(), NamedSharding.device_set) caches the mesh's
    # devices as a set (Mesh._flat_devices_set): a set of Device objects inside the mesh
    assert arr.devices() == sharding.device_set == {jax.devices()[0]}
    return [
        ("mesh", mesh),
        # (jax interns meshes: make_mesh((1,), ("d",)) again would be the used mesh itself)
        ("mesh_fresh", jax.make_mesh((1,), ("fresh",))),
        ("abstract_mesh", mesh.abstract_mesh),
        ("sharded_array", arr),
        ("NamedSharding", sharding),
        ("PartitionSpec", PartitionSpec("d")),
        ("SingleDeviceSharding", SingleDeviceSharding(jax.devices()[0])),
        ("device", jax.devices()[0]),
        ("devices", jax.devices()),
        ("jit_with_shardings", jitted),
        ("shard_map_fn", mapped),
        ("key_new_style", jax.random.key(0)),
        ("key_old_style", jax.random.PRNGKey(0)),
        ("adam_state", optax.adam(1e-3).init({"w": jnp.ones(3)})),
        ("GradientTransformation", optax.adam(1e-3)),
        ("threading_Lock", threading.Lock()),
        ("numpy_Generator", np.random.default_rng(0)),
        ("nnx_Linear", linear),
        ("eqx_MLP", eqx.nn.MLP(2, 3, 4, 1, key=jax.random.key(0))),
        # more of the same families: the used mesh inside a partial, sets and dicts of devices,
        # an object array of devices, jax's stage objects, an nnx optimizer
        ("partial_with_mesh", functools.partial(_takes_mesh, mesh=mesh)),
        ("mesh_devices_array", mesh.devices),
        ("set_of_devices", set(jax.devices())),
        ("dict_device_keys", {jax.devices()[0]: 1}),
        ("ShapeDtypeStruct_sharded", jax.ShapeDtypeStruct((4,), jnp.float32, sharding=sharding)),
        ("Lowered", jax.jit(_plus_one).lower(jnp.arange(3.0))),
        ("Compiled", jax.jit(_plus_one).lower(jnp.arange(3.0)).compile()),
        ("ClosedJaxpr", jax.make_jaxpr(_plus_one)(jnp.arange(3.0))),
        ("nnx_Optimizer", nnx.Optimizer(linear, optax.adam(1e-3), wrt=nnx.Param)),
    ]


def _takes_mesh(x: jax.Array, mesh: Any) -> jax.Array:
    return x


def _plus_one(x: jax.Array) -> jax.Array:
    return x + 1.0


def _kind(obj: Any) -> str:
    if isinstance(obj, types.ModuleType):
        return "module"
    if isinstance(obj, type):
        return "class"
    if isinstance(obj, types.FunctionType):
        return "function"
    if isinstance(obj, types.BuiltinFunctionType):
        return "builtin"
    return "instance" if not callable(obj) else "callable"


def _sample(objs: list[tuple[str, Any]]) -> set[str]:
    """Names of up to ``_PER_KIND`` objects of each kind, spread over the sorted names."""
    by_kind: dict[str, list[str]] = collections.defaultdict(list)
    for name, obj in objs:
        by_kind[_kind(obj)].append(name)
    out = set()
    for names in by_kind.values():
        step = max(1, len(names) // _PER_KIND)
        out |= set(names[::step][:_PER_KIND])
    return out


# ----------------------------------------------------------------------------------------------
# Checking one object
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Failure:
    what: str  # "library.name [variant]"
    stage: str  # "walk", "walk warning", "kiln.jit", "kiln.jit warning", "value", "verify path"
    cause: str  # exception type and innermost kiln frame (the grouping key)
    message: str


def _frames(e: BaseException) -> str:
    """The innermost kiln frame, and the innermost frame of the walk when that is another."""
    tb = traceback.extract_tb(e.__traceback__)
    ours = [fr for fr in tb if os.path.realpath(fr.filename).startswith(_KILN_DIR)]
    if not ours:
        return "no kiln frame"

    def where(fr: traceback.FrameSummary) -> str:
        return f"kiln/{os.path.relpath(os.path.realpath(fr.filename), _KILN_DIR)}:{fr.lineno} " \
               f"in {fr.name}"

    walk = [fr for fr in ours if fr.filename.endswith(_WALK_FILES)]
    text = where(ours[-1])
    if walk and walk[-1] is not ours[-1]:
        text += f" (walk: {where(walk[-1])})"
    return text


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [""])[0][:300]


@contextlib.contextmanager
def _recorded() -> Iterator[list[warnings.WarningMessage]]:
    """Warnings raised inside the block, recorded (not raised: filterwarnings = error)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def _undocumented(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    """Warnings kiln does not document for this case. A :class:`kiln.KilnWarning` (e.g. one that
    says a function cannot be keyed and takes the verify path) is allowed; a
    :class:`kiln.StoreWarning` is not (the store is fresh and local: a fault is a bug), nor is any
    warning of another category (the walk must not set off library warnings)."""
    return [w for w in caught if not issubclass(w.category, kiln.KilnWarning)
            or issubclass(w.category, kiln.StoreWarning)]


@dataclasses.dataclass
class Report:
    """What one library's objects did."""

    objects: int = 0
    walks: int = 0
    raised: int = 0
    unsound: list[str] = dataclasses.field(default_factory=list)
    calls: int = 0
    verify_path: list[str] = dataclasses.field(default_factory=list)
    failures: list[Failure] = dataclasses.field(default_factory=list)

    def fail(self, what: str, stage: str, cause: str, message: str) -> None:
        self.failures.append(Failure(what, stage, cause, message))

    def summary(self, label: str) -> str:
        lines = [
            f"[{label}] {self.objects} objects x {len(VARIANTS)} variants: {self.walks} walks, "
            f"{self.raised} raised, {len(self.unsound)} unsound; {self.calls} kiln.jit calls, "
            f"{len(self.verify_path)} took the verify path; {len(self.failures)} failures"
        ]
        lines += [f"    unsound: {u}" for u in self.unsound]
        lines += [f"    verify path: {v}" for v in self.verify_path]
        return "\n".join(lines)


def _check(label: str, objs: list[tuple[str, Any]], full: set[str]) -> Report:
    """Walk each object in each variant; call kiln.jit for those in ``full`` and for every
    object whose walk raised or is unsound."""
    x = jnp.arange(3.0)
    report = Report(objects=len(objs))
    for name, obj in objs:
        for variant, make in VARIANTS.items():
            what = f"{label}.{name} [{variant}]"
            f = make(obj)
            fp = None
            report.walks += 1
            with _recorded() as caught:
                try:
                    fp = fingerprint(f)
                except Exception as e:  # noqa: BLE001 - what this test is looking for
                    report.raised += 1
                    report.fail(what, "walk", f"{type(e).__name__} at {_frames(e)}",
                                _first_line(e))
            for w in _undocumented(caught):
                report.fail(what, "walk warning", f"{w.category.__name__} (walk)", str(w.message))
            if fp is not None and not fp.sound:
                report.unsound.append(f"{what}: {(fp.reason or '')[:160]}")
            if fp is not None and fp.sound and name not in full:
                continue
            _call(report, what, f, x, sound=None if fp is None else fp.sound)
    return report


def _call(report: Report, what: str, f: Callable[[jax.Array], jax.Array], x: jax.Array,
          sound: bool | None) -> None:
    """``kiln.jit(f)(x)`` against ``jax.jit(f)(x)``, with a fresh store (the autouse fixture's
    store under tmp_path; every object's key is new to it)."""
    want = np.asarray(jax.jit(f)(x))
    report.calls += 1
    before = kiln.stats().reasons["verify-path"]
    with _recorded() as caught:
        try:
            got = np.asarray(kiln.jit(f)(x))
        except Exception as e:  # noqa: BLE001 - what this test is looking for
            report.fail(what, "kiln.jit", f"{type(e).__name__} at {_frames(e)}", _first_line(e))
            return
    for w in _undocumented(caught):
        report.fail(what, "kiln.jit warning", f"{w.category.__name__}", str(w.message))
    took = kiln.stats().reasons["verify-path"] - before
    if took:
        report.verify_path.append(what)
    if got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(got, want):
        report.fail(what, "value", "kiln.jit differs from jax.jit",
                    f"kiln.jit gave {got!r}, jax.jit gave {want!r}")
    if sound is False and not took:
        report.fail(what, "verify path", "unsound fingerprint, verify path not counted",
                    "the walk could not key it, yet kiln.stats().reasons['verify-path'] did "
                    "not grow")


def _grouped(failures: list[Failure]) -> str:
    groups: dict[tuple[str, str], list[Failure]] = collections.defaultdict(list)
    for fl in failures:
        groups[(fl.stage, fl.cause)].append(fl)
    out = []
    for (stage, cause), items in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        out.append(f"{stage}: {cause} -- {len(items)} call(s), e.g. {items[0].message}")
        out += [f"    {fl.what}" for fl in items]
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tally() -> Iterator[dict[str, Report]]:
    """Every parameter's report; the totals are printed after the last one (``pytest -s``)."""
    reports: dict[str, Report] = {}
    yield reports
    if reports:
        rs = list(reports.values())
        print(
            f"\n[walk totals] {len(rs)} groups, {sum(r.objects for r in rs)} objects, "
            f"{sum(r.walks for r in rs)} walks, {sum(r.raised for r in rs)} raised, "
            f"{sum(len(r.unsound) for r in rs)} unsound, {sum(r.calls for r in rs)} kiln.jit "
            f"calls, {sum(len(r.verify_path) for r in rs)} took the verify path, "
            f"{sum(len(r.failures) for r in rs)} failures"
        )


@pytest.mark.parametrize("library", LIBRARIES)
def test_public_objects(library: str, tally: dict[str, Report]) -> None:
    """Every public object of ``library``: the walk never raises; sampled, raising and unsound
    objects give kiln.jit's value equal to jax.jit's."""
    objs, missing = _public(library)
    report = _check(library, objs, _sample(objs))
    tally[library] = report
    print(f"\n{report.summary(library)}")
    if missing:
        print(f"    listed but not gettable: {', '.join(missing)}")
    assert not report.failures, f"{library}:\n{_grouped(report.failures)}"


def test_live_objects(tally: dict[str, Report]) -> None:
    """Objects a program holds at run time: every one walked and called through kiln.jit."""
    objs = _live()
    report = _check("live", objs, {name for name, _ in objs})
    tally["live"] = report
    print(f"\n{report.summary('live')}")
    assert not report.failures, f"live:\n{_grouped(report.failures)}"

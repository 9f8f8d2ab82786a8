"""Tests for kiln._keys._hashing: canonical, cross-process digests of static arguments."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import decimal
import enum
import fractions
import functools
import gc
import http
import pathlib
import re
import sys
import uuid
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from kiln_test_children import child_env, run_child

import kiln
from kiln._base._errors import StaticArgumentError
from kiln._keys import _hashing
from kiln._keys._hashing import Unpersistable, array_digest, static_digest


def d(value: Any) -> str:
    return static_digest(value, argname="x")


class Color(enum.Enum):
    RED = 1
    GREEN = 2


@dataclasses.dataclass(frozen=True)
class Cfg:
    n: int
    scale: float


class Model(eqx.Module):
    w: jax.Array
    act: str = eqx.field(static=True)


def top_level_fn(x: Any) -> Any:
    return x


class Opaque:
    """Hashable by identity only."""


class Unhashable:
    __hash__ = None  # type: ignore[assignment]


class DictSub(dict):  # type: ignore[type-arg]
    """A dict subclass with no pytree registration."""


class Custom:
    def __init__(self, v: int) -> None:
        self.v = v

    def __kiln_digest__(self) -> bytes:
        return self.v.to_bytes(4, "little")


# --------------------------------------------------------------------------------------------
# Golden digests


def test_golden_digests() -> None:
    """Pinned digests: they are part of the persistent cache key.

    Changing any of these values changes every stored key, so it requires bumping kiln's entry
    format version (``_entry.py``) in the same change.
    """
    assert array_digest(np.arange(4, dtype=np.int32)) == "ac1e55c07d4f1a409ca0f7f9ef5f6bf6"
    assert d(np.arange(4, dtype=np.int32)) == "1c07d8af041c1e263329c14680c180f8"
    assert d((1, 2.5, "a")) == "f728be53d8d107b375f85a0da808ede3"
    assert d({"b": 1, "a": None}) == "c773d3a72395a148b0a83fcc3d727cd8"
    assert d({"a": None, "b": 1}) == "fe02d0ce0bf434198d020e462e3a17bb"  # in insertion order
    assert d(1) == "5c0fabed007821c11267cbb5dcaed171"
    assert d(http.HTTPStatus.OK) == "ed7b739cd8cd203f9b5d4e051d4c7992"


def test_digest_by_code_writes_functions_and_local_classes_by_name_only() -> None:
    """static_digest_by_code: what has no canonical digest only because it is code is written
    by its type and name (the caller's walk keys its code); anything else still has none."""
    class Local:
        pass

    def value(fn: Any, k: float) -> Any:
        return ((fn, k), jax.tree_util.tree_structure(Local), Local)

    by_code = _hashing.static_digest_by_code
    with pytest.raises(Unpersistable):
        static_digest(value(lambda x: x, 1.0), argname="s")
    d = by_code(value(lambda x: x, 1.0), argname="s")
    assert d is not None and len(d) == 32
    assert by_code(value(lambda y: y + 1, 1.0), argname="s") == d  # (code: the caller's)
    assert by_code(value(lambda x: x, 2.0), argname="s") != d  # values still by value
    assert by_code((len, 1.0), argname="s") == static_digest((len, 1.0), argname="s")
    assert by_code((len, object()), argname="s") is None  # an object: no digest
    made = type("Made", (), {"__module__": "json", "__qualname__": "factory.<locals>.Made"})
    assert by_code((made,), argname="s") is None  # a library's class made at run time: none
    assert by_code([[]], argname="s") is not None and by_code({1: {2}}, argname="s")
    assert by_code(([],), argname="s") == static_digest(([],), argname="s")
    with pytest.raises(Unpersistable):  # the mode is only on inside the call
        static_digest(lambda: 0, argname="s")


def test_golden_digests_of_mappings_and_shardings() -> None:
    """Pinned as above (a change bumps ``_entry.FORMAT_VERSION``): mappings other than dict,
    and the sharding objects that need no accelerator (the CPU device is ``cpu:0`` everywhere)."""
    import collections

    from flax.core import FrozenDict
    from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, SingleDeviceSharding
    from jax.sharding import PartitionSpec as P

    assert d(collections.OrderedDict(b=1, a=None)) == "4bc3f190d9ff8c101af8a46f9a1bbd5c"
    assert d(collections.defaultdict(int, {"b": 1, "a": None})) == (
        "07ddc0c8ef86b595f2c32f8452ef974e"
    )
    assert d(FrozenDict({"b": 1, "a": None})) == "5780990569579dfd9759527217006baa"
    assert d(P("a", None, ("a", "b"), P.UNCONSTRAINED)) == "3b2b1693e90fb7e745022c5b79b8951a"
    assert d(AxisType.Explicit) == "28b3048ce491719a8511a6af98c51fc0"
    auto = (AxisType.Auto, AxisType.Auto)  # (the default axis types differ across jax versions)
    assert d(AbstractMesh((2, 4), ("a", "b"), axis_types=auto)) == (
        "b89964b7ee9a80ab33f0d3ecc4c41da0"
    )
    cpu = jax.devices("cpu")[0]
    assert d(cpu) == "457c16acb1af33ad2a90e7bed5c4281a"
    mesh = Mesh(np.array([cpu]), ("d",), axis_types=(AxisType.Auto,))
    assert d(mesh) == "0d07840530fb1d718a99d332ad3c85a3"
    assert d(NamedSharding(mesh, P("d"))) == "b0e74d9cb9c56c728fdccd7b9b95a03e"
    assert d(SingleDeviceSharding(cpu)) == "000c15947a71ef7282566eff0cbaf4e9"
    assert d(np.array([cpu], dtype=object)) == "976c7c14cfbdde0191105d1fac23a62d"


@pytest.mark.slow
def test_digest_is_stable_across_processes() -> None:
    code = (
        "from kiln._keys._hashing import static_digest as s;"
        "print(s(('a', frozenset({'x', 'y', 'z'}), {'k': 1.5, 'j': b'b'}), argname='x'))"
    )
    runs = {
        run_child(
            [sys.executable, "-c", code],
            check=True,
            env=child_env(PYTHONHASHSEED=seed, PYTHONPATH=":".join(sys.path),
                          JAX_PLATFORMS="cpu"),
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert runs == {d(("a", frozenset({"x", "y", "z"}), {"k": 1.5, "j": b"b"}))}


# --------------------------------------------------------------------------------------------
# Scalars and containers


def test_digest_format() -> None:
    out = d(1)
    assert len(out) == 32
    int(out, 16)


def test_type_tags_distinguish_equal_python_values() -> None:
    values = [1, 1.0, True, "1", b"1", np.int32(1), np.float32(1), np.int64(1), (1,), [1], 1 + 0j]
    assert len({d(v) for v in values}) == len(values)


def test_none_false_zero_empty_differ() -> None:
    values: list[Any] = [None, False, 0, 0.0, "", b"", (), [], {}, frozenset()]
    assert len({d(v) for v in values}) == len(values)


def test_float_by_bits() -> None:
    assert d(0.0) != d(-0.0)
    assert d(float("nan")) == d(float("nan"))
    assert d(float("inf")) != d(float("-inf"))


def test_big_ints() -> None:
    values = [2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**200, -(2**200)]
    assert len({d(v) for v in values}) == len(values)


def test_dict_insertion_order_matters() -> None:
    """Code iterating a static dict (``[x * v for v in cfg.values()]``) builds another program
    for another order, so the order is part of the value."""
    assert d({"a": 1, "b": [2, 3], 4: None}) != d({4: None, "b": [2, 3], "a": 1})
    assert d({"a": 1, "b": [2, 3], 4: None}) == d({"a": 1, "b": [2, 3], 4: None})
    assert d({"a": 1, "b": 2}) != d({"a": 2, "b": 1})
    assert d({"a": {"x": 1, "y": 2}}) != d({"a": {"y": 2, "x": 1}})  # nested too
    assert d({("a", "b"): 1}) != d({"a": "b", 1: None})  # keys and values stay apart


def test_dict_subclasses_in_order_and_by_class() -> None:
    import collections

    ab, ba = {"a": 1, "b": 2}, {"b": 2, "a": 1}
    od = collections.OrderedDict
    assert d(od(ab)) == d(od(ab))
    assert d(od(ab)) != d(od(ba))
    assert d(od(ab)) != d(ab)  # the class is part of the value
    dd = collections.defaultdict
    assert d(dd(int, ab)) == d(dd(int, ab))
    assert d(dd(int, ab)) != d(dd(int, ba))
    assert d(dd(int, ab)) != d(dd(list, ab))  # a trace can call the default_factory
    assert d(dd(None, ab)) != d(dd(int, ab))
    assert d(DictSub(ab)) != d(DictSub(ba))
    assert d(DictSub(ab)) != d(ab)


def test_frozendict_in_order_not_through_its_sorting_flatten() -> None:
    from flax.core import FrozenDict

    ab, ba = {"a": 1.0, "b": 2.0}, {"b": 2.0, "a": 1.0}
    assert d(FrozenDict(ab)) == d(FrozenDict(ab))
    assert d(FrozenDict(ab)) != d(FrozenDict(ba))  # its pytree flatten sorts the keys
    assert d(FrozenDict(ab)) != d(ab)
    assert d(FrozenDict({"n": ab})) != d(FrozenDict({"n": ba}))


def test_set_order_irrelevant() -> None:
    assert d(frozenset(["x", "y", "z"])) == d(frozenset(["z", "y", "x"]))
    assert d(frozenset([1, 2])) != d(frozenset([1, 3]))


def test_nesting_is_unambiguous() -> None:
    assert d((("a",), "b")) != d(("a", ("b",)))
    assert d(("ab", "c")) != d(("a", "bc"))


def test_enum_type_partial_dataclass() -> None:
    assert d(Color.RED) == d(Color.RED)
    assert d(Color.RED) != d(Color.GREEN)
    assert d(Color.RED) != d(1)
    assert d(np.float32) != d(np.float64)
    assert d(jnp.float32) == d(jnp.float32)
    assert d(top_level_fn) == d(top_level_fn)
    assert d(functools.partial(top_level_fn, 1)) != d(functools.partial(top_level_fn, 2))
    assert d(Cfg(1, 2.0)) == d(Cfg(1, 2.0))
    assert d(Cfg(1, 2.0)) != d(Cfg(1, 3.0))
    assert d(np.dtype("float32")) != d(np.dtype("int32"))
    assert d(jax.ShapeDtypeStruct((2, 3), jnp.float32)) != d(
        jax.ShapeDtypeStruct((3, 2), jnp.float32)
    )


def test_kiln_digest_hook() -> None:
    assert d(Custom(1)) == d(Custom(1))
    assert d(Custom(1)) != d(Custom(2))


def test_equinox_module_hashes_by_value() -> None:
    a = Model(jnp.arange(3.0), "relu")
    b = Model(jnp.arange(3.0), "relu")
    assert d(a) == d(b)
    assert d(a) != d(Model(jnp.arange(3.0), "tanh"))
    assert d(a) != d(Model(jnp.arange(3.0) + 1, "relu"))


# --------------------------------------------------------------------------------------------
# Arrays


def test_nan_array_equals_itself() -> None:
    a = np.array([1.0, np.nan])
    assert d(a) == d(a.copy())


def test_negative_zero_array_differs() -> None:
    assert d(np.array([0.0])) != d(np.array([-0.0]))


def test_shape_matters() -> None:
    assert d(np.zeros((2, 2), np.float32)) != d(np.zeros((4,), np.float32))


def test_dtype_matters_with_identical_bytes() -> None:
    a = np.arange(4, dtype=np.int32)
    assert d(a) != d(a.view(np.float32))


def test_non_contiguous_view_equals_contiguous_copy() -> None:
    a = np.arange(24.0).reshape(4, 6)
    big_endian = a.astype(">f8")
    bf16 = a.astype(jnp.bfloat16)  # exports no buffer: hashed through a uint8 view
    for base in (a, big_endian, bf16):
        for view in (base[:, ::2], base.T, base[::-1], base[1:3, 2:5]):
            assert d(view) == d(np.ascontiguousarray(view))
            assert _hashing.ndarray_key(view) == _hashing.ndarray_key(np.ascontiguousarray(view))
    assert d(big_endian) != d(a)  # the byte order is part of the dtype


def test_in_place_mutation_changes_digest() -> None:
    a = np.zeros(8, np.float32)
    before = d(a)
    a[3] = 1.0
    assert d(a) != before


def test_numpy_scalar_vs_zero_d_array() -> None:
    assert d(np.float32(1)) != d(np.array(1, np.float32))
    assert array_digest(np.float32(1)) == array_digest(np.array(1, np.float32))


def test_bfloat16_differs_from_float16() -> None:
    bf16 = jnp.bfloat16
    assert d(np.zeros(2, bf16)) != d(np.zeros(2, np.float16))


def test_jax_array_matches_numpy_and_is_memoised(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = _hashing._jax._jax_array_digest_uncached

    def counting(x: Any) -> bytes:
        calls.append(1)
        return real(x)

    monkeypatch.setattr(_hashing._jax, "_jax_array_digest_uncached", counting)
    host = np.arange(12, dtype=np.float32).reshape(3, 4)
    dev = jnp.asarray(host)
    assert array_digest(dev) == array_digest(host)
    assert d(dev) == d(host)
    assert d((dev, 1)) == d((host, 1))
    assert len(calls) == 1


def test_weakly_typed_jax_array_differs() -> None:
    assert d(jnp.asarray(1.0)) != d(jnp.asarray(1.0, dtype=jnp.float32))


def test_jax_memo_entry_removed_after_gc() -> None:
    x = jnp.arange(5)
    d(x)
    key = id(x)
    assert key in _hashing._jax._JAX_MEMO
    del x
    gc.collect()
    assert key not in _hashing._jax._JAX_MEMO


def test_prng_key() -> None:
    assert d(jax.random.key(0)) == d(jax.random.key(0))
    assert d(jax.random.key(0)) != d(jax.random.key(1))


# --------------------------------------------------------------------------------------------
# Errors


def test_object_array_error_names_argument_and_path() -> None:
    table = {"cfg": Cfg(1, 2.0), "w": [0, np.array([object()], dtype=object)]}
    with pytest.raises(StaticArgumentError) as info:
        static_digest(table, argname="table")
    msg = str(info.value)
    assert "static argument 'table' (path: ['w'][1])" in msg
    assert "object array" in msg
    assert "mark the argument as dynamic" in msg
    assert isinstance(info.value, TypeError)


def test_error_path_through_pytree_attribute() -> None:
    bad = Model(np.array([None], dtype=object), "relu")  # type: ignore[arg-type]
    with pytest.raises(StaticArgumentError, match=r"'m' \(path: \[0\]\.w\)"):
        static_digest([bad], argname="m")


def test_tracer_error() -> None:
    seen = []

    @jax.jit
    def f(x: jax.Array) -> jax.Array:
        with pytest.raises(StaticArgumentError, match="'x' is a traced value"):
            static_digest(x, argname="x")
        seen.append(1)
        return x

    f(jnp.ones(2))
    assert seen == [1]


def test_lambda_is_unpersistable() -> None:
    with pytest.raises(Unpersistable, match="static argument 'f'"):
        static_digest(lambda x: x, argname="f")


def test_local_function_and_class_are_unpersistable() -> None:
    def local(x: Any) -> Any:
        return x

    @dataclasses.dataclass(frozen=True)
    class Local:
        a: int

    with pytest.raises(Unpersistable):
        d(local)
    with pytest.raises(Unpersistable):
        d(Local(1))


def test_identity_hashed_object_is_unpersistable() -> None:
    with pytest.raises(Unpersistable, match=r"path: \[0\].*Opaque"):
        d((Opaque(),))


def test_unhashable_object_is_static_argument_error() -> None:
    with pytest.raises(StaticArgumentError, match="Unhashable.*not hashable"):
        d(Unhashable())


def test_self_referential_is_static_argument_error() -> None:
    x: list[Any] = []
    x.append(x)
    with pytest.raises(StaticArgumentError, match="nested too deeply"):
        d(x)


# --------------------------------------------------------------------------------------------
# Standard-library values: by what they are, each type with its own tag

# One of each, built from this text in this process and in children (equal values, fresh
# objects); a ZoneInfo needs the tz database, so it is tested on its own
STDLIB = """
import collections, datetime as dt, decimal, fractions, pathlib, re, uuid
VALUES = (
    dt.date(2024, 1, 1),
    dt.datetime(2024, 1, 1, 12, 30, 15, 7),
    dt.datetime(2024, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=-5), "EST")),
    dt.time(23, 59, 1, 5, tzinfo=dt.timezone.utc),
    dt.timedelta(days=-1, seconds=5),
    dt.timezone.utc,
    decimal.Decimal("-0.250"),
    decimal.Decimal("NaN12"),
    fractions.Fraction(-3, 9),
    re.compile(r"layer_(\\d+)", re.I),
    re.compile(rb"x+"),
    collections.deque([1.5, "a", (2,)], maxlen=5),
    uuid.UUID("12345678-1234-5678-1234-567812345678"),
    pathlib.PurePosixPath("data/train.csv"),
    pathlib.PureWindowsPath("C:/data"),
    pathlib.Path("a") / "b",
)
"""


def stdlib_values() -> tuple[Any, ...]:
    scope: dict[str, Any] = {}
    exec(STDLIB, scope)
    return scope["VALUES"]


def zone(key: str) -> Any:
    import zoneinfo

    try:
        return zoneinfo.ZoneInfo(key)
    except zoneinfo.ZoneInfoNotFoundError:
        pytest.skip(f"no tz database entry {key!r} here")


class Day(datetime.date):
    """A date subclass: it may hold more than the date's fields."""


class Dec(decimal.Decimal):
    pass


class Offset(datetime.tzinfo):
    """A tzinfo computing offsets in its own code."""

    def utcoffset(self, dt: datetime.datetime | None) -> datetime.timedelta:
        return datetime.timedelta(hours=1)


def test_golden_digests_of_stdlib_values() -> None:
    """Pinned as above (a change bumps ``_entry.FORMAT_VERSION``)."""
    assert [d(v) for v in stdlib_values()] == [
        "db07fecf273e3a64139bf16e5359feb9",  # date
        "820b2fb681af240f8fe6ab0618609fd8",  # naive datetime
        "40fbeade64468373965d4eb249210d9c",  # datetime with a timezone
        "37fc0363b929173a12911b07c92828d8",  # time
        "377fbc0e8e0179ca38b46c0142ff9230",  # timedelta
        "1308c80590a04e6313cb8756b6f2132f",  # timezone.utc
        "40c48838aebe180e02e5e5108ee4a648",  # Decimal("-0.250")
        "b2e023de1dd31b5e2294040af809ec73",  # Decimal("NaN12")
        "1abbfa09944164b24000c3d0f56d6758",  # Fraction
        "93639f5fafefc1c47cc66fef8b86b505",  # str regex
        "156620097fcfbc2be47ef48fb893f6eb",  # bytes regex
        "af0d98ad22d04adb52ff41d8f9f9798c",  # deque
        "6eb4cf49715ed2be761f1ed2d7332450",  # UUID
        "cb9aea39ea760e74e3040d21455a6505",  # PurePosixPath
        "a5ade064d0d479a2bf58e6ebe671a3c4",  # PureWindowsPath
        "69723cff7fac7e9b364f416cf09248ce",  # PosixPath
    ]


def test_stdlib_values_equal_by_value() -> None:
    for a, b in zip(stdlib_values(), stdlib_values(), strict=True):
        assert d(a) == d(b), a
    tz = datetime.timezone(datetime.timedelta(hours=2))
    assert d(datetime.datetime(2024, 1, 1, tzinfo=tz)) == d(
        datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone(datetime.timedelta(hours=2))))
    assert d(fractions.Fraction(1, 3)) == d(fractions.Fraction(-2, -6))  # normalised
    assert d(re.compile("a")) == d(re.compile("a", re.UNICODE))  # (str patterns: implied)


def test_stdlib_values_differ() -> None:
    D, date, dtime, td = decimal.Decimal, datetime.date, datetime.datetime, datetime.timedelta
    utc = datetime.UTC
    values = [
        *stdlib_values(),
        date(2020, 1, 1), date(2020, 1, 2), "2020-01-01", (2020, 1, 1), [2020, 1, 1],
        dtime(2020, 1, 1), dtime(2020, 1, 1, tzinfo=utc),  # naive and aware
        dtime(2020, 1, 1, fold=1),  # == the fold=0 one, but a zone picks another offset
        dtime(2020, 1, 1, tzinfo=datetime.timezone(td(0), "GMT")),  # == utc, another %Z
        dtime(2020, 1, 1, tzinfo=datetime.timezone(td(hours=1))),
        datetime.time(0, 0), datetime.time(0, 0, tzinfo=utc), td(0), td(microseconds=1),
        td(days=1), td(seconds=86399), datetime.timezone(td(hours=-1)),
        D("0"), D("-0"), D("0.0"), D("1.0"), D("1.00"), D("1"), D("-1"), D("1E+1"), D("10"),
        D("NaN"), D("-NaN"), D("sNaN"), D("NaN1"), D("Infinity"), D("-Infinity"), 0, 0.0,
        fractions.Fraction(1, 2), fractions.Fraction(1, 3), fractions.Fraction(2), 2, 0.5,
        re.compile("a+"), re.compile(b"a+"), re.compile("a+", re.I), re.compile("a+", re.M),
        "a+", b"a+",
        collections.deque([1, 2]), collections.deque([1, 2], maxlen=2),
        collections.deque([1, 2], maxlen=3), collections.deque([2, 1]), collections.deque(),
        collections.deque([None]), [1, 2], (1, 2),
        uuid.UUID(int=1), uuid.UUID(int=2), 1, b"\0" * 15 + b"\1",
        pathlib.PurePosixPath("a/b"), pathlib.PureWindowsPath("a/b"),  # (and Path("a/b"))
        pathlib.PurePosixPath("a/c"), "a/b",
    ]
    digests = [d(v) for v in values]
    assert len(set(digests)) == len(values), [
        v for v, x in zip(values, digests, strict=True) if digests.count(x) > 1]


def test_decimal_nan_equals_itself() -> None:
    """By ``as_tuple``, as floats by their bits: a NaN equals a NaN with the same payload."""
    assert d(decimal.Decimal("NaN")) == d(decimal.Decimal("nan"))
    assert d(decimal.Decimal("-sNaN7")) == d(decimal.Decimal("-sNaN7"))


def test_deque_items_by_value_and_mutation_changes_digest() -> None:
    q = collections.deque([np.arange(3), {"k": 1.5}], maxlen=4)
    before = d(q)
    assert before == d(collections.deque([np.arange(3), {"k": 1.5}], maxlen=4))
    q[1]["k"] = 2.5
    assert d(q) != before
    with pytest.raises(Unpersistable, match=r"path: \[0\]"):
        d(collections.deque([Opaque()]))


def test_zoneinfo_by_key() -> None:
    paris = zone("Europe/Paris")
    import zoneinfo

    assert d(paris) == d(zoneinfo.ZoneInfo.no_cache("Europe/Paris"))  # another object
    assert d(paris) != d(zone("UTC")) and d(paris) != d("Europe/Paris")
    noon = datetime.datetime(2024, 7, 1, 12)
    assert d(noon.replace(tzinfo=paris)) == d(noon.replace(tzinfo=zone("Europe/Paris")))
    assert d(noon.replace(tzinfo=paris)) != d(noon.replace(tzinfo=zone("Europe/Berlin")))
    assert d(noon.replace(tzinfo=paris)) != d(noon.replace(tzinfo=datetime.timezone(
        datetime.timedelta(hours=2))))  # the same offset that day: another zone


def test_other_tzinfo_and_zone_from_a_file_are_unpersistable(tmp_path: Any) -> None:
    with pytest.raises(Unpersistable, match=r"path: \.tzinfo.*Offset"):
        d(datetime.datetime(2024, 1, 1, tzinfo=Offset()))
    with pytest.raises(Unpersistable, match="tzinfo"):
        d(datetime.time(1, tzinfo=Offset()))
    import zoneinfo

    key = "Europe/Paris"
    zone(key)
    source = next((pathlib.Path(p) / key for p in zoneinfo.TZPATH
                   if (pathlib.Path(p) / key).is_file()), None)
    if source is None:
        pytest.skip("the tz database is not a folder here (the tzdata package)")
    with source.open("rb") as f:
        from_file = zoneinfo.ZoneInfo.from_file(f)
    with pytest.raises(Unpersistable, match="from a file"):
        d(from_file)


def test_stdlib_subclasses_do_not_take_the_base_digest() -> None:
    """A subclass can hold more than its base shows (``pandas.Timestamp``'s nanoseconds): it is
    hashed as any other object, here by identity."""
    with pytest.raises(Unpersistable, match="Day"):
        d(Day(2024, 1, 1))
    with pytest.raises(Unpersistable, match="Dec"):
        d(Dec("1"))


def test_stdlib_static_arguments_in_process() -> None:
    """In process a hashable static value is looked up by ``hash`` / ``==`` (as jax.jit); only
    the unhashable deque is given a digest, so a deque changed in place is never stale."""
    traces: list[Any] = []

    def body(x: Any, v: Any) -> Any:
        traces.append(v)
        return x * float(v[-1] if isinstance(v, collections.deque) else v.month)

    f = kiln.jit(body, static_argnums=1)
    x = jnp.float32(2.0)
    assert float(f(x, datetime.date(2024, 1, 1))) == 2.0
    assert float(f(x, datetime.date(2024, 1, 1))) == 2.0
    assert float(f(x, datetime.date(2024, 3, 1))) == 6.0
    assert len(traces) == 2
    q = collections.deque([1.0, 2.0], maxlen=3)
    assert float(f(x, q)) == 4.0
    assert float(f(x, collections.deque([1.0, 2.0], maxlen=3))) == 4.0
    assert len(traces) == 3
    q.append(5.0)  # changed in place: never the old executable
    assert float(f(x, q)) == 10.0
    assert len(traces) == 4


@pytest.mark.slow
def test_stdlib_digests_are_stable_across_processes() -> None:
    code = STDLIB + (
        "from kiln._keys._hashing import static_digest as s\n"
        "print(*[s(v, argname='x') for v in VALUES])\n"
    )
    runs = {
        run_child(
            [sys.executable, "-c", code],
            check=True,
            env=child_env(PYTHONHASHSEED=seed, PYTHONPATH=":".join(sys.path),
                          JAX_PLATFORMS="cpu"),
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert runs == {" ".join(d(v) for v in stdlib_values())}


STDLIB_PROG = """
import collections
import datetime
import decimal
import fractions
import pathlib
import re
import uuid

import jax.numpy as jnp

import kiln

START = datetime.date(2024, 1, 1)
NOON = datetime.datetime(2024, 1, 1, 12, tzinfo=datetime.timezone.utc)
STEP = datetime.timedelta(minutes=90)
RATE = decimal.Decimal("0.25")
SHARE = fractions.Fraction(1, 4)
PATTERN = re.compile(r"layer_(\\d+)")
HISTORY = collections.deque([1.0, 2.0], maxlen=4)
RUN = uuid.UUID(int=12)
DATA = pathlib.PurePosixPath("data") / "train.csv"


@kiln.jit
def f_date(x):
    TRACE()
    return x * START.month


@kiln.jit
def f_datetime(x):
    TRACE()
    return x * NOON.hour


@kiln.jit
def f_timedelta(x):
    TRACE()
    return x * (STEP.total_seconds() / 3600.0)


@kiln.jit
def f_decimal(x):
    TRACE()
    return x * float(RATE)


@kiln.jit
def f_fraction(x):
    TRACE()
    return x * float(SHARE)


@kiln.jit
def f_regex(x):
    TRACE()
    return x * int(PATTERN.match("layer_3").group(1))


@kiln.jit
def f_deque(x):
    TRACE()
    return x * HISTORY[-1]


@kiln.jit
def f_uuid(x):
    TRACE()
    return x * RUN.int


@kiln.jit
def f_path(x):
    TRACE()
    return x * len(DATA.suffix)


x = jnp.float32(2.0)
for name in [n for n in dir() if n.startswith("f_")]:
    call(name, globals()[name], x)
report()
"""
STDLIB_FUNCS = {"f_date": 2.0, "f_datetime": 24.0, "f_timedelta": 3.0, "f_decimal": 0.5,
                "f_fraction": 0.5, "f_regex": 6.0, "f_deque": 4.0, "f_uuid": 24.0, "f_path": 8.0}


@pytest.fixture(scope="module")
def stdlib_runs(tmp_path_factory: pytest.TempPathFactory, xp: Any) -> dict[str, Any]:
    """A (cold), B (unchanged), C (START and RATE changed in the file): fresh processes, one
    store."""
    prog = xp.Program(tmp_path_factory.mktemp("stdlib"))
    prog.write("prog.py", STDLIB_PROG)
    out = {"A": prog.run(), "B": prog.run()}
    prog.edit("prog.py", "datetime.date(2024, 1, 1)", "datetime.date(2024, 3, 1)")
    prog.edit("prog.py", 'decimal.Decimal("0.25")', 'decimal.Decimal("0.75")')
    out["C"] = prog.run()
    return out


@pytest.mark.slow
def test_stdlib_globals_warm_start_with_no_trace(stdlib_runs: dict[str, Any], xp: Any) -> None:
    """A global holding a date, Decimal, regex, deque... read while tracing: the second process
    loads each function from the store, with no trace and no verify path."""
    a, b = stdlib_runs["A"], stdlib_runs["B"]
    for name, want in STDLIB_FUNCS.items():
        xp.assert_cold(a[name])
        xp.assert_warm(b[name])
        assert xp.value(a[name]) == xp.value(b[name]) == want, name
    assert b.stats["hits"] == len(STDLIB_FUNCS) and b.stats["traces"] == 0, b.stats
    assert b.stats["reasons"].get("verify-path", 0) == 0, b.stats["reasons"]


@pytest.mark.slow
def test_stdlib_global_changed_gives_the_new_value(
    stdlib_runs: dict[str, Any], xp: Any
) -> None:
    """START and RATE edited between processes: those two functions trace and compile again
    with the new values; the others still load from the store (verified once: the edit is an
    input of their guards, kiln._keys._guard)."""
    c = stdlib_runs["C"]
    assert xp.value(c["f_date"]) == 6.0
    assert xp.value(c["f_decimal"]) == 1.5
    for name in ("f_date", "f_decimal"):
        assert c[name]["hits"] == 0 and c[name]["py_traces"] == 1, c[name]
        assert c[name]["compiles"] == 1, c[name]
    for name in set(STDLIB_FUNCS) - {"f_date", "f_decimal"}:
        xp.assert_same_key(c[name])
        assert xp.value(c[name]) == STDLIB_FUNCS[name], name


# --------------------------------------------------------------------------------------------
# Properties

_arrays = hnp.arrays(
    dtype=st.sampled_from([np.int8, np.int32, np.float32, np.float64, np.uint16, np.bool_]),
    shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=5),
)


@settings(max_examples=50, deadline=None)
@given(_arrays)
def test_property_copy_has_equal_digest(a: np.ndarray) -> None:
    assert d(a) == d(a.copy())
    assert d(a) == d(np.asfortranarray(a))


@settings(max_examples=50, deadline=None)
@given(_arrays, st.data())
def test_property_any_byte_change_changes_digest(a: np.ndarray, data: st.DataObject) -> None:
    raw = bytearray(a.tobytes())
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] ^= data.draw(st.integers(1, 255))
    b = np.frombuffer(bytes(raw), dtype=a.dtype).reshape(a.shape)
    assert d(a) != d(b)


@settings(max_examples=50, deadline=None)
@given(_arrays)
def test_property_reshape_changes_digest(a: np.ndarray) -> None:
    flat = a.reshape(-1)
    if flat.shape != a.shape:
        assert d(a) != d(flat)
    assert d(a) != d(a.reshape(a.shape + (1,)))


@settings(max_examples=50, deadline=None)
@given(_arrays)
def test_property_dtype_view_changes_digest(a: np.ndarray) -> None:
    other = np.uint8 if a.dtype != np.uint8 else np.int8
    assert d(a) != d(a.view(other))


_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary()
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(st.text(max_size=3) | st.integers(), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=100, deadline=None)
@given(_values)
def test_property_equal_structure_equal_digest(v: Any) -> None:
    import copy

    assert d(v) == d(copy.deepcopy(v))


_keys = st.text(max_size=4) | st.integers(-3, 3) | st.tuples(st.integers(0, 2), st.text(max_size=2))


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(_keys, _values, min_size=2, max_size=6), st.data())
def test_property_dict_insertion_order_is_part_of_the_digest(
    v: dict[Any, Any], data: st.DataObject
) -> None:
    """Another insertion order of the same items: another digest (``[x * v for v in
    cfg.values()]`` traces another program); the same items in the same order: the same one."""
    import collections

    items = list(v.items())
    other = data.draw(st.permutations(items).filter(lambda p: [k for k, _ in p] != list(v)))
    assert dict(other) == v  # equal by ==, as a dict
    assert d(dict(other)) != d(v)
    assert d(dict(items)) == d(v)
    assert d(collections.OrderedDict(other)) != d(collections.OrderedDict(items))
    assert d({"cfg": dict(other)}) != d({"cfg": v})


class _FrozenMap(Mapping):  # an immutable mapping class, as flax's HashableMapping
    def __init__(self, d):
        self._d = dict(d)

    def __getitem__(self, k):
        return self._d[k]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)

    def __hash__(self):
        return hash(tuple(self._d.items()))


def test_hashable_mapping_by_items() -> None:
    a, b = _FrozenMap({"k": 1}), _FrozenMap({"k": 2})
    assert static_digest(a, argname="m") == static_digest(_FrozenMap({"k": 1}), argname="m")
    assert static_digest(a, argname="m") != static_digest(b, argname="m")
    assert static_digest(a, argname="m") != static_digest({"k": 1}, argname="m")  # class counts
    assert d(_FrozenMap({"a": 1, "b": 2})) != d(_FrozenMap({"b": 2, "a": 1}))  # in order


def test_flax_hashable_mapping_in_order() -> None:
    from flax.nnx.graph import HashableMapping

    ab, ba = {"a": 1, "b": 2}, {"b": 2, "a": 1}
    assert HashableMapping(ab) == HashableMapping(ba)  # its == ignores the order; kiln does not
    assert d(HashableMapping(ab)) == d(HashableMapping(ab))
    assert d(HashableMapping(ab)) != d(HashableMapping(ba))
    assert d(HashableMapping(ab)) != d(_FrozenMap(ab))


def test_unhashable_non_dict_mapping_is_still_refused() -> None:
    """``os.environ`` and other mutable mappings are not hashed by their items (the fingerprint
    walker counts ``os.environ`` by library version, never by the whole environment)."""
    import os

    with pytest.raises(StaticArgumentError, match="not hashable"):
        d(os.environ)


def test_operator_callables_by_what_they_call() -> None:
    """register_pytree_node_class registers methodcaller("tree_flatten") (eqx.nn.State):
    it was hashed by identity, so every warm start of such an argument traced again."""
    import operator

    def d(v):
        return static_digest(v, argname="f")

    assert d(operator.methodcaller("tree_flatten")) == d(operator.methodcaller("tree_flatten"))
    assert d(operator.methodcaller("a")) != d(operator.methodcaller("b"))
    assert d(operator.methodcaller("a", 1, k=2)) != d(operator.methodcaller("a", 1, k=3))
    assert d(operator.attrgetter("a.b")) != d(operator.attrgetter("a.c"))
    assert d(operator.itemgetter(1)) != d(operator.itemgetter(2))

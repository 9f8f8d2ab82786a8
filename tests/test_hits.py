"""Hit checker: an everyday program run twice, unchanged, hits on the second run.

The mirror of the staleness fuzzer (``test_staleness_fuzz.py``): where the fuzzer checks that an
*edited* program never gets a stale result, this test checks that an *unchanged* one is never
traced again. The second run of a program that changed nothing must load every jitted function
from the store (a hit, no trace, no lowering, no compile), give the first run's values, and
leave the store holding one executable per jitted function.

A corpus of small everyday programs (:data:`CORPUS`) is written into one folder, each program
its own package (``hc03b_logging``, ...) whose ``main`` module defines ``FUNCS`` (the names of
its jitted functions), ``ARG``, optionally ``CALLS`` (``{name: how(fn, ARG)}``: a loop, a key,
numpy around the call) and ``MUST_MISS`` (``{name: reason}``, below). Each template has *slots*
filled with *ingredients* drawn by ``random.Random(seed)``: numpy beside jax (``np.pi``,
``np.float32(2.0)``, ``np.arange``, ``np.linspace``, numpy on the host, ``jax.random.normal``
with numpy constants), process-varying globals the trace never reads (``os.getpid()``,
``time.time()``, ``uuid4``, ``datetime.now()``, ``np.random.seed(os.getpid())``, unseeded
draws, ``tempfile.mkdtemp()``, a counter dict updated on the host), loggers (``basicConfig``,
``logger.info`` / ``debug`` inside the trace and outside), tqdm bars (a module-level bar, a
loop of calls), static arguments (a plain class with ``__hash__`` / ``__eq__``, a static
``self``, a frozen dataclass, a NamedTuple, ``static_argnames``), closures and
``functools.partial``, random keys (as arguments and as globals), ``lax.scan`` / ``fori_loop`` /
``while_loop`` bodies, ``cond`` / ``switch`` / ``checkpoint``, ``grad`` / ``vmap`` inside, an
optax update (with and without donation), an equinox MLP (``filter_jit``), a flax.linen
``apply``, pytree arguments (``flax.struct``, ``register_dataclass``, NamedTuple, nested
containers), ``jax.jit(self._step)`` in ``__init__``, global config objects and stdlib values
(``datetime``, ``Decimal``, regex, ``deque``, ``Path``, ...) read while tracing, and what a trace's
read enters the key by (an environment variable, a memo's value from a file, a subclass
registry, a host callback through a module attribute, a library's setting such as equinox's
``EQX_ON_ERROR``) beside an unread variable set anew in every process. Every round
writes each template as many times as its largest slot has ingredients, every ingredient
once, so each round covers the whole corpus; the draw decides which ingredients meet in one
program.

Each round runs the corpus in two modes, each against a store of its own:

- decorated: the functions wrapped in ``kiln.jit`` (``kiln.filter_jit`` for equinox), run by
  ``python prog.py`` twice;
- zero-change: the same source with ``jax.jit`` (``eqx.filter_jit``), run by ``python -m kiln
  run --jit prog.py`` twice.

All programs of a mode run in one process per run (the fuzzer's ``DRIVER``). On the second
(warm) run every call must show ``hits >= 1`` and no miss, trace (kiln's, the ``TRACE()``
count, jax's), lowering or compile, and the first run's values exactly; the store (``kiln ls
--json``) must hold one executable per jitted function, the warm run must write none, and the
process must count no miss, trace or compile outside the calls. (The host code around a call
runs no eager jax operation: JAX compiles those in every process, outside kiln's jits, with the
kiln:// route off as in the whole suite; keys and states are made at import.)

A program that must miss on its second run says why: ``MUST_MISS = {"f": "reason"}``. The test
asserts that it misses, and that a third run with ``KILN_EXPLAIN=1`` (every program, one
process, as before) prints a reason containing ``reason``. The corpus has honest ones: a trace
that reads ``time.time()`` (``jax.jit`` bakes the clock in), and traces that bake a
process-varying global (``PID``, ``RUN_ID``, ``STARTED``) into the computation.

Ingredients in :data:`KNOWN_MISSES_TODAY` (gaps being fixed; empty the dict as fixes land)
and must-miss ingredients in :data:`KNOWN_HITS_TODAY` (kiln cannot see them) are run and
reported, never failed on. Every call that missed is explained from the ``KILN_EXPLAIN=1``
run. Settings (environment):

- ``KILN_HITS_SEED`` (default 11): the seed of round 0 (round ``r`` uses ``seed + r``);
- ``KILN_HITS_BUDGET_S`` (default 60): seconds of the test's own time; a further round
  starts only while the last one would fit (round 0 always runs; a round takes 25 to 50 s on
  2 cores, so CI runs one or two).

It prints ``hit check: seed S, N programs, M calls, warm: H hit, X missed (by ingredient:
...)``, a table per ingredient, and fails listing each call that missed (its ingredients and
the ``KILN_EXPLAIN`` reason) and the command that replays the seed::

    KILN_HITS_SEED=11 python -m pytest -m slow tests/test_hits.py -n 0 -s -p no:cacheprovider
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import string
import sys
import textwrap
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kiln_test_children import child_env, run_child

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("KILN_HITS_SEED", "11"))
BUDGET_S = float(os.environ.get("KILN_HITS_BUDGET_S", "60"))

# Ingredients (kinds) whose calls miss on an unchanged second run today, each with its cause
# (what KILN_EXPLAIN=1 says): run and reported, not failed on. Being fixed: empty the dict as
# the fixes land (the test says when an ingredient here hits everywhere).
KNOWN_MISSES_TODAY: dict[str, str] = {}
# Must-miss ingredients that hit today (a stale hit: the warm run gives the cold run's value),
# each with its cause: run and reported, not failed on.
KNOWN_HITS_TODAY: dict[str, str] = {
    "time.time() read while tracing": (
        "the clock is not keyed (docs/never-stale.md, 'What kiln cannot see'): the warm run "
        "loads the executable with the cold run's time baked in"),
}


@dataclasses.dataclass(frozen=True)
class Ingredient:
    """One choice for a slot: its name, the text for the slot's placeholder, texts for other
    placeholders (``extra``), and its kind (what :data:`KNOWN_MISSES_TODAY` and the summary
    count by; by default its name)."""

    name: str
    text: str = ""
    extra: dict[str, str] = dataclasses.field(default_factory=dict)
    kind: str = ""

    @property
    def group(self) -> str:
        return self.kind or self.name


def ing(name: str, text: str = "", kind: str = "", **extra: str) -> Ingredient:
    return Ingredient(name, textwrap.dedent(text).strip("\n"), extra, kind)


@dataclasses.dataclass(frozen=True)
class Slot:
    """A place in a template and the ingredients it takes; ``pick`` of them per program."""

    options: tuple[Ingredient, ...]
    pick: int = 1


@dataclasses.dataclass(frozen=True)
class Template:
    """One program of the corpus: the text of its ``main.py`` (``$slot`` placeholders, and
    ``$jit``, ``$filter_jit``, ``$kiln``: the mode's), its slots, per function the slots it
    uses (default: all) and the ingredients it always has (``fixed``)."""

    name: str
    main: str
    slots: dict[str, Slot] = dataclasses.field(default_factory=dict)
    uses: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    fixed: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


HEAD = """\
import functools

import jax
import jax.numpy as jnp
import numpy as np
$kiln
from kiln_probe import TRACE

ARG = np.array([0.5, 1.25, -2.0], dtype=np.float32)
"""

CORPUS: list[Template] = [
    Template(
        "numpy_side",
        HEAD + """\
ARG = $arg
C = $const
NOISE = $noise
KEY = $key
GLOBAL_KEY = $gkey


@$jit
def f_const(x):
    TRACE()
    return x * C + jnp.sum(x) / np.pi + np.float32(2.0)


@$jit
def f_random(key, x):
    TRACE()
    return x + NOISE * jax.random.normal(key, x.shape) * np.sqrt(2.0)


@$jit
def f_global_key(x):
    TRACE()
    return x + jax.random.normal(GLOBAL_KEY, x.shape) * np.pi


def _host(f, x):
    y = np.asarray(f(x))
    return np.clip(y, -np.inf, np.float32(10.0)) + np.arange(3) * np.pi


CALLS = {"f_const": _host, "f_random": lambda f, x: f(KEY, x)}
FUNCS = ["f_const", "f_random", "f_global_key"]
""",
        {
            "arg": Slot((
                ing("ARG from np.linspace", "np.linspace(0.0, 1.0, 3, dtype=np.float32)"),
                ing("ARG from np.arange", "(np.arange(3) / np.float32(4.0)).astype(np.float32)"),
                ing("ARG from np.random.default_rng(0)",
                    "np.random.default_rng(0).standard_normal(3).astype(np.float32)"),
            )),
            "const": Slot((
                ing("np.pi constant", "np.pi"),
                ing("np.float32(2.0) constant", "np.float32(2.0)"),
                ing("np.arange(3) constant", "np.arange(3)"),
                ing("np.linspace constant", "np.linspace(-1.0, 1.0, 3)"),
            )),
            "noise": Slot((
                ing("np.float32 noise scale", "np.float32(0.1)"),
                ing("np.pi / 10 noise scale", "np.pi / 10"),
                ing("np.ones noise scale", "0.5 * np.ones(3, dtype=np.float32)"),
            )),
            "key": Slot((
                ing("jax.random.key(0)", "jax.random.key(0)"),
                ing("jax.random.PRNGKey(1)", "jax.random.PRNGKey(1)"),
                ing("jax.random.key of a numpy int", "jax.random.key(np.int64(7))"),
            )),
            "gkey": Slot((
                ing("global jax.random.key read while tracing", "jax.random.key(3)"),
                ing("global PRNGKey read while tracing", "jax.random.PRNGKey(3)"),
                ing("global split key read while tracing",
                    "jax.random.split(jax.random.key(3))[1]"),
            )),
        },
        uses={"f_const": ("arg", "const"), "f_random": ("arg", "noise", "key"),
              "f_global_key": ("arg", "gkey")},
        fixed={"f_const": ("numpy on the host around the call",),
               "f_random": ("jax.random.normal with numpy constants",)},
    ),
    Template(
        "process_globals",
        """\
import atexit
import datetime
import os
import random
import shutil
import tempfile
import time
import uuid

import jax
import jax.numpy as jnp
import numpy as np
$kiln
from kiln_probe import TRACE

HOST_INFO = {}
$globals
COUNTS = {"calls": 0, "total": 0.0}
SCALE = 2.0
ARG = np.array([0.5, 1.25, -2.0], dtype=np.float32)


def _shift(x):
    return x + 1.0


@$jit
def f_pure(x):
    TRACE()
    return jnp.sin(x) * SCALE + _shift(x)


@$jit
def f_pair(x, y):
    TRACE()
    return x * y - jnp.mean(x)


def describe(y):
    # host code of the same module reading the process-varying globals, never traced
    return f"{sorted(HOST_INFO.items())} {float(np.asarray(y).sum()):.3f}"


def _counted(f, x):
    COUNTS["calls"] += 1
    y = f(x)
    COUNTS["total"] += float(np.asarray(y).sum())
    COUNTS["last"] = describe(y)
    return y


CALLS = {"f_pure": _counted, "f_pair": lambda f, x: _counted(lambda v: f(v, v * 2.0), x)}
FUNCS = ["f_pure", "f_pair"]
""",
        {"globals": Slot((
            ing("PID = os.getpid() at import", 'PID = os.getpid()\nHOST_INFO["pid"] = PID'),
            ing("STARTED = time.time() at import",
                'STARTED = time.time()\nHOST_INFO["started"] = STARTED'),
            ing("RUN_ID = uuid.uuid4().hex at import",
                'RUN_ID = uuid.uuid4().hex\nHOST_INFO["run"] = RUN_ID'),
            ing("NOW = datetime.datetime.now() at import",
                'NOW = datetime.datetime.now()\nHOST_INFO["now"] = NOW.isoformat()'),
            ing("np.random.seed(os.getpid()) at import",
                'np.random.seed(os.getpid())\nHOST_INFO["seeded"] = float(np.random.rand())'),
            ing("unseeded np.random.rand() at import",
                'DRAWN = np.random.rand(3)\nHOST_INFO["drawn"] = DRAWN.tolist()'),
            ing("random.random() at import",
                'JITTER = random.random()\nHOST_INFO["jitter"] = JITTER'),
            ing("tempfile.mkdtemp() at import",
                'TMP = tempfile.mkdtemp(prefix="hc-")\natexit.register(shutil.rmtree, TMP, True)\n'
                'HOST_INFO["tmp"] = TMP'),
        ), pick=3)},
        fixed={f: ("counter dict updated outside the trace",) for f in ("f_pure", "f_pair")},
    ),
    Template(
        "logging",
        """\
import logging
import sys
import uuid

import jax
import jax.numpy as jnp
import numpy as np
$kiln
from kiln_probe import TRACE

logger = logging.getLogger(__name__)
$log_config
RUN_ID = uuid.uuid4().hex
ARG = np.array([0.5, 1.25, -2.0], dtype=np.float32)


@$jit
def f_logged(x):
    TRACE()
    $trace_log
    return jnp.tanh(x) * 3.0


@$jit
def f_log_run(x):
    TRACE()
    logger.info("tracing f_log_run in run %s", RUN_ID)
    return jnp.cos(x) + 1.0


def _host(f, x):
    logger.info("calling on %s", x.shape)
    y = f(x)
    logger.debug("result %s", float(np.asarray(y).sum()))
    return y


CALLS = {"f_logged": _host, "f_log_run": _host}
FUNCS = ["f_logged", "f_log_run"]
""",
        {
            "log_config": Slot((
                ing("logging.basicConfig(level=INFO)", "logging.basicConfig(level=logging.INFO)"),
                ing("logging.basicConfig(level=WARNING, format=...)",
                    'logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")'),
                ing("logging.basicConfig(level=DEBUG)", "logging.basicConfig(level=logging.DEBUG)"),
                ing("own logger at DEBUG with a handler",
                    "logger.setLevel(logging.DEBUG)\n"
                    "logger.addHandler(logging.StreamHandler(sys.stderr))"),
            )),
            "trace_log": Slot((
                ing("logger.info inside the trace",
                    'logger.info("tracing f_logged: %s %s", x.shape, x.dtype)'),
                ing("logger.debug inside the trace", 'logger.debug("tracing f_logged %s", x)'),
                ing("logger.warning inside the trace", 'logger.warning("tracing f_logged")'),
                ing("print inside the trace", 'print("tracing f_logged", x.shape)'),
            )),
        },
        uses={"f_logged": ("log_config", "trace_log"), "f_log_run": ("log_config",)},
        fixed={"f_logged": ("logger.info / debug outside the trace",),
               "f_log_run": ("trace-time log line naming a process-varying global",)},
    ),
    Template(
        "tqdm",
        """\
import sys

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm, trange
$kiln
from kiln_probe import TRACE

BAR = $bar
ARG = np.array([0.5, 1.25, -2.0], dtype=np.float32)


@$jit
def step(x):
    TRACE()
    return x * 0.5 + jnp.cos(x)


def _loop(f, x):
    $loop
        x = f(x)
        BAR.update(1)
    BAR.set_postfix(last=float(np.asarray(x).sum()))
    return x


CALLS = {"step": _loop}
FUNCS = ["step"]
""",
        {
            "bar": Slot((
                ing("module-level tqdm bar", 'tqdm(total=100, desc="hc", leave=False)'),
                ing("module-level disabled tqdm bar", "tqdm(total=100, disable=True)"),
                ing("module-level tqdm bar on stderr, no min interval",
                    "tqdm(total=100, file=sys.stderr, mininterval=0.0)"),
            )),
            "loop": Slot((
                ing("loop over tqdm(range(4))", "for _ in tqdm(range(4), leave=False):"),
                ing("loop over trange(4)", 'for _ in trange(4, desc="steps", leave=False):'),
                ing("loop over enumerate(tqdm(...))",
                    "for _i, _ in enumerate(tqdm(range(4), disable=True)):"),
            )),
        },
        fixed={"step": ("tqdm loop calling the jitted function",)},
    ),
    Template(
        "static_objects",
        """\
import dataclasses
import enum
import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np
$kiln
from kiln_probe import TRACE

ARG = np.array([0.5, 1.25, -2.0], dtype=np.float32)


class Act(enum.Enum):
    TANH = "tanh"
    RELU = "relu"
    SIN = "sin"


def _act(act, y):
    return {Act.TANH: jnp.tanh, Act.RELU: jax.nn.relu, Act.SIN: jnp.sin}[act](y)


class Inner:
    def __init__(self, k):
        self.k = k

    def __hash__(self):
        return hash(self.k)

    def __eq__(self, other):
        return type(other) is Inner and other.k == self.k


class Cfg:
    def __init__(self, scale, name, dims, inner, act):
        self.scale = scale
        self.name = name
        self.dims = dims
        self.inner = inner
        self.act = act

    def _fields(self):
        return (self.scale, self.name, self.dims, self.inner, self.act)

    def __hash__(self):
        return hash(self._fields())

    def __eq__(self, other):
        return type(other) is Cfg and other._fields() == self._fields()


CFG = Cfg($scale, "$name", $dims, Inner($k), Act.$act)


@functools.partial($jit, static_argnums=1)
def f_cfg(x, cfg):
    TRACE()
    y = x * cfg.scale + cfg.inner.k + len(cfg.name) + sum(cfg.dims)
    return _act(cfg.act, y)


class Model:
    def __init__(self, w, depth, act):
        self.w = w
        self.depth = depth
        self.act = act

    def __hash__(self):
        return hash((self.w, self.depth, self.act))

    def __eq__(self, other):
        return type(other) is Model and (other.w, other.depth, other.act) == (
            self.w, self.depth, self.act)

    @functools.partial($jit, static_argnums=0)
    def apply(self, x):
        TRACE()
        for _ in range(self.depth):
            x = _act(self.act, x * self.w)
        return x


MODEL = Model($scale, $depth, Act.$act)
model_apply = MODEL.apply


@dataclasses.dataclass(frozen=True)
class Opts:
    lr: float = 0.1
    name: str = "opts"
    sizes: tuple = (1, 2)
    act: Act = Act.TANH


class Pair(typing.NamedTuple):
    a: float
    b: int


@functools.partial($jit, static_argnums=(1, 2))
def f_dataclass(x, opts, pair):
    TRACE()
    return _act(opts.act, x * opts.lr * pair.a) + pair.b + len(opts.sizes)


@functools.partial($jit, static_argnames=("training",))
def f_flag(x, training=False):
    TRACE()
    return jnp.where(x > 0, x * 2.0, x) if training else x - 1.0


CALLS = {"f_cfg": lambda f, x: f(x, CFG),
         "f_dataclass": lambda f, x: f(x, Opts(lr=$scale, act=Act.$act), Pair($k, $depth)),
         "f_flag": lambda f, x: f(x, training=$flag)}
FUNCS = ["f_cfg", "model_apply", "f_dataclass", "f_flag"]
""",
        {
            "scale": Slot((ing("static float 2.0", "2.0"), ing("static float -0.5", "-0.5"),
                           ing("static float 1.5", "1.5"))),
            "name": Slot((ing("static str 'alpha'", "alpha"),
                          ing("static non-ascii str", "β-model"), ing("static empty str", ""))),
            "dims": Slot((ing("static tuple (1, 2)", "(1, 2)"), ing("static empty tuple", "()"),
                          ing("static tuple (3,)", "(3,)"))),
            "k": Slot((ing("nested static object k=1.0", "1.0"),
                       ing("nested static object k=0.25", "0.25"))),
            "act": Slot((ing("static enum TANH", "TANH"), ing("static enum RELU", "RELU"),
                         ing("static enum SIN", "SIN"))),
            "depth": Slot((ing("static int 1", "1"), ing("static int 2", "2"),
                           ing("static int 3", "3"))),
            "flag": Slot((ing("static_argnames training=True", "True"),
                          ing("static_argnames training=False", "False"))),
        },
        uses={"f_cfg": ("scale", "name", "dims", "k", "act"),
              "model_apply": ("scale", "depth", "act"),
              "f_dataclass": ("scale", "k", "depth", "act"), "f_flag": ("flag",)},
        fixed={
            "f_cfg": ("plain class with __hash__/__eq__ as a static argument",),
            "model_apply": ("static self of a method jitted with partial(jit, static_argnums=0)",),
            "f_dataclass": ("frozen dataclass static argument", "NamedTuple static argument"),
            "f_flag": ("bool static argument by name (static_argnames)",),
        },
    ),
    Template(
        "closures",
        HEAD + """\
OFFSET = 0.25
KEY = $key


def make_scaler(c):
    def scaled(x):
        TRACE()
        return x * c + OFFSET

    return scaled


f_closure = $jit(make_scaler($c))


@$jit
def _gated(x, scale):
    TRACE()
    return jnp.tanh(x) * scale


f_partial = functools.partial(_gated, scale=$c)

$loop


@$jit
def f_loop(x):
    TRACE()
    return $loop_expr


$transform


@$jit
def f_transform(x):
    TRACE()
    return $transform_expr


$control


@$jit
def f_control(x):
    TRACE()
    return $control_expr


@$jit
def f_keys(key, x):
    TRACE()
    k1, k2 = jax.random.split(key)
    return x * jax.random.uniform(k1, x.shape) + jax.random.normal(k2, x.shape)


CALLS = {"f_keys": lambda f, x: f(KEY, x)}
FUNCS = ["f_closure", "f_partial", "f_loop", "f_transform", "f_control", "f_keys"]
""",
        {
            "c": Slot((ing("closure / partial value 2.0", "2.0"),
                       ing("closure / partial value np.float32(1.5)", "np.float32(1.5)"),
                       ing("closure / partial value -0.5", "-0.5"))),
            "loop": Slot((
                ing("lax.scan body", """\
                    def _body(carry, xi):
                        return carry * 0.9 + xi, carry * xi
                    """, loop_expr="jax.lax.scan(_body, jnp.float32(0.0), x)[1]"),
                ing("lax.fori_loop body", """\
                    def _step(i, v):
                        return v * 0.5 + i
                    """, loop_expr="jax.lax.fori_loop(0, 4, _step, x)"),
                ing("lax.fori_loop lambda body", "",
                    loop_expr="jax.lax.fori_loop(0, 3, lambda i, v: jnp.sin(v) + i, x)"),
                ing("lax.while_loop body", """\
                    def _cond(s):
                        return s[0] < 3


                    def _wbody(s):
                        return s[0] + 1, s[1] * 1.5
                    """, loop_expr="jax.lax.while_loop(_cond, _wbody, (0, x))[1]"),
            )),
            "transform": Slot((
                ing("jax.grad inside", """\
                    def _loss(w, x):
                        return jnp.sum((w * x - 1.0) ** 2)
                    """, transform_expr="jax.grad(_loss)(x, x * 2.0)"),
                ing("jax.vmap inside", """\
                    def _row(r):
                        return jnp.dot(r, r) + r[0]
                    """, transform_expr="jax.vmap(_row)(jnp.outer(x, x))"),
                ing("jax.vmap of jax.grad inside", """\
                    def _loss(w, x):
                        return jnp.sum((w * x - 1.0) ** 2)
                    """, transform_expr="jax.vmap(jax.grad(_loss), in_axes=(0, None))("
                                        "jnp.outer(x, x), x)"),
                ing("jitted helper called inside", """\
                    @$jit
                    def _helper(v):
                        return v * 3.0 - 1.0
                    """, transform_expr="_helper(x) + 1.0"),
            )),
            "control": Slot((
                ing("lax.cond with lambda branches", "", control_expr=(
                    "jax.lax.cond(jnp.sum(x) > 0, lambda v: v * 2.0, lambda v: -v, x)")),
                ing("lax.switch with function branches", """\
                    def _neg(v):
                        return -v


                    def _dbl(v):
                        return v * 2.0
                    """, control_expr="jax.lax.switch(1, [_neg, _dbl, jnp.sin], x)"),
                ing("jax.checkpoint inside", """\
                    def _block(v):
                        return jnp.sin(v) * 2.0
                    """, control_expr="jax.checkpoint(_block)(x) + 1.0"),
                ing("functools.lru_cache helper inside", """\
                    @functools.lru_cache
                    def _table(n):
                        return np.arange(n, dtype=np.float32) / n
                    """, control_expr="x + _table(3)"),
            )),
            "key": Slot((
                ing("jax.random.key(0)", "jax.random.key(0)"),
                ing("jax.random.PRNGKey(1)", "jax.random.PRNGKey(1)"),
                ing("jax.random.key of a numpy int", "jax.random.key(np.int64(7))"),
            )),
        },
        uses={"f_closure": ("c",), "f_partial": ("c",), "f_loop": ("loop",),
              "f_transform": ("transform",), "f_control": ("control",), "f_keys": ("key",)},
        fixed={"f_closure": ("closure",),
               "f_partial": ("functools.partial of the jitted function",),
               "f_keys": ("jax.random.split / uniform / normal inside",)},
    ),
    Template(
        "optax",
        """\
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
$kiln
from kiln_probe import TRACE

ARG = np.linspace(-1.0, 1.0, 8, dtype=np.float32)
OPT = $opt
PARAMS = {"w": jnp.ones((8,)), "b": jnp.zeros(())}
STATE = OPT.init(PARAMS)


def loss_fn(params, x):
    return jnp.mean((params["w"] * x + params["b"] - jnp.sin(x)) ** 2)


@$donate
def train_step(params, opt_state, x):
    TRACE()
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _train(f, x):
    params, state = PARAMS, STATE
    losses = []
    for _ in range(3):
        params, state, loss = f(params, state, x)
        losses.append(float(loss))
    return params, np.asarray(losses)


CALLS = {"train_step": _train}
FUNCS = ["train_step"]
""",
        {"opt": Slot((
            ing("optax.adam", "optax.adam(1e-2)"),
            ing("optax.sgd with momentum", "optax.sgd(0.1, momentum=0.9)"),
            ing("optax.adamw", "optax.adamw(1e-3)"),
            ing("optax.chain(clip_by_global_norm, adam)",
                "optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))"),
        )),
         "donate": Slot((ing("train step without donation", "$jit"),
                         ing("train step donating params and state",
                             "functools.partial($jit, donate_argnums=(0, 1))")))},
        fixed={"train_step": ("optax optimizer update",)},
    ),
    Template(
        "equinox",
        """\
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
$kiln
from kiln_probe import TRACE

ARG = np.linspace(-1.0, 1.0, 6, dtype=np.float32).reshape(3, 2)
MLP = eqx.nn.MLP(2, 2, 4, 1, activation=$act, key=jax.random.key($seed))


@$filter_jit
def f_mlp(model, x):
    TRACE()
    return jax.vmap(model)(x)


@$filter_jit
def f_loss_grad(model, x):
    TRACE()
    return eqx.filter_value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)


CALLS = {"f_mlp": lambda f, x: f(MLP, x), "f_loss_grad": lambda f, x: f(MLP, x)}
FUNCS = ["f_mlp", "f_loss_grad"]
""",
        {
            "act": Slot((ing("equinox MLP relu", "jax.nn.relu"),
                         ing("equinox MLP tanh", "jnp.tanh"),
                         ing("equinox MLP softplus", "jax.nn.softplus"))),
            "seed": Slot((ing("equinox init key 0", "0"), ing("equinox init key 1", "1"))),
        },
        fixed={"f_mlp": ("equinox MLP through filter_jit",),
               "f_loss_grad": ("equinox MLP through filter_jit",)},
    ),
    Template(
        "flax",
        """\
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
$kiln
from kiln_probe import TRACE

ARG = np.linspace(-1.0, 1.0, 6, dtype=np.float32).reshape(2, 3)


class MLP(nn.Module):
    features: int = $features

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.features)(x)
        x = $act(x)
        return nn.Dense(1)(x)


MODEL = MLP()
PARAMS = MODEL.init(jax.random.key(0), jnp.ones((2, 3)))


@$jit
def f_flax(params, x):
    TRACE()
    return MODEL.apply(params, x)


@$jit
def f_flax_grad(params, x):
    TRACE()
    return jax.grad(lambda p: jnp.mean(MODEL.apply(p, x) ** 2))(params)


CALLS = {"f_flax": lambda f, x: f(PARAMS, x), "f_flax_grad": lambda f, x: f(PARAMS, x)}
FUNCS = ["f_flax", "f_flax_grad"]
""",
        {
            "act": Slot((ing("flax nn.relu", "nn.relu"), ing("flax nn.gelu", "nn.gelu"),
                         ing("flax nn.tanh", "nn.tanh"))),
            "features": Slot((ing("flax 4 features", "4"), ing("flax 8 features", "8"))),
        },
        fixed={"f_flax": ("flax.linen apply",), "f_flax_grad": ("flax.linen apply",)},
    ),
    Template(
        "pytrees",
        HEAD + """\
import dataclasses
import typing

import flax.struct


@flax.struct.dataclass
class State:
    w: jax.Array
    step: int
    name: str = flax.struct.field(pytree_node=False, default="state")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["a", "b"],
                   meta_fields=["tag"])
@dataclasses.dataclass
class Affine:
    a: jax.Array
    b: jax.Array
    tag: str = "affine"


class Batch(typing.NamedTuple):
    x: np.ndarray
    y: np.ndarray


STATE = State(np.ones(3, dtype=np.float32), $step)
AFFINE = Affine(np.full(3, 2.0, dtype=np.float32), np.zeros(3, dtype=np.float32))
BATCH = Batch(np.linspace(0.0, 1.0, 3, dtype=np.float32), np.ones(3, dtype=np.float32))
TREE = {"w": [np.ones(2, dtype=np.float32), (np.float32(3.0),)], "b": None}


@$jit
def f_state(s, x):
    TRACE()
    return State(s.w * x, s.step + 1, s.name)


@$jit
def f_affine(p, x):
    TRACE()
    return p.a * x + p.b


@$jit
def f_batch(b):
    TRACE()
    return jnp.mean((b.x - b.y) ** 2)


@$jit
def f_tree(tree, x):
    TRACE()
    return jax.tree.map(lambda v: v * jnp.sum(x), tree)


CALLS = {"f_state": lambda f, x: f(STATE, x), "f_affine": lambda f, x: f(AFFINE, x),
         "f_batch": lambda f, x: f(BATCH), "f_tree": lambda f, x: f(TREE, x)}
FUNCS = ["f_state", "f_affine", "f_batch", "f_tree"]
""",
        {"step": Slot((ing("flax.struct.dataclass with a python int leaf", "0"),
                       ing("flax.struct.dataclass with an np.int32 leaf", "np.int32(0)")))},
        uses={"f_state": ("step",), "f_affine": (), "f_batch": (), "f_tree": ()},
        fixed={"f_state": ("flax.struct.dataclass argument",),
               "f_affine": ("jax.tree_util.register_dataclass argument",),
               "f_batch": ("NamedTuple pytree argument",),
               "f_tree": ("nested dict / list / tuple / None argument",)},
    ),
    Template(
        "bound_method",
        HEAD + """\
import logging
import time
import uuid


class Trainer:
    def __init__(self, lr):
        self.lr = lr
        $field
        self.step = $jit(self._step)

    def _step(self, x):
        TRACE()
        return jnp.tanh(x) * self.lr


TRAINER = Trainer(0.5)
trainer_step = TRAINER.step
FUNCS = ["trainer_step"]
""",
        {"field": Slot((
            ing("bound-method self with plain fields", 'self.name = "trainer"\n'
                '        self.sizes = (4, 2)'),
            ing("bound-method self holding a logger", 'self.log = logging.getLogger("trainer")'),
            ing("bound-method self with an unread time.time() field",
                "self.started = time.time()",
                kind="jitted bound method whose self has an unread process-varying field"),
            ing("bound-method self with an unread uuid4 field", "self.run_id = uuid.uuid4().hex",
                kind="jitted bound method whose self has an unread process-varying field"),
        ))},
        fixed={"trainer_step": ("jax.jit(self._step) in __init__",)},
    ),
    # ---- programs that must miss on their second run, and say why
    Template(
        "must_miss",
        """\
import os
import time
import uuid

import jax
import jax.numpy as jnp
import numpy as np
$kiln
from kiln_probe import TRACE

PID = os.getpid()
STARTED = time.time()
RUN_ID = uuid.uuid4().hex
SCALE = 1.5
ARG = np.array([0.5, 1.25, -2.0], dtype=np.float32)


@$jit
def f_baked(x):
    TRACE()
    return x + $baked


@$jit
def f_neighbour(x):
    TRACE()
    return x * SCALE


MUST_MISS = {"f_baked": "$reason"}
FUNCS = ["f_baked", "f_neighbour"]
""",
        {"baked": Slot((
            ing("time.time() read while tracing", "jnp.float32(time.time() % 1000.0)",
                reason="time.time"),
            ing("PID baked into the computation", "PID", reason="PID"),
            ing("RUN_ID baked into the computation", "int(RUN_ID[:6], 16)", reason="RUN_ID"),
            ing("STARTED baked into the computation", "jnp.float32(STARTED % 1000.0)",
                reason="STARTED"),
        ))},
        uses={"f_baked": ("baked",), "f_neighbour": ()},
        fixed={"f_neighbour": ("stable neighbour of a must-miss function",)},
    ),
    # ---- gaps named by the issue (fixed), one program each
    Template(
        "static_unread_field",
        HEAD + """\
import datetime
import os
import time
import uuid


class Model:
    def __init__(self, w):
        self.w = w
        $field

    def __hash__(self):
        return hash(self.w)

    def __eq__(self, other):
        return type(other) is Model and other.w == self.w

    @functools.partial($jit, static_argnums=0)
    def apply(self, x):
        TRACE()
        return jnp.tanh(x * self.w)


MODEL = Model(1.5)
model_apply = MODEL.apply
FUNCS = ["model_apply"]
""",
        {"field": Slot(tuple(
            ing(f"static self with an unread {what} field", text,
                kind="static object with an unread process-varying field")
            for what, text in (("time.time()", "self.created = time.time()"),
                               ("uuid4", "self.run_id = uuid.uuid4().hex"),
                               ("datetime.now()", "self.started = datetime.datetime.now()"),
                               ("os.getpid()", "self.pid = os.getpid()"))))},
    ),
    Template(
        "static_unread_state",
        HEAD + """\
import threading

from tqdm import tqdm


class Stepper:
    def __init__(self, w):
        self.w = w
        $field

    def __hash__(self):
        return hash(self.w)

    def __eq__(self, other):
        return type(other) is Stepper and other.w == self.w

    @functools.partial($jit, static_argnums=0)
    def step(self, x):
        TRACE()
        return x * self.w + 1.0


STEPPER = Stepper(0.5)
stepper_step = STEPPER.step
FUNCS = ["stepper_step"]
""",
        {"field": Slot(tuple(
            ing(f"static self holding an unread {what}", text,
                kind="static self holding an unread tqdm bar or lock")
            for what, text in (("tqdm bar", "self.bar = tqdm(total=3, leave=False)"),
                               ("disabled tqdm bar", "self.bar = tqdm(total=3, disable=True)"),
                               ("threading.Lock", "self.lock = threading.Lock()"))))},
    ),
    Template(
        "debug_callback",
        HEAD + """\
import os
import uuid

PID = os.getpid()
RUN_ID = uuid.uuid4().hex


def _show(v):
    print("hc debug", RUN_ID, float(np.asarray(v).sum()))


@$jit
def f_callback(x):
    TRACE()
    y = jnp.sin(x) * 2.0
    $callback
    return y


FUNCS = ["f_callback"]
""",
        {"callback": Slot((
            ing("debug callback lambda reading PID",
                'jax.debug.callback(lambda v: print("hc debug", PID, np.asarray(v).sum()), y)',
                kind="debug callback lambda reading a process-varying global"),
            ing("debug callback lambda reading RUN_ID",
                'jax.debug.callback(lambda v: print("hc debug", RUN_ID, np.asarray(v).sum()), y)',
                kind="debug callback lambda reading a process-varying global"),
            ing("debug callback of a module function reading a process-varying global",
                "jax.debug.callback(_show, y)"),
            ing("jax.debug.print", 'jax.debug.print("hc debug y={y}", y=y)'),
        ))},
    ),
    # ---- misses this checker found, now fixed: a global config object and stdlib values
    # read while tracing must hit
    Template(
        "global_config",
        HEAD + """\
import argparse
import dataclasses
import os
import time
import types
import uuid

$config


@$jit
def f_config(x):
    TRACE()
    return x * $read + 1.0


FUNCS = ["f_config"]
""",
        {"config": Slot(tuple(
            ing(name, text, kind=kind, read=read)
            for name, text, read, kind in (
                ("argparse.Namespace config with an unread seed=os.getpid()",
                 "ARGS = argparse.Namespace(lr=0.1, seed=os.getpid())", "ARGS.lr", ""),
                ("SimpleNamespace config with an unread run name from time.time()",
                 'CFG = types.SimpleNamespace(lr=0.1, run_name=f"run-{time.time()}")', "CFG.lr",
                 ""),
                ("config dict with an unread uuid4 entry",
                 'CONFIG = {"lr": 0.1, "run_id": uuid.uuid4().hex}', 'CONFIG["lr"]',
                 ""),
                ("dataclass config instance with an unread time.time() field", """\
                    @dataclasses.dataclass
                    class RunConfig:
                        lr: float = 0.1
                        started: float = dataclasses.field(default_factory=time.time)


                    RUN = RunConfig()
                    """, "RUN.lr", ""),
            )))},
    ),
    Template(
        "stdlib_values",
        HEAD + """\
import collections
import datetime
import decimal
import fractions
import pathlib
import re

START = datetime.date(2024, 3, 1)
STEP = datetime.timedelta(minutes=90)
RATE = decimal.Decimal("0.25")
PATTERN = re.compile(r"layer_(\\d+)")
HISTORY = collections.deque([1.0, 2.0], maxlen=4)
DATA = pathlib.Path("data") / "train.csv"
SHARE = fractions.Fraction(1, 4)
WEIGHTS = collections.OrderedDict(a=1.5, b=-0.5)


@$jit
def f_date(x):
    TRACE()
    return x * START.month


@$jit
def f_timedelta(x):
    TRACE()
    return x * (STEP.total_seconds() / 3600.0)


@$jit
def f_decimal(x):
    TRACE()
    return x * float(RATE)


@$jit
def f_regex(x):
    TRACE()
    return x * int(PATTERN.match("layer_3").group(1))


@$jit
def f_deque(x):
    TRACE()
    return x * HISTORY[-1]


@$jit
def f_path(x):
    TRACE()
    return x * len(DATA.suffix)


@$jit
def f_fraction(x):
    TRACE()
    return x * float(SHARE)


@$jit
def f_ordereddict(x):
    TRACE()
    return x * WEIGHTS["a"] + WEIGHTS["b"]


FUNCS = ["f_date", "f_timedelta", "f_decimal", "f_regex", "f_deque", "f_path", "f_fraction",
         "f_ordereddict"]
""",
        fixed={
            "f_date": ("datetime.date global read while tracing",),
            "f_timedelta": ("datetime.timedelta global read while tracing",),
            "f_decimal": ("decimal.Decimal global read while tracing",),
            "f_regex": ("compiled regex global read while tracing",),
            "f_deque": ("collections.deque global read while tracing",),
            "f_path": ("pathlib.Path global read while tracing",),
            "f_fraction": ("fractions.Fraction global read while tracing",),
            "f_ordereddict": ("OrderedDict global read while tracing",),
        },
    ),
    Template(
        # what issue 43 keys while tracing: each must enter the key only because the trace read
        # it, and an unchanged program must hit (beside it, a process-varying variable unread)
        "read_while_tracing",
        HEAD + """\
import json
import os
import types
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
os.environ["HC_RUN_ID"] = uuid.uuid4().hex  # set in every process, never read while tracing
$setup


@$jit
def f_read(x):
    TRACE()
    return $body


FUNCS = ["f_read"]
""",
        {"setup": Slot((
            ing("environment variable read while tracing",
                'os.environ.setdefault("HC_SCALE", "2.5")',
                body='x * float(os.environ.get("HC_SCALE", "1"))'),
            ing("os.getenv of an unset variable while tracing", "",
                body='x * (2.0 if os.getenv("HC_NEVER_SET") is None else 3.0)'),
            ing("lru_cache of a file read while tracing", """\
                import functools

                CFG = HERE / "cfg.json"
                if not CFG.exists():
                    CFG.write_text('{"scale": 1.5}')


                @functools.lru_cache
                def scale():
                    return json.loads(CFG.read_text())["scale"]
                """, body="x * scale()"),
            ing("subclass registry walked while tracing", """\
                class Op:
                    def __call__(self, x):
                        raise NotImplementedError


                class Double(Op):
                    def __call__(self, x):
                        return x * 2.0


                class Shift(Op):
                    def __call__(self, x):
                        return x + 1.0


                def apply_all(x):
                    for cls in Op.__subclasses__():
                        x = cls()(x)
                    return x
                """, body="apply_all(x)"),
            ing("host callback through a module attribute", """\
                def _host_square(v):
                    return (np.asarray(v) ** 2).astype(np.float32)


                ops = types.SimpleNamespace(transform=None)
                ops.transform = _host_square
                """, body="jax.pure_callback(ops.transform, "
                          "jax.ShapeDtypeStruct(x.shape, x.dtype), x) + 1.0"),
            ing("a library setting read while tracing (equinox's EQX_ON_ERROR)",
                "import equinox as eqx",
                body='eqx.error_if(x, jnp.any(x > 100.0), "too big") * 2.0'),
        ))},
    ),
]

# The mode's spelling of the placeholders every template may use
MODES: dict[str, dict[str, str]] = {
    "kiln.jit": {"jit": "kiln.jit", "filter_jit": "kiln.filter_jit", "kiln": "import kiln"},
    "kiln run --jit": {"jit": "jax.jit", "filter_jit": "eqx.filter_jit", "kiln": ""},
}
MAIN: dict[str, tuple[str, ...]] = {
    "kiln.jit": ("prog.py",),
    "kiln run --jit": ("-m", "kiln", "run", "--jit", "prog.py"),
}

# ----------------------------------------------------------------------------------------------
# The driver: prog.py, run in each fresh process with the package names to run
# ----------------------------------------------------------------------------------------------
DRIVER = '''\
import importlib
import logging
import sys

names = sys.argv[1:]
mods = {n: importlib.import_module(n + ".main") for n in names}  # all imports first


class _Reasons(logging.Handler):
    """kiln's log lines (its miss reasons with KILN_EXPLAIN=1), kept per call."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


reasons = _Reasons()
logging.getLogger("kiln").addHandler(reasons)
explained = {}
for n, m in mods.items():
    calls = getattr(m, "CALLS", {})
    for fname in m.FUNCS:
        start = len(reasons.lines)
        call(f"{n}.{fname}", calls.get(fname, lambda f, x: f(x)), getattr(m, fname), m.ARG)
        explained[f"{n}.{fname}"] = reasons.lines[start:]
report(explain=explained, must_miss={n: getattr(m, "MUST_MISS", {}) for n, m in mods.items()})
'''

# (after a tqdm bar's control characters, on the same line)
SUMMARY = re.compile(r"kiln: hits: (\d+), misses: (\d+), traces: (\d+), compiles: (\d+)")
COUNTS = ("hits", "misses", "traces", "compiles")


@dataclasses.dataclass
class Instance:
    """One program of the corpus written into a folder: its package and ingredients."""

    template: Template
    package: str
    chosen: dict[str, list[Ingredient]]

    def render(self, mode: str) -> str:
        values: dict[str, str] = {}
        for slot, ings in self.chosen.items():
            values[slot] = "\n".join(i.text for i in ings)
            for i in ings:
                values.update(i.extra)
        values.update(MODES[mode])
        text = string.Template(self.template.main).substitute(values)
        # an ingredient may use the mode's placeholders too ($jit in a helper)
        return string.Template(text).safe_substitute(MODES[mode])

    def ingredients(self, fname: str) -> list[Ingredient]:
        slots = self.template.uses.get(fname, tuple(self.template.slots))
        fixed = [Ingredient(k) for k in self.template.fixed.get(fname, ())]
        return fixed + [i for s in slots for i in self.chosen[s]]

    def funcs(self) -> list[str]:
        text = self.render("kiln.jit")
        line = re.search(r"^FUNCS = (\[.*?\])$", text, re.M | re.S)
        assert line is not None, self.package
        return json.loads(line.group(1).replace("\n", " "))


def _instances(rng: random.Random) -> list[Instance]:
    """Every template as many times as its widest slot needs to use each ingredient once;
    which ingredients meet in one program is the draw's."""
    out = []
    for t, template in enumerate(CORPUS):
        n = max([-(-len(s.options) // s.pick) for s in template.slots.values()] or [1])
        orders = {k: rng.sample(s.options, len(s.options)) for k, s in template.slots.items()}
        for i in range(n):
            chosen = {k: [orders[k][(i * s.pick + j) % len(s.options)] for j in range(s.pick)]
                      for k, s in template.slots.items()}
            package = f"hc{t:02d}{string.ascii_lowercase[i]}_{template.name}"
            out.append(Instance(template, package, chosen))
    return out


def _write(root: Path, instances: list[Instance], mode: str) -> None:
    for inst in instances:
        pkg = root / inst.package
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "main.py").write_text(inst.render(mode))


def _entries(cache: Path) -> dict[str, Counter[str]]:
    """``kiln ls --json`` of a store: executables per function, and their keys."""
    proc = run_child([sys.executable, "-m", "kiln", "ls", "--json"],
                     env=child_env(KILN_CACHE_DIR=str(cache)), check=True)
    rows = json.loads(proc.stdout or "[]")
    out: dict[str, Counter[str]] = defaultdict(Counter)
    for r in rows:
        if r["kind"] == "executable":
            out[r["function"]][r["key"]] += 1
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if "error" in a or "error" in b:
        return False
    if a["dtypes"] != b["dtypes"] or a["tree"] != b["tree"]:
        return False
    for x, y, dtype in zip(a["leaves"], b["leaves"], a["dtypes"], strict=True):
        if dtype == "static":
            if x != y:
                return False
        elif not np.array_equal(np.asarray(x, dtype=float), np.asarray(y, dtype=float),
                                equal_nan=True):
            return False
    return True


def _shown(rec: dict[str, Any]) -> str:
    if "error" in rec:
        return rec["error"][:300]
    return ", ".join(f"{k} {rec[k]}" for k in ("hits", "misses", "traces", "py_traces",
                                                "jax_traces", "jax_lowerings", "compiles",
                                                "xla_compiles"))


def _hit(rec: dict[str, Any]) -> bool:
    """A warm hit: loaded from the store, nothing traced, lowered or compiled."""
    return ("error" not in rec and rec["hits"] >= 1 and rec["misses"] == 0
            and rec["traces"] == 0 and rec["py_traces"] == 0 and rec["jax_traces"] == 0
            and rec["jax_lowerings"] == 0 and rec["compiles"] == 0 and rec["xla_compiles"] == 0)


def _how(rec: dict[str, Any]) -> str:
    if "error" in rec:
        return "error"
    if _hit(rec):
        return "hit"
    if rec["misses"]:
        return "miss"
    return "hit after a trace" if rec["hits"] else "other"


@dataclasses.dataclass
class Outcome:
    """One call's second run."""

    mode: str
    package: str
    function: str
    kinds: list[str]
    names: list[str]
    how: str
    cold: dict[str, Any]
    warm: dict[str, Any]
    must_miss: str | None
    explain: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def label(self) -> str:
        return f"[{self.mode}] {self.package}.{self.function}"

    def known(self, table: dict[str, str]) -> list[str]:
        return [k for k in self.kinds if k in table]


def _round(root: Path, xp: Any, seed: int) -> tuple[list[Outcome], list[str], int]:
    """One round: the corpus drawn with ``seed``, run cold, warm and explained in both modes.
    Returns each call's outcome, failures that are no one call's, and the program count."""
    rng = random.Random(seed)
    instances = _instances(rng)
    print(f"\nhit check round, seed {seed}: {len(instances)} programs")
    for inst in instances:
        chosen = "; ".join(i.name for ings in inst.chosen.values() for i in ings)
        print(f"  {inst.package}: {chosen or '(no slots)'}")
    names = [i.package for i in instances]
    progs = {}
    for mode in MODES:
        prog = xp.Program(root / mode.replace(" ", "_").replace(".", "_").replace("-", ""))
        prog.write("prog.py", DRIVER)
        _write(prog.dir, instances, mode)
        progs[mode] = prog

    def run_all(env: dict[str, str] | None = None) -> dict[str, Any]:
        started = {m: p.start(*names, env=env, main=MAIN[m]) for m, p in progs.items()}
        return {m: progs[m].finish(proc, timeout=600) for m, proc in started.items()}

    t0 = time.monotonic()
    cold = run_all()
    cold_entries = {m: _entries(p.cache) for m, p in progs.items()}
    t1 = time.monotonic()
    warm = run_all()
    warm_entries = {m: _entries(p.cache) for m, p in progs.items()}
    t2 = time.monotonic()
    print(f"  cold {t1 - t0:.0f} s, warm {t2 - t1:.0f} s (both modes side by side)")

    outcomes: list[Outcome] = []
    general: list[str] = []
    for mode in MODES:
        must_miss = warm[mode].extra["must_miss"]
        for inst in instances:
            for fname in inst.funcs():
                label = f"{inst.package}.{fname}"
                ings = inst.ingredients(fname)
                c, w = cold[mode][label], warm[mode][label]
                mm = must_miss[inst.package].get(fname)
                o = Outcome(mode, inst.package, fname, sorted({i.group for i in ings}),
                            [i.name for i in ings], _how(w), c, w, mm)
                if "error" in c:
                    o.problems.append(f"cold call raised {c['error'][:300]}")
                elif c["misses"] < 1 or c["compiles"] < 1:
                    o.problems.append(f"cold call did not compile ({_shown(c)})")
                if "error" in w:
                    o.problems.append(f"warm call raised {w['error'][:300]}")
                elif mm is None and not _same(c, w):
                    o.problems.append("warm value differs from the cold run's")
                outcomes.append(o)
        general += _check_store(mode, instances, outcomes, cold_entries[mode],
                                warm_entries[mode])
        general += _check_totals(mode, warm[mode], [o for o in outcomes if o.mode == mode])

    # every call that missed, and every must-miss one: a third run, KILN_EXPLAIN=1, says why
    if any(o.how != "hit" or o.must_miss for o in outcomes):
        explained = run_all({"KILN_EXPLAIN": "1"})
        print(f"  explain run {time.monotonic() - t2:.0f} s")
        for o in outcomes:
            run = explained[o.mode]
            o.explain = [ln for ln in run.extra["explain"][f"{o.package}.{o.function}"]
                         if ln.startswith("kiln: ")]
            if o.must_miss is not None and o.how != "miss":
                continue  # a must-miss that hit: nothing to explain (reported as such)
            if o.must_miss is not None and not any(
                    o.must_miss in ln and ln in run.stderr for ln in o.explain):
                o.problems.append(f"KILN_EXPLAIN=1 gave no reason naming {o.must_miss!r}")
    return outcomes, general, len(instances)


def _check_store(mode: str, instances: list[Instance], outcomes: list[Outcome],
                 cold: dict[str, Counter[str]], warm: dict[str, Counter[str]]) -> list[str]:
    """One executable per jitted function after the cold run; the warm run adds at most one
    per call that did not hit, and none to a program whose calls all hit.

    An executable is the program's by its function's module (``hc03b_logging.main.f``); under
    ``kiln run --jit`` a library's jit names its own function (``eqx.filter_jit``:
    ``equinox._jit.f_mlp``), matched by the function's name to the programs that have none."""
    problems = []
    ours = [o for o in outcomes if o.mode == mode]

    def total(entries: dict[str, Counter[str]], prefix: str | None) -> int:
        return sum(sum(c.values()) for f, c in entries.items()
                   if (f.startswith(prefix) if prefix else not f.startswith("hc")))

    unclaimed: Counter[str] = Counter()  # function names of programs with no entry named theirs
    unclaimed_misses = 0
    for inst in instances:
        prefix = f"{inst.package}."
        mine = [o for o in ours if o.package == inst.package]
        not_hit = sum(o.how != "hit" for o in mine)
        n_cold, n_warm = total(cold, prefix), total(warm, prefix)
        if n_cold == 0:
            unclaimed.update(o.function for o in mine)
            unclaimed_misses += not_hit
            continue
        twice = {f: sum(c.values()) for f, c in cold.items()
                 if f.startswith(prefix) and sum(c.values()) > 1}
        if n_cold != len(mine) or twice:
            problems.append(f"[{mode}] {inst.package}: the cold store holds {n_cold} executables "
                            f"for {len(mine)} jitted functions ({twice or 'none twice'}: "
                            f"{sorted(f for f in cold if f.startswith(prefix))})")
        if not n_cold <= n_warm <= n_cold + not_hit:
            problems.append(f"[{mode}] {inst.package}: the warm run added {n_warm - n_cold} "
                            f"executables ({not_hit} calls did not hit)")
    library = Counter({f.rsplit(".", 1)[-1]: sum(c.values()) for f, c in cold.items()
                       if not f.startswith("hc")})
    if library != unclaimed:
        problems.append(f"[{mode}] executables named by libraries: {dict(library)}, for the "
                        f"jitted functions of programs with none named theirs: {dict(unclaimed)}")
    n_cold, n_warm = total(cold, None), total(warm, None)
    if not n_cold <= n_warm <= n_cold + unclaimed_misses:
        problems.append(f"[{mode}] the warm run added {n_warm - n_cold} executables named by "
                        f"libraries ({unclaimed_misses} of their calls did not hit)")
    return problems


def _check_totals(mode: str, run: Any, outcomes: list[Outcome]) -> list[str]:
    """Nothing missed, traced or compiled outside the probed calls (an import that calls a
    jitted function, a library's jit at exit)."""
    summed = {k: sum(o.warm.get(k, 0) for o in outcomes) for k in COUNTS}
    if mode == "kiln run --jit":
        found = SUMMARY.findall(run.stderr)
        if not found:
            return [f"[{mode}] no kiln summary line on stderr:\n{run.stderr[-2000:]}"]
        total = dict(zip(COUNTS, map(int, found[-1]), strict=True))
    else:
        total = {k: run.stats[k] for k in COUNTS}
    if total != summed:
        return [f"[{mode}] the warm process counted {total}, its calls {summed}"]
    return []


def test_unchanged_programs_hit(tmp_path: Path, xp: Any) -> None:
    """Every everyday program of the corpus, run twice unchanged, hits on its second run."""
    start = time.monotonic()
    outcomes: list[Outcome] = []
    general: list[str] = []
    programs = rounds = 0
    round_s = 0.0
    while rounds == 0 or time.monotonic() - start + round_s <= BUDGET_S:
        t0 = time.monotonic()
        got, problems, n = _round(tmp_path / f"round{rounds}", xp, SEED + rounds)
        outcomes += got
        general += problems
        programs += n
        rounds += 1
        round_s = time.monotonic() - t0
    wall = time.monotonic() - start
    _report(outcomes, general, programs, rounds, wall)


def _report(outcomes: list[Outcome], general: list[str], programs: int, rounds: int,
            wall: float) -> None:
    ordinary = [o for o in outcomes if o.must_miss is None]
    must = [o for o in outcomes if o.must_miss is not None]
    missed = [o for o in ordinary if o.how != "hit"]
    # a miss is blamed on its known ingredients where it has any, else on all of them
    by_kind = Counter(k for o in missed for k in (o.known(KNOWN_MISSES_TODAY) or o.kinds))
    seeds = f"{SEED}" if rounds == 1 else f"{SEED}..{SEED + rounds - 1}"
    summary = (f"hit check: seed {seeds}, {programs} programs, {len(outcomes)} calls, warm: "
               f"{sum(o.how == 'hit' for o in ordinary)} hit, {len(missed)} missed (by "
               f"ingredient: {', '.join(f'{k} {n}' for k, n in by_kind.most_common()) or 'none'})"
               f"; must miss: {sum(o.how == 'miss' for o in must)} missed, "
               f"{sum(o.how == 'hit' for o in must)} hit; {rounds} round(s), {wall:.0f} s")
    lines = [summary, "calls per ingredient: calls / warm hit / missed (miss, hit after a "
             "trace)   (* known miss today, ! must miss)"]
    per: dict[str, Counter[str]] = defaultdict(Counter)
    for o in outcomes:
        for k in o.kinds:
            per[k]["calls"] += 1
            per[k][o.how] += 1
    must_kinds = {k for o in outcomes if o.must_miss for k in o.kinds}
    for k in sorted(per):
        c = per[k]
        mark = "*" if k in KNOWN_MISSES_TODAY else "!" if k in must_kinds else " "
        lines.append(f" {mark} {k}: {c['calls']} / {c['hit']} / {c['calls'] - c['hit']} "
                     f"({c['miss']}, {c['hit after a trace']})")

    failing: list[str] = []
    known: list[str] = []
    for o in outcomes:
        why = " | ".join(o.explain) or "(KILN_EXPLAIN=1 gave no reason)"
        text = (f"  {o.label} ({'; '.join(o.names) or 'no ingredients'}): {o.how} "
                f"({_shown(o.warm)})\n      explain: {why}")
        for p in o.problems:
            failing.append(f"  {o.label} ({'; '.join(o.names)}): {p}")
        if o.must_miss is None and o.how != "hit":
            (known if o.known(KNOWN_MISSES_TODAY) else failing).append(text)
        elif o.must_miss is not None and o.how == "hit":
            hit_text = text.replace(": hit (", ": HIT although it must miss (")
            (known if o.known(KNOWN_HITS_TODAY) else failing).append(hit_text)
    fixed = sorted(k for k in KNOWN_MISSES_TODAY
                   if per[k]["calls"] and per[k]["hit"] == per[k]["calls"])
    fixed += sorted(k for k in KNOWN_HITS_TODAY if per[k]["calls"] and not per[k]["hit"])
    if known:
        lines.append(f"known today (reported, not failed): {len(known)} calls")
        lines += known
    if fixed:
        lines.append("known today, but right in every call now (remove from KNOWN_MISSES_TODAY"
                     f" / KNOWN_HITS_TODAY): {', '.join(fixed)}")
    print("\n" + "\n".join(lines))
    if failing or general:
        rerun = (f"KILN_HITS_SEED={SEED} KILN_HITS_BUDGET_S={BUDGET_S:g} python -m pytest -m "
                 "slow tests/test_hits.py -n 0 -s -p no:cacheprovider")
        pytest.fail(
            f"{len(failing) + len(general)} problems on an unchanged second run:\n"
            + "\n".join(failing[:80] + general[:40])
            + f"\n{summary}\nreplay: {rerun}", pytrace=False)

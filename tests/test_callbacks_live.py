"""A warm start's host callbacks act on the user's live objects, exactly as a cold run's do.

Across real processes sharing one store: each run builds its objects in ``main()`` (a list a
closure appends to, a dict, a simulator object with methods), calls kiln functions whose host
callbacks (``jax.debug.callback``, ``jax.pure_callback``, ``io_callback`` ordered and not) act
on them, and reports what the objects hold afterwards. The warm run must report the same side
effects as the cold one and as plain ``jax.jit``: before, the warm start ran a cloudpickled copy
of each callback, so ``losses`` stayed empty and the simulator never advanced.

Where a copy cannot be told apart from the live object (an importable function, a function the
trace made over live cells) the callbacks come from the entry (no trace); where it could differ
(an object the function's walk does not reach) they are rebuilt by tracing and lowering, never
compiled.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

PROGRAM = '''
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

import kiln

MODE = __import__("sys").argv[1]  # "kiln" or "jax"
JIT = kiln.jit if MODE == "kiln" else jax.jit


def loss(w, x):
    return jnp.sum((w * x - 1.0) ** 2)


def make_step(lr):
    losses = []

    def record(v):
        losses.append(float(v))

    def step(w, x):
        TRACE()
        jax.debug.callback(record, loss(w, x))
        return w - lr * jax.grad(loss)(w, x)

    return JIT(step), losses


def make_counter():
    seen = {"n": 0, "total": 0.0}

    def host(v):
        v = np.asarray(v)  # (numpy only: eager jax operations here would trace in every run)
        seen["n"] += 1
        seen["total"] += float(np.sum(v))
        return np.asarray(v * 2.0, dtype=np.float32)

    def f(x):
        TRACE()
        return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    return JIT(f), seen


class Sim:
    """A simulator the program creates in main(): its state lives in the process."""

    def __init__(self):
        self.t = 0
        self.pos = np.zeros(3, np.float32)

    def advance(self, v):
        self.t += 1
        self.pos = self.pos + np.asarray(v, np.float32)
        return self.pos.copy()

    def read(self):
        return np.float32(self.t)


def make_lambda_log():
    log = []

    def f(x):
        TRACE()
        jax.debug.callback(lambda v: log.append(float(v)), jnp.sum(x))
        return x + 1.0

    return JIT(f), log


class Writer:
    def __init__(self, sink):
        self.sink = sink

    def write(self, v):
        self.sink.append(float(v))


def make_writer():
    sink = []

    def f(x):
        TRACE()
        # a user object the trace makes: a stored copy is not the object this run would make,
        # so a warm start rebuilds the callbacks by tracing (and lowering: never compiling)
        jax.debug.callback(Writer(sink).write, jnp.max(x))
        return x * 2.0

    return JIT(f), sink


THRESH = 1.0
PID = __import__("os").getpid()  # a global that differs in every process


def make_tagged():
    tags = []

    def f(x):
        TRACE()
        # only the callback reads PID, when the program runs: not keyed (a warm start hits),
        # and read live (a copy of the cold run's binding would append False)
        jax.debug.callback(lambda v: tags.append(PID == __import__("os").getpid()), x)
        return x + 1.0

    return JIT(f), tags


def make_thresh():
    above = []

    def f(x):
        TRACE()
        # a lambda the trace makes, reading a module global the program rebinds later: it
        # comes back bound to the module's live globals, so it reads THRESH as it is now
        jax.debug.callback(lambda v: above.append(bool(float(v) > THRESH)), jnp.sum(x))
        return x * 1.0

    return JIT(f), above


class Journal:
    """An open file a callback writes to: no value to key, and none needed."""

    def __init__(self, path):
        self.fh = open(path, "a")
        self.noise = np.random.default_rng().normal(size=3)  # differs in every run

    def write(self, v):
        self.fh.write(f"{float(v)}\\n")
        self.fh.flush()


def main():
    x = jnp.arange(3.0, dtype=jnp.float32)
    out = {}

    step, losses = make_step(0.1)
    w = jnp.ones(3, jnp.float32)
    for i in range(3):
        w = call(f"step{i}", step, w, x)
    jax.effects_barrier()
    out["losses"] = losses

    f, seen = make_counter()
    for i in range(2):
        call(f"pure{i}", f, x)
    out["seen"] = seen

    sim = Sim()

    def adv(v):
        TRACE()
        return io_callback(sim.advance, jax.ShapeDtypeStruct(v.shape, v.dtype), v,
                           ordered=True)

    def peek(v):
        TRACE()
        return v * io_callback(sim.read, jax.ShapeDtypeStruct((), jnp.float32))

    adv, peek = JIT(adv), JIT(peek)
    for i in range(3):
        call(f"adv{i}", adv, x)
    call("peek", peek, x)  # keyed after adv ran: sim's state must be the one adv left
    out["sim_t"] = sim.t
    out["sim_pos"] = sim.pos.tolist()

    g, log = make_lambda_log()
    call("lambda", g, x)
    jax.effects_barrier()
    out["log"] = log

    journal = Journal("journal.txt")

    def jot(v):
        TRACE()
        jax.debug.callback(journal.write, jnp.sum(v))
        return v - 1.0

    call("journal", JIT(jot), x)
    jax.effects_barrier()
    with open("journal.txt") as fh:
        out["journal_lines"] = len(fh.read().splitlines())

    global THRESH
    t, above = make_thresh()
    call("thresh", t, x)
    THRESH = 10.0
    t(x)
    jax.effects_barrier()
    out["above"] = above

    tagged, tags = make_tagged()
    call("tagged", tagged, x)
    jax.effects_barrier()
    out["tags"] = tags

    h, sink = make_writer()
    call("writer", h, x)
    jax.effects_barrier()
    out["sink"] = sink
    report(**out)


main()
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory, xp):
    prog = xp.Program(tmp_path_factory.mktemp("callbacks"))
    prog.write("prog.py", PROGRAM)
    ref = prog.run("jax")
    cold = prog.run("kiln")
    warm = prog.run("kiln")
    return ref, cold, warm


def test_a_key_does_not_see_state_only_callbacks_touch(runs):
    """``peek`` is keyed after ``adv`` stepped the simulator, ``jot``'s journal holds an open
    file and noise drawn afresh in every run: what the callbacks act on is not what the
    program is built from, so neither changes the key (and the file does not make the
    function take the verify path)."""
    _, cold, warm = runs
    assert cold["peek"]["misses"] == 1 and warm["peek"]["hits"] == 1
    assert warm["journal"]["hits"] == 1 and warm["journal"]["py_traces"] == 0
    assert not warm.stats["reasons"], warm.stats["reasons"]


def test_side_effects_match_jax_jit_cold_and_warm(runs):
    ref, cold, warm = runs
    assert ref.extra["losses"] and len(ref.extra["losses"]) == 3
    for run, lines in ((cold, 2), (warm, 3)):  # (the file grows by one line a run)
        assert run.extra.pop("journal_lines") == lines
        assert run.extra == {k: v for k, v in ref.extra.items() if k != "journal_lines"}
    for name in ("step2", "pure1", "adv2", "peek", "lambda", "writer", "journal", "thresh"):
        assert warm[name]["leaves"] == ref[name]["leaves"], name


def test_cold_compiles_once_per_function(runs, xp):
    _, cold, _ = runs
    for name in ("step0", "pure0", "adv0", "peek", "lambda", "writer", "journal"):
        xp.assert_cold(cold[name])


def test_warm_start_restores_callbacks_without_tracing(runs, xp):
    """Callbacks over closures, dicts and a simulator's methods come back bound to the live
    objects: no trace, no lowering, no compile."""
    _, _, warm = runs
    for name in ("step0", "pure0", "adv0", "peek", "lambda", "journal"):
        xp.assert_warm(warm[name])


def test_a_callback_that_would_hold_a_copy_is_rebuilt_by_tracing(runs, xp):
    """A user object the function's walk does not reach (made by the trace): the warm start
    traces and lowers to bind the callbacks to this run's objects, and does not compile."""
    ref, _, warm = runs
    xp.assert_warm_verified(warm["writer"])
    assert warm["writer"]["jax_lowerings"] >= 1
    assert warm.extra["sink"] == ref.extra["sink"] == [2.0]

def test_a_callback_the_trace_made_reads_the_live_globals(runs, xp):
    """A lambda the trace made reads a global only when the program runs: the global is not
    keyed (no trace on the warm start), and the lambda comes back bound to the module's live
    globals, so it sees the program rebind THRESH as a cold run does."""
    ref, _, warm = runs
    xp.assert_warm(warm["thresh"])
    assert warm.extra["above"] == ref.extra["above"] == [True, False]
    xp.assert_warm(warm["tagged"])  # PID differs in every process
    assert warm.extra["tags"] == ref.extra["tags"] == [True]

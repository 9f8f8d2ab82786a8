"""Tier-up: under kiln.jit, a program calling kiln.noinline functions is replaced by its inlined
form (compiled in the background), which is stored and loaded by later processes."""

from __future__ import annotations

import json
import logging
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kiln_test_children import child_env, run_child, start_child

import kiln
from kiln._miss import _tier_up


def _layers(x, w):
    for i in range(4):
        x = jnp.tanh(x * w[i] + 0.1 * i)
    return x


def _program(sub, sites=3):
    def outer(x, w):
        for _ in range(sites):
            x = sub(x, w)
        return x.sum(), x

    return outer


X, W = jnp.linspace(-1.0, 1.0, 8), jnp.full((4, 8), 0.7)


@pytest.fixture(autouse=True)
def _callback_tier_first(monkeypatch):
    """These tests are about tier-up: never skip the host-callback tier for small programs."""
    monkeypatch.setattr(_tier_up, "DIRECT_RATIO", 0.0)
REF = jax.jit(_program(_layers))(X, W)


def _host_calls(f, *args):
    before = kiln.stats().noinline_calls
    out = jax.block_until_ready(f(*args))
    return out, kiln.stats().noinline_calls - before


def _assert_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6)


def test_first_result_not_inlined_then_inlined_program_swapped_in():
    f = kiln.jit(_program(kiln.noinline(_layers)))
    first, calls = _host_calls(f, X, W)
    assert calls == 3  # the first result came from the not-inlined program: 3 call sites
    assert kiln.wait_for_tier_up(timeout=300)
    assert kiln.stats().tier_ups == 1
    after, calls = _host_calls(f, X, W)
    assert calls == 0  # the inlined program runs now: no host round trip
    _assert_equal(first, REF)
    _assert_equal(after, REF)
    # and it is C++-dispatched like jax.jit: kiln's Python table sees no more calls
    hot = kiln.stats().calls_hot
    for _ in range(3):
        f(X, W)
    assert kiln.stats().calls_hot == hot


def test_under_grad_and_vmap_the_derived_functions_are_inlined_too():
    sub = kiln.noinline(_layers)

    def loss(x, w):
        return jax.vmap(lambda r: _program(sub)(r, w)[0])(x).sum()

    f = kiln.jit(jax.grad(loss, argnums=(0, 1)))
    xs = jnp.stack([X, 2 * X])
    first, calls = _host_calls(f, xs, W)
    assert calls > 0
    assert kiln.wait_for_tier_up(timeout=300)
    after, calls = _host_calls(f, xs, W)
    assert calls == 0 and kiln.stats().tier_ups == 1
    ref = jax.jit(jax.grad(lambda x, w: jax.vmap(
        lambda r: _program(_layers)(r, w)[0])(x).sum(), argnums=(0, 1)))(xs, W)
    _assert_equal(first, ref)
    _assert_equal(after, ref)


def test_donated_arguments_and_static_arguments():
    sub = kiln.noinline(_layers)

    @kiln.jit
    def step(x, w, *, scale):
        return _program(sub)(x, w)[1] * scale

    f = kiln.jit(step, static_argnames="scale", donate_argnums=0)
    outs = []
    for _ in range(3):
        x = jnp.array(X)  # donated: a fresh buffer per call
        outs.append(f(x, W, scale=2.0))
        kiln.wait_for_tier_up(timeout=300)
    for out in outs:
        _assert_equal(out, REF[1] * 2.0)
    assert kiln.stats().tier_ups == 1


def test_tier_up_off_per_function_and_globally():
    f = kiln.jit(_program(kiln.noinline(_layers, tier_up=False)))
    _host_calls(f, X, W)
    assert kiln.wait_for_tier_up(timeout=300)
    out, calls = _host_calls(f, X, W)
    assert calls == 3 and kiln.stats().tier_ups == 0
    _assert_equal(out, REF)

    g = kiln.jit(_program(kiln.noinline(_layers)))
    with kiln.config_context(tier_up=False):
        _host_calls(g, X, W)
    kiln.wait_for_tier_up(timeout=300)
    _, calls = _host_calls(g, X, W)
    assert calls == 3 and kiln.stats().tier_ups == 0

    with pytest.raises(TypeError, match="tier_up must be True or False"):
        kiln.noinline(_layers, tier_up="no")
    with pytest.raises(kiln.ConfigError, match="KILN_TIER_UP"):
        os.environ["KILN_TIER_UP"] = "maybe"
        try:
            kiln.get_config()
        finally:
            del os.environ["KILN_TIER_UP"]


def test_small_share_of_noinline_code_compiles_inlined_directly(monkeypatch, caplog):
    monkeypatch.setattr(_tier_up, "DIRECT_RATIO", 2.0)  # the default
    tiny = kiln.noinline(lambda x, w: jnp.tanh(x * w[0]))
    f = kiln.jit(lambda x, w: (x + jnp.sin(x).sum() * w).sum() + tiny(x, w).sum())
    lowerings = []
    lower = jax.stages.Traced.lower
    monkeypatch.setattr(jax.stages.Traced, "lower",
                        lambda self, *a, **k: lowerings.append(1) or lower(self, *a, **k))
    with caplog.at_level(logging.DEBUG, logger="kiln"):
        out, calls = _host_calls(f, X, W)
    assert calls == 0  # no host-callback tier: the first executable is the inlined one
    s = kiln.stats()
    assert s.compiles == 1 and s.tier_ups == 0 and s.traces == 1
    assert len(lowerings) == 1  # only the inlined form is lowered
    assert any("compiling the program inlined directly" in r.getMessage() for r in caplog.records)
    np.testing.assert_allclose(out, (X + jnp.sin(X).sum() * W).sum() + jnp.tanh(X * W[0]).sum(),
                               rtol=1e-6)
    # many call sites of a bigger function: the callback tier first, then tier-up
    g = kiln.jit(_program(kiln.noinline(_layers), sites=8))
    _, calls = _host_calls(g, X, W)
    assert calls == 8


def test_programs_too_big_once_inlined_keep_calling(monkeypatch, caplog):
    monkeypatch.setattr(_tier_up, "MAX_EQUATIONS", 10)
    f = kiln.jit(_program(kiln.noinline(_layers), sites=4))
    with caplog.at_level(logging.DEBUG, logger="kiln"):
        _host_calls(f, X, W)
    kiln.wait_for_tier_up(timeout=300)
    assert kiln.stats().tier_ups == 0
    assert any("no tier-up: inlined, the program would have" in r.getMessage()
               for r in caplog.records)
    _, calls = _host_calls(f, X, W)
    assert calls == 4


def test_a_failed_tier_up_keeps_the_first_program(monkeypatch, caplog):
    def boom(*a, **k):
        raise RuntimeError("simulated XLA failure")

    monkeypatch.setattr(_tier_up, "_compile_inlined", boom)
    f = kiln.jit(_program(kiln.noinline(_layers)))
    with caplog.at_level(logging.WARNING, logger="kiln"):
        _host_calls(f, X, W)
        kiln.wait_for_tier_up(timeout=300)
    assert any("outer failed (RuntimeError: simulated XLA failure)" in r.getMessage()
               for r in caplog.records)
    out, calls = _host_calls(f, X, W)
    assert calls == 3
    _assert_equal(out, REF)


PROG = r'''
import json, sys, jax, jax.numpy as jnp, kiln
SCALE = {scale}

@kiln.noinline
def layers(x, w):
    for i in range(4):
        x = jnp.tanh(x * w[i] * SCALE + 0.1 * i)
    return x

@kiln.jit
def outer(x, w):
    for _ in range(6):  # enough call sites for the host-callback tier to come first
        x = layers(x, w)
    return x

x, w = jnp.linspace(-1.0, 1.0, 8), jnp.full((4, 8), 0.7)
before = kiln.stats()
out = outer(x, w)
s = kiln.stats()
if sys.argv[1:] == ["wait"]:
    kiln.wait_for_tier_up()
print(json.dumps({{"out": out.tolist(), "hits": s.hits, "traces": s.traces,
                  "compiles": s.compiles, "noinline_calls": s.noinline_calls}}))
'''


def _run(tmp_path, scale, *args, prog=PROG, **env_extra):
    src = tmp_path / "prog.py"
    src.write_text(prog.format(scale=scale))
    # ("wait": a flag of this harness, not of the program; left out of the guard)
    env = child_env(KILN_CACHE_DIR=str(tmp_path / "cache"),
                    **{"KILN_GUARD_EXCLUDE": "argv", **env_extra})
    proc = run_child([sys.executable, src, *args], env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _expected(scale):
    x, w = np.linspace(-1.0, 1.0, 8, dtype=np.float32), np.full((4, 8), 0.7, np.float32)
    for _ in range(6):
        for i in range(4):
            x = np.tanh(x * w[i] * scale + 0.1 * i)
    return x


@pytest.mark.slow
def test_the_inlined_program_is_stored_and_a_warm_process_runs_it(tmp_path):
    # the first process exits without waiting: kiln waits at exit, so the inlined form lands
    cold = _run(tmp_path, 1.0)
    # outer and layers (the tier-up compile may or may not have finished): not inlined yet
    assert cold["compiles"] in (2, 3) and cold["noinline_calls"] == 6
    warm = _run(tmp_path, 1.0)
    # the stored inlined executable: no trace, no compile, no host round trip
    assert warm == {**warm, "hits": 1, "traces": 0, "compiles": 0, "noinline_calls": 0}
    np.testing.assert_allclose(cold["out"], _expected(1.0), rtol=1e-5)
    assert warm["out"] == cold["out"]
    # audit mode: the stored entry matches a fresh lowering of the program
    audited = _run(tmp_path, 1.0, KILN_VERIFY="1")
    assert audited["out"] == cold["out"] and audited["compiles"] == 0


@pytest.mark.slow
def test_a_changed_noinline_function_is_never_run_inlined_stale(tmp_path):
    _run(tmp_path, 1.0, "wait")
    changed = _run(tmp_path, 2.0, "wait")  # the sub-function's global changed
    assert changed["hits"] == 0
    np.testing.assert_allclose(changed["out"], _expected(2.0), rtol=1e-5)
    again = _run(tmp_path, 2.0)
    assert again["hits"] == 1 and again["noinline_calls"] == 0
    np.testing.assert_allclose(again["out"], _expected(2.0), rtol=1e-5)


@pytest.mark.slow
def test_an_entry_stored_with_tier_up_off_tiers_up_in_a_later_process(tmp_path):
    off = _run(tmp_path, 1.0, KILN_TIER_UP="0")
    assert off["noinline_calls"] == 6
    later = _run(tmp_path, 1.0, "wait")  # loads the not-inlined entry, tiers up, stores
    assert later["hits"] >= 1 and later["compiles"] == 0
    warm = _run(tmp_path, 1.0)
    assert warm["hits"] == 1 and warm["traces"] == 0 and warm["noinline_calls"] == 0
    assert warm["out"] == off["out"] == later["out"]


# The same program on kiln's verify path (a global without a canonical digest: a lock), with
# the host-callback tier first (6 call sites) or compiled inlined directly (the noinline calls
# a small share of a program padded with 200 equations that leave its result as it is).
VERIFY_PROG = PROG.replace("import json,", "import threading, json,").replace(
    "@kiln.jit\ndef outer(x, w):\n",
    "LOCK = threading.Lock()\n\n@kiln.jit\ndef outer(x, w):\n    assert not LOCK.locked()\n",
)
DIRECT_PROG = VERIFY_PROG.replace(
    "    return x\n\nx, w =",
    "    pad = jnp.sin(x)\n    for _ in range(200):\n        pad = jnp.cos(pad)\n"
    "    return x + 0.0 * pad\n\nx, w =",
)


@pytest.mark.slow
@pytest.mark.parametrize("prog", [VERIFY_PROG, DIRECT_PROG], ids=["tier-up", "direct"])
def test_verify_path_programs_store_their_inlined_form(tmp_path, prog):
    assert prog.count("LOCK") == 2 and (prog is VERIFY_PROG or "pad" in prog)
    cold = _run(tmp_path, 1.0, "wait", prog=prog)
    # tier-up: outer and layers (and the inlined outer, if done by the time the counts are
    # read); direct: the inlined outer only
    assert cold["compiles"] in ((1,) if prog is DIRECT_PROG else (2, 3))
    assert cold["noinline_calls"] == (0 if prog is DIRECT_PROG else 6)
    warm = _run(tmp_path, 1.0, prog=prog)
    # keyed by its inlined module: traced and lowered (the verify path), never compiled
    assert warm == {**warm, "hits": 1, "traces": 1, "compiles": 0, "noinline_calls": 0}
    np.testing.assert_allclose(cold["out"], _expected(1.0), rtol=1e-5)
    assert warm["out"] == cold["out"]
    # layers' global changed: its inlined module is another; the not-inlined outer (stored by
    # the tier-up variant) calls layers, which is recompiled, and is never stale
    changed = _run(tmp_path, 2.0, prog=prog)
    if prog is DIRECT_PROG:
        assert changed == {**changed, "hits": 0, "compiles": 1, "noinline_calls": 0}
    else:
        assert changed == {**changed, "hits": 1, "noinline_calls": 6}
        assert changed["compiles"] in (1, 2)  # layers; then the tier-up, if done by then
    np.testing.assert_allclose(changed["out"], _expected(2.0), rtol=1e-5)


MIXED = r'''
import json, jax, jax.numpy as jnp, kiln
a = kiln.noinline(lambda x: x * 2.0 + 1.0)
b = kiln.noinline(lambda x: jnp.sin(x) * 10.0, tier_up=False)

@kiln.jit
def outer(x):
    return b(a(x) + 0.5) + a(x)

out = outer(jnp.arange(3.0))
kiln.wait_for_tier_up()
s = kiln.stats()
print(json.dumps({"out": out.tolist(), "hits": s.hits, "compiles": s.compiles}))
'''


@pytest.mark.slow
@pytest.mark.parametrize("verify", ["0", "1"])
def test_warm_inlined_program_with_remaining_callbacks_gets_its_own_callbacks(tmp_path, verify):
    # the inlined form still calls b (tier_up=False) through a host callback that cannot be
    # pickled: a warm process must rebuild the *inlined* program's callbacks, not the first's
    src = tmp_path / "mixed.py"
    src.write_text(MIXED)
    outs = []
    for extra in ({}, {"KILN_VERIFY": verify}):
        env = child_env(KILN_CACHE_DIR=str(tmp_path / "cache"), **extra)
        proc = run_child([sys.executable, src], env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        outs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    x = np.arange(3.0, dtype=np.float32)
    expected = np.sin(x * 2 + 1.5) * 10.0 + x * 2 + 1.0
    cold, warm = outs
    assert warm["hits"] >= 2 and warm["compiles"] == 0  # outer (inlined form) and b
    np.testing.assert_allclose(cold["out"], expected, rtol=1e-5)
    np.testing.assert_allclose(warm["out"], expected, rtol=1e-5)


def test_tier_up_runs_under_the_callers_thread_local_jax_config():
    # a `with jax.enable_x64(True):` block is thread-local: the background compile must see it
    sub = kiln.noinline(lambda x: jnp.sin(x) * 2)
    f = kiln.jit(lambda x: sub(sub(x)) + jnp.asarray(1e-12))
    with jax.enable_x64(True):
        x = jnp.linspace(0.0, 1.0, 4, dtype=jnp.float64)
        first = f(x)
        assert kiln.wait_for_tier_up(timeout=300)
        after, calls = _host_calls(f, x)
    assert first.dtype == after.dtype == jnp.float64
    assert calls == 0 and kiln.stats().tier_ups == 1
    np.testing.assert_array_equal(first, after)


def test_side_effects_in_noinline_functions_survive_and_ordered_ones_are_refused():
    from jax.experimental import io_callback

    log = []

    def sub(x):
        io_callback(lambda v: log.append(float(v)), None, x[0])
        return x * 2

    s = kiln.noinline(sub)
    program = kiln.jit(lambda x: (s(x), x + 1.0)[1])  # the result of s is unused
    program(jnp.arange(3.0))
    assert log == [0.0]  # an effect: not dead-code eliminated (as with plain jax.jit)
    assert kiln.wait_for_tier_up(timeout=300)
    program(jnp.arange(3.0))
    assert log == [0.0, 0.0] and kiln.stats().tier_ups == 1

    ordered = kiln.noinline(lambda x: (jax.debug.print("{}", x[0], ordered=True), x)[1])
    with pytest.raises(kiln.KilnError, match=r"has ordered side effects \(OrderedDebugEffect\)"):
        jax.jit(ordered)(jnp.ones(2))


SIGINT_PROG = r'''
import logging, signal
# a shell's background job ignores SIGINT, and children inherit that: Ctrl-C as in a terminal
signal.signal(signal.SIGINT, signal.default_int_handler)
logging.basicConfig(level=logging.WARNING, format="%(message)s")
logging.getLogger("kiln").setLevel(logging.INFO)  # says when it starts waiting at exit
import jax, jax.numpy as jnp, kiln

@kiln.noinline
def block(x, w):
    for i in range(20):
        x = jnp.tanh(x * w[i] + 0.1 * i)
    return x

@kiln.jit
def net(x, w):
    for _ in range(64):  # the inlined program takes many seconds to compile
        x = block(x, w)
    return x

net(jnp.ones(64), jnp.full((20, 64), 0.5)).block_until_ready()
print("first result", flush=True)
'''


@pytest.mark.slow
def test_ctrl_c_while_waiting_for_tier_up_at_exit_exits_cleanly(tmp_path):
    import signal
    import time

    proc = start_child([sys.executable, "-c", SIGINT_PROG],
                       env=child_env(KILN_CACHE_DIR=str(tmp_path / "cache")))
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().strip() == "first result"
    seen = []
    for line in proc.stderr:  # until kiln's exit wait has begun (the inlined compile running)
        seen.append(line)
        if "to store the inlined program" in line:
            break
    assert seen and "to store the inlined program" in seen[-1], "".join(seen)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err  # not SIGABRT (-6) from finalizing around XLA
    assert "interrupted while compiling the inlined program in the background" in err

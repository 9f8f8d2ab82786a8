"""kiln.noinline: compiled once, called by every program; transforms equal the inlined version."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kiln_test_children import child_env, run_child

import kiln


def _vf_inlined(y, a):
    return jnp.sin(y) * a


vf = kiln.noinline(_vf_inlined)


def _outer(v, y, a, sites=5):
    for _ in range(sites):
        y = v(y, a)
    return (y**2).sum()


Y = jnp.linspace(0.1, 1.0, 3)
A = 1.5 * jnp.ones(3)


def test_many_call_sites_and_programs_compile_it_once():
    before = kiln.stats().compiles
    p1 = jax.jit(lambda y, a: _outer(vf, y, a, sites=8))
    p2 = kiln.jit(lambda y, a: _outer(vf, y, a, sites=3) + 1.0)
    np.testing.assert_allclose(p1(Y, A), _outer(_vf_inlined, Y, A, 8), rtol=1e-6)
    np.testing.assert_allclose(p2(Y, A), _outer(_vf_inlined, Y, A, 3) + 1.0, rtol=1e-6)
    kiln.wait_for_tier_up()
    # vf once (8 call sites of p1) + the kiln.jit program p2, which kiln compiled inlined
    # directly (vf is a small share of it: tests/test_tier_up.py)
    assert kiln.stats().compiles - before == 2
    assert kiln.stats().noinline_calls == 8 and kiln.stats().tier_ups == 0


@pytest.mark.parametrize("wrap", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_grad_jvp_vjp_vmap_scan_equal_inlined(wrap):
    def both(fun):
        return fun(vf), fun(_vf_inlined)

    grads = both(lambda v: wrap(jax.grad(lambda y, a: _outer(v, y, a), argnums=(0, 1)))(Y, A))
    for g_noinline, g_inlined in zip(*grads, strict=True):
        np.testing.assert_allclose(g_noinline, g_inlined, rtol=1e-5)
    jvps = both(lambda v: wrap(lambda y: jax.jvp(lambda y: _outer(v, y, A), (y,), (Y,)))(Y))
    np.testing.assert_allclose(jvps[0][1], jvps[1][1], rtol=1e-5)
    vjps = both(lambda v: jax.vjp(lambda y: v(y, A), Y)[1](jnp.ones(3))[0])
    np.testing.assert_allclose(vjps[0], vjps[1], rtol=1e-5)
    vmaps = both(lambda v: wrap(jax.vmap(lambda y: _outer(v, y, A)))(jnp.ones((4, 3))))
    np.testing.assert_allclose(vmaps[0], vmaps[1], rtol=1e-6)
    scans = both(lambda v: wrap(lambda y: jax.lax.scan(
        lambda c, _: (v(c, A), None), y, None, length=4)[0])(Y))
    np.testing.assert_allclose(scans[0], scans[1], rtol=1e-6)


def test_while_cond_and_nested():
    inner = kiln.noinline(lambda x: x * 0.5)
    outer = kiln.noinline(lambda x: inner(x) + 1.0)

    def run(f):
        def body(c):
            i, x = c
            return i + 1, jax.lax.cond(x.sum() > 1.0, f, lambda x: x, x)
        return jax.lax.while_loop(lambda c: c[0] < 3, body, (0, jnp.full(2, 4.0)))[1]

    np.testing.assert_allclose(jax.jit(lambda: run(outer))(), run(lambda x: x * 0.5 + 1.0))


def test_derived_functions_compile_once_each():
    w = kiln.noinline(lambda x: jnp.tanh(x) * 3.0)
    loss = jax.jit(jax.grad(lambda x: (w(x) ** 2).sum()))
    before = kiln.stats().compiles
    loss(Y)
    first = kiln.stats().compiles - before
    loss2 = jax.jit(jax.grad(lambda x: (w(x) ** 2).sum() * 2.0))
    loss2(Y)
    # a second program needs only its own outer executable: w, its tangent and transpose exist
    assert kiln.stats().compiles - before == first
    # reverse mode runs w and the transpose of its tangent part; the tangent part itself is
    # only transposed, never run, so it is never compiled
    assert first == 2


def test_static_argnames_and_bad_input():
    p = kiln.noinline(lambda x, n: x**n, static_argnames="n")
    assert jax.jit(lambda x: p(x, n=3))(jnp.full(2, 2.0)).tolist() == [8.0, 8.0]
    with pytest.raises(TypeError, match="must be callable"):
        kiln.noinline(3)


NOINLINE_PROG = r'''
import json, jax, jax.numpy as jnp, kiln
vf = kiln.noinline(lambda y, a: jnp.sin(y) * a)


@kiln.noinline
def sq(x):
    return x * x


y, a = jnp.linspace(0.1, 1.0, 3), 1.5 * jnp.ones(3)
g = jax.jit(jax.grad(lambda y: (vf(vf(y, a), a) ** 2).sum()))(y)
v = jax.jit(jax.vmap(lambda y: vf(y, a).sum()))(jnp.ones((4, 3)))
t = jax.jit(lambda y: jax.jvp(sq, (y,), (y,))[1] + jax.grad(lambda y: sq(y).sum())(y))(y)
s = kiln.stats()
print(json.dumps({"g": g.tolist(), "v": v.tolist(), "t": t.tolist(), "hits": s.hits,
                  "misses": s.misses, "compiles": s.compiles}))
'''


@pytest.mark.slow
@pytest.mark.parametrize("how", ["-c", "script"])
def test_noinline_executables_persist_across_processes(tmp_path, how):
    """Every derived function (transpose, vmap, jvp, jvp transpose) is loaded on the warm run,
    whether the program is ``python -c`` or a script file: a noinline function of a script's
    ``__main__`` once made its jvp entries stale on every warm run (their manifest looked for
    ``__main__.sq`` in kiln's own module)."""
    import json
    import sys

    env = child_env(KILN_CACHE_DIR=str(tmp_path / "cache"))
    script = tmp_path / "prog.py"
    script.write_text(NOINLINE_PROG)
    argv = [sys.executable, "-c", NOINLINE_PROG] if how == "-c" else [sys.executable, script]

    def run():
        proc = run_child(argv, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    cold, warm = run(), run()
    assert cold["misses"] >= 5 and cold["hits"] == 0  # vf, its transpose and vmap; sq's jvps
    assert warm["compiles"] == 0 and warm["misses"] == 0 and warm["hits"] == cold["misses"]
    assert (warm["g"], warm["v"], warm["t"]) == (cold["g"], cold["v"], cold["t"])
    # never stale: sq doubled, so are its jvp and grad (t = 2y*y + 2y before, 4y*y + 4y now)
    changed = NOINLINE_PROG.replace("return x * x", "return x * x * 2.0")
    script.write_text(changed)
    argv[-1] = changed if how == "-c" else script
    doubled = run()
    assert doubled["compiles"] > 0 and doubled["g"] == cold["g"]
    np.testing.assert_allclose(doubled["t"], 2 * np.asarray(cold["t"]), rtol=1e-6)


# -- noinline functions as arguments: swapped without retracing or recompiling the caller ------
def _swap_outer(traces):
    def outer(f, x):
        traces.append(1)
        return f(f(x) * 3.0)

    return outer


@pytest.mark.parametrize("jit", [jax.jit, kiln.jit], ids=["jax.jit", "kiln.jit"])
def test_noinline_functions_swap_as_arguments_without_recompiling(jit):
    f1 = kiln.noinline(lambda x: jnp.sin(x) * 2.0)
    f2 = kiln.noinline(lambda x: jnp.cos(x) + x)
    traces: list[int] = []
    outer = jit(_swap_outer(traces))
    x = jnp.linspace(0.0, 1.0, 4)
    np.testing.assert_allclose(outer(f1.dynamic(), x), jnp.sin(jnp.sin(x) * 2.0 * 3.0) * 2.0,
                               rtol=1e-6)
    compiles = kiln.stats().compiles
    np.testing.assert_allclose(outer(f2.dynamic(), x),
                               (lambda y: jnp.cos(y) + y)((jnp.cos(x) + x) * 3.0), rtol=1e-6)
    assert len(traces) == 1  # the caller was traced once, for f1
    assert kiln.stats().compiles == compiles + 1  # f2's own executable, not the caller's

    # grad and vmap through the swapped function
    g = jit(jax.grad(lambda f, x: _swap_outer([])(f, x).sum(), argnums=1))
    for f, plain in [(f1, lambda x: jnp.sin(x) * 2.0), (f2, lambda x: jnp.cos(x) + x)]:
        ref = jax.grad(lambda x, p=plain: p(p(x) * 3.0).sum())(x)
        np.testing.assert_allclose(g(f.dynamic(), x), ref, rtol=1e-5)
    v = jit(jax.vmap(_swap_outer([]), in_axes=(None, 0)))
    np.testing.assert_allclose(v(f2.dynamic(), jnp.stack([x, x + 1.0]))[1],
                               outer(f2.dynamic(), x + 1.0), rtol=1e-6)


def test_a_noinline_function_itself_is_static_not_a_pytree_of_arrays():
    import equinox as eqx

    f1 = kiln.noinline(lambda x: jnp.sin(x))
    f2 = kiln.noinline(lambda x: jnp.cos(x))
    assert jax.tree.leaves({"f": f1}) == [f1]  # no int leaf for numerical tree maps to alter
    traces: list[int] = []

    @eqx.filter_jit
    def outer(f, x):
        traces.append(1)
        return f(x)

    x = jnp.ones(3)
    np.testing.assert_allclose(outer(f1, x), jnp.sin(x), rtol=1e-6)
    np.testing.assert_allclose(outer(f2, x), jnp.cos(x), rtol=1e-6)
    assert len(traces) == 2  # static: one trace per function, as any function argument
    with pytest.raises(TypeError):
        jax.jit(lambda f, x: f(x))(f1, x)  # not a JAX type: pass f1.dynamic(), or make it static


def test_swapped_function_with_other_outputs_and_batched_functions_are_refused():
    f1 = kiln.noinline(lambda x: jnp.sin(x))
    f3 = kiln.noinline(lambda x: x.sum())
    outer = jax.jit(lambda f, x: f(x))
    x = jnp.ones(3)
    outer(f1.dynamic(), x)
    # raised in the host callback: jax re-raises it as its callback error, with kiln's message
    with pytest.raises(Exception,  # noqa: B017 - ValueError or JaxRuntimeError, by jax's path
                       match=r"returns \['float32\[\]'\] where the program was "
                             r"traced with .* returning \['float32\[3\]'\]"):
        outer(f3.dynamic(), x)
    # pytree round trips outside a trace give the function back
    leaves, treedef = jax.tree.flatten(f1.dynamic())
    assert jax.tree.unflatten(treedef, leaves).template is f1
    assert jax.tree.unflatten(treedef, jax.tree.leaves(f3.dynamic())).template is f3
    np.testing.assert_array_equal(jax.tree.unflatten(treedef, leaves)(x), f1(x))
    with pytest.raises(kiln.KilnError, match="a batch of noinline functions"):
        jax.tree.map(lambda a, b: jnp.stack([a, b]), f1.dynamic(), f3.dynamic())
    with pytest.raises(kiln.KilnError, match="vmap over a batch of noinline functions"):
        jax.vmap(lambda h, x: jax.tree.unflatten(treedef, [h])(x))(
            jnp.array([leaves[0], leaves[0]]), jnp.ones((2, 3)))


def test_output_structure_may_depend_on_input_shapes():
    rows = kiln.noinline(lambda x: tuple(x))
    f = jax.jit(lambda x: rows(x))
    assert len(f(jnp.zeros((2, 4)))) == 2
    assert len(f(jnp.zeros((3, 4)))) == 3
    both = kiln.noinline(lambda x: {"a": x[0], "b": x[1]} if x.shape[0] == 2 else (x[0], x[1]))
    assert isinstance(both(jnp.zeros(2)), dict)
    assert isinstance(both(jnp.zeros(3)), tuple)
    assert isinstance(jax.jit(both)(jnp.zeros(2)), dict)


def test_static_arguments_by_position_or_keyword_and_unknown_names():
    def f(x, n, y):
        for _ in range(n):
            x = jnp.sin(x) + y
        return x

    p = kiln.noinline(f, static_argnames="n")
    x, y = jnp.ones(2), jnp.full(2, 0.5)
    before = kiln.stats().compiles
    by_name = jax.jit(lambda x, y: p(x, n=2, y=y))(x, y)
    by_position = jax.jit(lambda x, y: p(x, 2, y))(x, y)
    np.testing.assert_allclose(by_name, f(x, 2, y), rtol=1e-6)
    np.testing.assert_array_equal(by_name, by_position)
    assert kiln.stats().compiles - before == 1  # one executable for both spellings
    with pytest.raises(ValueError, match=r"has no parameter 'nn'; its parameters are "
                                         r"\['x', 'n', 'y'\]\. Did you mean 'n'\?"):
        kiln.noinline(f, static_argnames="nn")

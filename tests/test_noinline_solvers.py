"""kiln.noinline inside diffrax and optimistix solvers: a noinline vector field or objective gives
the results of the same program with the plain (inlined) function, under ``jax.grad`` too, and
its executables are compiled once for every program that uses it.

The vector field is a Lotka-Volterra system, the one ``examples/lotka_volterra.py`` fits.
Count tests use ``jax.jit`` outer programs (kiln does not compile those, and they never tier up),
so every compile ``kiln.stats()`` counts is a noinline function or one derived from it; the
tier-up tests use a ``kiln.jit`` outer program and count it too.

Regression tests for kiln 0bc8cc6 ("a NoinlineFunction is static again", "transpose via
jax.linear_transpose"), each failing before it: tier-up with ``diffrax.ODETerm(vf)``,
``BacksolveAdjoint``, ``LevenbergMarquardt`` and ``jax.grad`` of a noinline solve.
"""

from __future__ import annotations

import functools

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx
import pytest

import kiln


def _lotka_volterra(t, y, args):
    a, b, c, d = args[0], args[1], args[2], args[3]
    return jnp.stack([a * y[0] - b * y[0] * y[1], -c * y[1] + d * y[0] * y[1]])


def _fresh_vf():
    """A new noinline vector field, so no test reuses another's executables."""
    return kiln.noinline(lambda t, y, args: _lotka_volterra(t, y, args))


Y0 = jnp.array([10.0, 5.0])
RATES = jnp.array([1.0, 0.1, 1.5, 0.075])
CONSTANT = diffrax.ConstantStepSize()
ADAPTIVE = diffrax.PIDController(rtol=1e-5, atol=1e-5)


def _solve(vf, y0, rates, *, t1=3.0, controller=CONSTANT, adjoint=None, term=None, saveat=None):
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(vf) if term is None else term,
        diffrax.Tsit5(),
        t0=0.0,
        t1=t1,
        dt0=0.1,
        y0=y0,
        args=rates,
        saveat=diffrax.SaveAt(ts=jnp.linspace(0.0, t1, 4)) if saveat is None else saveat,
        stepsize_controller=controller,
        adjoint=diffrax.RecursiveCheckpointAdjoint() if adjoint is None else adjoint,
        max_steps=256,
    )
    return sol.ys


def _loss(vf, **kw):
    """Of the final state only: SaveAt(ts=...) costs ~2 s more to compile under grad."""

    def loss(y0, rates):
        return jnp.mean(jnp.log(_solve(vf, y0, rates, saveat=diffrax.SaveAt(t1=True), **kw)) ** 2)

    return loss


@functools.cache
def _reference(controller=CONSTANT):
    """The solve with the plain vector field (shared by the tests that compare with it)."""
    return jax.jit(lambda y0, r: _solve(_lotka_volterra, y0, r, controller=controller))(Y0, RATES)


# -- diffrax -----------------------------------------------------------------------------------
@pytest.mark.parametrize("controller", [CONSTANT, ADAPTIVE], ids=["constant", "adaptive"])
def test_diffeqsolve_equals_inlined(controller):
    vf = _fresh_vf()
    ys = jax.jit(lambda y0, r: _solve(vf, y0, r, controller=controller))(Y0, RATES)
    ref = _reference(controller)
    # adaptive: a last-bit difference in one stage can move the step sequence; the solutions
    # then differ by the solver's tolerance, not by float rounding
    np.testing.assert_allclose(ys, ref, rtol=1e-5 if controller is CONSTANT else 1e-4)
    s = kiln.stats()
    assert s.compiles == 1  # the vector field; the outer program is jax.jit's
    assert s.noinline_calls > 0  # each stage of each step is a host round trip


@functools.cache
def _grad_reference():
    return jax.jit(jax.grad(_loss(_lotka_volterra), argnums=(0, 1)))(Y0, RATES)


def test_grad_through_diffeqsolve_equals_inlined_and_compiles_once():
    vf = _fresh_vf()
    got = jax.jit(jax.grad(_loss(vf), argnums=(0, 1)))(Y0, RATES)
    for g, w in zip(got, _grad_reference(), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
    # reverse mode (RecursiveCheckpointAdjoint) runs the vector field and the transpose of its
    # tangent part; the tangent part itself is only transposed, never run, so never compiled
    first = kiln.stats().compiles
    assert first == 2

    # another program (other t1, adaptive steps) differentiating through the same vector field
    other = _loss(vf, t1=2.0, controller=ADAPTIVE)
    jax.jit(jax.grad(other, argnums=(0, 1)))(Y0, RATES)
    assert kiln.stats().compiles == first


@functools.cache
def _backsolve_reference():
    loss = _loss(_lotka_volterra, adjoint=diffrax.BacksolveAdjoint())
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(Y0, RATES)


def test_grad_through_backsolve_adjoint_equals_inlined():
    # the adjoint solve calls vf inside equinox's filter_custom_vjp: broke while a noinline
    # function was a pytree (its traced handle hid in a non-pytree object, a leaked tracer)
    loss = _loss(_fresh_vf(), adjoint=diffrax.BacksolveAdjoint())
    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(Y0, RATES)
    for g, w in zip(got, _backsolve_reference(), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
    # the backward solve calls the vector field and the transpose of its tangent part
    assert kiln.stats().compiles == 2


# -- kiln.jit outer program: tier-up -----------------------------------------------------------
def test_kiln_jit_outer_compiles_a_solve_around_a_small_vector_field_inlined_directly():
    # the vector field is a tiny share of the solver: a host-callback tier would only slow the
    # first run down, so kiln compiles the inlined program straight away (no tier-up needed)
    vf = _fresh_vf()
    out = kiln.jit(lambda y0, r: _solve(vf, y0, r))(Y0, RATES)
    np.testing.assert_allclose(out, _reference(), rtol=1e-5)
    s = kiln.stats()
    assert s.compiles == 1 and s.noinline_calls == 0 and s.tier_ups == 0


def test_kiln_jit_outer_tiers_up_to_the_inlined_result(monkeypatch):
    # diffeqsolve is an eqx.filter_jit: while a noinline function was a pytree of an int32
    # handle, equinox traced it, and the solve never tiered up
    monkeypatch.setattr(kiln._miss._tier_up, "DIRECT_RATIO", 0.0)  # always the callback tier first
    vf = _fresh_vf()
    program = kiln.jit(lambda y0, r: _solve(vf, y0, r))
    before = program(Y0, RATES)
    s = kiln.stats()
    assert s.compiles == 2 and s.noinline_calls > 0  # the vector field and the outer program
    assert kiln.wait_for_tier_up(timeout=120)
    calls = kiln.stats().noinline_calls
    after = program(Y0, RATES)
    np.testing.assert_allclose(after, before, rtol=1e-5)
    np.testing.assert_allclose(after, _reference(), rtol=1e-5)
    s = kiln.stats()
    assert s.tier_ups == 1 and s.compiles == 3  # + the inlined program, in the background
    assert s.noinline_calls == calls  # the swapped-in program calls no noinline function

    # another kiln.jit program without tier-up adds only its own compile
    with kiln.config_context(tier_up=False):
        kiln.jit(lambda y0, r: _solve(vf, y0, r, t1=2.0))(Y0, RATES)
    assert kiln.stats().compiles == 4


# -- optimistix --------------------------------------------------------------------------------
def _rosenbrock(y, args):
    a, b = args
    return (a - y[0]) ** 2 + b * (y[1] - y[0] ** 2) ** 2


def _decay_residuals(y, args):
    ts, obs = args
    return y[0] * jnp.exp(-y[1] * ts) - obs


def _result(sol):
    return sol.value, sol.stats["num_steps"], sol.result == optx.RESULTS.successful


def test_bfgs_minimise_with_noinline_objective_equals_inlined():
    objective = kiln.noinline(_rosenbrock)

    def fit(fn, rtol):
        solver = optx.BFGS(rtol=rtol, atol=rtol)

        def run(y0):
            return _result(optx.minimise(fn, solver, y0, (1.0, 100.0), max_steps=256))

        return jax.jit(run)(jnp.array([-1.2, 1.0]))

    # iteration counts are not compared: a last-bit difference in the objective can change them
    value, _, ok = fit(objective, 1e-6)
    ref_value, _, _ = fit(_rosenbrock, 1e-6)
    assert ok
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(value, [1.0, 1.0], rtol=1e-4)
    first = kiln.stats().compiles
    assert first == 2  # the objective and the transpose of its tangent part (the gradient)
    fit(objective, 1e-5)
    assert kiln.stats().compiles == first


def _fit_decay(fn):
    ts = jnp.linspace(0.0, 2.0, 8)
    data = (ts, 2.0 * jnp.exp(-0.7 * ts))
    solver = optx.LevenbergMarquardt(rtol=1e-6, atol=1e-6)

    def run(y0):
        return _result(optx.least_squares(fn, solver, y0, data, max_steps=64))

    return jax.jit(run)(jnp.array([1.0, 1.0]))


@functools.cache
def _decay_reference():
    return _fit_decay(_decay_residuals)


def _check_decay(fn):
    (value, _, ok), (ref_value, _, _) = _fit_decay(fn), _decay_reference()
    assert ok
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(value, [2.0, 0.7], rtol=1e-4)
    assert kiln.stats().noinline_calls > 0


def test_levenberg_marquardt_with_noinline_residuals_equals_inlined():
    # optimistix builds LM's initial state with tree_full_like(..., 0): while a noinline function
    # was a pytree, that zeroed its handle and the first iteration called the function with
    # handle 0 (another one, or none). Make sure residuals is not that first function.
    kiln.noinline(lambda x: x)
    _check_decay(kiln.noinline(_decay_residuals))


# -- a solve inside a noinline function ---------------------------------------------------------
def test_grad_of_noinline_solve_equals_inlined():
    # the transpose of a function holding a custom_vjp (diffrax's checkpointed while loop): the
    # jvp of a custom_vjp is transposable, not differentiable, so no jax.vjp of the jvp
    loss = kiln.noinline(_loss(_lotka_volterra))
    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(Y0, RATES)
    for g, w in zip(got, _grad_reference(), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)

# Source: github.com/patrick-kidger/diffrax, docs/examples/neural_ode.ipynb
#   (repository snapshot 5ea5fcb05058bd22548300a10ea5ef5ce7fb75bb; the notebook last changed in
#   7cf3034599534be0cd9e80e25e5aa5563d89b3fe). Copyright Patrick Kidger, Apache License 2.0
#   (http://www.apache.org/licenses/LICENSE-2.0). The notebook's code cells, in order, as
#   published, except (imports that the additions need are marked `# added`):
#   - the JIT switch (`_swap.py`): `filter_jit` is `kiln.filter_jit` when EXAMPLE_JIT=kiln, else
#     `eqx.filter_jit`; the one `@eqx.filter_jit` decorator reads `@filter_jit`;
#   - no plotting: `import matplotlib.pyplot as plt` and main()'s `if plot:` block are removed;
#   - shrunk, at the call site only (main()'s defaults are as published): dataset_size 256 -> 32,
#     batch_size 32 -> 8, steps_strategy (500, 500) -> (1, 20), print_every 100 -> 5,
#     plot=False. One step in the first phase (the first 10% of each series): a second one
#     would trace and compile make_step a third time (the first update makes the model's
#     weakly typed `out_scale = jnp.array(1.0)` strongly typed), ~15 s more per run on 2 cores;
#   - stdout is teed (`_swap.tee_stdout`) so that the last line can report the losses main()
#     printed, as one JSON object with a checksum of the trained model's parameters and,
#     under kiln, the kiln.stats() counters hits / misses / traces / compiles.
# ruff: noqa: B905  (published style: zip() without strict=)
import time

import diffrax
import equinox as eqx  # https://github.com/patrick-kidger/equinox
import jax
import jax.nn as jnn
import jax.numpy as jnp
import jax.random as jr
import numpy as np  # added
import optax  # https://github.com/deepmind/optax
from _swap import (  # added: the jit switch (examples/public/_swap.py)
    filter_jit,
    printed,
    report,
    tee_stdout,
)

tee_stdout()  # added


class Func(eqx.Module):
    out_scale: jax.Array
    mlp: eqx.nn.MLP

    def __init__(self, data_size, width_size, depth, *, key, **kwargs):
        super().__init__(**kwargs)
        self.out_scale = jnp.array(1.0)
        self.mlp = eqx.nn.MLP(
            in_size=data_size,
            out_size=data_size,
            width_size=width_size,
            depth=depth,
            activation=jnn.softplus,
            final_activation=jax.nn.tanh,
            key=key,
        )

    def __call__(self, t, y, args):
        # Best practice is often to use `learnt_scalar * tanh(MLP(...))` for the
        # vector field.
        return self.out_scale * self.mlp(y)


class NeuralODE(eqx.Module):
    func: Func

    def __init__(self, data_size, width_size, depth, *, key, **kwargs):
        super().__init__(**kwargs)
        self.func = Func(data_size, width_size, depth, key=key)

    def __call__(self, ts, y0):
        solution = diffrax.diffeqsolve(
            diffrax.ODETerm(self.func),
            diffrax.Tsit5(),
            t0=ts[0],
            t1=ts[-1],
            dt0=ts[1] - ts[0],
            y0=y0,
            stepsize_controller=diffrax.PIDController(rtol=1e-3, atol=1e-6),
            saveat=diffrax.SaveAt(ts=ts),
        )
        return solution.ys


def _get_data(ts, *, key):
    y0 = jr.uniform(key, (2,), minval=-0.6, maxval=1)

    def f(t, y, args):
        x = y / (1 + y)
        return jnp.stack([x[1], -x[0]], axis=-1)

    solver = diffrax.Tsit5()
    dt0 = 0.1
    saveat = diffrax.SaveAt(ts=ts)
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(f), solver, ts[0], ts[-1], dt0, y0, saveat=saveat
    )
    ys = sol.ys
    return ys


def get_data(dataset_size, *, key):
    ts = jnp.linspace(0, 10, 100)
    key = jr.split(key, dataset_size)
    ys = jax.vmap(lambda key: _get_data(ts, key=key))(key)
    return ts, ys


def dataloader(arrays, batch_size, *, key):
    dataset_size = arrays[0].shape[0]
    assert all(array.shape[0] == dataset_size for array in arrays)
    indices = jnp.arange(dataset_size)
    while True:
        perm = jr.permutation(key, indices)
        (key,) = jr.split(key, 1)
        start = 0
        end = batch_size
        while end < dataset_size:
            batch_perm = perm[start:end]
            yield tuple(array[batch_perm] for array in arrays)
            start = end
            end = start + batch_size


def main(
    dataset_size=256,
    batch_size=32,
    lr=3e-3,
    steps_strategy=(500, 500),
    length_strategy=(0.1, 1),
    width_size=64,
    depth=2,
    seed=5678,
    plot=True,
    print_every=100,
):
    key = jr.PRNGKey(seed)
    data_key, model_key, loader_key = jr.split(key, 3)

    ts, ys = get_data(dataset_size, key=data_key)
    _, length_size, data_size = ys.shape

    model = NeuralODE(data_size, width_size, depth, key=model_key)
    optim = optax.adabelief(lr)

    # Training loop like normal.
    #
    # Only thing to notice is that up until step 500 we train on only the first 10% of
    # each time series. This is a standard trick to avoid getting caught in a local
    # minimum.

    @eqx.filter_value_and_grad
    def grad_loss(model, ti, yi):
        y_pred = jax.vmap(model, in_axes=(None, 0))(ti, yi[:, 0])
        return jnp.mean((yi - y_pred) ** 2)

    @filter_jit
    def make_step(ti, yi, model, opt_state):
        loss, grads = grad_loss(model, ti, yi)
        updates, opt_state = optim.update(grads, opt_state)
        model = eqx.apply_updates(model, updates)
        return loss, model, opt_state

    for steps, length in zip(steps_strategy, length_strategy):
        opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
        _ts = ts[: int(length_size * length)]
        _ys = ys[:, : int(length_size * length)]
        for step, (yi,) in zip(
            range(steps), dataloader((_ys,), batch_size, key=loader_key)
        ):
            start = time.time()
            loss, model, opt_state = make_step(_ts, yi, model, opt_state)
            end = time.time()
            if (step % print_every) == 0 or step == steps - 1:
                print(f"Step: {step}, Loss: {loss}, Computation time: {end - start}")

    return ts, ys, model


ts, ys, model = main(
    dataset_size=32, batch_size=8, steps_strategy=(1, 20), print_every=5, plot=False
)

# ---- added: one JSON line with the results -----------------------------------------------------
_losses = [
    float(line.split("Loss: ")[1].split(",")[0])
    for line in printed()
    if line.startswith("Step: ")
]
_params = [np.asarray(p, np.float64) for p in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
_result = {
    "losses": _losses,
    "param_sum": float(sum(p.sum() for p in _params)),
    "param_abs_sum": float(sum(np.abs(p).sum() for p in _params)),
}
report(_result)

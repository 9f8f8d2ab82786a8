# Source: github.com/patrick-kidger/equinox, docs/examples/stateful.ipynb ("Stateful operations
#   (e.g. BatchNorm)"; repository snapshot 9336d820b2ef66b360fc6cb3611b3da5cefbb14d; the notebook
#   last changed in 76d697c1dbad528ef24868c369a0b74c1be153e4). Copyright Patrick Kidger, Apache
#   License 2.0 (http://www.apache.org/licenses/LICENSE-2.0). The notebook's code cells, in
#   order, as published, except (imports that the additions need are marked `# added`):
#   - the JIT switch (`_swap.py`): `filter_jit` is `kiln.filter_jit` when EXAMPLE_JIT=kiln, else
#     `eqx.filter_jit`; the two `@eqx.filter_jit` decorators read `@filter_jit`;
#   - nothing is shrunk (10 training points, 5 steps, as published);
#   - the last line printed is one JSON object with the test predictions, checksums of the
#     trained model's parameters and of the BatchNorm / SpectralNorm state and, under kiln, the
#     kiln.stats() counters hits / misses / traces / compiles.

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np  # added
import optax  # https://github.com/deepmind/optax
from _swap import filter_jit, report  # added: the jit switch (examples/public/_swap.py)


# This model is just a weird mish-mash of stateful and non-stateful layers for
# demonstration purposes, it isn't doing any clever.
class Model(eqx.Module):
    norm1: eqx.nn.BatchNorm
    spectral_linear: eqx.nn.SpectralNorm[eqx.nn.Linear]
    norm2: eqx.nn.BatchNorm
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear

    def __init__(self, key):
        key1, key2, key3, key4 = jr.split(key, 4)
        self.norm1 = eqx.nn.BatchNorm(input_size=3, axis_name="batch")
        self.spectral_linear = eqx.nn.SpectralNorm(
            layer=eqx.nn.Linear(in_features=3, out_features=32, key=key1),
            weight_name="weight",
            key=key2,
        )
        self.norm2 = eqx.nn.BatchNorm(input_size=32, axis_name="batch")
        self.linear1 = eqx.nn.Linear(in_features=32, out_features=32, key=key3)
        self.linear2 = eqx.nn.Linear(in_features=32, out_features=3, key=key4)

    def __call__(self, x, state):
        x, state = self.norm1(x, state)
        x, state = self.spectral_linear(x, state)
        x = jax.nn.relu(x)
        x, state = self.norm2(x, state)
        x = self.linear1(x)
        x = jax.nn.relu(x)
        x = self.linear2(x)
        return x, state


def compute_loss(model, state, xs, ys):
    batch_model = jax.vmap(
        model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )
    pred_ys, state = batch_model(xs, state)
    loss = jnp.mean((pred_ys - ys) ** 2)
    return loss, state


@filter_jit
def make_step(model, state, opt_state, xs, ys):
    grads, state = eqx.filter_grad(compute_loss, has_aux=True)(model, state, xs, ys)
    updates, opt_state = optim.update(grads, opt_state)
    model = eqx.apply_updates(model, updates)
    return model, state, opt_state


dataset_size = 10
learning_rate = 3e-4
steps = 5
seed = 5678

key = jr.PRNGKey(seed)
mkey, xkey, xkey2 = jr.split(key, 3)

model, state = eqx.nn.make_with_state(Model)(mkey)

xs = jr.normal(xkey, (dataset_size, 3))
ys = jnp.sin(xs) + 1
optim = optax.adam(learning_rate)
opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))

for _ in range(steps):
    # Full-batch gradient descent in this simple example.
    model, state, opt_state = make_step(model, state, opt_state, xs, ys)

inference_model = eqx.nn.inference_mode(model)
inference_model = eqx.Partial(inference_model, state=state)


@filter_jit
def evaluate(model, xs):
    # discard state
    out, _ = jax.vmap(model)(xs)
    return out


test_dataset_size = 5
test_xs = jr.normal(xkey2, (test_dataset_size, 3))
pred_test_ys = evaluate(inference_model, test_xs)

# ---- added: one JSON line with the results -----------------------------------------------------
_params = [np.asarray(p, np.float64) for p in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
_state = [np.asarray(s, np.float64) for s in jax.tree.leaves(state)]
_result = {
    "pred_test_ys": np.asarray(pred_test_ys, np.float64).ravel().tolist(),
    "param_sum": float(sum(p.sum() for p in _params)),
    "param_abs_sum": float(sum(np.abs(p).sum() for p in _params)),
    "state_abs_sum": float(sum(np.abs(s).sum() for s in _state)),
}
report(_result)

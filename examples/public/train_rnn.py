# Source: github.com/patrick-kidger/equinox, docs/examples/train_rnn.ipynb
#   (repository snapshot 9336d820b2ef66b360fc6cb3611b3da5cefbb14d; the notebook last changed in
#   25f096b7c9152c523b4eba9e7047976dfa7b0cc5). Copyright Patrick Kidger, Apache License 2.0
#   (http://www.apache.org/licenses/LICENSE-2.0). The notebook's code cells, in order, as
#   published, except (imports that the additions need are marked `# added`):
#   - the JIT switch (`_swap.py`): `filter_jit` is `kiln.filter_jit` when EXAMPLE_JIT=kiln, else
#     `eqx.filter_jit`; the one `@eqx.filter_jit` decorator reads `@filter_jit`;
#   - `np.random.seed(5678)` before main(): the published dataloader shuffles with numpy's
#     global random generator, unseeded, so two runs would not otherwise see the same batches;
#   - shrunk, at the call site only (main()'s defaults are as published): dataset_size
#     10000 -> 1000 (steps as published, 200);
#   - stdout is teed (`_swap.tee_stdout`) so that the last line can report the losses and
#     accuracy main() printed, as one JSON object with, under kiln, the kiln.stats() counters
#     hits / misses / traces / compiles.
# ruff: noqa: B905  (published style: zip() without strict=)
import math

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jrandom
import numpy as np
import optax  # https://github.com/deepmind/optax
from _swap import (  # added: the jit switch (examples/public/_swap.py)
    filter_jit,
    printed,
    report,
    tee_stdout,
)

tee_stdout()  # added


def dataloader(arrays, batch_size):
    dataset_size = arrays[0].shape[0]
    assert all(array.shape[0] == dataset_size for array in arrays)
    indices = np.arange(dataset_size)
    while True:
        perm = np.random.permutation(indices)
        start = 0
        end = batch_size
        while end <= dataset_size:
            batch_perm = perm[start:end]
            yield tuple(array[batch_perm] for array in arrays)
            start = end
            end = start + batch_size


def get_data(dataset_size, *, key):
    t = jnp.linspace(0, 2 * math.pi, 16)
    offset = jrandom.uniform(key, (dataset_size, 1), minval=0, maxval=2 * math.pi)
    x1 = jnp.sin(t + offset) / (1 + t)
    x2 = jnp.cos(t + offset) / (1 + t)
    y = jnp.ones((dataset_size, 1))

    half_dataset_size = dataset_size // 2
    x1 = x1.at[:half_dataset_size].multiply(-1)
    y = y.at[:half_dataset_size].set(0)
    x = jnp.stack([x1, x2], axis=-1)

    return x, y


class RNN(eqx.Module):
    hidden_size: int
    cell: eqx.Module
    linear: eqx.nn.Linear
    bias: jax.Array

    def __init__(self, in_size, out_size, hidden_size, *, key):
        ckey, lkey = jrandom.split(key)
        self.hidden_size = hidden_size
        self.cell = eqx.nn.GRUCell(in_size, hidden_size, key=ckey)
        self.linear = eqx.nn.Linear(hidden_size, out_size, use_bias=False, key=lkey)
        self.bias = jnp.zeros(out_size)

    def __call__(self, input):
        hidden = jnp.zeros((self.hidden_size,))

        def f(carry, inp):
            return self.cell(inp, carry), None

        out, _ = lax.scan(f, hidden, input)
        # sigmoid because we're performing binary classification
        return jax.nn.sigmoid(self.linear(out) + self.bias)


def main(
    dataset_size=10000,
    batch_size=32,
    learning_rate=3e-3,
    steps=200,
    hidden_size=16,
    depth=1,
    seed=5678,
):
    data_key, model_key = jrandom.split(jrandom.PRNGKey(seed), 2)
    xs, ys = get_data(dataset_size, key=data_key)
    iter_data = dataloader((xs, ys), batch_size)

    model = RNN(in_size=2, out_size=1, hidden_size=hidden_size, key=model_key)

    @eqx.filter_value_and_grad
    def compute_loss(model, x, y):
        pred_y = jax.vmap(model)(x)
        # Trains with respect to binary cross-entropy
        return -jnp.mean(y * jnp.log(pred_y) + (1 - y) * jnp.log(1 - pred_y))

    # Important for efficiency whenever you use JAX: wrap everything into a single JIT
    # region.
    @filter_jit
    def make_step(model, x, y, opt_state):
        loss, grads = compute_loss(model, x, y)
        updates, opt_state = optim.update(
            grads, opt_state, eqx.filter(model, eqx.is_array)
        )
        model = eqx.apply_updates(model, updates)
        return loss, model, opt_state

    optim = optax.adam(learning_rate)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    for step, (x, y) in zip(range(steps), iter_data):
        loss, model, opt_state = make_step(model, x, y, opt_state)
        loss = loss.item()
        print(f"step={step}, loss={loss}")

    pred_ys = jax.vmap(model)(xs)
    num_correct = jnp.sum((pred_ys > 0.5) == ys)
    final_accuracy = (num_correct / dataset_size).item()
    print(f"final_accuracy={final_accuracy}")


np.random.seed(5678)
main(dataset_size=1000)  # All right, let's run the code.

# ---- added: one JSON line with the results -----------------------------------------------------
_printed = printed()
_result = {
    "losses": [float(line.split("loss=")[1]) for line in _printed if line.startswith("step=")],
    "final_accuracy": [
        float(line.split("=")[1]) for line in _printed if line.startswith("final_accuracy=")
    ][-1],
}
report(_result)

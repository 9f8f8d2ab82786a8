"""A flax linen CNN trained with a ``TrainState`` and optax AdamW on scikit-learn's 8x8 digits.

The step returns the ``TrainState`` (whose structure holds ``apply_fn`` and the optimizer), as
flax's own examples do::

    python examples/flax_cnn.py --jit jax    # compiles every time
    python examples/flax_cnn.py --jit kiln   # compiles once, then loads

Deterministic; the last line printed is one JSON object with ``time_to_first_result_s`` (from
before jax is imported), the test accuracy and the final loss.
"""

from __future__ import annotations

import time

_T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jit", choices=("jax", "kiln"), default="kiln")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    from flax.training import train_state
    from sklearn.datasets import load_digits

    if args.jit == "kiln":
        import kiln

        jit = kiln.jit
    else:
        jit = jax.jit

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]  # (1797, 8, 8, 1)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(y))
    n_train = (3 * len(y)) // 4
    tr, te = order[:n_train], order[n_train:]

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(16, (3, 3))(x))
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
            x = nn.relu(nn.Conv(32, (3, 3))(x))
            x = x.reshape((x.shape[0], -1))
            x = nn.relu(nn.Dense(64)(x))
            return nn.Dense(10)(x)

    model = CNN()
    params = model.init(jax.random.key(0), jnp.ones((1, 8, 8, 1)))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=optax.adamw(3e-3, weight_decay=1e-4))

    @jit
    def train_step(state, x, y):
        def loss_fn(p):
            logits = state.apply_fn({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    @jit
    def accuracy(state, x, y):
        return jnp.mean(jnp.argmax(state.apply_fn({"params": state.params}, x), -1) == y)

    xtr, ytr, xte, yte = x[tr], y[tr], x[te], y[te]
    first = None
    for _ in range(args.steps):
        state, loss = train_step(state, xtr, ytr)
        if first is None:
            first = float(loss)
            t_first = time.perf_counter() - _T_START
    result = {"time_to_first_result_s": round(t_first, 3), "first_loss": first,
              "loss": float(f"{float(loss):.6g}"),
              "test_accuracy": round(float(accuracy(state, xte, yte)), 6)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

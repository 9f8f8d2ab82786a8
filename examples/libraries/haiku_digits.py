"""A haiku convolutional network trained with optax on scikit-learn's 8x8 digits, written as
haiku's MNIST example is: ``hk.transform`` of the network, a ``@jax.jit`` update step that
takes ``optax.adam``'s update, a ``@jax.jit`` evaluation::

    python examples/libraries/haiku_digits.py                  # jax.jit, as published
    python -m kiln run --jit examples/libraries/haiku_digits.py  # every jax.jit a kiln.jit

1347 training and 450 test images (a fixed 75/25 split), minibatches of 128 drawn from a fixed
seed, 300 steps. The last line printed is one JSON object: ``time_to_first_result_s`` (from
before ``import jax``; the first result is the first step's loss), ``imports_to_first_result_s``
(from the end of the imports), the final loss, the test accuracy and a checksum of the
trained parameters.
"""

from __future__ import annotations

import time

_T_START = time.perf_counter()  # before importing jax: the cost a user waits for

import json  # noqa: E402

import haiku as hk  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

_T_IMPORTED = time.perf_counter()

STEPS, BATCH, SEED = 300, 128, 0


def load_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``x_train, y_train, x_test, y_test``: images (N, 8, 8, 1) scaled to [0, 1], int32
    labels, a fixed 75/25 split."""
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(SEED).permutation(len(y))
    n_train = (3 * len(y)) // 4
    return x[order[:n_train]], y[order[:n_train]], x[order[n_train:]], y[order[n_train:]]


def net_fn(images):
    net = hk.Sequential([
        hk.Conv2D(16, kernel_shape=3), jax.nn.relu,
        hk.Conv2D(32, kernel_shape=3, stride=2), jax.nn.relu,
        hk.Flatten(),
        hk.Linear(64), jax.nn.relu,
        hk.Linear(10),
    ])
    return net(images)


def main() -> dict:
    x_train, y_train, x_test, y_test = load_data()
    net = hk.without_apply_rng(hk.transform(net_fn))
    optimizer = optax.adam(1e-3)

    def loss(params, images, labels):
        logits = net.apply(params, images)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    @jax.jit
    def update(params, opt_state, images, labels):
        value, grads = jax.value_and_grad(loss)(params, images, labels)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    @jax.jit
    def accuracy(params, images, labels):
        return jnp.mean(jnp.argmax(net.apply(params, images), -1) == labels)

    params = net.init(jax.random.key(SEED), x_train[:1])
    opt_state = optimizer.init(params)
    rng = np.random.default_rng(SEED)
    losses = []
    t_first = None
    for _ in range(STEPS):
        idx = rng.choice(len(y_train), BATCH, replace=False)
        params, opt_state, value = update(params, opt_state, x_train[idx], y_train[idx])
        losses.append(value)
        if t_first is None:
            losses[0] = float(value)
            t_first = time.perf_counter()
    test_accuracy = float(accuracy(params, x_test, y_test))
    checksum = float(sum(jnp.sum(jnp.abs(p)) for p in jax.tree.leaves(params)))
    result = {
        "time_to_first_result_s": round(t_first - _T_START, 3),
        "imports_to_first_result_s": round(t_first - _T_IMPORTED, 3),
        "first_loss": losses[0],
        "final_loss": float(losses[-1]),
        "test_accuracy": test_accuracy,
        "params_abs_sum": checksum,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

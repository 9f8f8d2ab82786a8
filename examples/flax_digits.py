"""Train two flax MLPs (64-64-10) on scikit-learn's bundled 8x8 digits with optax Adam.

Both training steps are jitted with either ``jax.jit`` or ``kiln.jit``::

    python examples/flax_digits.py --jit jax    # compiles every time
    python examples/flax_digits.py --jit kiln   # compiles once, then loads

- **linen**: ``LinenMLP`` is a ``flax.linen`` module; ``train_step(params, opt_state, x, y)``
  calls ``model.apply`` (the module is closed over) and takes one optax Adam step.
- **nnx**: ``NnxMLP`` is a ``flax.nnx`` module, taken apart with
  ``graphdef, state = nnx.split(model)``; ``train_step(graphdef, state, opt_state, x, y)``
  takes the graph definition as a static argument and the ``nnx.State`` as a pytree argument,
  and rebuilds the module inside with ``nnx.merge(graphdef, state)``. kiln keys the
  ``GraphDef`` by value (its node types, pytree structures and attributes), so a warm start
  runs the stored executables with no trace; closing over the graphdef is keyed the same way.

Full-batch training (1347 training images, 450 test images), deterministic: the same seed
gives the same accuracies and losses in every run. The last line printed is one JSON object
with ``time_to_first_result_s``, per model ``test_accuracy`` and ``loss`` and, under
``--jit kiln``, the ``kiln.stats()`` counters (``hits``, ``misses``, ``traces``, ``compiles``)
that model's training and evaluation added.
"""

from __future__ import annotations

import time

_T_START = time.perf_counter()  # before importing jax and flax: the cost a user waits for

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

HIDDEN = 64
CLASSES = 10
LEARNING_RATE = 1e-2


def load_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return ``x_train, y_train, x_test, y_test``: float32 pixels scaled to [0, 1],
    int32 labels, a fixed 75/25 split (as ``examples/mlp_digits.py``)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(y))
    n_train = (3 * len(y)) // 4
    tr, te = order[:n_train], order[n_train:]
    return x[tr], y[tr], x[te], y[te]


def _to_jax_jit(jit: str) -> Callable[..., Any]:
    if jit == "jax":
        return jax.jit
    if jit == "kiln":
        import kiln  # lazily: only this mode needs it

        return kiln.jit
    raise ValueError(f"unknown jit mode {jit!r}; expected 'kiln' or 'jax'")


def _loss(logits: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _accuracy(logits: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.argmax(logits, axis=-1) == y)


# ----------------------------------------------------------------------------------------------
# flax.linen: model.apply inside an optax train step
# ----------------------------------------------------------------------------------------------


class LinenMLP(nn.Module):
    hidden: int = HIDDEN
    classes: int = CLASSES

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.classes)(x)


def make_linen(jit: str = "kiln") -> tuple[LinenMLP, Any, Callable[..., Any], Callable[..., Any]]:
    """Return ``(model, optimizer, train_step, accuracy)``, the last two jitted.

    ``train_step(params, opt_state, x, y) -> (params, opt_state, loss)``;
    ``accuracy(params, x, y) -> float``.
    """
    jit_fn = _to_jax_jit(jit)
    model = LinenMLP()
    optimizer = optax.adam(LEARNING_RATE)

    def loss_fn(params, x, y):
        return _loss(model.apply(params, x), y)

    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def accuracy(params, x, y):
        return _accuracy(model.apply(params, x), y)

    return model, optimizer, jit_fn(train_step, donate_argnums=(0, 1)), jit_fn(accuracy)


def train_linen(jit: str, data: tuple[np.ndarray, ...], steps: int, seed: int) -> dict[str, Any]:
    x_train, y_train, x_test, y_test = data
    model, optimizer, train_step, accuracy = make_linen(jit)
    params = model.init(jax.random.key(seed), x_train[:1])
    opt_state = optimizer.init(params)
    loss = None
    for _ in range(steps):
        params, opt_state, loss = train_step(params, opt_state, x_train, y_train)
    return _metrics(accuracy, params, data, loss)


# ----------------------------------------------------------------------------------------------
# flax.nnx: nnx.split / nnx.merge, the state a pytree argument, the graphdef a static argument
# ----------------------------------------------------------------------------------------------


class NnxMLP(nnx.Module):
    def __init__(self, n_in: int, rngs: nnx.Rngs, hidden: int = HIDDEN, classes: int = CLASSES):
        self.hidden1 = nnx.Linear(n_in, hidden, rngs=rngs)
        self.hidden2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.hidden1(x))
        x = nnx.relu(self.hidden2(x))
        return self.out(x)


def make_nnx(jit: str = "kiln") -> tuple[Any, Callable[..., Any], Callable[..., Any]]:
    """Return ``(optimizer, train_step, accuracy)``, the last two jitted.

    ``train_step(graphdef, state, opt_state, x, y) -> (state, opt_state, loss)``;
    ``accuracy(graphdef, state, x, y) -> float``; ``graphdef`` is static.
    """
    jit_fn = _to_jax_jit(jit)
    optimizer = optax.adam(LEARNING_RATE)

    def loss_fn(state, graphdef, x, y):
        model = nnx.merge(graphdef, state)
        return _loss(model(x), y)

    def train_step(graphdef, state, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(state, graphdef, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    def accuracy(graphdef, state, x, y):
        return _accuracy(nnx.merge(graphdef, state)(x), y)

    return (
        optimizer,
        jit_fn(train_step, static_argnums=0, donate_argnums=(1, 2)),
        jit_fn(accuracy, static_argnums=0),
    )


def train_nnx(jit: str, data: tuple[np.ndarray, ...], steps: int, seed: int) -> dict[str, Any]:
    x_train, y_train, x_test, y_test = data
    optimizer, train_step, accuracy = make_nnx(jit)
    graphdef, state = nnx.split(NnxMLP(x_train.shape[1], nnx.Rngs(seed)))
    opt_state = optimizer.init(state)
    loss = None
    for _ in range(steps):
        state, opt_state, loss = train_step(graphdef, state, opt_state, x_train, y_train)
    return _metrics(lambda s, x, y: accuracy(graphdef, s, x, y), state, data, loss)


def _metrics(
    accuracy: Callable[..., Any], params: Any, data: tuple[np.ndarray, ...], loss: Any
) -> dict[str, Any]:
    x_train, y_train, x_test, y_test = data
    return {
        "test_accuracy": round(float(accuracy(params, x_test, y_test)), 6),
        "train_accuracy": round(float(accuracy(params, x_train, y_train)), 6),
        "loss": float(f"{float(loss):.6g}") if loss is not None else None,
    }


def _kiln_counters(jit: str) -> dict[str, int] | None:
    """This process's ``kiln.stats()`` counters under ``--jit kiln``; None under ``--jit jax``."""
    if jit != "kiln":
        return None
    import kiln

    stats = kiln.stats()
    return {k: getattr(stats, k) for k in ("hits", "misses", "traces", "compiles")}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jit", choices=("kiln", "jax"), default="kiln")
    parser.add_argument("--steps", type=int, default=200, help="full-batch Adam steps per model")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    data = load_data(args.seed)
    result: dict[str, Any] = {"jit": args.jit, "steps": args.steps}
    for name, train in (("linen", train_linen), ("nnx", train_nnx)):
        before = _kiln_counters(args.jit)
        result[name] = train(args.jit, data, args.steps, args.seed)
        if before is not None:
            after = _kiln_counters(args.jit)
            result[name]["kiln"] = {k: after[k] - v for k, v in before.items()}
    result["time_to_first_result_s"] = round(time.perf_counter() - _T_START, 3)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)

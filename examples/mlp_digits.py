"""Train a small MLP (64-64-10) on scikit-learn's bundled 8x8 digits with optax Adam.

The training step ``train_step(params, opt_state, x, y)`` and the evaluation
``accuracy(params, x, y)`` are jitted with either ``jax.jit`` or ``kiln.jit``::

    python examples/mlp_digits.py --jit jax    # compiles every time
    python examples/mlp_digits.py --jit kiln   # compiles once, then loads

Full-batch training (1347 training images, 450 test images), deterministic:
the same seed gives the same accuracy and loss in every run.  The last line
printed is one JSON object with ``time_to_first_result_s``, ``test_accuracy``
and ``loss``.
"""

from __future__ import annotations

import time

_T_START = time.perf_counter()  # before importing jax: the cost a user waits for

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

LAYER_SIZES = (64, 64, 10)


def load_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return ``x_train, y_train, x_test, y_test``: float32 pixels scaled to [0, 1],
    int32 labels, a fixed 75/25 split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(y))
    n_train = (3 * len(y)) // 4
    tr, te = order[:n_train], order[n_train:]
    return x[tr], y[tr], x[te], y[te]


def init_params(seed: int = 0, sizes: Sequence[int] = LAYER_SIZES) -> list[dict[str, Any]]:
    """He-initialised weights as a plain pytree: a list of ``{"w": (in, out), "b": (out,)}``."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    return [
        {
            "w": jax.random.normal(k, (n_in, n_out), jnp.float32) * jnp.sqrt(2.0 / n_in),
            "b": jnp.zeros((n_out,), jnp.float32),
        }
        for k, n_in, n_out in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def _to_jax_jit(jit: str | Callable[..., Any]) -> Callable[..., Any]:
    if callable(jit):
        return jit
    if jit == "jax":
        import jax

        return jax.jit
    if jit == "kiln":
        import kiln  # lazily: only this mode needs it

        return kiln.jit
    raise ValueError(f"unknown jit mode {jit!r}; expected 'kiln' or 'jax'")


def make_functions(
    jit: str | Callable[..., Any] = "kiln", learning_rate: float = 1e-2
) -> tuple[Any, Callable[..., Any], Callable[..., Any]]:
    """Return ``(optimizer, train_step, accuracy)``, the last two jitted.

    ``train_step(params, opt_state, x, y) -> (params, opt_state, loss)``;
    ``accuracy(params, x, y) -> float``.
    """
    import jax
    import jax.numpy as jnp
    import optax

    jit_fn = _to_jax_jit(jit)
    optimizer = optax.adam(learning_rate)

    def forward(params, x):
        for layer in params[:-1]:
            x = jax.nn.relu(x @ layer["w"] + layer["b"])
        return x @ params[-1]["w"] + params[-1]["b"]

    def loss_fn(params, x, y):
        logits = forward(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def accuracy(params, x, y):
        return jnp.mean(jnp.argmax(forward(params, x), axis=-1) == y)

    return optimizer, jit_fn(train_step, donate_argnums=(0, 1)), jit_fn(accuracy)


def train(
    functions: tuple[Any, Callable[..., Any], Callable[..., Any]],
    data: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    steps: int = 300,
    seed: int = 0,
) -> dict[str, Any]:
    """Train for ``steps`` full-batch Adam steps with ``functions`` (from
    :func:`make_functions`); return accuracies, the final loss and the duration of the
    first step (which includes tracing and compiling, or loading, ``train_step``)."""
    import jax

    x_train, y_train, x_test, y_test = data
    optimizer, train_step, accuracy = functions
    params = init_params(seed)
    opt_state = optimizer.init(params)
    loss = None
    first_step_s = None
    for i in range(steps):
        t = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, x_train, y_train)
        if i == 0:
            jax.block_until_ready(loss)
            first_step_s = time.perf_counter() - t
    acc = jax.block_until_ready(accuracy(params, x_test, y_test))
    return {
        "test_accuracy": round(float(acc), 6),
        "train_accuracy": round(float(accuracy(params, x_train, y_train)), 6),
        "loss": float(f"{float(loss):.6g}") if loss is not None else None,
        "first_step_s": round(first_step_s, 3) if first_step_s is not None else None,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jit", choices=("kiln", "jax"), default="kiln")
    parser.add_argument("--steps", type=int, default=300, help="full-batch Adam steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=0, help="train N more times")
    args = parser.parse_args(argv)

    data = load_data(args.seed)
    functions = make_functions(args.jit)
    metrics = train(functions, data, args.steps, args.seed)
    time_to_first = time.perf_counter() - _T_START
    result: dict[str, Any] = {
        "jit": args.jit,
        "time_to_first_result_s": round(time_to_first, 3),
        "steps": args.steps,
        **metrics,
    }
    if args.repeat > 0:
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            train(functions, data, args.steps, args.seed)
            times.append(time.perf_counter() - t)
        result["steady_s"] = round(statistics.median(times), 6)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)

"""Eager data preparation and a nearest-neighbour classifier on scikit-learn's digits, in
``jax.numpy`` outside any ``jax.jit``: the kind of program (a notebook's cells, a data step,
an ``init``) that is all eager work, a few hundred small programs JAX traces, lowers and
compiles one by one on every run.

    python examples/eager_prep.py                 # JAX as is
    kiln run examples/eager_prep.py               # eager work loaded from kiln's store

Prints the test accuracy of k-nearest-neighbours (k = 1, 3, 5, 7) on PCA features of several
sizes, a checksum of the prepared features (the same whatever runs it), and a JSON line of
both with the time to that result.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.datasets import load_digits


def standardize(x: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=0)
    std = jnp.std(x, axis=0)
    return (x - mean) / jnp.where(std > 0, std, 1.0)


def pca(x: jax.Array, k: int) -> jax.Array:
    centered = x - jnp.mean(x, axis=0, keepdims=True)
    _, s, vt = jnp.linalg.svd(centered, full_matrices=False)
    explained = jnp.cumsum(s**2) / jnp.sum(s**2)
    print(f"  pca {k:2d}: {float(explained[k - 1]):.3f} of the variance")
    return centered @ vt[:k].T


def knn_accuracy(train: jax.Array, train_y: jax.Array, test: jax.Array, test_y: jax.Array,
                 k: int) -> float:
    d2 = (jnp.sum(test**2, axis=1, keepdims=True) - 2.0 * test @ train.T
          + jnp.sum(train**2, axis=1)[None, :])
    nearest = jnp.argsort(d2, axis=1)[:, :k]
    votes = jax.nn.one_hot(train_y[nearest], 10).sum(axis=1)
    pred = jnp.argmax(votes, axis=1)
    return float(jnp.mean(pred == test_y))


_T_START = time.perf_counter()


def main() -> None:
    digits = load_digits()
    x = jnp.asarray(digits.data, dtype=jnp.float32)
    y = jnp.asarray(digits.target, dtype=jnp.int32)
    key = jax.random.key(0)
    perm = jax.random.permutation(key, x.shape[0])
    x, y = x[perm], y[perm]
    n_train = int(0.8 * x.shape[0])
    x = standardize(jnp.clip(x, 0.0, 16.0) / 16.0)
    noise = 0.01 * jax.random.normal(jax.random.fold_in(key, 1), x.shape)
    x = x + noise
    checksum = 0.0
    accuracies = {}
    for k in (8, 16, 32):
        feats = pca(x, k)
        feats = feats / jnp.linalg.norm(feats, axis=1, keepdims=True)
        checksum += float(jnp.sum(jnp.abs(feats)))
        train, test = feats[:n_train], feats[n_train:]
        train_y, test_y = y[:n_train], y[n_train:]
        for nn in (1, 3, 5, 7):
            acc = knn_accuracy(train, train_y, test, test_y, nn)
            accuracies[f"{k}/{nn}"] = round(acc, 6)
            print(f"  k-NN on {k:2d} features, k={nn}: accuracy {acc:.3f}")
        per_class = jnp.stack([jnp.mean(train[train_y == c], axis=0) for c in range(10)])
        spread = jnp.max(jnp.linalg.norm(per_class[:, None] - per_class[None], axis=-1))
        print(f"  class means on {k:2d} features: largest distance {float(spread):.3f}")
    hist = jnp.histogram(x[:, 10], bins=8)[0]
    print("histogram of feature 10:", np.asarray(hist).tolist())
    print(f"checksum {checksum:.3f}")
    print(json.dumps({"time_to_first_result_s": round(time.perf_counter() - _T_START, 3),
                      "checksum": round(checksum, 3), "accuracy": accuracies,
                      "histogram": np.asarray(hist).tolist()}), flush=True)


if __name__ == "__main__":
    main()

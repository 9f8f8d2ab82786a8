"""Bayesian logistic regression on scikit-learn's breast-cancer data (569 tumours, 30
features), sampled with numpyro's NUTS through ``numpyro.infer.MCMC``, as in numpyro's
tutorials: the jits are numpyro's own (the warm-up and sampling loops of ``MCMC.run``)::

    python examples/libraries/numpyro_logreg.py                 # jax.jit, as published
    python -m kiln run --jit examples/libraries/numpyro_logreg.py  # every jax.jit a kiln.jit

Features standardised on the 400 training tumours; a Normal(0, 1) prior on the intercept and
the 30 weights; one chain, 400 warm-up and 400 samples from a fixed seed, so every run draws
the same chain. The last line printed is one JSON object: ``time_to_first_result_s`` (from
before ``import jax``), ``imports_to_first_result_s`` (from the end of the imports), the
posterior means, the held-out accuracy of the posterior-mean predictive and NUTS's
diagnostics.
"""

from __future__ import annotations

import time

_T_START = time.perf_counter()  # before importing jax: the cost a user waits for

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
from numpyro.infer import MCMC, NUTS  # noqa: E402
from sklearn.datasets import load_breast_cancer  # noqa: E402

_T_IMPORTED = time.perf_counter()

N_TRAIN, NUM_WARMUP, NUM_SAMPLES, SEED = 400, 400, 400, 0


def load_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``x_train, y_train, x_test, y_test``: a fixed shuffle, features standardised on the
    training split, float32."""
    x, y = load_breast_cancer(return_X_y=True)
    order = np.random.default_rng(SEED).permutation(len(y))
    x, y = x[order], y[order]
    mean, std = x[:N_TRAIN].mean(0), x[:N_TRAIN].std(0)
    x = ((x - mean) / std).astype(np.float32)
    y = y.astype(np.int32)
    return x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]


def model(x, y=None):
    intercept = numpyro.sample("intercept", dist.Normal(0.0, 1.0))
    weights = numpyro.sample("weights", dist.Normal(jnp.zeros(x.shape[1]), 1.0).to_event(1))
    logits = intercept + x @ weights
    numpyro.sample("y", dist.Bernoulli(logits=logits), obs=y)


def main() -> dict:
    x_train, y_train, x_test, y_test = load_data()
    mcmc = MCMC(NUTS(model), num_warmup=NUM_WARMUP, num_samples=NUM_SAMPLES, num_chains=1,
                progress_bar=False)
    mcmc.run(jax.random.key(SEED), x_train, y_train, extra_fields=("diverging", "num_steps"))
    samples = mcmc.get_samples()
    extra = mcmc.get_extra_fields()
    intercept = np.asarray(samples["intercept"]).mean()
    weights = np.asarray(samples["weights"]).mean(0)
    t_first = time.perf_counter()
    accuracy = float(((x_test @ weights + intercept > 0) == (y_test == 1)).mean())
    result = {
        "time_to_first_result_s": round(t_first - _T_START, 3),
        "imports_to_first_result_s": round(t_first - _T_IMPORTED, 3),
        "intercept_mean": float(intercept),
        "weights_mean": [float(w) for w in weights],
        "test_accuracy": accuracy,
        "divergences": int(np.asarray(extra["diverging"]).sum()),
        "mean_num_steps": float(np.asarray(extra["num_steps"]).mean()),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

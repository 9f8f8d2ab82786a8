"""Bayesian linear regression on scikit-learn's diabetes data (442 patients, 10 features),
sampled as in blackjax's quickstart: ``blackjax.window_adaptation`` tunes NUTS's step size and
diagonal mass matrix, then ``blackjax.util.run_inference_algorithm`` draws the samples. The
jits are blackjax's own (each ``run`` jits its ``lax.scan``)::

    python examples/libraries/blackjax_nuts.py                  # jax.jit, as published
    python -m kiln run --jit examples/libraries/blackjax_nuts.py  # every jax.jit a kiln.jit

Features and target standardised; Normal(0, 1) priors on the intercept and the 10 weights, a
half-normal(1) prior on the noise scale (sampled on the log scale); 400 adaptation steps and
400 samples from a fixed seed. The last line printed is one JSON object:
``time_to_first_result_s`` (from before ``import jax``), ``imports_to_first_result_s`` (from
the end of the imports), the tuned step size, the posterior means and the acceptance rate.
"""

from __future__ import annotations

import time

_T_START = time.perf_counter()  # before importing jax: the cost a user waits for

import json  # noqa: E402

import blackjax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.scipy.stats as stats  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_diabetes  # noqa: E402

_T_IMPORTED = time.perf_counter()

NUM_ADAPT, NUM_SAMPLES, SEED = 400, 400, 0


def load_data() -> tuple[np.ndarray, np.ndarray]:
    """Standardised features and target, float32."""
    x, y = load_diabetes(return_X_y=True)
    x = (x - x.mean(0)) / x.std(0)
    y = (y - y.mean()) / y.std()
    return x.astype(np.float32), y.astype(np.float32)


def make_logdensity(x: np.ndarray, y: np.ndarray):
    def logdensity(params):
        sigma = jnp.exp(params["log_sigma"])
        mean = params["intercept"] + x @ params["weights"]
        loglik = stats.norm.logpdf(y, mean, sigma).sum()
        # half-normal(1) on sigma = log 2 + N(0, 1) density, times the Jacobian of exp
        logprior = (stats.norm.logpdf(params["intercept"]) + stats.norm.logpdf(
            params["weights"]).sum() + jnp.log(2.0) + stats.norm.logpdf(sigma)
            + params["log_sigma"])
        return loglik + logprior

    return logdensity


def main() -> dict:
    x, y = load_data()
    logdensity = make_logdensity(x, y)
    position = {"intercept": jnp.zeros(()), "weights": jnp.zeros(x.shape[1]),
                "log_sigma": jnp.zeros(())}
    warmup_key, sample_key = jax.random.split(jax.random.key(SEED))

    warmup = blackjax.window_adaptation(blackjax.nuts, logdensity)
    (state, parameters), _ = warmup.run(warmup_key, position, num_steps=NUM_ADAPT)
    nuts = blackjax.nuts(logdensity, **parameters)
    _, (states, infos) = blackjax.util.run_inference_algorithm(
        sample_key, nuts, NUM_SAMPLES, initial_state=state)
    samples = jax.tree.map(np.asarray, states.position)
    t_first = time.perf_counter()
    result = {
        "time_to_first_result_s": round(t_first - _T_START, 3),
        "imports_to_first_result_s": round(t_first - _T_IMPORTED, 3),
        "step_size": float(parameters["step_size"]),
        "intercept_mean": float(samples["intercept"].mean()),
        "weights_mean": [float(w) for w in samples["weights"].mean(0)],
        "sigma_mean": float(np.exp(samples["log_sigma"]).mean()),
        "acceptance_rate": float(np.asarray(infos.acceptance_rate).mean()),
        "divergences": int(np.asarray(infos.is_divergent).sum()),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

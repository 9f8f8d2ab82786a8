"""A Gaussian-process regression fit: the kernel's hyperparameters by optimistix BFGS on the
negative log marginal likelihood, all inside one jitted function, on scikit-learn's diabetes
data (442 patients, 10 features; the first 300 to fit, the rest to predict)::

    python examples/gp_fit.py --jit jax    # compiles every time
    python examples/gp_fit.py --jit kiln   # compiles once, then loads

Deterministic; the last line printed is one JSON object with ``time_to_first_result_s`` (from
before jax is imported), the fitted hyperparameters and the test RMSE.
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
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import optimistix as optx
    from sklearn.datasets import load_diabetes

    jax.config.update("jax_enable_x64", True)
    if args.jit == "kiln":
        import kiln

        jit = kiln.jit
    else:
        jit = jax.jit

    x, y = load_diabetes(return_X_y=True)
    x = (x - x.mean(0)) / x.std(0)
    y = (y - y.mean()) / y.std()
    xtr, ytr, xte, yte = x[:300], y[:300], x[300:], y[300:]

    def kernel(theta, a, b):
        length, amp = jnp.exp(theta[0]), jnp.exp(theta[1])
        d2 = jnp.sum((a[:, None, :] - b[None, :, :]) ** 2, -1)
        return amp * jnp.exp(-0.5 * d2 / length**2)

    def nll(theta, data):
        xs, ys = data
        k = kernel(theta, xs, xs) + (jnp.exp(theta[2]) + 1e-6) * jnp.eye(xs.shape[0])
        chol = jnp.linalg.cholesky(k)
        alpha = jax.scipy.linalg.cho_solve((chol, True), ys)
        return 0.5 * ys @ alpha + jnp.sum(jnp.log(jnp.diag(chol)))

    @jit
    def fit_and_predict(xtr, ytr, xte):
        solver = optx.BFGS(rtol=1e-6, atol=1e-6)
        sol = optx.minimise(nll, solver, jnp.zeros(3), args=(xtr, ytr), max_steps=200)
        theta = sol.value
        k = kernel(theta, xtr, xtr) + (jnp.exp(theta[2]) + 1e-6) * jnp.eye(xtr.shape[0])
        mean = kernel(theta, xte, xtr) @ jnp.linalg.solve(k, ytr)
        return theta, mean

    theta, mean = fit_and_predict(xtr, ytr, xte)
    rmse = float(jnp.sqrt(jnp.mean((mean - yte) ** 2)))
    t_first = time.perf_counter() - _T_START
    result = {"time_to_first_result_s": round(t_first, 3),
              "theta": [round(float(t), 6) for t in theta], "test_rmse": round(rmse, 6)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

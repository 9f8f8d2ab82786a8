"""The Rosenbrock function in 10 dimensions minimised with evosax's separable natural evolution
strategy (``evosax.algorithms.SNES``) in the ask / evaluate / tell loop of evosax's README: the
jits are evosax's own (``es.init``, ``es.ask`` and ``es.tell`` are ``jax.jit``s), the fitness
a ``jax.jit`` of a ``jax.vmap`` as a user writes it::

    python examples/libraries/evosax_snes.py                  # jax.jit, as published
    python -m kiln run --jit examples/libraries/evosax_snes.py  # every jax.jit a kiln.jit

A population of 32 from a mean at the origin, evosax's default SNES parameters, 20
generations from a fixed key. The last line printed is one JSON object:
``time_to_first_result_s`` (from before ``import jax``; the first result is the first
generation's best fitness), ``imports_to_first_result_s`` (from the end of the imports), the
best fitness after each generation, the best fitness found, the fitness of the final mean and
the final mean itself.
"""

from __future__ import annotations

import time

_T_START = time.perf_counter()  # before importing jax: the cost a user waits for

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from evosax.algorithms import SNES  # noqa: E402

_T_IMPORTED = time.perf_counter()

NUM_DIMS, POPULATION_SIZE, NUM_GENERATIONS, SEED = 10, 32, 20, 0


def rosenbrock(x: jax.Array) -> jax.Array:
    """Rosenbrock's function: 0 at ``x = (1, ..., 1)``."""
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


evaluate = jax.jit(jax.vmap(rosenbrock))


def main() -> dict:
    solution = jnp.zeros(NUM_DIMS)
    es = SNES(population_size=POPULATION_SIZE, solution=solution)
    params = es.default_params

    key = jax.random.key(SEED)
    key, key_init = jax.random.split(key)
    state = es.init(key_init, solution, params)

    best_per_generation: list[float] = []
    t_first = 0.0
    for _ in range(NUM_GENERATIONS):
        key, key_ask, key_tell = jax.random.split(key, 3)
        population, state = es.ask(key_ask, state, params)
        fitness = evaluate(population)
        state, metrics = es.tell(key_tell, population, fitness, state, params)
        best_per_generation.append(float(state.best_fitness))
        if len(best_per_generation) == 1:
            t_first = time.perf_counter()

    mean = np.asarray(es.get_mean(state))
    result = {
        "time_to_first_result_s": round(t_first - _T_START, 3),
        "imports_to_first_result_s": round(t_first - _T_IMPORTED, 3),
        "best_fitness_per_generation": best_per_generation,
        "best_fitness": float(state.best_fitness),
        "mean_fitness": float(rosenbrock(jnp.asarray(mean))),
        "mean": [float(m) for m in mean],
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

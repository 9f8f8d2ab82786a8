"""Optax's "Getting started" notebook, its section "Example: Fitting a MLP": a one-hidden-layer
MLP learns whether an 8-bit integer is odd or even, trained by a ``fit`` whose ``@jax.jit``
step is a closure over the optimizer (``jax.value_and_grad``, ``optimizer.update``,
``optax.apply_updates``), three times: ``optax.adam``, then ``optax.adamw`` chained with
``optax.clip`` under a warmup-cosine schedule, then ``optax.inject_hyperparams(optax.adamw)``::

    python examples/libraries/optax_getting_started.py                  # jax.jit, as published
    python -m kiln run --jit examples/libraries/optax_getting_started.py  # every jax.jit a kiln.jit

Source: https://github.com/google-deepmind/optax, ``docs/getting_started.ipynb`` at commit
2edbcbe2390da13983b92cbef94ac0460ecde1c5 (the notebook last changed in
d44e5c17193fdc7834cde86510b4adac53848b99). Copyright DeepMind, Apache License 2.0
(https://www.apache.org/licenses/LICENSE-2.0). The code cells of that section (18, 20, 22, 25
and 27), in order, as published, except (lines marked ``# added``):

- numpy's global generator is seeded (``np.random.seed(0)``) before the notebook draws its
  training integers from it (``np.random.randint``), so that every run trains on the same data
  and the values can be compared;
- after each ``fit``, its trained parameters are kept (read from the published ``_``), for the
  last line.

The notebook's first section (a linear model fitted by un-jitted loops) is left out. 1000 steps
of minibatches of 5 in each of the three fits; ``fit`` prints the loss every 100 steps, as
published. The last line printed is one JSON object: ``time_to_first_result_s`` (from before
``import jax``; the first result is the end of the first fit), ``imports_to_first_result_s``
(from the end of the imports), for each fit the loss on the whole training data and a
checksum of the trained parameters, and the learning rate of the third fit before and after.
"""
# ruff: noqa: E402, E501, B905, I001  (published style and import order)

import time

_T_START = time.perf_counter()  # added: before importing jax, the cost a user waits for

import json  # added

# ---- cell 18 ----
import optax
import jax.numpy as jnp
import jax
import numpy as np

_T_IMPORTED = time.perf_counter()  # added

BATCH_SIZE = 5
NUM_TRAIN_STEPS = 1_000
np.random.seed(0)  # added: the same training data in every run
RAW_TRAINING_DATA = np.random.randint(255, size=(NUM_TRAIN_STEPS, BATCH_SIZE, 1))

TRAINING_DATA = np.unpackbits(RAW_TRAINING_DATA.astype(np.uint8), axis=-1)
LABELS = jax.nn.one_hot(RAW_TRAINING_DATA % 2, 2).astype(jnp.float32).reshape(NUM_TRAIN_STEPS, BATCH_SIZE, 2)

# ---- cell 20 ----
initial_params = {
    'hidden': jax.random.normal(shape=[8, 32], key=jax.random.PRNGKey(0)),
    'output': jax.random.normal(shape=[32, 2], key=jax.random.PRNGKey(1)),
}


def net(x: jnp.ndarray, params: optax.Params) -> jnp.ndarray:
  x = jnp.dot(x, params['hidden'])
  x = jax.nn.relu(x)
  x = jnp.dot(x, params['output'])
  return x


def loss(params: optax.Params, batch: jnp.ndarray, labels: jnp.ndarray) -> jnp.ndarray:
  y_hat = net(batch, params)

  # optax also provides a number of common loss functions.
  loss_value = optax.sigmoid_binary_cross_entropy(y_hat, labels).sum(axis=-1)

  return loss_value.mean()

# ---- cell 22 ----
def fit(params: optax.Params, optimizer: optax.GradientTransformation) -> optax.Params:
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, batch, labels):
    loss_value, grads = jax.value_and_grad(loss)(params, batch, labels)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss_value

  for i, (batch, labels) in enumerate(zip(TRAINING_DATA, LABELS)):
    params, opt_state, loss_value = step(params, opt_state, batch, labels)
    if i % 100 == 0:
      print(f'step {i}, loss: {loss_value}')

  return params, opt_state

# Finally, we can fit our parametrized function using the Adam optimizer
# provided by optax.
optimizer = optax.adam(learning_rate=1e-2)
_ = fit(initial_params, optimizer)
adam_params = _[0]  # added
_T_FIRST = time.perf_counter()  # added

# ---- cell 25 ----
schedule = optax.warmup_cosine_decay_schedule(
  init_value=0.0,
  peak_value=1.0,
  warmup_steps=50,
  decay_steps=1_000,
  end_value=0.0,
)

optimizer = optax.chain(
  optax.clip(1.0),
  optax.adamw(learning_rate=schedule),
)

_ = fit(initial_params, optimizer)
adamw_params = _[0]  # added

# ---- cell 27 ----
optimizer = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule)

params = initial_params
state = optimizer.init(params)
print('initial learning rate:', state.hyperparams['learning_rate'])
initial_learning_rate = float(state.hyperparams['learning_rate'])  # added

_, state = fit(initial_params, optimizer)

print('final learning rate:', state.hyperparams['learning_rate'])


# ---- added: the last line, one JSON object ----
def _checksum(params: optax.Params) -> float:
  return float(sum(np.asarray(p, np.float64).sum() for p in jax.tree.leaves(params)))


_ALL_DATA, _ALL_LABELS = TRAINING_DATA.reshape(-1, 8), LABELS.reshape(-1, 2)
print(json.dumps({
    "time_to_first_result_s": round(_T_FIRST - _T_START, 3),
    "imports_to_first_result_s": round(_T_FIRST - _T_IMPORTED, 3),
    **{f"{name}_loss": float(loss(trained, _ALL_DATA, _ALL_LABELS))
       for name, trained in (("adam", adam_params), ("adamw", adamw_params),
                             ("injected_adamw", _))},
    **{f"{name}_params_checksum": _checksum(trained)
       for name, trained in (("adam", adam_params), ("adamw", adamw_params),
                             ("injected_adamw", _))},
    "initial_learning_rate": initial_learning_rate,
    "final_learning_rate": float(state.hyperparams['learning_rate']),
}))

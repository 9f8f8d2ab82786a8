"""Flax's own NNX "MNIST tutorial": a CNN (``nnx.Conv``, ``nnx.BatchNorm``, ``nnx.Dropout``,
``nnx.Linear``) trained by ``nnx.Optimizer`` (``optax.adamw``) with an ``nnx.MultiMetric``,
its ``@nnx.jit`` ``train_step`` (``nnx.value_and_grad``, ``optimizer.update(model, grads)``),
``eval_step`` and ``pred_step`` called on ``nnx.view``s of the model::

    python examples/libraries/flax_nnx_mnist_tutorial.py                  # nnx.jit, as published
    python -m kiln run --jit examples/libraries/flax_nnx_mnist_tutorial.py  # every jax.jit a kiln.jit

Source: https://github.com/google/flax, ``docs_nnx/mnist_tutorial.md`` (the jupytext twin of
``mnist_tutorial.ipynb``) at commit 3a49110824001614baf35c6ee8934479fcdb133a ("update to
v0.12.8", the release of the flax installed here; the tutorial last changed in
83e3c21b703747a2ea0646cdb1e1d5da4269354c). Copyright The Flax Authors, Apache License 2.0
(https://www.apache.org/licenses/LICENSE-2.0). The code cells of sections 2 to 7, in order, as
published, except (lines marked ``# added`` or ``# changed``):

- no download: Hugging Face's ``load_dataset('mnist')`` (and its ``shuffle(seed=0)``) is
  replaced by ``load_digits_splits()``, scikit-learn's bundled 8x8 digits as a dict of numpy
  arrays (images (N, 8, 8) with values 0 to 16, labels), a fixed 75/25 split (1347 training and
  450 test images) shuffled by a seeded numpy generator, so the batches are the same in every
  run; ``make_batches`` slices that dict and divides by 16, not 255, so its images are float32
  (N, 8, 8, 1) in [0, 1], as published for MNIST;
- the CNN's first ``nnx.Linear`` takes 256 features, not 3136 (8x8 images pooled twice leave
  2x2x64, not 7x7x64), and the forward pass on ones is on an 8x8 image, not 28x28;
- 40 training steps with an evaluation every 10 (``train_steps = 1200``, ``eval_every = 200``
  published): one pass over the 42 full batches of 32;
- no plotting: matplotlib, ``plot_predictions`` and ``writer.add_figure`` are left out (the
  predictions of ``pred_step`` are recorded as the number it gets right instead);
  tensorboardX's ``SummaryWriter`` is replaced by a stand-in of the same name that keeps the
  scalars ``add_scalar`` is given, for the last line;
- section 8 (exporting the model with orbax.export to a TensorFlow SavedModel) is left out.

The model (``nnx.display``) and the optimizer are printed as published. The last line printed
is one JSON object: ``time_to_first_result_s`` (from before ``import numpy``; the first result
is the first training metric recorded, at step 10), ``imports_to_first_result_s`` (from the end
of the imports of section 3), the scalars recorded (training and test loss and accuracy at
steps 10, 20, 30 and 39, and how many of a test batch ``pred_step`` got right), and a checksum
of the trained parameters.
"""
# ruff: noqa: E402, E501, B018, F401, I001  (published style and import order)

import time

_T_START = time.perf_counter()  # added: before importing jax, the cost a user waits for

import json  # added

# ---- 2. Load the MNIST dataset ----
import numpy as np
from sklearn.datasets import load_digits  # changed: in place of matplotlib and datasets

train_steps = 40  # changed: 1200 published
eval_every = 10  # changed: 200 published
batch_size = 32


def load_digits_splits():  # added: in place of datasets.load_dataset('mnist')
  """``{'train': ..., 'test': ...}``, each a dict of ``image`` (N, 8, 8), values 0 to 16, and
  ``label`` arrays: a fixed 75/25 split, shuffled by a seeded generator."""
  digits = load_digits()
  order = np.random.default_rng(0).permutation(len(digits.target))
  n_train = (3 * len(order)) // 4
  return {split: {'image': digits.images[idx], 'label': digits.target[idx]}
          for split, idx in (('train', order[:n_train]), ('test', order[n_train:]))}


dataset = load_digits_splits()  # changed
train_ds = dataset['train']  # changed: shuffled by load_digits_splits
test_ds = dataset['test']

def make_batches(ds, batch_size):
  """Yield batches of normalized (image, label) numpy arrays."""
  for i in range(0, len(ds['label']), batch_size):  # changed: ds is a dict of arrays
    batch = {k: v[i : i + batch_size] for k, v in ds.items()}  # changed: ds[i : i + batch_size]
    if len(batch['label']) < batch_size:  # drop incomplete final batch
      break
    images = np.stack([
      np.array(img, dtype=np.float32)[..., None] / 16.0  # changed: 255.0 published
      for img in batch['image']
    ])
    yield {'image': images, 'label': np.array(batch['label'])}

# ---- 3. Define the model with Flax NNX ----
from flax import nnx  # The Flax NNX API.
from functools import partial
from typing import Optional

_T_IMPORTED = time.perf_counter()  # added

class CNN(nnx.Module):
  """A simple CNN model."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.025)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
    self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(256, 256, rngs=rngs)  # changed: 3136 (7 * 7 * 64) published
    self.dropout2 = nnx.Dropout(rate=0.025)
    self.linear2 = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)  # flatten
    x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
    x = self.linear2(x)
    return x

# Instantiate the model.
model = CNN(rngs=nnx.Rngs(0))
# Visualize it.
nnx.display(model)

# ---- Run the model ----
import jax.numpy as jnp  # JAX NumPy

y = model(jnp.ones((1, 8, 8, 1)), nnx.Rngs(0))  # changed: (1, 28, 28, 1) published
y

# ---- 4. Create the optimizer and define some metrics ----
import optax

learning_rate = 0.005
momentum = 0.9

optimizer = nnx.Optimizer(
  model, optax.adamw(learning_rate, momentum), wrt=nnx.Param
)
metrics = nnx.MultiMetric(
  accuracy=nnx.metrics.Accuracy(),
  loss=nnx.metrics.Average('loss'),
)

nnx.display(optimizer)

# ---- 5. Define training step functions ----
def loss_fn(model: CNN, batch, rngs: nnx.Rngs | None = None):
  logits = model(batch['image'], rngs)
  loss = optax.softmax_cross_entropy_with_integer_labels(
    logits=logits, labels=batch['label']
  ).mean()
  return loss, logits

@nnx.jit
def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, rngs: nnx.Rngs, batch):
  """Train for a single step."""
  grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
  (loss, logits), grads = grad_fn(model, batch, rngs)
  metrics.update(loss=loss, logits=logits, labels=batch['label'])  # In-place updates.
  optimizer.update(model, grads)  # In-place updates.

@nnx.jit
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
  loss, logits = loss_fn(model, batch)
  metrics.update(loss=loss, logits=logits, labels=batch['label'])  # In-place updates.

# ---- 6. Define test set inference functions ----
train_model = nnx.view(model, deterministic=False, use_running_average=False)
eval_model = nnx.view(model, deterministic=True, use_running_average=True)

@nnx.jit
def pred_step(model: CNN, batch):
  logits = model(batch['image'], None)
  return logits.argmax(axis=1)

# ---- 7. Train and evaluate the model ----
class SummaryWriter:  # added: in place of tensorboardX's, keeps the scalars for the last line
  def __init__(self):
    self.scalars, self.first_at = {}, None

  def add_scalar(self, tag, value, step):
    self.scalars.setdefault(tag, []).append([step, float(value)])
    self.first_at = self.first_at or time.perf_counter()

writer = SummaryWriter()

rngs = nnx.Rngs(0)

for step, batch in enumerate(make_batches(train_ds, batch_size)):
  if step >= train_steps:
    break
  # Run the optimization for one step and make a stateful update to the following:
  # - The train state's model parameters
  # - The optimizer state
  # - The training loss and accuracy batch metrics
  train_step(train_model, optimizer, metrics, rngs, batch)

  if step > 0 and (step % eval_every == 0 or step == train_steps - 1):  # Evaluation period passed.
    # Log the training metrics.
    for metric, value in metrics.compute().items():  # Compute the metrics.
      writer.add_scalar(f'train_{metric}', value, step) # Record the metrics.
    metrics.reset()  # Reset the metrics for the test set.

    # Compute the metrics on the test set after each training epoch.
    for test_batch in make_batches(test_ds, batch_size):
      eval_step(eval_model, metrics, test_batch)

    # Show predicted labels on a single test batch
    pred = pred_step(eval_model, test_batch)
    writer.add_scalar('inference_correct', (pred == test_batch['label']).sum(), step)  # changed: no figure

    # Log the test metrics.
    for metric, value in metrics.compute().items():
      writer.add_scalar(f'test_{metric}', value, step) # Record the metrics.

    metrics.reset()  # Reset the metrics for the next training epoch.


# ---- added: the last line, one JSON object ----
import jax  # added

print(json.dumps({
    "time_to_first_result_s": round(writer.first_at - _T_START, 3),
    "imports_to_first_result_s": round(writer.first_at - _T_IMPORTED, 3),
    **writer.scalars,
    "params_checksum": float(sum(np.asarray(p, np.float64).sum()
                                 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))),
}))

"""JAX's own example ``examples/mnist_classifier_fromscratch.py`` ("A basic MNIST example using
Numpy and JAX"): a tanh MLP trained by plain SGD, its ``@jit`` update step a closure of the
script, the accuracy computed eagerly (``predict`` outside any jit)::

    python examples/libraries/jax_example_mnist_classifier_fromscratch.py    # as published
    python -m kiln run --jit examples/libraries/jax_example_mnist_classifier_fromscratch.py

Source: https://github.com/jax-ml/jax, ``examples/mnist_classifier_fromscratch.py`` at commit
cec06d116c05f0d52adfceee3d3b730fdbcb0ce5. Copyright 2018 The JAX Authors, Apache License 2.0
(https://www.apache.org/licenses/LICENSE-2.0). The code is as published, except (lines marked
``# added`` or ``# changed``):

- no download: ``datasets.mnist()`` (``from examples import datasets``, which downloads MNIST)
  is replaced by ``digits()``, scikit-learn's bundled 8x8 digits in the same form (images
  flattened and scaled to [0, 1] as float32, labels one-hot as float32), a fixed 75/25 split
  (1347 training and 450 test images); so ``layer_sizes`` starts at 64 pixels, not 784;
- the accuracies the loop prints are also kept, for the last line.

10 epochs of 11 minibatches of 128 (a seeded permutation every epoch, as published). The last
line printed is one JSON object: ``time_to_first_result_s`` (from before ``import jax``; the
first result is the first epoch's training accuracy), ``imports_to_first_result_s`` (from the
end of the imports), the training and test accuracy after each epoch and a checksum of the
trained parameters.
"""
# ruff: noqa: E402, B008, B905, I001  (published style and import order)

import time

_T_START = time.perf_counter()  # added: before importing jax, the cost a user waits for

import json  # added

import numpy.random as npr

from jax import jit, grad
from jax.scipy.special import logsumexp
import jax.numpy as jnp
import numpy as np  # added
from sklearn.datasets import load_digits  # added

_T_IMPORTED = time.perf_counter()  # added


def digits():  # added: in place of examples.datasets.mnist()
  """``train_images, train_labels, test_images, test_labels`` as ``datasets.mnist()`` gives
  them: flattened float32 images in [0, 1], one-hot float32 labels."""
  data = load_digits()
  images = (data.images.reshape(len(data.images), -1) / 16.0).astype(np.float32)
  labels = np.array(data.target[:, None] == np.arange(10), np.float32)
  order = np.random.default_rng(0).permutation(len(images))
  n_train = (3 * len(images)) // 4
  train, test = order[:n_train], order[n_train:]
  return images[train], labels[train], images[test], labels[test]


def init_random_params(scale, layer_sizes, rng=npr.RandomState(0)):
  return [(scale * rng.randn(m, n), scale * rng.randn(n))
          for m, n, in zip(layer_sizes[:-1], layer_sizes[1:])]

def predict(params, inputs):
  activations = inputs
  for w, b in params[:-1]:
    outputs = jnp.dot(activations, w) + b
    activations = jnp.tanh(outputs)

  final_w, final_b = params[-1]
  logits = jnp.dot(activations, final_w) + final_b
  return logits - logsumexp(logits, axis=1, keepdims=True)

def loss(params, batch):
  inputs, targets = batch
  preds = predict(params, inputs)
  return -jnp.mean(jnp.sum(preds * targets, axis=1))

def accuracy(params, batch):
  inputs, targets = batch
  target_class = jnp.argmax(targets, axis=1)
  predicted_class = jnp.argmax(predict(params, inputs), axis=1)
  return jnp.mean(predicted_class == target_class)


if __name__ == "__main__":
  layer_sizes = [64, 1024, 1024, 10]  # changed: 8x8 digits, not 28x28 (784)
  param_scale = 0.1
  step_size = 0.001
  num_epochs = 10
  batch_size = 128

  train_images, train_labels, test_images, test_labels = digits()  # changed
  num_train = train_images.shape[0]
  num_complete_batches, leftover = divmod(num_train, batch_size)
  num_batches = num_complete_batches + bool(leftover)

  def data_stream():
    rng = npr.RandomState(0)
    while True:
      perm = rng.permutation(num_train)
      for i in range(num_batches):
        batch_idx = perm[i * batch_size:(i + 1) * batch_size]
        yield train_images[batch_idx], train_labels[batch_idx]
  batches = data_stream()

  @jit
  def update(params, batch):
    grads = grad(loss)(params, batch)
    return [(w - step_size * dw, b - step_size * db)
            for (w, b), (dw, db) in zip(params, grads)]

  train_accs, test_accs, t_first = [], [], 0.0  # added
  params = init_random_params(param_scale, layer_sizes)
  for epoch in range(num_epochs):
    start_time = time.time()
    for _ in range(num_batches):
      params = update(params, next(batches))
    epoch_time = time.time() - start_time

    train_acc = accuracy(params, (train_images, train_labels))
    test_acc = accuracy(params, (test_images, test_labels))
    train_accs.append(float(train_acc))  # added
    test_accs.append(float(test_acc))  # added
    t_first = t_first or time.perf_counter()  # added
    print(f"Epoch {epoch} in {epoch_time:0.2f} sec")
    print(f"Training set accuracy {train_acc}")
    print(f"Test set accuracy {test_acc}")

  print(json.dumps({  # added: the last line, one JSON object
      "time_to_first_result_s": round(t_first - _T_START, 3),
      "imports_to_first_result_s": round(t_first - _T_IMPORTED, 3),
      "train_accuracy_per_epoch": train_accs,
      "test_accuracy_per_epoch": test_accs,
      "params_checksum": float(sum(np.asarray(w, np.float64).sum()
                                   + np.asarray(b, np.float64).sum() for w, b in params)),
  }))

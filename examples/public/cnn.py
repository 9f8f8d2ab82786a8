# Source: github.com/patrick-kidger/equinox, docs/examples/mnist.ipynb ("Convolutional Neural
#   Network on MNIST"; repository snapshot 9336d820b2ef66b360fc6cb3611b3da5cefbb14d; the notebook
#   last changed in 76d697c1dbad528ef24868c369a0b74c1be153e4). Copyright Patrick Kidger, Apache
#   License 2.0 (http://www.apache.org/licenses/LICENSE-2.0). The notebook's code cells, in
#   order, as published, except (imports that the additions need are marked `# added`):
#   - the JIT switch (`_swap.py`): `filter_jit` is `kiln.filter_jit` when EXAMPLE_JIT=kiln, else
#     `eqx.filter_jit`; `loss = eqx.filter_jit(loss)` and the two `@eqx.filter_jit` decorators
#     read `filter_jit`;
#   - no download, no torch: MNIST (torchvision, cell 4) is replaced by scikit-learn's bundled
#     8x8 digits (1797 images), each upsampled 3x (np.kron) to 24x24 and zero-padded to 28x28,
#     scaled to [0, 1] and normalised as the notebook's Normalize((0.5,), (0.5,)): the first
#     1500 images train, the last 297 test. `torch.utils.data.DataLoader` is a small numpy
#     stand-in (`_DataLoader`: batches of 64, the last one partial as torch's, shuffled every
#     epoch by a seeded numpy generator, items with a `.numpy()` method), so the published
#     train() / evaluate() read as published, annotations included; `import torch` and
#     `import torchvision` are removed;
#   - cell 14 (`jax.value_and_grad(loss)(...)`, which the notebook shows raising an error) is
#     left out;
#   - shrunk: STEPS 300 -> 50, PRINT_EVERY 30 -> 10 (MNIST 60000 / 10000 images -> the digits
#     above);
#   - stdout is teed (`_swap.tee_stdout`) so that the last line can report the losses and accuracies
#     train() printed, as one JSON object with a checksum of the trained model's parameters
#     and, under kiln, the kiln.stats() counters hits / misses / traces / compiles.
# ruff: noqa: B905, F722  (published style: zip() without strict=, jaxtyping shape strings)
import math  # added
import types  # added

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np  # added
import optax  # https://github.com/deepmind/optax
from _swap import (  # added: the jit switch (examples/public/_swap.py)
    filter_jit,
    printed,
    report,
    tee_stdout,
)
from jaxtyping import Array, Float, Int, PyTree  # https://github.com/google/jaxtyping
from sklearn.datasets import load_digits  # added

tee_stdout()  # added

# Hyperparameters

BATCH_SIZE = 64
LEARNING_RATE = 3e-4
STEPS = 50
PRINT_EVERY = 10
SEED = 5678

key = jax.random.PRNGKey(SEED)

# ---- substitute for cell 4 (torchvision MNIST): scikit-learn digits, a numpy DataLoader -------


class _Tensor:
    def __init__(self, array):
        self._array = array

    def numpy(self):
        return self._array


class _DataLoader:
    """torch.utils.data.DataLoader(dataset, batch_size, shuffle) over a pair of numpy arrays."""

    def __init__(self, dataset, batch_size, shuffle):
        self.dataset, self.batch_size, self.shuffle = dataset, batch_size, shuffle
        self._rng = np.random.default_rng(len(dataset[1]))

    def __len__(self):
        return math.ceil(len(self.dataset[1]) / self.batch_size)

    def __iter__(self):
        xs, ys = self.dataset
        order = self._rng.permutation(len(ys)) if self.shuffle else np.arange(len(ys))
        for start in range(0, len(ys), self.batch_size):
            batch = order[start : start + self.batch_size]
            yield _Tensor(xs[batch]), _Tensor(ys[batch])


torch = types.SimpleNamespace(
    utils=types.SimpleNamespace(data=types.SimpleNamespace(DataLoader=_DataLoader))
)

_digits = load_digits()
_images = np.kron(_digits.images / 16.0, np.ones((3, 3)))  # 8x8 -> 24x24
_images = np.pad(_images, ((0, 0), (2, 2), (2, 2)))[:, None].astype(np.float32)  # 1x28x28
_images = (_images - 0.5) / 0.5  # Normalize((0.5,), (0.5,))
_labels = _digits.target.astype(np.int64)
train_dataset = (_images[:1500], _labels[:1500])
test_dataset = (_images[1500:], _labels[1500:])
trainloader = torch.utils.data.DataLoader(
    train_dataset, batch_size=BATCH_SIZE, shuffle=True
)
testloader = torch.utils.data.DataLoader(
    test_dataset, batch_size=BATCH_SIZE, shuffle=True
)
# ---- end of substitute -------------------------------------------------------------------------

# Checking our data a bit (by now, everyone knows what the MNIST dataset looks like)
dummy_x, dummy_y = next(iter(trainloader))
dummy_x = dummy_x.numpy()
dummy_y = dummy_y.numpy()
print(dummy_x.shape)  # 64x1x28x28
print(dummy_y.shape)  # 64
print(dummy_y)


class CNN(eqx.Module):
    layers: list

    def __init__(self, key):
        key1, key2, key3, key4 = jax.random.split(key, 4)
        # Standard CNN setup: convolutional layer, followed by flattening,
        # with a small MLP on top.
        self.layers = [
            eqx.nn.Conv2d(1, 3, kernel_size=4, key=key1),
            eqx.nn.MaxPool2d(kernel_size=2),
            jax.nn.relu,
            jnp.ravel,
            eqx.nn.Linear(1728, 512, key=key2),
            jax.nn.sigmoid,
            eqx.nn.Linear(512, 64, key=key3),
            jax.nn.relu,
            eqx.nn.Linear(64, 10, key=key4),
            jax.nn.log_softmax,
        ]

    def __call__(self, x: Float[Array, "1 28 28"]) -> Float[Array, "10"]:
        for layer in self.layers:
            x = layer(x)
        return x


key, subkey = jax.random.split(key, 2)
model = CNN(subkey)

print(model)


def loss(
    model: CNN, x: Float[Array, "batch 1 28 28"], y: Int[Array, " batch"]
) -> Float[Array, ""]:
    # Our input has the shape (BATCH_SIZE, 1, 28, 28), but our model operations on
    # a single input input image of shape (1, 28, 28).
    #
    # Therefore, we have to use jax.vmap, which in this case maps our model over the
    # leading (batch) axis.
    pred_y = jax.vmap(model)(x)
    return cross_entropy(y, pred_y)


def cross_entropy(
    y: Int[Array, " batch"], pred_y: Float[Array, "batch 10"]
) -> Float[Array, ""]:
    # y are the true targets, and should be integers 0-9.
    # pred_y are the log-softmax'd predictions.
    pred_y = jnp.take_along_axis(pred_y, jnp.expand_dims(y, 1), axis=1)
    return -jnp.mean(pred_y)


# Example loss
loss_value = loss(model, dummy_x, dummy_y)
print(loss_value.shape)  # scalar loss
# Example inference
output = jax.vmap(model)(dummy_x)
print(output.shape)  # batch of predictions

# This will work!
params, static = eqx.partition(model, eqx.is_array)


def loss2(params, static, x, y):
    model = eqx.combine(params, static)
    return loss(model, x, y)


loss_value, grads = jax.value_and_grad(loss2)(params, static, dummy_x, dummy_y)
print(loss_value)

# This will work too!
value, grads = eqx.filter_value_and_grad(loss)(model, dummy_x, dummy_y)
print(value)

loss = filter_jit(loss)  # JIT our loss function from earlier!


@filter_jit
def compute_accuracy(
    model: CNN, x: Float[Array, "batch 1 28 28"], y: Int[Array, " batch"]
) -> Float[Array, ""]:
    """This function takes as input the current model
    and computes the average accuracy on a batch.
    """
    pred_y = jax.vmap(model)(x)
    pred_y = jnp.argmax(pred_y, axis=1)
    return jnp.mean(y == pred_y)


def evaluate(model: CNN, testloader: torch.utils.data.DataLoader):
    """This function evaluates the model on the test dataset,
    computing both the average loss and the average accuracy.
    """
    avg_loss = 0
    avg_acc = 0
    for x, y in testloader:
        x = x.numpy()
        y = y.numpy()
        # Note that all the JAX operations happen inside `loss` and `compute_accuracy`,
        # and both have JIT wrappers, so this is fast.
        avg_loss += loss(model, x, y)
        avg_acc += compute_accuracy(model, x, y)
    return avg_loss / len(testloader), avg_acc / len(testloader)


evaluate(model, testloader)

optim = optax.adamw(LEARNING_RATE)


def train(
    model: CNN,
    trainloader: torch.utils.data.DataLoader,
    testloader: torch.utils.data.DataLoader,
    optim: optax.GradientTransformation,
    steps: int,
    print_every: int,
) -> CNN:
    # Just like earlier: It only makes sense to train the arrays in our model,
    # so filter out everything else.
    opt_state = optim.init(eqx.filter(model, eqx.is_array))

    # Always wrap everything -- computing gradients, running the optimiser, updating
    # the model -- into a single JIT region. This ensures things run as fast as
    # possible.
    @filter_jit
    def make_step(
        model: CNN,
        opt_state: PyTree,
        x: Float[Array, "batch 1 28 28"],
        y: Int[Array, " batch"],
    ):
        loss_value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
        updates, opt_state = optim.update(
            grads, opt_state, eqx.filter(model, eqx.is_array)
        )
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss_value

    # Loop over our training dataset as many times as we need.
    def infinite_trainloader():
        while True:
            yield from trainloader

    for step, (x, y) in zip(range(steps), infinite_trainloader()):
        # PyTorch dataloaders give PyTorch tensors by default,
        # so convert them to NumPy arrays.
        x = x.numpy()
        y = y.numpy()
        model, opt_state, train_loss = make_step(model, opt_state, x, y)
        if (step % print_every) == 0 or (step == steps - 1):
            test_loss, test_accuracy = evaluate(model, testloader)
            print(
                f"{step=}, train_loss={train_loss.item()}, "
                f"test_loss={test_loss.item()}, test_accuracy={test_accuracy.item()}"
            )
    return model


model = train(model, trainloader, testloader, optim, STEPS, PRINT_EVERY)

# ---- added: one JSON line with the results -----------------------------------------------------
_printed = [line for line in printed() if line.startswith("step=")]
_params = [np.asarray(p, np.float64) for p in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
_result = {
    name: [float(line.split(f"{name}=")[1].split(",")[0]) for line in _printed]
    for name in ("train_loss", "test_loss", "test_accuracy")
}
_result.update(
    param_sum=float(sum(p.sum() for p in _params)),
    param_abs_sum=float(sum(np.abs(p).sum() for p in _params)),
)
report(_result)

"""A small equinox transformer (2 blocks, 4 heads) learning to reverse digit sequences.

``eqx.filter_jit`` or ``kiln.filter_jit`` around the training step (optax Adam) and the
evaluation; the data is generated from a fixed seed (a synthetic task)::

    python examples/eqx_transformer.py --jit jax    # eqx.filter_jit: compiles every time
    python examples/eqx_transformer.py --jit kiln   # kiln.filter_jit: compiles once, then loads

Deterministic; the last line printed is one JSON object with ``time_to_first_result_s`` (from
before jax is imported), the final loss and the sequence accuracy.
"""

from __future__ import annotations

import time

_T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

VOCAB, LENGTH, DIM, HEADS, BLOCKS = 10, 12, 64, 4, 2


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jit", choices=("jax", "kiln"), default="kiln")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    if args.jit == "kiln":
        import kiln

        filter_jit = kiln.filter_jit
    else:
        filter_jit = eqx.filter_jit

    class Block(eqx.Module):
        attn: eqx.nn.MultiheadAttention
        norm1: eqx.nn.LayerNorm
        norm2: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.attn = eqx.nn.MultiheadAttention(HEADS, DIM, key=k1)
            self.norm1, self.norm2 = eqx.nn.LayerNorm(DIM), eqx.nn.LayerNorm(DIM)
            self.mlp = eqx.nn.MLP(DIM, DIM, 2 * DIM, 1, key=k2)

        def __call__(self, x):
            h = jax.vmap(self.norm1)(x)
            x = x + self.attn(h, h, h)
            return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))

    class Transformer(eqx.Module):
        embed: eqx.nn.Embedding
        pos: jax.Array
        blocks: list
        head: eqx.nn.Linear

        def __init__(self, key):
            keys = jax.random.split(key, BLOCKS + 3)
            self.embed = eqx.nn.Embedding(VOCAB, DIM, key=keys[0])
            self.pos = jax.random.normal(keys[1], (LENGTH, DIM)) * 0.02
            self.blocks = [Block(k) for k in keys[2:-1]]
            self.head = eqx.nn.Linear(DIM, VOCAB, key=keys[-1])

        def __call__(self, tokens):
            x = jax.vmap(self.embed)(tokens) + self.pos
            for block in self.blocks:
                x = block(x)
            return jax.vmap(self.head)(x)

    data_key, model_key = jax.random.split(jax.random.key(0))
    seqs = jax.random.randint(data_key, (256, LENGTH), 0, VOCAB)
    targets = seqs[:, ::-1]
    model = Transformer(model_key)
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    def loss_fn(model, x, y):
        logits = jax.vmap(model)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @filter_jit
    def train_step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    @filter_jit
    def accuracy(model, x, y):
        return jnp.mean(jnp.all(jnp.argmax(jax.vmap(model)(x), -1) == y, axis=-1))

    first = None
    for _ in range(args.steps):
        model, opt_state, loss = train_step(model, opt_state, seqs, targets)
        if first is None:
            first = float(loss)
            t_first = time.perf_counter() - _T_START
    result = {"time_to_first_result_s": round(t_first, 3), "first_loss": first,
              "loss": float(f"{float(loss):.6g}"),
              "accuracy": round(float(accuracy(model, seqs, targets)), 6)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

"""The worked example of docs/noinline.md (kept identical to it by tests/test_docs.py)."""

import time

import jax
import jax.numpy as jnp

import kiln


def block(x, w):                      # 20 layers: ~0.1 s to compile on its own
    for i in range(20):
        x = jnp.tanh(x * w[i] + 0.1 * i)
    return x


def network(f, x, w):                 # 16 call sites of the block
    for _ in range(16):
        x = f(x, w)
    return x


x, w = jnp.ones(64), jnp.full((20, 64), 0.5)

t0 = time.perf_counter()
plain = jax.jit(lambda x, w: network(block, x, w))(x, w).block_until_ready()
print(f"jax.jit, block inlined 16 times: first result after {time.perf_counter() - t0:.2f} s")

fast_block = kiln.noinline(block)
t0 = time.perf_counter()
run = kiln.jit(lambda x, w: network(fast_block, x, w))
first = run(x, w).block_until_ready()
print(f"kiln.noinline: first result after {time.perf_counter() - t0:.2f} s")

kiln.wait_for_tier_up()               # the inlined program compiled in the background
print(f"tier-up done after {time.perf_counter() - t0:.2f} s")
s = kiln.stats()
print(f"compiles: {s.compiles} (block, caller, caller inlined), host calls: {s.noinline_calls}")
assert jnp.allclose(first, plain) and jnp.allclose(run(x, w), plain)
assert kiln.stats().noinline_calls == s.noinline_calls   # inlined now: no host round trip

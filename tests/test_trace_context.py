"""jax's trace context is part of every key: a program traced under one context is never run
under another (the axis environment once gave a wrong result, stored and served
to later processes). The axis sizes of an enclosing vmap / shard_map are spelled out in the key,
and under such a transformation a kiln.jit function now runs as a nested jax.jit anyway."""

from __future__ import annotations

import sys
import textwrap

import jax
import pytest
from kiln_test_children import child_env, run_child

import kiln
from kiln._base import _jax_compat

PROG = textwrap.dedent('''\
    import sys
    import jax
    import kiln
    g = kiln.jit(lambda: jax.lax.axis_size("i"))
    got = [int(jax.vmap(g, axis_name="i", axis_size=int(n), out_axes=None)())
           for n in sys.argv[1:]]
    print(got, kiln.stats().hits, kiln.stats().misses)
    ''')


def test_axis_size_under_vmap_is_part_of_the_key_in_process() -> None:
    g = kiln.jit(lambda: jax.lax.axis_size("i"))
    for n in (2, 3, 2, 5):
        assert int(jax.vmap(g, axis_name="i", axis_size=n, out_axes=None)()) == n


@pytest.mark.slow
def test_axis_size_under_vmap_is_part_of_the_key_across_processes(tmp_path) -> None:
    env = child_env(KILN_CACHE_DIR=str(tmp_path / "store"), JAX_PLATFORMS="cpu")

    def run(*sizes: int) -> str:
        proc = run_child([sys.executable, "-c", PROG, *map(str, sizes)], env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.strip()

    # Under vmap a kiln.jit function is a nested jax.jit (nothing stored); before, the first
    # process stored the program for an axis of size 2 and the second got [2] for size 3.
    assert run(2) == "[2] 0 0"
    assert run(3) == "[3] 0 0"
    assert run(2, 3) == "[2, 3] 0 0"


def test_trace_context_text_has_no_address_and_names_axis_sizes() -> None:
    seen = []

    def probe():
        seen.append(dict(_jax_compat.trace_context()))  # runs while vmap traces
        return jax.numpy.zeros(())

    jax.vmap(probe, axis_name="i", axis_size=4, out_axes=None)()
    outside = dict(_jax_compat.trace_context())
    assert all("0x" not in v for v in [*outside.values(), *seen[0].values()])
    assert "axis_sizes=[]" in outside["axis_env_state"]
    assert "axis_sizes=[(\"'i'\", '4')]" in seen[0]["axis_env_state"], seen[0]

"""LAMMPS's Lennard-Jones "melt" benchmark in jax-md: 500 atoms on an fcc lattice at reduced
density 0.8442, velocities drawn at temperature 3.0, the LJ potential cut at 2.5 sigma with a
neighbor list (``energy.lennard_jones_neighbor_list``), integrated in the NVE ensemble with
velocity Verlet (``simulate.nve``, dt = 0.005) as jax-md's notebooks do: a ``@jax.jit`` block of
``lax.fori_loop`` steps that updates the neighbor list; jax-md's own ``jit``s build it::

    python examples/libraries/jaxmd_lj_melt.py                  # jax.jit, as published
    python -m kiln run --jit examples/libraries/jaxmd_lj_melt.py  # every jax.jit a kiln.jit
    EXAMPLE_JIT=kiln python examples/libraries/jaxmd_lj_melt.py    # its own jit a kiln.jit

10 blocks of 100 steps from a fixed seed. The last line printed is one JSON object:
``time_to_first_result_s`` (from before ``import jax``; the first result is the first block's
energies), ``imports_to_first_result_s`` (from the end of the imports), the temperature and
energies after each block (total energy is conserved by NVE: its drift is the check), and a
checksum of the final positions.
"""

from __future__ import annotations

import time

_T_START = time.perf_counter()  # before importing jax: the cost a user waits for

import json  # noqa: E402
import os  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax_md import energy, quantity, simulate, space  # noqa: E402

# EXAMPLE_JIT=kiln: the user's own jit is kiln.jit (kiln imported last, after jax-md, as a
# user's own tools are); unset, jax.jit as published
if os.environ.get("EXAMPLE_JIT") == "kiln":
    import kiln  # noqa: E402

    jit = kiln.jit
else:
    jit = jax.jit

_T_IMPORTED = time.perf_counter()

CELLS, DENSITY, KT, DT, BLOCKS, STEPS_PER_BLOCK, SEED = 5, 0.8442, 3.0, 0.005, 10, 100, 0


def fcc_lattice(cells: int, density: float) -> tuple[np.ndarray, float]:
    """Positions of ``4 * cells**3`` atoms on an fcc lattice at ``density``, and the box side."""
    side = (4 * cells**3 / density) ** (1 / 3)
    a = side / cells
    basis = np.array([[0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]])
    grid = np.stack(np.meshgrid(*[np.arange(cells)] * 3, indexing="ij"), -1).reshape(-1, 1, 3)
    return ((grid + basis) * a).reshape(-1, 3).astype(np.float32), side


def main() -> dict:
    positions, side = fcc_lattice(CELLS, DENSITY)
    displacement, shift = space.periodic(side)
    neighbor_fn, energy_fn = energy.lennard_jones_neighbor_list(displacement, side,
                                                                r_cutoff=2.5, dr_threshold=0.3)
    init_fn, apply_fn = simulate.nve(energy_fn, shift, dt=DT)
    nbrs = neighbor_fn.allocate(positions)
    state = init_fn(jax.random.key(SEED), positions, kT=KT, neighbor=nbrs)

    @jit
    def block(state, nbrs):
        def step(_, carry):
            state, nbrs = carry
            state = apply_fn(state, neighbor=nbrs)
            return state, nbrs.update(state.position)

        state, nbrs = jax.lax.fori_loop(0, STEPS_PER_BLOCK, step, (state, nbrs))
        potential = energy_fn(state.position, neighbor=nbrs)
        kinetic = quantity.kinetic_energy(momentum=state.momentum, mass=state.mass)
        temperature = quantity.temperature(momentum=state.momentum, mass=state.mass)
        return state, nbrs, jnp.stack([temperature, potential, kinetic + potential])

    records = []
    t_first = None
    for _ in range(BLOCKS):
        state, nbrs, record = block(state, nbrs)
        if nbrs.did_buffer_overflow:
            raise RuntimeError("neighbor list overflowed; allocate a larger one")
        records.append([float(v) for v in record])
        if t_first is None:
            t_first = time.perf_counter()
    n = positions.shape[0]
    result = {
        "time_to_first_result_s": round(t_first - _T_START, 3),
        "imports_to_first_result_s": round(t_first - _T_IMPORTED, 3),
        "atoms": n,
        "temperature": [r[0] for r in records],
        "potential_per_atom": [r[1] / n for r in records],
        "total_energy_per_atom": [r[2] / n for r in records],
        "positions_sum": float(np.asarray(state.position, np.float64).sum()),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

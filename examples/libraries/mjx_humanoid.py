"""A MuJoCo XLA (MJX) rollout of DeepMind Control's humanoid, as in MJX's tutorial: the model
that ships with ``mujoco-mjx`` (``mujoco/mjx/test_data/humanoid/humanoid.xml``), put on the
device with ``mjx.put_model``, stepped by ``mjx.step`` inside a ``@jax.jit`` ``lax.scan``::

    python examples/libraries/mjx_humanoid.py                  # jax.jit, as published
    python -m kiln run --jit examples/libraries/mjx_humanoid.py  # every jax.jit a kiln.jit
    EXAMPLE_JIT=kiln python examples/libraries/mjx_humanoid.py    # its own jit a kiln.jit

The humanoid starts from its default pose (``mujoco.MjData``, put on the device with
``mjx.put_data``), its joint velocities drawn from a fixed seed, and falls under gravity with
contacts for 2 blocks of 100 steps. The
last line printed is one JSON object: ``time_to_first_result_s`` (from before ``import jax``;
the first result is the first block's state), ``imports_to_first_result_s`` (from the end of
the imports), the torso height after each block and checksums of the final state.
"""

from __future__ import annotations

import time

_T_START = time.perf_counter()  # before importing jax: the cost a user waits for

import json  # noqa: E402
import os  # noqa: E402

import jax  # noqa: E402
import mujoco  # noqa: E402
import numpy as np  # noqa: E402
from mujoco import mjx  # noqa: E402

# EXAMPLE_JIT=kiln: the user's own jit is kiln.jit (kiln imported last, as a user's own tools
# are); unset, jax.jit as published
if os.environ.get("EXAMPLE_JIT") == "kiln":
    import kiln  # noqa: E402

    jit = kiln.jit
else:
    jit = jax.jit

_T_IMPORTED = time.perf_counter()

BLOCKS, STEPS_PER_BLOCK, SEED = 2, 100, 0
XML = os.path.join(os.path.dirname(mjx.__file__), "test_data", "humanoid", "humanoid.xml")


def main() -> dict:
    mj_model = mujoco.MjModel.from_xml_path(XML)
    mj_data = mujoco.MjData(mj_model)
    mj_data.qvel[:] = np.random.default_rng(SEED).normal(0.0, 0.5, mj_model.nv)
    model = mjx.put_model(mj_model)
    data = mjx.put_data(mj_model, mj_data)

    @jit
    def rollout(model, data):
        def step(data, _):
            data = mjx.step(model, data)
            return data, data.qpos[2]

        return jax.lax.scan(step, data, None, length=STEPS_PER_BLOCK)

    heights = []
    t_first = None
    for _ in range(BLOCKS):
        data, torso_z = rollout(model, data)
        heights.append(float(torso_z[-1]))
        if t_first is None:
            t_first = time.perf_counter()
    result = {
        "time_to_first_result_s": round(t_first - _T_START, 3),
        "imports_to_first_result_s": round(t_first - _T_IMPORTED, 3),
        "nq": int(mj_model.nq),
        "torso_height": heights,
        "qpos_sum": float(np.asarray(data.qpos, np.float64).sum()),
        "qvel_abs_sum": float(np.abs(np.asarray(data.qvel, np.float64)).sum()),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

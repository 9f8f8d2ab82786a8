"""Random-action rollouts of gymnax's CartPole-v1, as gymnax's README and purejaxrl write them:
``gymnax.make("CartPole-v1")``, one ``env.reset`` and ``env.step`` called directly (gymnax's
own ``jax.jit``s, the environment their static ``self``), then a ``jax.lax.scan`` of
``env.step`` with actions drawn from ``env.action_space(env_params).sample`` under ``jax.jit``,
and a batch of those rollouts under ``jax.vmap``::

    python examples/libraries/gymnax_cartpole.py                  # jax.jit, as published
    python -m kiln run --jit examples/libraries/gymnax_cartpole.py  # every jax.jit a kiln.jit

One step from a reset, then one rollout of 500 steps, then a batch of 64 rollouts of 500 steps,
from fixed keys (gymnax auto-resets an episode when it ends, so every rollout is 500 steps
long). The last line printed is one JSON object: ``time_to_first_result_s`` (from before
``import jax``; the first result is the single rollout's reward),
``imports_to_first_result_s`` (from the end of the imports), the observation after the first
step, the single rollout's total reward, episode count and mean return of its finished
episodes (CartPole pays 1 a step, so the return is the episode's length), the same for the
batch, and a checksum of the batch's final observations.
"""

from __future__ import annotations

import time

_T_START = time.perf_counter()  # before importing jax: the cost a user waits for

import json  # noqa: E402

import gymnax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

_T_IMPORTED = time.perf_counter()

NUM_STEPS, NUM_ENVS, SEED = 500, 64, 0

env, env_params = gymnax.make("CartPole-v1")


@jax.jit
def rollout(key):
    """``NUM_STEPS`` random-action steps from a reset: rewards, done flags, last observation."""
    key_reset, key_episode = jax.random.split(key)
    obs, state = env.reset(key_reset, env_params)

    def step(carry, _):
        obs, state, key = carry
        key, key_act, key_step = jax.random.split(key, 3)
        action = env.action_space(env_params).sample(key_act)
        next_obs, next_state, reward, terminated, truncated, _ = env.step(
            key_step, state, action, env_params)
        done = jnp.logical_or(terminated, truncated)
        return (next_obs, next_state, key), (reward, done)

    (obs, _, _), (rewards, dones) = jax.lax.scan(step, (obs, state, key_episode), None,
                                                  NUM_STEPS)
    return rewards, dones, obs


batch_rollout = jax.jit(jax.vmap(rollout))


def finished_return(rewards: np.ndarray, dones: np.ndarray) -> float:
    """Mean return of the episodes that ended within the rollouts (rows: rollouts)."""
    rewards, dones = np.atleast_2d(rewards), np.atleast_2d(dones)
    last = dones.shape[1] - np.argmax(dones[:, ::-1], axis=1)  # steps up to the last end
    ended = np.where(dones.any(1), last, 0)
    reward = sum(float(r[:n].sum()) for r, n in zip(rewards, ended, strict=True))
    return reward / max(int(dones.sum()), 1)


def main() -> dict:
    key = jax.random.key(SEED)
    key, key_reset, key_act, key_step = jax.random.split(key, 4)
    obs, state = env.reset(key_reset, env_params)
    action = env.action_space(env_params).sample(key_act)
    first_obs, state, reward, terminated, truncated, _ = env.step(key_step, state, action,
                                                                  env_params)
    key_single, key_batch = jax.random.split(key)
    rewards, dones, _ = map(np.asarray, rollout(key_single))
    total_reward = float(rewards.sum())
    t_first = time.perf_counter()
    batch_rewards, batch_dones, batch_obs = map(
        np.asarray, batch_rollout(jax.random.split(key_batch, NUM_ENVS)))
    result = {
        "time_to_first_result_s": round(t_first - _T_START, 3),
        "imports_to_first_result_s": round(t_first - _T_IMPORTED, 3),
        "first_step_obs": [float(o) for o in np.asarray(first_obs)],
        "total_reward": total_reward,
        "episodes": int(dones.sum()),
        "mean_episode_return": finished_return(rewards, dones),
        "batch_mean_total_reward": float(batch_rewards.sum(1).mean()),
        "batch_episodes": int(batch_dones.sum()),
        "batch_mean_episode_return": finished_return(batch_rewards, batch_dones),
        "batch_final_obs_checksum": float(batch_obs.astype(np.float64).sum()),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

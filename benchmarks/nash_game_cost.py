"""What the elementwise Nash game saves on this machine: the train step of a Nash model with the game as it is
(lambda_max in closed form, the L x L solves by unrolled elimination, elementwise over positions) against the
same step with a batched ``jnp.linalg.eigvalsh`` and ``jnp.linalg.solve`` in their place, timed alternately in one
process.

    python benchmarks/nash_game_cost.py [--preset small] [--rounds 8] [--batch-size 8]

Both steps are compiled before timing; each round times one step of each (the order alternates), so drift of a
shared machine reaches both alike. Prints the median step time of each and their ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp

from nash_mhc import ModelConfig, TrainConfig, make_mesh
from nash_mhc.ops import aggregation, equilibrium, game
from nash_mhc.sharding import shard_batch
from nash_mhc.training import Batch, init_train_state
from nash_mhc.training import step as step_module


@contextlib.contextmanager
def batched_linalg():
    """While tracing inside: lambda_max by ``eigvalsh`` and the solves by ``linalg.solve`` (the game before)."""
    eigen, solve = game.largest_eigenvalue, equilibrium.solve_small
    aggregation.largest_eigenvalue = game.largest_eigenvalue = (
        lambda gram, available: jnp.linalg.eigvalsh(gram)[..., -1])
    equilibrium.solve_small = lambda matrix, rhs: jnp.linalg.solve(matrix, rhs[..., None])[..., 0]
    try:
        yield
    finally:
        aggregation.largest_eigenvalue = game.largest_eigenvalue = eigen
        equilibrium.solve_small = solve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    config = ModelConfig.preset(args.preset, residual="mhc", attention="multiscale", aggregation="nash")
    train = TrainConfig(batch_size=args.batch_size, warmup_steps=1, total_steps=1000)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    tokens = jax.random.randint(jax.random.key(1), (args.batch_size, config.seq_len + 1), 0, config.vocab_size)
    batch = shard_batch(Batch(tokens=tokens), mesh)
    contexts = {"elementwise": contextlib.nullcontext, "batched linalg": batched_linalg}
    steps, states = {}, {}
    for name, context in contexts.items():
        states[name] = init_train_state(config, train, mesh, key=jax.random.key(0))
        steps[name] = eqx.filter_jit(step_module._train_step, donate="all-except-first")  # a trace of its own
        with context():  # every call inside its context, so a retrace would trace the same game
            states[name], metrics = steps[name](batch, states[name])
        jax.block_until_ready(metrics)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(args.rounds):
        for name in (list(steps) if round_ % 2 == 0 else list(steps)[::-1]):
            with contexts[name]():
                start = time.perf_counter()
                states[name], metrics = steps[name](batch, states[name])
                jax.block_until_ready(metrics)
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"{args.preset} mhc+multiscale+nash, batch {args.batch_size} x {config.seq_len}, "
          f"{jax.devices()[0].platform}, {args.rounds} alternated rounds")
    for name, value in medians.items():
        print(f"  {name}: median step {value * 1e3:.1f} ms "
              f"({args.batch_size * config.seq_len / value:,.0f} tokens/s)")
    print(f"  elementwise / batched linalg step time: {medians['elementwise'] / medians['batched linalg']:.2f}")


if __name__ == "__main__":
    main()

"""What rematerialisation costs in train-step time on this host, measured side by side.

    python benchmarks/remat_cost.py [--preset small] [--batch-size 8] [--rounds 15]

Variants: no remat; ``--remat dots``; ``--remat full`` (every layer's forward pass rerun in the backward pass);
``--remat full`` in groups of 2 and of every layer (``--remat-group``: each group's forward pass is rerun once
more, to rebuild the layer inputs of which only the group's input was kept). Every variant is compiled and
warmed up first, then the rounds run round-robin (one step of each variant per round), so the host's drift
falls on all of them alike; it prints the median step time of each and its ratio to no remat.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()

    from nash_mhc import ModelConfig, TrainConfig, make_mesh
    from nash_mhc.training import Batch, init_train_state, train_step

    layers = ModelConfig.preset(args.preset).num_layers
    variants = [("none", 1), ("dots", 1), ("full", 1), *(("full", g) for g in sorted({2, layers}) if layers % g == 0)]
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    train_config = TrainConfig(batch_size=args.batch_size, warmup_steps=1, total_steps=1000)
    states, times = {}, {v: [] for v in variants}
    for remat, group in variants:
        config = ModelConfig.preset(args.preset, remat=remat, remat_group=group)
        states[remat, group] = (config, init_train_state(config, train_config, mesh, key=jax.random.key(0)))
    config = next(iter(states.values()))[0]
    tokens = jax.random.randint(jax.random.key(1), (args.batch_size, config.seq_len + 1), 0, config.vocab_size)
    batch = Batch(tokens=tokens)

    def step(variant: tuple[str, int]) -> float:
        cfg, state = states[variant]
        start = time.perf_counter()
        state, metrics = train_step(state, batch)
        jax.block_until_ready(metrics)
        states[variant] = (cfg, state)
        return time.perf_counter() - start

    for variant in variants:  # compile and one warm-up step each, outside the timed rounds
        step(variant)
        step(variant)
    for _ in range(args.rounds):
        for variant in variants:
            times[variant].append(step(variant))
    base = statistics.median(times["none", 1])
    print(f"{args.preset}, batch {args.batch_size} x {config.seq_len}, {config.residual}+{config.attention}, "
          f"{config.dtype}, {jax.devices()[0].device_kind}; median of {args.rounds} interleaved rounds")
    print("| remat | group | step time (median) | ÷ no remat | tokens/s |")
    print("| --- | --- | ---: | ---: | ---: |")
    for (remat, group), samples in times.items():
        median = statistics.median(samples)
        print(f"| {remat} | {group} | {median * 1e3:,.0f} ms | {median / base:.2f} | "
              f"{args.batch_size * config.seq_len / median:,.0f} |")


if __name__ == "__main__":
    main()

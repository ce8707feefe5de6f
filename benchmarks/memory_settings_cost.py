"""What the memory-saving settings cost in train-step time on this host, measured side by side.

    python benchmarks/memory_settings_cost.py [--preset small] [--batch-size 8] [--rounds 15]

Variants: no remat; ``--remat dots``; ``--remat full`` (every layer's forward pass rerun in the backward pass);
``--remat full`` in groups of 2 and of every layer (``--remat-group``: each group's forward pass is rerun once
more, to rebuild the layer inputs of which only the group's input was kept); no remat with ``--loss-chunks 8``
(the LM head and cross-entropy over 8 slices of the sequence, each rematerialised). Every variant is compiled and
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

    from nash_mhc import ExecutionConfig, ModelConfig, TrainConfig, make_mesh
    from nash_mhc.training import Batch, init_train_state, train_step

    config = ModelConfig.preset(args.preset)
    layers = config.num_layers
    variants = [("none", 1, 1), ("dots", 1, 1), ("full", 1, 1),
                *(("full", g, 1) for g in sorted({2, layers}) if layers % g == 0),
                *([("none", 1, 8)] if config.seq_len % 8 == 0 else [])]
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    states, times = {}, {v: [] for v in variants}
    for remat, group, chunks in variants:
        train_config = TrainConfig(batch_size=args.batch_size, warmup_steps=1, total_steps=1000)
        states[remat, group, chunks] = init_train_state(config, train_config, mesh, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (args.batch_size, config.seq_len + 1), 0, config.vocab_size)
    batch = Batch(tokens=tokens)

    def step(variant: tuple[str, int, int]) -> float:
        remat, group, chunks = variant
        start = time.perf_counter()
        with ExecutionConfig(remat=remat, remat_group=group, loss_chunks=chunks).use():
            states[variant], metrics = train_step(states[variant], batch)
        jax.block_until_ready(metrics)
        return time.perf_counter() - start

    for variant in variants:  # compile and one warm-up step each, outside the timed rounds
        step(variant)
        step(variant)
    for _ in range(args.rounds):
        for variant in variants:
            times[variant].append(step(variant))
    base = statistics.median(times["none", 1, 1])
    print(f"{args.preset}, batch {args.batch_size} x {config.seq_len}, {config.residual}+{config.attention}, "
          f"{config.dtype}, {jax.devices()[0].device_kind}; median of {args.rounds} interleaved rounds")
    print("| remat | group | loss chunks | step time (median) | ÷ no remat | tokens/s |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for (remat, group, chunks), samples in times.items():
        median = statistics.median(samples)
        print(f"| {remat} | {group} | {chunks} | {median * 1e3:,.0f} ms | {median / base:.2f} | "
              f"{args.batch_size * config.seq_len / median:,.0f} |")


if __name__ == "__main__":
    main()

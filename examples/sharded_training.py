"""Sharded training on 8 fake CPU devices: a (data, fsdp, tp) = (2, 2, 2) mesh and a per-device memory table.

    python examples/sharded_training.py [--steps 5] [--data 2 --fsdp 2 --tp 2]

The same code runs unchanged on 8 TPU chips or GPUs (drop the XLA_FLAGS line's effect: it only applies to CPU).
"""

from __future__ import annotations

import os

# 8 host devices, before JAX starts; a user's other XLA flags are kept
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()

import argparse  # noqa: E402
import collections  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402

import nash_mhc  # noqa: E402
from nash_mhc.data import make_datasets  # noqa: E402
from nash_mhc.sharding import sharding_summary  # noqa: E402
from nash_mhc.training import Batch, init_train_state, train_step  # noqa: E402


def per_device_bytes(tree) -> dict[jax.Device, int]:
    """Bytes of every array leaf's shards, summed per device (what each device really holds)."""
    usage: dict[jax.Device, int] = collections.Counter()
    for leaf in jax.tree.leaves(eqx.filter(tree, eqx.is_array)):
        for shard in leaf.addressable_shards:
            usage[shard.device] += shard.data.nbytes
    return usage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="training steps")
    parser.add_argument("--data", type=int, default=2, help="data-parallel axis")
    parser.add_argument("--fsdp", type=int, default=2, help="FSDP axis")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel axis")
    args = parser.parse_args()
    nash_mhc.select_platform()  # the CPU, quietly, on a CPU host with libtpu installed (a no-op elsewhere)

    mesh = nash_mhc.make_mesh(args.data, args.fsdp, args.tp)
    model_config = nash_mhc.ModelConfig.preset("tiny", num_heads=4)
    train_config = nash_mhc.TrainConfig(batch_size=8, learning_rate=3e-3, warmup_steps=1,
                                        total_steps=max(args.steps, 1))
    train_data, _, _ = make_datasets("stdlib", "bytes", model_config.seq_len, seed=0)
    state = init_train_state(model_config, train_config, mesh, key=jax.random.key(0))
    for line in sharding_summary(state.model, mesh):
        print(line)

    params = per_device_bytes(state.model)
    optimizer = per_device_bytes(state.opt_state)
    whole = sum(x.nbytes for x in jax.tree.leaves(eqx.filter((state.model, state.opt_state), eqx.is_array)))
    print(f"\nfull state (params + optimizer): {whole / 1024:.1f} KiB; each device holds:")
    print(f"{'device':>8} {'params KiB':>12} {'optimizer KiB':>14} {'of full state':>14}")
    for device in mesh.devices.flat:
        share = (params[device] + optimizer[device]) / whole
        print(f"{device.id:>8} {params[device] / 1024:12.1f} {optimizer[device] / 1024:14.1f} {share:14.1%}")
    ideal = 1 / (mesh.shape["fsdp"] * mesh.shape["tp"])  # the data axis holds replicas
    print(f"{'ideal':>8} {'':>12} {'':>14} {ideal:14.1%}\n")

    for step in range(args.steps):
        state, metrics = train_step(state, Batch(tokens=train_data.batch_at(step, global_batch=8)))
        print(f"step {step + 1}: loss {float(metrics['loss']):.4f}")


if __name__ == "__main__":
    main()

"""Stability study: train ``tiny`` with residual plain / hc / mhc and plot loss curves and the Amax gain
magnitude of the composite residual mapping over depth (the small-scale version of the mHC paper's figure:
unconstrained HC mixing matrices compound, Sinkhorn-constrained mHC ones stay near 1).

    python examples/stability_study.py [--steps 60] [--layers 8] [--out stability.png]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import nash_mhc  # noqa: E402
from nash_mhc.data import make_datasets  # noqa: E402
from nash_mhc.training import Batch, init_train_state, train_step  # noqa: E402

MODES = ("plain", "hc", "mhc")


def amax_gain_over_depth(model: nash_mhc.LanguageModel, tokens: jax.Array) -> jax.Array:
    """[2·layers] max over tokens of max(|row sums|, |col sums|) of Π_{k≤d} H_res^(k), for every depth d."""
    maps = model(tokens, return_residual_maps=True).residual_maps  # [2L, T, n, n]

    def compose(acc: jax.Array, h: jax.Array) -> tuple[jax.Array, jax.Array]:
        acc = jnp.einsum("tij,tjk->tik", h, acc)
        rows = jnp.max(jnp.sum(jnp.abs(acc), axis=-1), axis=-1)
        cols = jnp.max(jnp.sum(jnp.abs(acc), axis=-2), axis=-1)
        return acc, jnp.max(jnp.maximum(rows, cols))

    eye = jnp.broadcast_to(jnp.eye(maps.shape[-1]), maps.shape[1:])
    return jax.lax.scan(compose, eye, maps)[1]


def train_mode(residual: str, args: argparse.Namespace, data) -> tuple[list[float], jax.Array]:
    config = nash_mhc.ModelConfig.preset("tiny", residual=residual, num_layers=args.layers)
    train_config = nash_mhc.TrainConfig(batch_size=8, learning_rate=args.learning_rate, warmup_steps=5,
                                        total_steps=args.steps, grad_clip=0.0, weight_decay=0.0)
    mesh = nash_mhc.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    state = init_train_state(config, train_config, mesh, key=jax.random.key(0))
    losses = []
    for step in range(args.steps):
        state, metrics = train_step(state, Batch(tokens=data.batch_at(step, global_batch=8)))
        losses.append(float(metrics["loss"]))
    probe = jnp.asarray(data.batch_at(10_000, global_batch=1)[0, :-1])
    return losses, jax.jit(functools.partial(amax_gain_over_depth))(state.model, probe)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps per mode")
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks (2 residual maps each)")
    parser.add_argument("--learning-rate", type=float, default=1e-2, help="peak learning rate (high on purpose)")
    parser.add_argument("--out", default="stability.png", help="where to write the figure")
    args = parser.parse_args()

    data, _, _ = make_datasets("stdlib", "bytes", 64, seed=0)
    results = {mode: train_mode(mode, args, data) for mode in MODES}

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, (losses, gains) in results.items():
        left.plot(range(1, len(losses) + 1), losses, label=mode)
        right.plot(range(1, len(gains) + 1), gains, marker="o", markersize=3, label=mode)
        print(f"{mode:>5}: final loss {losses[-1]:.3f}, Amax gain at full depth {float(gains[-1]):.3f}, "
              f"max over depth {float(jnp.max(gains)):.3f}")
    left.set(xlabel="step", ylabel="training loss", title="loss")
    right.set(xlabel="sublayer (composite depth)", ylabel="Amax gain magnitude", yscale="log",
              title="composite residual mapping Π H_res")
    right.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    for ax in (left, right):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

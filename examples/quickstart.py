"""Build a Nash-MHC model, run it on a batch, and take a few plain SGD steps on one repeated sequence.

    python examples/quickstart.py [--preset tiny] [--steps 20]
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp

import nash_mhc
from nash_mhc.model import describe


def loss_fn(model: nash_mhc.LanguageModel, batch: jax.Array) -> jax.Array:
    """Next-token cross-entropy plus the scaled sparsity aux loss; batch: int32[B, T+1]."""
    out = model(batch[:, :-1])  # a [B, T] batch runs natively (jax.vmap(model) gives the same)
    logp = jax.nn.log_softmax(out.logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1).mean()
    return nll + model.config.sparsity_weight * out.aux_loss.mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="model preset (tiny, small, ...)")
    parser.add_argument("--steps", type=int, default=20, help="SGD steps on the demo batch")
    parser.add_argument("--learning-rate", type=float, default=0.5, help="SGD learning rate")
    args = parser.parse_args()
    nash_mhc.select_platform()  # the CPU, quietly, on a CPU host with libtpu installed (a no-op elsewhere)

    config = nash_mhc.ModelConfig.preset(args.preset)
    print(describe(config))
    model = nash_mhc.LanguageModel(config, key=jax.random.key(0))
    text = (b"def add(a, b):\n    return a + b\n" * 64)[: 4 * (config.seq_len + 1)]
    batch = jnp.frombuffer(text, dtype=jnp.uint8).astype(jnp.int32).reshape(4, config.seq_len + 1)

    out = eqx.filter_jit(lambda m, t: m(t))(model, batch[:, :-1])
    print(f"logits {out.logits.shape}, aux loss {float(out.aux_loss.mean()):.4f}, "
          f"mean scale weights {jnp.round(out.scale_weights.mean(0), 3)}")

    @eqx.filter_jit
    def sgd_step(model, batch):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
        updates = jax.tree.map(lambda g: -args.learning_rate * g, grads)
        return eqx.apply_updates(model, updates), loss

    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        model, loss = sgd_step(model, batch)
        if step == 1 or step % 5 == 0 or step == args.steps:
            print(f"step {step:3d}  loss {float(loss):.4f}  ({time.perf_counter() - start:.1f}s)")


if __name__ == "__main__":
    main()

"""How far the Nash game moves the scale weights from the prior softmax(b), on a trained checkpoint.

For every layer and held-out position with at least two scales available: the total-variation distance between
the Nash equilibrium weights w and the prior's weights softmax(b) over the same scales, and the largest change of
a log-odds against scale 0, max_l |(log w_l - log w_0) - (b_l - b_0)| (what the README's bound limits: < 2/c
nats); prints the mean, the 90th percentile and the maximum of each over positions and layers, and the mean
weight the coarse scales get from the prior and from the game, as JSON.

    python benchmarks/nash_vs_prior.py --checkpoint-dir runs/nash_mhc [--batches 4]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np


def main() -> None:
    from nash_mhc.data import open_windows
    from nash_mhc.inference import load_model
    from nash_mhc.ops.multiscale import available_mask

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()
    loaded = load_model(args.checkpoint_dir)
    model, config = loaded.model, loaded.config
    if config.aggregation != "nash" or config.num_scales < 2:
        raise SystemExit("the checkpoint's model has no Nash aggregation")
    data = open_windows(loaded.data_config(), "eval", loaded.tokenizer, config.seq_len, loaded.seed)
    available = np.stack([available_mask(config.seq_len, s) for s in config.block_sizes], axis=1)  # [T, L]
    choice = available.sum(1) >= 2

    @jax.jit
    def layer_weights(tokens: jax.Array) -> jax.Array:
        x = model.embed(tokens)
        out = []
        for layer in range(config.num_layers):
            block = jax.tree.map(lambda a, i=layer: a[i] if hasattr(a, "shape") and a.ndim else a, model.blocks)
            x, stats = block(x)
            out.append(stats.weights)
        return jnp.stack(out)  # [layers, B, T, L]

    distances, shifts, coarse_prior, coarse_nash = [], [], [], []
    for i in range(args.batches):
        tokens = jnp.asarray(data.batch_at(i, global_batch=args.batch_size)[:, :-1])
        weights = np.asarray(layer_weights(tokens), np.float64)
        priors = np.asarray(model.blocks.attn.aggregation.prior, np.float64)  # [layers, L]
        for layer in range(config.num_layers):
            logits = np.where(available, priors[layer][None, :], -np.inf)
            prior = np.exp(logits - logits.max(1, keepdims=True))
            prior /= prior.sum(1, keepdims=True)
            tv = 0.5 * np.abs(weights[layer] - prior[None]).sum(-1)  # [B, T]
            distances.append(tv[:, choice].ravel())
            with np.errstate(divide="ignore"):
                odds = np.log(weights[layer]) - np.log(weights[layer][..., :1])  # [B, T, L]
            moved = np.where(available[None], np.abs(odds - (priors[layer] - priors[layer][0])[None, None]), 0.0)
            shifts.append(moved.max(-1)[:, choice].ravel())
            coarse_prior.append(np.broadcast_to(1.0 - prior[:, 0], tv.shape)[:, choice].ravel())
            coarse_nash.append((1.0 - weights[layer][..., 0])[:, choice].ravel())
    d, s = np.concatenate(distances), np.concatenate(shifts)
    print(json.dumps({"checkpoint": args.checkpoint_dir, "step": loaded.step, "positions": int(d.size),
                      "mean_tv": float(d.mean()), "p90_tv": float(np.quantile(d, 0.9)), "max_tv": float(d.max()),
                      "mean_log_odds_shift": float(s.mean()), "p90_log_odds_shift": float(np.quantile(s, 0.9)),
                      "max_log_odds_shift": float(s.max()),
                      "coarse_weight_prior": float(np.concatenate(coarse_prior).mean()),
                      "coarse_weight_nash": float(np.concatenate(coarse_nash).mean())}))


if __name__ == "__main__":
    main()

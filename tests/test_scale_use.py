"""Scale use in the logs (:mod:`nash_mhc.training.scale_use`) against a float64 NumPy reference."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nash_mhc import LanguageModel, ModelConfig, make_mesh
from nash_mhc.model import Block
from nash_mhc.training import Batch, eval_step
from nash_mhc.training.scale_use import scale_use_sums

SEQ, ROWS = 16, 4
MODEL = ModelConfig.preset("tiny", seq_len=SEQ)  # block sizes 1, 2, 4: the coarse scales start at positions 1, 3


def one_device() -> jax.sharding.Mesh:
    return make_mesh(1, 1, 1, devices=jax.devices()[:1])


def reference_available(seq: int, block_sizes: tuple[int, ...]) -> np.ndarray:
    """bool [T, L]: position t has a complete block of scale l (docs/design.md §3.2: t + 1 >= s_l)."""
    return np.arange(seq)[:, None] + 1 >= np.asarray(block_sizes)[None, :]


def reference_prior(logits: np.ndarray, available: np.ndarray) -> np.ndarray:
    """softmax(b) over the available scales, float64: [layers, L] logits → [layers, T, L] (0 where unavailable)."""
    e = np.where(available[None], np.exp(logits[:, None, :] - logits.max(axis=-1)[:, None, None]), 0.0)
    return e / e.sum(axis=-1, keepdims=True)


@eqx.filter_jit
def run_block(block: Block, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, stats = block(x)
    return x, stats.weights


def weights_block_by_block(model: LanguageModel, ids: jax.Array) -> np.ndarray:
    """[B, layers, T, L]: each block's aggregation weights, running the blocks one at a time (not the layer scan;
    one compile: every block has the same structure)."""
    x, found = model.embed(ids), []
    for i in range(model.config.num_layers):
        x, weights = run_block(jax.tree.map(lambda a, i=i: a[i] if eqx.is_array(a) else a, model.blocks), x)
        found.append(np.asarray(weights, np.float64))
    return np.stack(found, axis=1)


@pytest.mark.slow  # two compiles (the eval step, a block): multi-second, a log's numbers rather than an invariant
def test_logged_scale_use_matches_a_float64_reference():
    """eval_step's scale_weight, scale_prior and scale_tv, per layer and averaged over layers, equal float64 NumPy
    means over the masked-in positions (weights 0 where a scale is unavailable) of the weights the blocks give one
    at a time, of the prior softmax(b) over the available scales, and of 1/2 Σ_l |w_l - p_l|. Each layer's prior
    is different and far from the start, so a layer or scale mixed up, a mean over the masked-out positions, or
    a prior that ignores availability, shows."""
    rng = np.random.default_rng(0)
    model = LanguageModel(MODEL, key=jax.random.key(0))
    logits = rng.normal(size=(MODEL.num_layers, MODEL.num_scales))
    model = eqx.tree_at(lambda m: m.blocks.attn.aggregation.prior, model, jnp.asarray(logits, jnp.float32))
    tokens = rng.integers(0, MODEL.vocab_size, (ROWS, SEQ + 1)).astype(np.int32)
    mask = (rng.random((ROWS, SEQ)) < 0.7).astype(np.float32)
    mask[:, :3] = [1.0, 0.0, 1.0]  # where the coarse scales are missing: some positions count, some do not
    logged = eval_step(model, Batch(tokens=tokens, loss_mask=mask), mesh=one_device())
    metrics = {k: float(v) for k, v in logged.items()}

    w = weights_block_by_block(model, jnp.asarray(tokens[:, :-1]))  # [B, layers, T, L]
    m = mask.astype(np.float64)
    p = reference_prior(np.asarray(logits, np.float32).astype(np.float64), reference_available(SEQ, MODEL.block_sizes))
    expected = {"weight": np.einsum("bt,bitl->il", m, w) / m.sum(), "prior": np.einsum("bt,itl->il", m, p) / m.sum()}
    tv = np.einsum("bt,bit->i", m, 0.5 * np.abs(w - p[None]).sum(axis=-1)) / m.sum()
    layers, scales = range(MODEL.num_layers), range(MODEL.num_scales)
    names = {"scale_tv", *(f"scale_tv/layer{i}" for i in layers)}
    for name, per_layer in expected.items():
        assert np.min(per_layer) > 0.02  # every scale carries weight in every layer: the means can tell
        for level in scales:
            names.add(f"scale_{name}/{level}")
            assert metrics[f"scale_{name}/{level}"] == pytest.approx(per_layer[:, level].mean(), abs=1e-6), name
            for i in layers:
                names.add(f"scale_{name}/layer{i}/{level}")
                assert metrics[f"scale_{name}/layer{i}/{level}"] == pytest.approx(per_layer[i, level], abs=1e-6)
        for i in layers:  # each layer's shares add up to 1
            assert sum(metrics[f"scale_{name}/layer{i}/{level}"] for level in scales) == pytest.approx(1.0, abs=1e-6)
    assert tv.min() > 1e-3  # the game has moved the weights off the prior
    assert metrics["scale_tv"] == pytest.approx(tv.mean(), abs=1e-6)
    for i in layers:
        assert metrics[f"scale_tv/layer{i}"] == pytest.approx(tv[i], abs=1e-6)
    assert {k for k in metrics if k.startswith("scale_")} == names

    full = eqx.filter_eval_shape(LanguageModel, MODEL.replace(attention="full"), key=jax.random.key(0))
    # one scale: nothing to log
    assert scale_use_sums(jnp.ones((ROWS, MODEL.num_layers, SEQ, 1)), jnp.asarray(mask), full) == {}

"""The first invariant: changing token k never changes the logits at positions < k, bit for bit."""

from __future__ import annotations

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mode_case, perturbed

from nash_mhc import LanguageModel, ModelConfig

MODES = list(itertools.product(("mhc", "hc", "plain"), ("multiscale", "full"), ("nash", "convex")))
MODES += [("mhc-lite", "multiscale", "nash"), ("mhc", "multiscale", "gate"), ("mhc-lite", "full", "nash")]
DEFAULT_MODE = ("mhc", "multiscale", "nash")
# T = 21: a trailing partial coarse block at every coarse scale, every mode. The default mode also runs whole blocks
# (16, 32) and, in bfloat16 compute, keeps the residual streams in bfloat16 between layers: each case is one
# compilation, so those are slow, as are the modes outside the quick loop's covering set (under 5 minutes).
CASES = ([mode_case(mode, "float32", 21) for mode in MODES]
         + [pytest.param(*DEFAULT_MODE, "float32", seq, marks=pytest.mark.slow) for seq in (16, 32)]
         + [pytest.param(*DEFAULT_MODE, "bfloat16", 21, marks=pytest.mark.slow)])


@pytest.mark.parametrize("residual, attention, aggregation, dtype, seq", CASES)
def test_future_tokens_never_change_past_logits(residual, attention, aggregation, dtype, seq):
    """For every k: the sequence with tokens k.. replaced (token k always changed) keeps the logits at < k bit
    for bit and changes them at k. All T + 1 sequences of one length run as one batch."""
    config = ModelConfig.preset("tiny", residual=residual, attention=attention, aggregation=aggregation,
                                num_layers=2, dtype=dtype)
    model = LanguageModel(config, key=jax.random.key(0))
    model = perturbed(model)  # train-like parameters: no branch is inert
    forward = eqx.filter_jit(lambda m, t: m(t).logits)
    rng = np.random.default_rng(0)
    base = rng.integers(0, config.vocab_size, seq)
    rows = [base]
    for k in range(seq):
        changed = base.copy()
        changed[k:] = rng.integers(0, config.vocab_size, seq - k)
        changed[k] = (base[k] + 1) % config.vocab_size
        rows.append(changed)
    logits = np.asarray(forward(model, jnp.asarray(np.stack(rows))))
    for k in range(seq):
        assert np.array_equal(logits[k + 1, :k], logits[0, :k]), f"T={seq}: token {k} changed an earlier logit"
        assert not np.array_equal(logits[k + 1, k], logits[0, k]), f"T={seq}: token {k} had no effect at {k}"


def test_causality_across_attention_query_chunks():
    """At T = 128 causal_attention splits queries into two chunks of 64 (block skipping); changing a token
    on either side of the chunk boundary must still leave every earlier logit bit-identical."""
    config = ModelConfig.preset("tiny", seq_len=128, num_layers=2)
    model = LanguageModel(config, key=jax.random.key(0))
    rng = np.random.default_rng(1)
    base = rng.integers(0, config.vocab_size, 128)
    positions = (1, 40, 63, 64, 65, 100, 127)
    batch = np.stack([base] + [np.concatenate([base[:k], (base[k:] + 1) % config.vocab_size]) for k in positions])
    logits = np.asarray(eqx.filter_jit(lambda m, t: m(t).logits)(model, jnp.asarray(batch)))
    for row, k in enumerate(positions, start=1):
        assert np.array_equal(logits[row, :k], logits[0, :k]), f"token {k} changed an earlier logit"
        assert not np.array_equal(logits[row, k], logits[0, k]), f"token {k} had no effect at {k}"

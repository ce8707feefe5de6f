"""The start of the multiscale aggregation as a setting (``ModelConfig.scale_prior``, ``--scale-prior``): scale0,
uniform or scale 0's weight, the same in every aggregation, and the default for checkpoints saved before it."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import write_checkpoint

from nash_mhc import LanguageModel, ModelConfig, TrainConfig, make_mesh
from nash_mhc.layers.aggregation import ScaleAggregation
from nash_mhc.train import main as train_main
from nash_mhc.training import init_train_state
from nash_mhc.training.checkpoint import config_differences, saved_model_config

SEQ = 16
MODEL = ModelConfig.preset("tiny", seq_len=SEQ)  # block sizes 1, 2, 4: the coarse scales start at positions 1, 3


def reference_available(seq: int, block_sizes: tuple[int, ...]) -> np.ndarray:
    """bool [T, L]: position t has a complete block of scale l (docs/design.md §3.2: t + 1 >= s_l)."""
    return np.arange(seq)[:, None] + 1 >= np.asarray(block_sizes)[None, :]


@eqx.filter_jit
def aggregation_weights(layer: ScaleAggregation, outputs: list[jax.Array], available: jax.Array) -> jax.Array:
    return layer(outputs, available).weights  # one compile per mode: the prior is an array leaf


@pytest.mark.parametrize("scale_prior, scale0", [("uniform", 1 / 3), ("0.6", 0.6), ("scale0", 0.99)])
def test_the_aggregation_starts_at_the_scale_prior(scale_prior, scale0):
    """The model's prior softmax(b) starts at ``scale0`` on scale 0 and the rest split equally, in every layer.
    The gate and convex weights start there at each position, renormalised over the available scales (uniform:
    every available scale equal); the Nash game starts from that prior and stays on it when the scales' outputs
    agree (a game with nothing to settle; outputs that disagree move it, by design)."""
    config = MODEL.replace(scale_prior=scale_prior)
    start = np.array([scale0, (1 - scale0) / 2, (1 - scale0) / 2])
    model = LanguageModel(config, key=jax.random.key(0))
    np.testing.assert_allclose(np.asarray(jax.nn.softmax(model.blocks.attn.aggregation.prior, axis=-1)),
                               np.broadcast_to(start, (MODEL.num_layers, 3)), atol=1e-6)
    available = reference_available(SEQ, MODEL.block_sizes)
    expected = np.where(available, start, 0.0)
    expected /= expected.sum(axis=-1, keepdims=True)
    if scale_prior == "uniform":
        np.testing.assert_allclose(expected, available / available.sum(axis=-1, keepdims=True), atol=1e-12)
    rng = np.random.default_rng(1)
    differ = [jnp.asarray(rng.normal(size=(SEQ, 16)), jnp.float32) * s for s in (1.0, 2.0, 0.5)]
    agree = [differ[0]] * 3
    for mode in ("nash", "gate", "convex"):
        layer = ScaleAggregation(3, mode, num_iters=config.nash_iters, temperature=config.nash_temperature, dim=16,
                                 scale0_weight=config.scale0_prior_weight)
        got = np.asarray(aggregation_weights(layer, agree if mode == "nash" else differ, jnp.asarray(available)))
        np.testing.assert_allclose(got, expected, atol=1e-6, err_msg=mode)


def before_scale_prior() -> dict:
    """The tiny model config as a checkpoint saved before ``scale_prior`` existed holds it."""
    saved = MODEL.to_dict()
    del saved["scale_prior"]
    return saved


def test_a_checkpoint_saved_before_the_setting_started_at_scale0():
    """A checkpoint whose model config predates ``scale_prior`` counts as ``scale0``: the default matches it,
    another start differs from it."""
    saved = before_scale_prior()
    assert config_differences(saved, MODEL) == []
    assert config_differences(saved, MODEL.replace(scale_prior="uniform")) == ["scale_prior"]
    assert config_differences(saved, MODEL.replace(scale_prior="0.99")) == ["scale_prior"]  # the same start, named
    assert ModelConfig.from_dict(saved_model_config(saved)) == MODEL


@pytest.mark.slow  # multi-second (a train state, a checkpoint and the program's start), an error path
def test_resuming_a_checkpoint_from_before_the_setting_with_another_start_is_refused(tmp_path, capsys):
    """Resuming that checkpoint with ``--scale-prior uniform`` is refused in one line that names both starts."""
    saved = before_scale_prior()

    class Before:  # the model config as that version wrote it
        def to_dict(self) -> dict:
            return saved

    train_config = TrainConfig(batch_size=8, total_steps=4, warmup_steps=1)
    state = init_train_state(MODEL, train_config, make_mesh(1, 1, 1, devices=jax.devices()[:1]), key=jax.random.key(0))
    write_checkpoint(tmp_path / "run", 2, state, Before(), train_config)
    code = train_main(["--model", "tiny", "--seq-len", str(SEQ), "--dataset", "synthetic", "--no-progress",
                       "--compile-cache-dir", "none", "--batch-size", "8", "--total-steps", "4",
                       "--scale-prior", "uniform", "--checkpoint-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "scale_prior: checkpoint 'scale0' vs now 'uniform'" in err, err


def test_scale_prior_is_checked_and_written_one_way():
    assert MODEL.replace(scale_prior="0.50").scale_prior == "0.5" == MODEL.replace(scale_prior="5e-1").scale_prior
    for bad in ("1", "0", "-0.2", "nan", "inf", "full", ""):
        with pytest.raises(ValueError, match=r"scale_prior must be scale0, uniform or a number in \(0, 1\)"):
            MODEL.replace(scale_prior=bad)

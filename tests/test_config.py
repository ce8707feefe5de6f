"""ModelConfig validation, presets, exact parameter count and FLOPs convention."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import pytest

from nash_mhc import LanguageModel, ModelConfig


def count_leaves(config: ModelConfig) -> int:
    shapes = eqx.filter_eval_shape(LanguageModel, config, key=jax.random.key(0))
    return sum(x.size for x in jax.tree.leaves(shapes) if isinstance(x, jax.ShapeDtypeStruct))


@pytest.mark.parametrize("overrides, message", [
    (dict(num_heads=5), "num_heads=5 must divide d_model=64"),
    (dict(seq_len=62), "divisible by the coarsest block"),
    (dict(num_streams=0), "num_streams must be a positive integer"),
    (dict(residual="resnet"), "unknown residual 'resnet'"),
    (dict(attention="linear"), "unknown attention 'linear'"),
    (dict(aggregation="mean"), "unknown aggregation 'mean'"),
    (dict(dtype="float16"), "unknown dtype 'float16'"),
    (dict(remat="some"), "unknown remat 'some'"),
    (dict(compression_ratio=1), "compression_ratio must be >= 2"),
    (dict(d_model=60, num_heads=20), "must be even for RoPE"),
])
def test_invalid_configs_raise_clear_value_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.preset("tiny", **overrides)


def test_unknown_preset_and_field():
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        ModelConfig.preset("huge")
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        ModelConfig.preset("tiny", width=3)


def test_config_is_frozen_and_normalised():
    config = ModelConfig.preset("tiny", residual="plain", attention="full")
    assert config.num_streams == 1 and config.num_scales == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.d_model = 8  # type: ignore[misc]
    assert ModelConfig.from_dict(config.to_dict()) == config
    assert ModelConfig().padded_vocab_size % 128 == 0
    assert ModelConfig().ffn_hidden % 128 == 0


def test_presets_cover_the_documented_sizes():
    sizes = {name: ModelConfig.preset(name) for name in ("tiny", "small", "base", "medium", "1b", "3b")}
    three_b = sizes["3b"]
    assert (three_b.d_model, three_b.num_layers, three_b.num_scales, three_b.seq_len) == (2048, 28, 4, 4096)
    assert sizes["small"].d_model == 256 and sizes["small"].num_layers == 4
    baseline = ModelConfig.preset("base", residual="plain", attention="full").num_params()
    assert 110e6 < baseline < 140e6
    medium = ModelConfig.preset("medium", residual="plain", attention="full").num_params()
    assert 300e6 < medium < 400e6
    params = [c.num_params() for c in sizes.values()]
    assert params == sorted(params)


@pytest.mark.parametrize("name", ["tiny", "small", "3b"])
@pytest.mark.parametrize("residual, attention, tie", [
    ("mhc", "multiscale", True), ("hc", "full", False), ("plain", "multiscale", False), ("plain", "full", True)])
def test_param_count_matches_model_leaves(name, residual, attention, tie):
    config = ModelConfig.preset(name, residual=residual, attention=attention, tie_embeddings=tie)
    assert count_leaves(config) == config.num_params()


def test_flops_convention():
    config = ModelConfig.preset("small", attention="full")
    T, D = config.seq_len, config.d_model
    expected = 6 * config.matmul_params() + config.num_layers * 6 * D * T
    assert config.flops_per_token() == pytest.approx(expected)
    multiscale = config.replace(attention="multiscale", num_scales=3)
    extra = multiscale.num_layers * sum(6 * D * T / s**2 for s in multiscale.block_sizes[1:])
    # coarse scales' own Q, K projections run on T / s_l tokens: 2·D² per scale, counted 1/s_l per token
    coarse_qk = multiscale.num_layers * sum(6 * 2 * D * D * (1 - 1 / s) for s in multiscale.block_sizes[1:])
    assert multiscale.flops_per_token() == pytest.approx(6 * multiscale.matmul_params() - coarse_qk
                                                         + config.num_layers * 6 * D * T + extra)

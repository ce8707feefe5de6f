"""ModelConfig validation, presets, exact parameter count, and the FLOPs convention against XLA's count."""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

from nash_mhc import ExecutionConfig, LanguageModel, ModelConfig
from nash_mhc.model import num_params, param_counts


def expected_counts(c: ModelConfig) -> dict[str, int]:
    """Parameters by role, written out from the architecture (docs/design.md §1-§3 and the layers' docstrings)."""
    D, F, V, n, L = c.d_model, c.ffn_hidden, c.padded_vocab_size, c.num_streams, c.num_scales
    matmul = 2 * L * D * D + 2 * D * D + 3 * D * F  # per-scale Q, K; shared V; output; SwiGLU
    norm = 2 * D  # the two pre-norms
    kernel = sum(c.compression_ratio**level for level in range(1, L)) * D  # downsampling kernels
    coefficient = 0 if L == 1 else L + {"nash": 1, "gate": L * L * D, "convex": 0}[c.aggregation]
    if n > 1:  # per sublayer: the connection's own norm gain, Φ, α (3) and the static biases
        rows, columns, biases = {"mhc": (n * D, 2 * n + n * n, 2 * n + n * n),  # b_pre, b_post, b_res [n, n]
                                 "mhc-lite": (n * D, 2 * n + math.factorial(n), 2 * n + math.factorial(n)),  # b_perm
                                 "hc": (D, 2 + n, 2 * n + n * n)}[c.residual]
        norm += 2 * rows
        coefficient += 2 * (rows * columns + 3 + biases)
    return {"matmul": c.num_layers * matmul, "head": 0 if c.tie_embeddings else D * V, "embedding": V * D,
            "norm": c.num_layers * norm + D, "kernel": c.num_layers * kernel,
            "coefficient": c.num_layers * coefficient}


@pytest.mark.parametrize("overrides, message", [
    (dict(num_heads=5), "num_heads=5 must divide d_model=64"),
    (dict(seq_len=62), "divisible by the coarsest block"),
    (dict(num_streams=0), "num_streams must be a positive integer"),
    (dict(residual="resnet"), "unknown residual 'resnet'"),
    (dict(attention="linear"), "unknown attention 'linear'"),
    (dict(aggregation="mean"), "unknown aggregation 'mean'"),
    (dict(dtype="float16"), "unknown dtype 'float16'"),
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
    baseline = num_params(ModelConfig.preset("base", residual="plain", attention="full"))
    assert 110e6 < baseline < 140e6
    medium = num_params(ModelConfig.preset("medium", residual="plain", attention="full"))
    assert 300e6 < medium < 400e6
    params = [num_params(c) for c in sizes.values()]
    assert params == sorted(params)
    # the accelerator presets run their layers unrolled by default (docs/gpu.md at base, docs/tpu.md at 1b, 3b)
    assert all(ExecutionConfig().for_preset(name).scan_unroll >= sizes[name].num_layers
               for name in ("base", "1b", "3b"))


@pytest.mark.parametrize("name", ["tiny", "3b"])
@pytest.mark.parametrize("residual, attention, aggregation, tie", [
    ("mhc", "multiscale", "nash", True), ("mhc-lite", "multiscale", "gate", False), ("hc", "full", "nash", False),
    ("plain", "multiscale", "convex", False), ("plain", "full", "nash", True)])
def test_param_counts_by_role_match_the_architecture(name, residual, attention, aggregation, tie):
    """The counts read from the parameters' declared roles equal the architecture's, role by role, and add up to
    every leaf of the model."""
    config = ModelConfig.preset(name, residual=residual, attention=attention, aggregation=aggregation,
                                tie_embeddings=tie)
    assert param_counts(config) == expected_counts(config)
    shapes = eqx.filter_eval_shape(LanguageModel, config, key=jax.random.key(0))
    assert num_params(config) == sum(x.size for x in jax.tree.leaves(shapes) if isinstance(x, jax.ShapeDtypeStruct))


def lowered_flops(fn, *abstract_args) -> float:
    """XLA's cost analysis (HloCostAnalysis of the lowered module: nothing is compiled or allocated)."""
    return float(jax.jit(fn).lower(*abstract_args).cost_analysis()["flops"])


def forward_and_head_flops(config: ModelConfig, batch: int = 2) -> tuple[float, float]:
    """XLA's FLOPs of the forward pass on [batch, T] tokens and of its head (stream sum, final norm, LM head)."""
    model = eqx.filter_eval_shape(LanguageModel, config, key=jax.random.key(0))
    params, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    tokens = jax.ShapeDtypeStruct((batch, config.seq_len), jnp.int32)
    streams = jax.ShapeDtypeStruct((batch, config.seq_len, config.num_streams, config.d_model), jnp.float32)
    forward = lowered_flops(lambda p, t: eqx.combine(p, static)(t).logits, params, tokens)
    head = lowered_flops(lambda p, x: eqx.combine(p, static).unembed(x), params, streams)
    return forward, head


@pytest.mark.parametrize("residual, attention", [("mhc", "multiscale"), ("plain", "full")])
def test_flops_per_token_agrees_with_xla_cost_analysis(residual, attention):
    """flops_per_token()/3 is the forward pass: per layer, and for the head, against XLA's own count.

    The scan over layers is counted once by XLA, so the forward's count is one layer plus the head; the
    formula's per-layer and head parts are separated by its linearity in num_layers. XLA also counts the
    element-wise work (norms, softmax, RoPE, Sinkhorn, the Nash iterations: 2.5–5.5 % at ``small``) and the
    extra score blocks of the chunked causal attention, which the matmul-only model-FLOPs convention leaves
    out; so XLA's per-layer count must lie in [1, 1.08] × the formula. The head runs over the padded
    vocabulary while model FLOPs count the real one: XLA's head must lie in [1, 1.03] × formula · V_pad / V.
    """
    config = ModelConfig.preset("small", residual=residual, attention=attention)  # scan_unroll 1: a real scan
    tokens = 2 * config.seq_len
    forward, head = forward_and_head_flops(config)
    assert forward == forward_and_head_flops(config.replace(num_layers=1))[0]  # the scan body counted once
    per_layer = (config.flops_per_token() - config.replace(num_layers=config.num_layers - 1).flops_per_token()) / 3
    formula_head = config.flops_per_token() / 3 - config.num_layers * per_layer
    assert formula_head == pytest.approx(2 * config.d_model * config.vocab_size)  # real vocabulary
    assert 1.0 <= (forward - head) / tokens / per_layer <= 1.08
    assert 1.0 <= head / tokens / (formula_head * config.padded_vocab_size / config.vocab_size) <= 1.03

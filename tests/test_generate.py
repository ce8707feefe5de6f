"""Incremental decoding, sampling and ``python -m nash_mhc.generate``.

The cache's contract: feeding tokens one at a time through ``decode_step`` gives the full forward pass's
logits at every position (≤ 1e-5 in float32), in every residual/attention/aggregation mode, including
positions where a coarse block has just completed and trailing partial blocks.
"""

from __future__ import annotations

import io
import itertools
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mode_case, perturbed, write_checkpoint

import nash_mhc
from nash_mhc import LanguageModel, ModelConfig, TrainConfig
from nash_mhc.decoding import Sampling, decode_step, init_cache, num_decode_traces, prefill, sample_token
from nash_mhc.sharding import make_mesh
from nash_mhc.training import init_train_state

MODES = list(itertools.product(("mhc", "hc", "plain"), ("multiscale", "full"), ("nash", "convex")))
MODES += [("mhc-lite", "multiscale", "nash"), ("mhc", "multiscale", "gate"), ("mhc-lite", "full", "nash")]
# (compression ratio, seq_len, tokens fed): r=2 → blocks 1,2,4 (22 = 5·4 + 2: a trailing partial block);
# r=3 → blocks 1,3,9 (16 = 5·3 + 1 = 9 + 7) checks the input ring with a block size that is not a power of 2.
# Modes outside the quick loop's covering set (tests/helpers.py) run with the slow tests, a compilation each; the
# convex aggregation's cache path is the Nash one's (weights from the same per-position outputs), so it is slow too.
# r=3 is slow as well: the quick loop's prefill test feeds the same ring (blocks 1, 3, 9) a prompt and a step.
CASES = [mode_case(mode, 2, 24, 22) if mode[2] != "convex" else pytest.param(*mode, 2, 24, 22,
                                                                             marks=pytest.mark.slow)
         for mode in MODES] + [pytest.param("mhc", "multiscale", "nash", 3, 18, 16, marks=pytest.mark.slow)]
TOLERANCE = 1e-5


@eqx.filter_jit
def full_and_cached(model: LanguageModel, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(full-forward logits, logits of feeding the tokens one at a time through the cache)."""

    def feed(cache, xs):
        logits, cache = decode_step(model, cache, *xs)
        return cache, logits

    _, cached = jax.lax.scan(feed, init_cache(model, model.config.seq_len), (tokens, jnp.arange(tokens.shape[0])))
    return model(tokens).logits, cached


@pytest.mark.parametrize("residual, attention, aggregation, ratio, seq_len, fed", CASES)
def test_cached_decoding_matches_the_full_forward_at_every_position(residual, attention, aggregation, ratio,
                                                                    seq_len, fed):
    config = ModelConfig.preset("tiny", residual=residual, attention=attention, aggregation=aggregation,
                                compression_ratio=ratio, seq_len=seq_len)
    model = perturbed(LanguageModel(config, key=jax.random.key(0)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, fed), jnp.int32)
    full, cached = map(np.asarray, full_and_cached(model, tokens))
    real = slice(0, config.vocab_size)
    assert np.all(np.isfinite(full[:, real])) and np.abs(full[:, real]).max() > 0.1
    error = np.abs(cached - full).max(axis=-1)
    assert error.max() <= TOLERANCE, f"cached logits differ from the full forward: {error}"


@eqx.filter_jit
def prefill_then_step(model: LanguageModel, tokens: jax.Array, length: jax.Array
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """prefill(tokens[:length]) from a fixed-size padded buffer, then one decode_step with tokens[length]."""
    max_len = model.config.seq_len
    padded = jnp.zeros((max_len,), tokens.dtype).at[:tokens.shape[0]].set(tokens)
    after_prompt, cache = prefill(model, padded, init_cache(model, max_len), length)
    following, _ = decode_step(model, cache, tokens[length], length)
    return model(tokens).logits, after_prompt, following


def test_prefill_of_a_padded_prompt_matches_the_full_forward():
    config = ModelConfig.preset("tiny", compression_ratio=3, seq_len=18)
    model = perturbed(LanguageModel(config, key=jax.random.key(0)))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, 16), jnp.int32)
    for length in (1, 9, 13):  # one compilation: the prompt length is traced
        full, after_prompt, following = map(np.asarray, prefill_then_step(model, tokens, jnp.asarray(length)))
        assert np.abs(after_prompt - full[length - 1]).max() <= TOLERANCE
        assert np.abs(following - full[length]).max() <= TOLERANCE


# ------------------------------------------------------------------------------------------------ generation
@pytest.fixture(scope="module")
def model() -> LanguageModel:
    config = ModelConfig.preset("tiny", seq_len=32)
    return perturbed(LanguageModel(config, key=jax.random.key(0)), seed=2)


GREEDY = dict(temperature=0)
SAMPLED = dict(temperature=1.0, top_k=50, top_p=0.95)  # the CLI tests reuse these compiled settings


@pytest.mark.slow
def test_greedy_generation_is_deterministic_and_identical_with_and_without_cache(model):
    prompt = np.array([100, 101, 32, 102, 40], np.int32)
    cached = nash_mhc.generate_tokens(model, prompt, max_new_tokens=20, **GREEDY)
    again = nash_mhc.generate_tokens(model, prompt, max_new_tokens=20, key=123, **GREEDY)
    uncached = nash_mhc.generate_tokens(model, prompt, max_new_tokens=20, use_cache=False, **GREEDY)
    assert cached.shape == (1, 20) and cached.dtype == np.int32
    np.testing.assert_array_equal(cached, again)
    np.testing.assert_array_equal(cached, uncached)


@pytest.mark.slow
def test_sampling_is_reproducible_and_the_same_with_and_without_cache(model):
    prompt = [120, 121]
    first = nash_mhc.generate_tokens(model, prompt, max_new_tokens=12, key=7, num_samples=2, **SAMPLED)
    assert first.shape == (2, 12)
    again = nash_mhc.generate_tokens(model, prompt, max_new_tokens=12, key=7, num_samples=2, **SAMPLED)
    np.testing.assert_array_equal(first, again)
    uncached = nash_mhc.generate_tokens(model, prompt, max_new_tokens=12, key=7, num_samples=2, use_cache=False,
                                        **SAMPLED)
    np.testing.assert_array_equal(first, uncached)
    assert not np.array_equal(first[0], first[1]), "samples drawn together must differ"
    other = nash_mhc.generate_tokens(model, prompt, max_new_tokens=12, key=8, num_samples=2, **SAMPLED)
    assert not np.array_equal(first, other)


@pytest.mark.slow  # multi-second, not an invariant of the results: the full run (CI) keeps it
def test_generation_traces_only_the_branches_of_its_arrays_platform(monkeypatch):
    """The model's kernel-or-XLA choices (nash_mhc.ops.dispatch) are made for the platform of the model's arrays
    when generation traces its steps, so no choice is left to the lowering: jax.lax.platform_dependent (which
    traces every branch, the Pallas kernels' too) is never called."""
    calls = []
    real = jax.lax.platform_dependent
    monkeypatch.setattr(jax.lax, "platform_dependent", lambda *a, **k: calls.append(sorted(k)) or real(*a, **k))
    config = ModelConfig.preset("tiny", residual="plain", attention="full", num_layers=1, seq_len=20)  # shapes no
    # other test compiles, so the steps are traced here; the choices are made by one function for every mode
    model = LanguageModel(config, key=jax.random.key(0))
    before = num_decode_traces()
    assert nash_mhc.generate_tokens(model, [5, 6, 7], max_new_tokens=1, **GREEDY).shape == (1, 1)
    assert num_decode_traces() - before == 1 and calls == []
    jax.make_jaxpr(lambda x: model(x).logits)(jnp.zeros((20,), jnp.int32))  # a model call outside generation
    assert ["default", "tpu"] in calls  # still leaves the choice to the lowering


@pytest.mark.slow  # multi-second, not an invariant: the full run (CI) keeps it
def test_one_compilation_serves_every_prompt_and_length(model):
    before = num_decode_traces()
    streamed = []
    for prompt, new in (([1, 2, 3], 4), ([5] * 11, 9), ([7], 1)):
        out = nash_mhc.generate_tokens(model, prompt, max_new_tokens=new, temperature=0.5, key=3,
                                callback=lambda step, ids: streamed.append((step, ids.copy())))
        assert out.shape == (1, new)
    assert num_decode_traces() - before == 1
    assert [s for s, _ in streamed] == [0, 1, 2, 3, *range(9), 0]


@pytest.mark.slow  # multi-second, not an invariant: the full run (CI) keeps it
def test_eos_ends_each_sample_and_stops_once_all_have_ended(model):
    greedy = nash_mhc.generate_tokens(model, [65, 66], max_new_tokens=10, **GREEDY)
    stopped = nash_mhc.generate_tokens(model, [65, 66], max_new_tokens=10, eos_id=int(greedy[0, 0]), **GREEDY)
    np.testing.assert_array_equal(stopped, greedy[:, :1])
    free = nash_mhc.generate_tokens(model, [65, 66], max_new_tokens=12, key=5, num_samples=2, **SAMPLED)
    eos = int(free[0, 2])
    ended = nash_mhc.generate_tokens(model, [65, 66], max_new_tokens=12, key=5, num_samples=2, eos_id=eos, **SAMPLED)
    firsts = [int(np.argmax(row == eos)) if eos in row else 11 for row in free]
    assert ended.shape[1] == max(firsts) + 1
    for row, first in enumerate(firsts):
        np.testing.assert_array_equal(ended[row, :first + 1], free[row, :first + 1])
        assert np.all(ended[row, first:] == eos) or eos not in free[row]


def test_generate_rejects_bad_prompts(model):
    with pytest.raises(ValueError, match="exceed the context"):
        nash_mhc.generate_tokens(model, list(range(30)), max_new_tokens=3)
    with pytest.raises(ValueError, match="empty"):
        nash_mhc.generate_tokens(model, [], max_new_tokens=3)
    with pytest.raises(ValueError, match="ids must be"):
        nash_mhc.generate_tokens(model, [model.config.vocab_size], max_new_tokens=3)
    with pytest.raises(ValueError, match="top-p"):
        nash_mhc.generate_tokens(model, [1], max_new_tokens=3, top_p=0.0)


# -------------------------------------------------------------------------------------------------- sampling
@jax.jit
def _draws(logits: jax.Array, keys: jax.Array) -> dict[str, jax.Array]:
    def draw(sampling: Sampling) -> jax.Array:
        return jax.vmap(lambda k: sample_token(k, logits, sampling, 6))(keys)

    return {"greedy": draw(Sampling(temperature=0)), "top1": draw(Sampling(top_k=1)),
            "top3": draw(Sampling(top_k=3)), "p0.5": draw(Sampling(top_p=0.5)), "p0.4": draw(Sampling(top_p=0.4)),
            "hot": draw(Sampling(temperature=3.0))}


def test_sampling_filters_keep_exactly_the_intended_tokens():
    # probabilities 0.4, 0.3, 0.2, 0.06, 0.04, ~0 over the 6 real tokens; columns 6.. are vocabulary padding.
    probs = np.array([0.4, 0.3, 0.2, 0.06, 0.04, 1e-9])
    logits = jnp.asarray(np.concatenate([np.log(probs), np.full(2, -1e30)]), jnp.float32)
    draws = {k: np.asarray(v) for k, v in _draws(logits, jax.random.split(jax.random.key(0), 4000)).items()}
    assert set(draws["greedy"]) == {0} and set(draws["top1"]) == {0} and set(draws["p0.4"]) == {0}
    assert set(draws["top3"]) == {0, 1, 2}
    assert set(draws["p0.5"]) == {0, 1}  # the smallest set whose mass reaches 0.5
    assert draws["hot"].max() < 6, "a padded vocabulary column was drawn"
    freq = np.bincount(draws["top3"], minlength=6)[:3] / 4000
    np.testing.assert_allclose(freq, probs[:3] / probs[:3].sum(), atol=0.03)


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_k=-1), dict(top_p=1.5)])
def test_sampling_settings_are_validated(bad):
    with pytest.raises(ValueError):
        Sampling(**bad)


# ------------------------------------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A run directory holding the step-0 state of a tiny model, as the training program writes it."""
    directory = tmp_path_factory.mktemp("run")
    model_config = ModelConfig.preset("tiny", seq_len=32)
    train_config = TrainConfig(batch_size=8, total_steps=10, warmup_steps=1)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    state = init_train_state(model_config, train_config, mesh, key=jax.random.key(0))
    meta = write_checkpoint(directory, 0, state, model_config, train_config)
    (directory / "config.json").write_text(json.dumps(meta))
    return str(directory)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    from nash_mhc.generate import main

    code = main([*argv, "--compile-cache-dir", "none"])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow  # multi-second, not an invariant: the full run (CI) keeps it
def test_cli_streams_greedy_text_identical_with_and_without_cache(capsys, checkpoint):
    args = ("--checkpoint-dir", checkpoint, "--prompt", "def f(x):", "--temperature", "0", "--max-new-tokens", "12",
            "--ignore-eos")
    code, cached, err = run_cli(capsys, *args)
    assert code == 0, err
    assert cached.startswith("def f(x):") and cached.endswith("\n")
    code, uncached, _ = run_cli(capsys, *args, "--no-cache")
    assert code == 0 and uncached == cached
    code, samples, _ = run_cli(capsys, "--checkpoint-dir", checkpoint, "--prompt", "x", "--num-samples", "2",
                               "--max-new-tokens", "5", "--seed", "3", "--temperature", "1", "--top-k", "50",
                               "--top-p", "0.95")
    assert code == 0 and samples.count("--- sample") == 2


@pytest.mark.parametrize("argv, message", [
    (("--checkpoint-dir", "/nonexistent/run", "--prompt", "x"), "does not exist"),
    (("--prompt", "x" * 40), "longer than the model's context"),
    (("--prompt", "x" * 20, "--max-new-tokens", "20"), "exceed the model's context"),
    (("--temperature", "-1"), "--temperature"),
    (("--top-p", "0"), "--top-p"),
    (("--top-k", "many"), "invalid int value"),
    (("--num-samples", "0"), "--num-samples"),
    (("--step", "7"), "no checkpoint at step 7"),
    (("--colour", "red"), "unrecognized arguments"),
])
@pytest.mark.slow  # shares the trained-checkpoint fixture with the test above
def test_cli_bad_input_exits_2_with_one_line(capsys, checkpoint, argv, message):
    if "--checkpoint-dir" not in argv:
        argv = ("--checkpoint-dir", checkpoint, *argv)
    try:
        code, out, err = run_cli(capsys, *argv)
    except SystemExit as exit_:  # argparse errors
        code, err = exit_.code, capsys.readouterr().err
    assert code == 2
    assert err.startswith("error:") and err.count("\n") == 1 and message in err, err
    assert "Traceback" not in err


def test_text_stream_holds_back_incomplete_characters():
    from nash_mhc.data import ByteTokenizer
    from nash_mhc.generate import TextStream

    out = io.StringIO()
    stream = TextStream(ByteTokenizer(), out)
    for byte in "é!".encode():
        stream.add(byte)
        assert "\ufffd" not in out.getvalue()
    stream.close()
    assert out.getvalue() == "é!"


@pytest.mark.slow  # multi-second, not an invariant: the full run (CI) keeps it
def test_generate_tokens_is_the_function_and_the_old_name_still_works_with_a_warning(model):
    """``nash_mhc.generate_tokens`` is the library function; ``nash_mhc.generate`` is the program's module, a plain
    module (not callable); ``nash_mhc.decoding.generate``, the function's old name, gives the same tokens with a
    DeprecationWarning."""
    import types

    import nash_mhc.generate as cli

    assert nash_mhc.generate is cli and nash_mhc.generate_tokens is nash_mhc.decoding.generate_tokens
    assert type(cli) is types.ModuleType and not callable(cli)
    expected = nash_mhc.generate_tokens(model, [1, 2], max_new_tokens=2, temperature=0)
    with pytest.warns(DeprecationWarning, match="generate_tokens"):
        np.testing.assert_array_equal(nash_mhc.decoding.generate(model, [1, 2], max_new_tokens=2, temperature=0),
                                      expected)

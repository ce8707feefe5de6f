"""The ``kernels`` setting (auto | xla | pallas): one decision point in nash_mhc.ops.dispatch that every platform
choice asks; ``--kernels`` on train, evaluate and generate, ``nash_mhc.use_kernels`` in the library; a setting of how
the step runs that no checkpoint or run identity records."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT, needs_libtpu, write_checkpoint
from jax.sharding import AbstractDevice, AbstractMesh

import nash_mhc
from nash_mhc import ModelConfig, TrainConfig, make_mesh
from nash_mhc import evaluate as evaluate_program
from nash_mhc import generate as generate_program
from nash_mhc import train as train_program
from nash_mhc.ops import sinkhorn
from nash_mhc.ops.dispatch import (
    interpreting,
    kernels_setting,
    lowering_platform,
    platform_dependent,
    platform_vjp,
    tpu_kernels,
    use_kernels,
)
from nash_mhc.training import Batch, evaluation, init_train_state, train_step
from nash_mhc.training import step as train_step_module


def mesh_on(platform: str) -> AbstractMesh:
    device = AbstractDevice(device_kind=platform, num_cores=None, platform=platform)
    return AbstractMesh((2,), ("data",), abstract_device=device)


def where(mesh: str | None = None, platform: str | None = None) -> contextlib.ExitStack:
    """A context: an abstract mesh on ``mesh``'s platform and/or ``lowering_platform(platform)`` (None: neither)."""
    stack = contextlib.ExitStack()
    if mesh is not None:
        stack.enter_context(jax.sharding.use_abstract_mesh(mesh_on(mesh)))
    if platform is not None:
        stack.enter_context(lowering_platform(platform))
    return stack


def branches(kernels: str, mesh: str | None = None, platform: str | None = None) -> list[str]:
    """The branches platform_dependent and platform_vjp (forward and backward) trace under ``kernels`` there."""
    seen = []

    def form(name, fn):
        return lambda *a: seen.append(name) or fn(*a)

    def f(x):
        y = platform_dependent(x, tpu=form("tpu", jnp.exp), cuda=form("cuda", jnp.sin), default=form("xla", jnp.tanh))
        return platform_vjp(form("tpu", lambda a: a * 2), form("xla", lambda a: a * 3))(y).sum()

    with use_kernels(kernels), where(mesh, platform):
        jax.make_jaxpr(jax.grad(f))(jnp.ones((4,), jnp.float32))
    return sorted(set(seen))


@pytest.mark.parametrize(("mesh", "platform"), [("tpu", None), (None, "tpu"), ("cpu", None), ("gpu", None),
                                                (None, None)])
def test_xla_takes_the_default_form_everywhere_and_no_tpu_only_path(mesh, platform):
    assert branches("xla", mesh, platform) == ["xla"]
    with use_kernels("xla"), where(mesh, platform):
        assert not tpu_kernels() and not interpreting()


@pytest.mark.parametrize(("mesh", "platform", "interpreted"), [("tpu", None, False), (None, "tpu", False),
                                                               ("cpu", None, True), (None, "cpu", True),
                                                               ("gpu", None, True)])
def test_pallas_takes_the_tpu_form_everywhere_interpreted_off_tpu(mesh, platform, interpreted):
    assert branches("pallas", mesh, platform) == ["tpu"]
    with use_kernels("pallas"), where(mesh, platform):
        assert tpu_kernels() and interpreting() == interpreted


@pytest.mark.parametrize(("mesh", "platform", "want"), [("tpu", None, ["tpu"]), (None, "tpu", ["tpu"]),
                                                        ("cpu", None, ["xla"]), (None, None, ["cuda", "tpu", "xla"])])
def test_auto_is_the_platforms_choice(mesh, platform, want):
    assert kernels_setting() == "auto" and branches("auto", mesh, platform) == want
    with where(mesh, platform):
        assert tpu_kernels() == (want == ["tpu"]) and not interpreting()


def test_the_setting_holds_within_its_block_keys_jaxs_caches_and_rejects_other_values():
    seen = []

    @jax.jit
    def f(x):
        return platform_dependent(x, tpu=lambda x: seen.append("tpu") or jnp.exp(x),
                                  default=lambda x: seen.append("xla") or jnp.tanh(x))

    x = jnp.ones((3,))
    with lowering_platform("tpu"):
        with nash_mhc.use_kernels("xla"):  # the library's name for it
            jax.make_jaxpr(f)(x)
            assert kernels_setting() == "xla"
        jax.make_jaxpr(f)(x)  # not the trace made under xla
        assert kernels_setting() == "auto"
    assert seen == ["xla", "tpu"]
    with pytest.raises(ValueError, match="kernels must be one of auto, xla, pallas, got 'mosaic'"):
        use_kernels("mosaic")


def test_pallas_runs_a_kernel_in_the_interpreter_on_the_cpu_and_xla_runs_none():
    """The Sinkhorn op under ``pallas`` on this CPU: its Pallas kernel, interpreted, gives the XLA form's matrix."""
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((256, 4, 4)) * 3, jnp.float32)
    got = {}
    for kernels in ("pallas", "xla"):
        with use_kernels(kernels):
            text = str(jax.make_jaxpr(sinkhorn)(logits))
            got[kernels] = (np.asarray(jax.jit(sinkhorn)(logits)), "pallas_call" in text)
    assert got["pallas"][1] and not got["xla"][1]
    np.testing.assert_allclose(got["pallas"][0], got["xla"][0], rtol=2e-6, atol=2e-6)


# ----------------------------------------------------------------------------------------------------- programs
@pytest.mark.parametrize("program", [train_program, evaluate_program, generate_program])
def test_each_program_has_the_flag_and_a_bad_value_is_one_line_exit_2(program, capsys):
    assert "--kernels" in program.build_parser().format_help()
    with pytest.raises(SystemExit) as exit_info:
        program.main(["--kernels", "mosaic", "--checkpoint-dir", "somewhere"] if program is not train_program
                     else ["--kernels", "mosaic"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "--kernels" in err and "mosaic" in err and "pallas" in err


def test_train_runs_under_the_flags_setting(monkeypatch):
    seen = []
    monkeypatch.setattr(train_program, "_run", lambda *a: seen.append(kernels_setting()) or 0)
    assert train_program.main(["--model", "tiny", "--kernels", "xla"]) == 0
    assert train_program.main(["--model", "tiny"]) == 0
    assert seen == ["xla", "auto"] and kernels_setting() == "auto"


class Reached(Exception):
    """Raised by a stand-in for a program's step runner, once it has recorded the setting it runs under."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A run directory holding the step-0 state of a tiny model (synthetic data, bytes tokenizer)."""
    directory = tmp_path_factory.mktemp("run")
    model_config, train_config = ModelConfig.preset("tiny", seq_len=32), TrainConfig(batch_size=8, total_steps=4)
    state = init_train_state(model_config, train_config, make_mesh(1, 1, 1, devices=jax.devices()[:1]),
                             key=jax.random.key(0))
    meta = write_checkpoint(directory, 0, state, model_config, train_config)
    (directory / "config.json").write_text(json.dumps(meta))
    return str(directory)


@pytest.mark.parametrize("program", [evaluate_program, generate_program])
def test_evaluate_and_generate_run_under_the_flags_setting(program, checkpoint, monkeypatch):
    seen = []

    def runner(*args, **kwargs):
        seen.append(kernels_setting())
        raise Reached

    if program is evaluate_program:
        monkeypatch.setattr(evaluation, "evaluate", runner)
    else:
        monkeypatch.setattr(generate_program, "generate_tokens", runner)
    for flags in (["--kernels", "xla"], []):
        with pytest.raises(Reached):
            program.main(["--checkpoint-dir", checkpoint, "--compile-cache-dir", "none", *flags])
    assert seen == ["xla", "auto"]


def test_kernels_is_no_part_of_what_a_checkpoint_or_resume_compares():
    """Every config a run records but its execution (model, train, data, mesh, loop: checkpoint config_differences
    and the resume identity read from them) is the same under each value of --kernels, and of the other execution
    settings."""
    default, _ = train_program.configs(["--model", "tiny"])
    for flags in (["--kernels", "xla"], ["--kernels", "pallas"],
                  ["--remat", "full", "--remat-group", "2", "--scan-unroll", "2", "--loss-chunks", "2"]):
        configs, _ = train_program.configs(["--model", "tiny", *flags])
        assert configs.execution != default.execution and configs.replace(execution=default.execution) == default


def run_train(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nash_mhc.train", "--model", "tiny", *flags], cwd=ROOT,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_run_saved_under_auto_resumes_under_xla(tmp_path, cache_dir):
    common = ("--dataset", "synthetic", "--tokenizer", "bytes", "--batch-size", "8", "--seq-len", "32",
              "--checkpoint-dir", str(tmp_path / "run"), "--compile-cache-dir", str(cache_dir), "--no-progress",
              "--log-interval", "1", "--eval-interval", "0", "--lr-schedule-steps", "3")
    first = run_train(*common, "--total-steps", "2", "--checkpoint-interval", "2")
    assert first.returncode == 0, first.stderr
    second = run_train(*common, "--total-steps", "3", "--kernels", "xla")
    assert second.returncode == 0, second.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]  # steps 1, 2 under auto, 3 resumed under xla


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("kernels", ["xla", "auto"])
def test_xla_compiles_a_tpu_train_step_without_a_pallas_kernel(kernels):
    """The `tiny` (mhc + multiscale + nash) train step compiled for v6e-8 by the TPU compiler on this CPU: no
    Mosaic custom call under --kernels xla; under auto the same compile holds the kernels."""
    result = run_train("--compile-only", "--topology", "v6e-8", "--kernels", kernels)
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("Pallas kernel calls")]
    calls = int(line.split(": ")[1].split()[0])
    assert calls == 0 if kernels == "xla" else calls > 0, line
    # the estimate's band (kernels at 100 %-60 % of their roofline) has no width without a kernel
    (band,) = [line for line in result.stdout.splitlines() if line.startswith("estimated step:")]
    low, high = (float(x) for x in band.removeprefix("estimated step: ").split(" ms")[0].split("-"))
    assert 0 < low == high if kernels == "xla" else 0 < low < high, band


@pytest.mark.slow
def test_pallas_interpreted_on_the_cpu_trains_as_xla_does():
    """Three train steps of `tiny` mhc + multiscale + nash (T = D = 128, so the flash, stream, resampling and
    aggregation kernels all apply: 23 Pallas calls) under ``pallas`` (every kernel in Pallas' interpreter) give the
    losses and gradient norms of the same steps under ``xla``, to float32 rounding."""
    config = ModelConfig.preset("tiny", seq_len=128, d_model=128, residual="mhc", attention="multiscale",
                                aggregation="nash")
    train_config = TrainConfig(batch_size=2, total_steps=3, warmup_steps=1)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 129)), jnp.int32)
    got = {}
    for kernels in ("pallas", "xla"):
        state = init_train_state(config, train_config, mesh, key=jax.random.key(0))
        with use_kernels(kernels):
            kernel_calls = str(jax.make_jaxpr(lambda b, s: train_step_module._train_step_jit(b, s))(
                Batch(tokens=tokens), state)).count("pallas_call")
            metrics = []
            for _ in range(3):
                state, step_metrics = train_step(state, Batch(tokens=tokens))
                metrics.append([float(step_metrics["loss"]), float(step_metrics["grad_norm"])])
        got[kernels] = kernel_calls, np.asarray(metrics)
    assert got["pallas"][0] >= 20 and got["xla"][0] == 0
    np.testing.assert_allclose(got["pallas"][1], got["xla"][1], rtol=1e-5)

"""``auto`` checks before it trusts: on a checked platform the training program runs the kernels check for its step
first; a failing kernel runs its XLA form for the run (``dispatch.disable_kernels``) with a warning under ``auto``,
and is a one-line exit 2 under ``pallas``. The CPU is made a checked platform by the internal
NASH_MHC_KERNELS_CHECK_PLATFORMS, and a kernel is broken by the NASH_MHC_BREAK_KERNEL test hook."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from helpers import ROOT, cpu_env

from nash_mhc import ModelConfig, TrainConfig
from nash_mhc.kernels import trust
from nash_mhc.kernels.jaxprs import pallas_kernels
from nash_mhc.ops import dispatch, sinkhorn
from nash_mhc.ops.multiscale import downsample


def kernels_of(function, *args) -> list[str]:
    return pallas_kernels(jax.make_jaxpr(function)(*args))


def test_a_disabled_choice_takes_its_xla_form_forward_and_backward_and_only_it():
    logits, x, weights = jnp.zeros((256, 4, 4)), jnp.zeros((2, 256, 128)), jnp.zeros((2, 128))

    def both(logits, x, weights):  # sinkhorn (platform_dependent) and the downsampling (platform_vjp)
        return sinkhorn(logits).sum() + downsample(x, weights).sum()

    def modules(disabled):
        with dispatch.use_kernels("pallas"), dispatch.disable_kernels(disabled):
            assert dispatch.disabled_kernels() == disabled
            return {k.split(".")[0] for k in kernels_of(jax.grad(both, argnums=(0, 1, 2)), logits, x, weights)}

    assert modules(frozenset()) == {"sinkhorn_kernel", "downsample_kernel"}
    assert modules(frozenset({"downsample"})) == {"sinkhorn_kernel"}  # its forward and its backward kernels
    assert modules(frozenset({"sinkhorn"})) == {"downsample_kernel"}
    assert modules(frozenset({"sinkhorn", "downsample"})) == set()


def test_a_disabled_platform_vjp_takes_its_xla_pullback_too():
    seen = []

    def form(name, scale):
        return lambda a: seen.append(name) or a * scale

    f = dispatch.platform_vjp(form("tpu", 2.0), form("xla", 3.0), name="scaled")
    with dispatch.use_kernels("pallas"), dispatch.disable_kernels({"scaled"}):
        grad = jax.grad(lambda a: f(a).sum())(jnp.ones(3))
    assert set(seen) == {"xla"} and float(grad[0]) == 3.0


FAILED = {"target": "1 x cpu, interpreted", "kernels": 6, "failed": {"mix_streams": "stream_mix.mix_kernel: "
                                                                     "relative error forward 5.9e-02 > 2e-03"},
          "unchecked": []}


@pytest.fixture
def checked_cpu(monkeypatch):
    """The CPU as a checked platform, and a check whose result is FAILED (counting its runs)."""
    runs = []
    monkeypatch.setenv(trust.CHECK_PLATFORMS_ENV, "cpu")
    monkeypatch.setattr(trust, "_check", lambda *a: runs.append(a) or dict(FAILED))
    return runs


CONFIGS = (ModelConfig.preset("tiny"), TrainConfig(batch_size=8, total_steps=1))


def test_auto_runs_a_failing_kernel_as_xla_with_a_warning_and_caches_the_result(checked_cpu, tmp_path, capsys):
    for _ in range(2):
        assert trust.trusted_kernels("auto", *CONFIGS, str(tmp_path)) == {"mix_streams"}
        err, out = capsys.readouterr()[::-1]
        (warning,) = err.splitlines()
        assert warning.startswith("WARNING: kernel mix_streams differs from its XLA form") and "5.9e-02" in warning
    assert len(checked_cpu) == 1 and "(cached)" in out  # the second run read the compile-cache directory's result
    assert list((tmp_path / "kernels_check").glob("*.json"))


def test_pallas_fails_on_a_failing_kernel_and_xla_or_an_unchecked_platform_checks_nothing(checked_cpu, monkeypatch):
    with pytest.raises(trust.KernelsFailed, match="kernel mix_streams fails its check") as error:
        trust.trusted_kernels("pallas", *CONFIGS, "none")
    assert len(str(error.value).splitlines()) == 1
    assert trust.trusted_kernels("xla", *CONFIGS, "none") == frozenset()
    monkeypatch.delenv(trust.CHECK_PLATFORMS_ENV)
    assert trust.trusted_kernels("auto", *CONFIGS, "none") == frozenset() and len(checked_cpu) == 1


def test_the_cache_key_follows_the_shapes_the_source_and_the_test_hook(monkeypatch):
    key = trust.cache_key(*CONFIGS)
    assert trust.cache_key(CONFIGS[0], TrainConfig(batch_size=16, total_steps=1)) != key
    monkeypatch.setattr(trust, "source_hash", lambda: "changed")
    assert trust.cache_key(*CONFIGS) != key
    monkeypatch.undo()
    monkeypatch.setenv(dispatch.BREAK_KERNEL, "mix_kernel")
    assert trust.cache_key(*CONFIGS) != key


@pytest.mark.slow
def test_the_training_program_checks_its_kernels_first(tmp_path):
    """A tiny run on a CPU made a checked platform, with mix_kernel broken: under auto a warning names it and the
    run trains; under pallas (the same result, from the compile-cache directory) it exits 2 with one line."""
    env = cpu_env(1, **{trust.CHECK_PLATFORMS_ENV: "cpu", dispatch.BREAK_KERNEL: "mix_kernel"})

    def train(run: str, *flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "nash_mhc.train", "--model", "tiny", "--dataset", "synthetic",
                               "--tokenizer", "bytes", "--batch-size", "8", "--total-steps", "1", "--no-progress",
                               "--eval-interval", "0", "--checkpoint-dir", str(tmp_path / run),
                               "--compile-cache-dir", str(tmp_path / "cache"), *flags],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)

    auto = train("auto")
    assert auto.returncode == 0, auto.stderr
    warnings = [line for line in auto.stderr.splitlines() if line.startswith("WARNING: kernel ")]
    assert len(warnings) == 1 and "mix_streams" in warnings[0] and "step 1: loss" in auto.stdout
    assert "kernels check: 5 of 6 kernels match XLA" in auto.stdout
    pallas = train("pallas", "--kernels", "pallas")
    assert pallas.returncode == 2 and len(pallas.stderr.strip().splitlines()) == 1, pallas.stderr
    assert pallas.stderr.startswith("error: kernel mix_streams fails its check")


def test_the_training_program_runs_its_steps_without_the_failing_kernels(checked_cpu, tmp_path, monkeypatch):
    from nash_mhc import train as train_program
    from nash_mhc.training import loop

    seen = []
    monkeypatch.setattr(loop, "train", lambda *a: seen.append(dispatch.disabled_kernels()) or 0)
    assert train_program.main(["--model", "tiny", "--dataset", "synthetic", "--tokenizer", "bytes", "--total-steps",
                               "1", "--checkpoint-dir", str(tmp_path / "run"), "--compile-cache-dir", "none"]) == 0
    assert seen == [{"mix_streams"}] and len(checked_cpu) == 1

"""``python -m nash_mhc.kernels check``: every Pallas kernel of a preset's train step, found by tracing the step
under ``dispatch.recording``, run standalone against its XLA form (forward and VJP); exit 1 on a mismatch."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from helpers import ROOT, cpu_env, needs_libtpu

from nash_mhc import ModelConfig, TrainConfig, make_mesh
from nash_mhc.kernels.__main__ import build_parser, main
from nash_mhc.kernels.discover import discover, kernel_choices
from nash_mhc.kernels.jaxprs import short_name
from nash_mhc.kernels.replay import check_choice
from nash_mhc.ops import dispatch, sinkhorn


def sinkhorn_choice() -> dispatch.Choice:
    """The Sinkhorn op's choice, recorded as a step records it (its kernels apply from 128 matrices)."""
    with dispatch.use_kernels("pallas"), dispatch.recording() as recorder:
        jax.eval_shape(sinkhorn, jax.ShapeDtypeStruct((256, 4, 4), jnp.float32))
    (choice,) = recorder.choices.values()
    return choice


def test_a_choice_is_recorded_with_its_forms_shapes_and_kernels_and_replays_against_xla():
    choice = sinkhorn_choice()
    assert choice.name == "sinkhorn" and choice.args[0].shape == (256, 4, 4)
    assert choice.kernels == ("_forward_kernel",)
    result = check_choice(choice, ("sinkhorn_kernel._forward_kernel",), make_mesh(1, 1, 1, devices=jax.devices()[:1]),
                          jax.random.key(0), repeats=1)
    assert result.ok and result.vjp is not None and result.forward[1] < 1e-5 and result.vjp[1] < 1e-5
    assert result.kernel_ms > 0 and result.xla_ms > 0


def test_a_kernel_broken_on_purpose_fails_its_check(monkeypatch):
    """The test hook NASH_MHC_BREAK_KERNEL adds one to the named kernel's outputs: the forward check fails."""
    monkeypatch.setenv(dispatch.BREAK_KERNEL, "_forward_kernel")
    result = check_choice(sinkhorn_choice(), (), make_mesh(1, 1, 1, devices=jax.devices()[:1]), jax.random.key(0),
                          repeats=1)
    assert not result.ok and result.forward[1] > result.tolerance


def test_recording_keys_jaxs_caches_so_a_step_traced_before_is_recorded():
    f = jax.jit(lambda x: sinkhorn(x))
    x = jax.ShapeDtypeStruct((256, 4, 4), jnp.float32)
    with dispatch.use_kernels("pallas"):
        f.trace(x)
        for _ in range(2):
            with dispatch.recording() as recorder:
                f.trace(x)
            assert [c.name for c in recorder.choices.values()] == ["sinkhorn"]


@pytest.mark.parametrize(("argv", "words"), [
    (["check", "--model", "huge"], ["huge", "tiny"]),
    (["check", "--batch-size", "0"], ["--batch-size 0"]),
    (["check", "--dtype", "int8"], ["int8"]),
    (["verify"], ["verify"]),
])
def test_bad_arguments_are_one_line_exit_2(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        code = main(argv)
        raise SystemExit(code)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert all(word in err for word in words), err


def test_the_docs_commands_parse():
    text = (ROOT / "docs" / "tpu.md").read_text()
    commands = re.findall(r"^python -m nash_mhc\.kernels (.*)$", text, re.MULTILINE)
    assert commands
    for command in commands:
        args = build_parser().parse_args(shlex.split(command))
        assert args.model in ModelConfig.PRESETS


def run_check(**env: str) -> subprocess.CompletedProcess:
    """``python -m nash_mhc.kernels check --model tiny`` as a user runs it on this CPU (one device)."""
    return subprocess.run([sys.executable, "-m", "nash_mhc.kernels", "check", "--model", "tiny"], cwd=ROOT,
                          env=cpu_env(1, **env), capture_output=True, text=True, timeout=900)


KERNEL_SITES = {"stream_copies", "collapse_streams", "nash_aggregate", "sinkhorn", "mix_streams", "stream_sum"}


@pytest.mark.slow
def test_check_of_tiny_passes_on_this_cpu():
    result = run_check()
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("kernels check on 1 x cpu, interpreted") and lines[-1] == "all kernels match XLA"
    rows = {line.split()[0]: line for line in lines[2:-1]}
    assert set(rows) == KERNEL_SITES and all(" ok " in row for row in rows.values())


@pytest.mark.slow
def test_check_exits_1_when_a_kernel_is_broken():
    result = run_check(**{dispatch.BREAK_KERNEL: "mix_kernel"})
    assert result.returncode == 1, result.stdout + result.stderr
    failed = [line.split()[0] for line in result.stdout.splitlines() if " FAIL " in line]
    assert failed == ["mix_streams"] and "mismatch: mix_streams" in result.stdout


@needs_libtpu
@pytest.mark.slow  # a TPU compile of each preset's step (tiny about 15 s): a check of the check, not of the model
@pytest.mark.parametrize(("preset", "batch"), [("tiny", 16), ("base", 8)])
def test_the_checks_kernels_are_the_pallas_calls_of_the_tpu_step(preset, batch):
    """The kernels the check runs for the `tiny` and `base` Nash-MHC (mhc + multiscale + nash) train steps, traced
    for v6e-8, are exactly the Pallas custom calls of that step lowered for v6e-8: no kernel escapes the check."""
    from nash_mhc.tpu_compile import fit
    from nash_mhc.training import step as train_step_module

    model_config, train_config = ModelConfig.preset(preset), TrainConfig(batch_size=batch, total_steps=1)
    assert (model_config.residual, model_config.attention, model_config.aggregation) == ("mhc", "multiscale", "nash")
    discovery = discover(model_config, train_config, fit.topology_devices("v6e-8"))
    kept, unchecked = kernel_choices(discovery)
    checked = {short_name(name) for _, names in kept for name in names}
    state = fit.abstract_train_state(model_config, train_config, discovery.mesh)
    tokens = fit.abstract_batch(batch, model_config.seq_len, discovery.mesh)
    text = jax.jit(lambda b, s: train_step_module._train_step_jit(b, s)).lower(tokens, state).as_text()
    lowered = re.findall(r'kernel_name = "([^"]*)"', text)
    assert len(lowered) == text.count("tpu_custom_call") > 10
    assert not unchecked and checked == set(lowered)

"""``python -m nash_mhc.study``: the gain metric against a float64 reference, both studies end to end at a smoke
size, a finished run is skipped, an interrupted run continues from its checkpoint, bad input exits 2."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from nash_mhc.config import ModelConfig
from nash_mhc.study.__main__ import main
from nash_mhc.study.gains import composite_gains

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG"


# ----------------------------------------------------------------------------------------------- the metric
def reference_gains(maps: np.ndarray) -> dict[str, np.ndarray]:
    """Per token, P_l = H_l @ ... @ H_1 built one matrix at a time; gains from NumPy's matrix norms
    (ord=inf: max absolute row sum, ord=1: max absolute column sum)."""
    batch, sublayers, seq = maps.shape[:3]
    forward = np.zeros((sublayers, batch * seq))
    backward = np.zeros((sublayers, batch * seq))
    for b in range(batch):
        for t in range(seq):
            product = np.eye(maps.shape[-1])
            for depth in range(sublayers):
                product = maps[b, depth, t].astype(np.float64) @ product
                forward[depth, b * seq + t] = np.linalg.norm(product, ord=np.inf)
                backward[depth, b * seq + t] = np.linalg.norm(product, ord=1)
    return {"forward_max": forward.max(1), "forward_mean": forward.mean(1),
            "backward_max": backward.max(1), "backward_mean": backward.mean(1)}


@pytest.mark.parametrize("shape", [(2, 6, 3, 4, 4), (1, 5, 2, 3, 3), (3, 1, 1, 2, 2)])
def test_composite_gains_match_a_float64_reference(shape):
    maps = np.random.default_rng(sum(shape)).normal(0.3, 0.6, size=shape).astype(np.float32)
    got = composite_gains(maps)
    want = reference_gains(maps)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-12, err_msg=key)
    assert not np.allclose(got["forward_max"], got["backward_max"])  # the example tells rows from columns


def test_composite_gains_by_hand_and_for_doubly_stochastic_products():
    shear = np.array([[1.0, 1.0], [0.0, 1.0]])  # P_l = [[1, l], [0, 1]]: gain 1 + l both ways
    maps = np.broadcast_to(shear, (1, 4, 1, 2, 2))
    np.testing.assert_array_equal(composite_gains(maps)["forward_max"], [2, 3, 4, 5])
    lopsided = np.array([[[1.0, 1.0], [0.0, 0.0]], [[0.5, 0.0], [0.5, 3.0]]])  # H_1 then H_2
    gains = composite_gains(lopsided[None, :, None])
    # P_1 = H_1: rows sum to 2, 0; columns to 1, 1.  P_2 = H_2 H_1 = [[.5, .5], [.5, .5]].
    np.testing.assert_array_equal(gains["forward_max"], [2.0, 1.0])
    np.testing.assert_array_equal(gains["backward_max"], [1.0, 1.0])
    perm = np.eye(3)[[2, 0, 1]]
    doubly = 0.5 * np.eye(3) + 0.5 * perm
    maps = np.stack([doubly, perm, doubly.T])[None, :, None]
    for key, value in composite_gains(maps).items():
        np.testing.assert_allclose(value, 1.0, rtol=1e-12, err_msg=key)


@pytest.mark.parametrize("shape", [(2, 3, 4, 4), (1, 2, 3, 4, 3)])
def test_maps_of_the_wrong_shape_are_a_type_error(shape):
    with pytest.raises(TypeError, match="batch sublayers seq n n"):
        composite_gains(np.ones(shape, np.float32))


# ---------------------------------------------------------------------------------------------- ablation
@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("xla_cache")


@pytest.fixture
def one_device(monkeypatch):
    """The studies' child processes see one CPU device (the test process has 8 fake ones)."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")


def ablation_argv(out: Path, cache: Path, *extra: str) -> list[str]:
    return ["ablation", "--out-dir", str(out), "--model", "tiny", "--steps", "60", "--batch-size", "4",
            "--learning-rate", "3e-3", "--warmup-steps", "2", "--seeds", "0", "--residual", "plain", "mhc",
            "--attention", "full", "--eval-batches", "2", "--eval-batch-size", "4", "--log-interval", "1",
            "--checkpoint-interval", "25", "--compile-cache-dir", str(cache), "--no-progress", *extra]


def logged_steps(run_dir: Path) -> list[int]:
    """Every training record of metrics.jsonl in order (a restart would log step 1 twice)."""
    path = run_dir / "train" / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r["step"] for r in records if "loss" in r]


@pytest.mark.slow
def test_ablation_resumes_after_sigterm_finishes_the_grid_and_skips_finished_runs(tmp_path, cache_dir, one_device,
                                                                                  capsys):
    out, published = tmp_path / "study", tmp_path / "published"
    argv = ablation_argv(out, cache_dir, "--report-dir", str(published))
    first, second = out / "runs" / "plain-full" / "seed0", out / "runs" / "mhc-full" / "seed0"
    proc = subprocess.Popen([sys.executable, "-m", "nash_mhc.study", *argv], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None and not logged_steps(first):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # to the study only: it forwards the signal to the training program
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "stopped by a signal after 0 of 2 runs" in output, output[-3000:]
    stopped_at = logged_steps(first)[-1]
    assert 1 <= stopped_at < 60 and logged_steps(first) == list(range(1, stopped_at + 1))
    assert f"stopping at step {stopped_at} after a signal" in (first / "train.log").read_text()
    assert not (first / "result.json").exists() and not second.exists()  # no further run was started
    assert not json.loads((published / "results.json").read_text())["complete"]

    assert main(argv) == 0
    assert "2 of 2 runs finished" in capsys.readouterr().out
    assert logged_steps(first) == list(range(1, 61)), "the interrupted run restarted instead of resuming"
    assert f"resuming from step {stopped_at}" in (first / "train.log").read_text()
    results = json.loads((published / "results.json").read_text())
    assert results["complete"] and results["runs_finished"] == 2
    for run in results["runs"]:
        config = ModelConfig.preset("tiny", residual=run["residual"], attention="full")
        assert run["status"] == "finished" and 0 < run["bits_per_byte"] < 12
        assert run["params"] == config.num_params() and run["flops_per_token"] == config.flops_per_token()
        assert run["tokens_trained"] == 60 * 4 * 64 and run["eval_tokens"] == 2 * 4 * 64
        assert [step for step, _ in run["curve"]] == list(range(1, 61))
    plain, mhc = results["runs"]
    assert plain["eval_bytes"] == mhc["eval_bytes"]  # the same held-out batches
    assert plain["sessions"] == 3 and mhc["sessions"] == 2  # train, train again (resumed), evaluate
    cells = {(c["residual"], c["attention"]): c for c in results["cells"]}
    assert cells[("mhc", "full")]["delta_bits_per_byte"][0] == pytest.approx(
        mhc["bits_per_byte"] - plain["bits_per_byte"])
    table = (published / "results.md").read_text()
    assert "python -m nash_mhc.study ablation" in table and "| mhc | full | 1 |" in table
    figure = published / "loss_curves.png"
    assert figure.read_bytes()[:4] == PNG and figure.stat().st_size > 20_000
    assert not (out / "results.md").exists()  # the runs stay apart from the published report

    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.name in ("result.json", "sessions.jsonl")}
    assert len(stamps) == 4
    assert main(argv) == 0  # both runs finished: nothing is trained or evaluated
    assert stamps == {p: p.stat().st_mtime_ns for p in stamps}

    assert main([*argv, "--learning-rate", "1e-3"]) == 2
    assert "holds a study with other settings (learning_rate: 0.003 there vs 0.001 now)" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--seeds", "1", "1"], "--seeds must be distinct"),
    (["--model", "huge"], "unknown --model 'huge'"),
    (["--train-args", "--dtype 'bfloat16"], "cannot parse --train-args"),
])
def test_bad_ablation_flags_exit_2_with_one_line(tmp_path, capsys, argv, message):
    assert main(["ablation", "--out-dir", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "runs").exists()


# --------------------------------------------------------------------------------------------- stability
@pytest.mark.slow
def test_stability_runs_end_to_end_and_skips_finished_runs(tmp_path, cache_dir, capsys):
    out = tmp_path / "stability"
    argv = ["stability", "--out-dir", str(out), "--depths", "3", "--learning-rates", "1e-2", "--residual", "plain",
            "hc", "--seeds", "0", "--steps", "6", "--warmup-steps", "1", "--probes", "3", "--probe-batch", "2",
            "--compile-cache-dir", str(cache_dir), "--no-progress"]
    assert main(argv) == 0
    assert "2 of 2 runs finished" in capsys.readouterr().out
    setting = out / "runs" / "L3-lr0.01"
    runs = {mode: json.loads((setting / f"{mode}-seed0.json").read_text()) for mode in ("plain", "hc")}
    for run in runs.values():
        assert run["status"] == "finished" and len(run["loss"]) == len(run["grad_norm"]) == 6
        assert sorted(map(int, run["probes"])) == [0, 3, 6]
        assert all(len(gains) == 2 * 3 for probe in run["probes"].values() for gains in probe.values())
    for probe in runs["plain"]["probes"].values():  # one stream: H_res = 1 at every sublayer
        assert all(gains == [1.0] * 6 for gains in probe.values())
    hc_final = runs["hc"]["probes"]["6"]
    assert max(hc_final["forward_max"]) > 1.01  # unconstrained H_res has moved away from the identity
    assert all(m >= a for m, a in zip(hc_final["forward_max"], hc_final["forward_mean"], strict=True))
    summary = {r["residual"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert summary["hc"]["forward_final"] == hc_final["forward_max"][-1]
    assert summary["hc"]["final_loss"] == np.mean(runs["hc"]["loss"][-1:])  # the last 10 % of 6 steps: 1 step
    report_md = (out / "report.md").read_text()
    assert "python -m nash_mhc.study stability" in report_md and "- **hc**: 0 of 1 runs diverged" in report_md
    for figure in ("gains_depth.png", "curves.png", "sweep.png"):
        assert (out / figure).read_bytes()[:4] == PNG and (out / figure).stat().st_size > 20_000

    stamps = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*.json")}
    assert main(argv) == 0  # nothing left to train
    assert stamps == {p: p.stat().st_mtime_ns for p in stamps}
    assert main([*argv[:-1], "--steps", "7", "--no-progress"]) == 2

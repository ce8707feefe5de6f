"""``python -m nash_mhc.study``: the gain metric against a float64 reference and its n bound, the Sinkhorn probe,
the power-law fit against scipy; the scaling and stability studies end to end at a smoke size (a finished run is
skipped, an interrupted run continues from its checkpoint); bad input, or the retired v2 ablation's name, exits 2
with one line (ablation3: tests/test_study_ablation3.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import USERS_CPU_EMITTERS, suite_xla_flags

from nash_mhc.config import ModelConfig
from nash_mhc.study import powerlaw
from nash_mhc.study.__main__ import main
from nash_mhc.study.gains import composite_gains
from nash_mhc.study.scaling_report import crossing_sentence

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


def test_gains_of_row_stochastic_products_are_bounded_by_n():
    """The stability report's bound: non-negative matrices whose rows sum to 1 (every Sinkhorn output) multiply
    to such a matrix, so the forward gain is 1 and the backward gain (largest column sum) at most n, at any
    depth, however lopsided; a product can reach the bound (every row putting its weight on one column)."""
    rng = np.random.default_rng(0)
    for n in (2, 3, 4):
        logits = rng.normal(0, 8, size=(2, 24, 5, n, n))  # spreads far beyond what 20 iterations balance
        maps = np.exp(logits - logits.max(-1, keepdims=True))
        maps /= maps.sum(-1, keepdims=True)
        gains = composite_gains(maps)
        np.testing.assert_allclose(gains["forward_max"], 1.0, rtol=1e-12)
        assert np.all(gains["backward_max"] <= n + 1e-9) and gains["backward_max"][-1] > 1.5
    to_first = np.zeros((1, 3, 1, 4, 4))
    to_first[..., 0] = 1.0
    np.testing.assert_allclose(composite_gains(to_first)["backward_max"], 4.0)


@pytest.mark.slow  # three compiles, about 12 s: the quick loop is at its 5-minute budget
def test_the_sinkhorn_probe_reads_the_logits_the_model_projects():
    """The logits captured at the Sinkhorn call, projected with 20 iterations, are exactly the model's H_res (so
    the capture takes the right values in the right order and changes nothing); 200 iterations bring the column
    sums closer to 1, and the probe's numbers follow from those matrices."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from nash_mhc.model import LanguageModel
    from nash_mhc.ops.sinkhorn import sinkhorn
    from nash_mhc.study.sinkhorn_probe import column_deviation, make_probe, sinkhorn_inputs

    config = ModelConfig.preset("tiny", residual="mhc", attention="full", num_layers=2, seq_len=16)
    model = LanguageModel(config, key=jax.random.key(0))
    model = eqx.tree_at(lambda m: m.blocks.attn_hc.alpha, model, jnp.full_like(model.blocks.attn_hc.alpha, 6.0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 259, (2, 16)))
    params, static = eqx.partition(model, eqx.is_array)

    def maps_of(p, t):
        return eqx.combine(p, static)(t, return_residual_maps=True).residual_maps

    # compiled as users' CPU programs are (bit for bit across two programs: tests/helpers.py)
    plain = np.asarray(jax.jit(maps_of, compiler_options=USERS_CPU_EMITTERS)(params, tokens))  # without the wrapper
    captured: list[np.ndarray] = []
    with sinkhorn_inputs(captured):
        # a new function, so jit traces it again, now with the recording wrapper (not the cached trace above)
        maps = np.asarray(jax.jit(lambda p, t: maps_of(p, t), compiler_options=USERS_CPU_EMITTERS)(params, tokens))
        jax.effects_barrier()
    np.testing.assert_array_equal(maps, plain)
    assert len(captured) == 4 and captured[0].shape == (32, 4, 4)
    projected = np.stack([np.asarray(sinkhorn(jnp.asarray(z), 20)) for z in captured])  # [S, B*T, n, n]
    np.testing.assert_array_equal(projected, np.moveaxis(maps, 1, 0).reshape(4, 32, 4, 4))
    out = make_probe("mhc")(model, tokens)
    spread = np.stack(captured).max(axis=(-1, -2)) - np.stack(captured).min(axis=(-1, -2))
    np.testing.assert_allclose(out["logit_spread_max"], spread.max(1), rtol=1e-6)
    np.testing.assert_allclose(out["colsum_dev"], column_deviation(maps), rtol=1e-6)
    assert max(out["colsum_dev"]) > 1e-3 and max(out["colsum_dev_200"]) < 0.5 * max(out["colsum_dev"])
    assert out["backward_max"][-1] > out["backward_max_200"][-1] >= 1.0 - 1e-6


# ------------------------------------------------------------------------------------------- fits and rules
def test_power_law_fit_matches_scipy_linregress_and_recovers_exact_laws():
    from scipy.stats import linregress

    rng = np.random.default_rng(1)
    compute = np.geomspace(1e7, 1e10, 5)
    bpb = 9.0 * compute**-0.07 * np.exp(rng.normal(0, 0.01, 5))
    fit = powerlaw.fit_power_law(list(compute), list(bpb))
    ref = linregress(np.log(compute), np.log(bpb))
    assert fit.slope == pytest.approx(-ref.slope, rel=1e-10) and fit.intercept == pytest.approx(ref.intercept)
    assert fit.slope_se == pytest.approx(ref.stderr, rel=1e-8)
    assert fit.intercept_se == pytest.approx(ref.intercept_stderr, rel=1e-8)
    exact = powerlaw.fit_power_law([1e6, 1e7, 1e8], [5 * c**-0.1 for c in (1e6, 1e7, 1e8)])
    assert exact.a == pytest.approx(5.0) and exact.slope == pytest.approx(0.1) and exact.rss < 1e-20
    with pytest.raises(ValueError, match="at least 3 points"):
        powerlaw.fit_power_law([1e6, 1e7], [2.0, 1.9])


def fitted(a: float, b: float, noise: float = 1e-3) -> powerlaw.Fit:
    compute = np.geomspace(1e7, 1e9, 5)
    wiggle = np.exp(noise * np.array([1.0, -1.0, 0.5, -0.5, 0.0]))
    return powerlaw.fit_power_law(list(compute), list(a * compute**-b * wiggle))


def test_crossing_point_and_what_the_report_says_about_it():
    base, other = fitted(8.0, 0.05), fitted(16.0, 0.07)  # a1 C^-b1 = a2 C^-b2 at C* = (a2 / a1)^(1 / (b2 - b1))
    cross = powerlaw.crossing(base, other)
    want = (16.0 / 8.0) ** (1 / 0.02)
    assert cross["compute"] == pytest.approx(want, rel=0.05) and cross["ahead_of_fitted_range"]
    low, high = cross["interval_16_84"]
    assert low < want < high
    text = crossing_sentence("plain+full", "mhc+nash", base, other, cross)
    assert "cross beyond the fitted range" in text and "extrapolation" in text
    inside = powerlaw.crossing(fitted(8.0, 0.05), fitted(8.0 * 1e8**0.02, 0.07))  # equal at C = 1e8
    assert inside["inside_fitted_range"] and inside["compute"] == pytest.approx(1e8, rel=0.05)
    assert "cross inside the fitted range" in crossing_sentence("a", "b", fitted(8.0, 0.05),
                                                                fitted(8.0 * 1e8**0.02, 0.07), inside)
    close = powerlaw.crossing(fitted(8.0, 0.05, 0.05), fitted(8.1, 0.0505, 0.05))
    assert abs(close["slope_difference_z"]) < 2
    assert "do not say whether the curves cross" in crossing_sentence("a", "b", fitted(8.0, 0.05, 0.05),
                                                                      fitted(8.1, 0.0505, 0.05), close)
    parallel = powerlaw.crossing(fitted(8.0, 0.05, 0.0), fitted(9.0, 0.05, 0.0))
    assert parallel["compute"] is None and "parallel" in crossing_sentence(
        "a", "b", fitted(8.0, 0.05, 0.0), fitted(9.0, 0.05, 0.0), parallel)


# ------------------------------------------------------------------------------ shared by the smoke runs
@pytest.fixture
def one_device(monkeypatch):
    """The studies' child processes see one CPU device (the test process has 8 fake ones)."""
    monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=1 {suite_xla_flags()}")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")


def logged_steps(run_dir: Path) -> list[int]:
    """Every training record of metrics.jsonl in order (a restart would log step 1 twice)."""
    path = run_dir / "train" / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r["step"] for r in records if "loss" in r]


def stop_during_first_run(argv: list[str], first: Path, cwd: Path) -> str:
    """Start the study, SIGTERM it once the first run has logged a step; its output."""
    proc = subprocess.Popen([sys.executable, "-m", "nash_mhc.study", *argv], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None and not logged_steps(first):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # to the study only: it forwards the signal to the training program
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "stopped by a signal after 0" in output, output[-3000:]
    return output


@pytest.mark.parametrize(("study", "argv", "message"), [
    ("scaling", ["--sizes", "32:2:2", "48:2"], "--sizes needs at least 3 sizes"),
    ("scaling", ["--sizes", "32:2:2", "48:2:2", "50:2:3"], "--sizes 50:2:3: ModelConfig"),
    ("scaling", ["--sizes", "32:2:2", "48:2:2", "x:2:2"], "width:layers:heads"),
    ("scaling", ["--variants", "mhc+dense"], "unknown variant 'mhc+dense'"),
    ("scaling", ["--tokens-per-param", "0"], "--tokens-per-param"),
    ("stability", ["--depths", "0"], "--depths must be >= 1"),
    ("stability", ["--coefficient-lr-scale", "0"], "--coefficient-lr-scale > 0"),
])
def test_bad_study_flags_exit_2_with_one_line(tmp_path, capsys, study, argv, message):
    assert main([study, "--out-dir", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "runs").exists()


@pytest.mark.parametrize("argv", [["ablation"], ["ablation", "--steps", "400", "--seeds", "0", "1"],
                                  ["ablation", "--help"]])
def test_the_retired_v2_ablation_exits_2_with_one_line_naming_ablation3(tmp_path, capsys, argv):
    assert main([*argv, "--out-dir", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert "v2 ablation study was retired" in captured.err and "python -m nash_mhc.study ablation3" in captured.err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------- scaling
@pytest.mark.slow
def test_scaling_fits_a_power_law_resumes_after_sigterm_and_skips_finished_runs(tmp_path, cache_dir, one_device,
                                                                              capsys):
    from nash_mhc.model import param_counts

    out = tmp_path / "scaling"
    argv = ["scaling", "--out-dir", str(out), "--seq-len", "64", "--sizes", "16:1:2", "24:1:2", "32:1:2",
            "--variants", "plain+full", "--tokens-per-param", "0.5", "--batch-size", "2", "--eval-batches", "2",
            "--eval-batch-size", "2", "--log-interval", "1", "--checkpoint-interval", "10",
            "--compile-cache-dir", str(cache_dir), "--no-progress"]
    first = out / "runs" / "plain+full" / "d16-L1-h2"
    stop_during_first_run(argv, first, tmp_path)
    stopped_at = logged_steps(first)[-1]
    assert main(argv) == 0
    assert "3 of 3 runs finished" in capsys.readouterr().out
    assert f"resuming from step {stopped_at}" in (first / "train.log").read_text()
    results = json.loads((out / "results.json").read_text())
    assert results["complete"]
    for run in results["runs"]:
        config = ModelConfig.preset("tiny", seq_len=64, residual="plain", attention="full", d_model=run["d_model"],
                                    num_layers=run["num_layers"], num_heads=run["num_heads"])
        counts = param_counts(config)
        assert run["non_embedding_params"] == sum(counts.values()) - counts["embedding"]
        assert run["steps"] == int(np.ceil(0.5 * run["non_embedding_params"] / (2 * 64)))
        assert run["tokens"] == run["steps"] * 2 * 64 and run["compute"] == config.flops_per_token() * run["tokens"]
        assert logged_steps(out / "runs" / "plain+full" / f"d{run['d_model']}-L1-h2") == list(
            range(1, run["steps"] + 1))
        assert run["evaluation"]["tokens"] == 2 * 2 * 64 and 0 < run["bits_per_byte"] < 12
    fit = results["fits"]["plain+full"]
    runs = results["runs"]
    want = powerlaw.fit_power_law([r["compute"] for r in runs], [r["bits_per_byte"] for r in runs])
    assert fit["b"] == pytest.approx(want.slope) and fit["points"] == 3 and results["crossings"] == {}
    text = (out / "report.md").read_text()
    assert "python -m nash_mhc.study scaling" in text and "| plain / full | 3 |" in text
    assert "\nCode: commit " in text and json.loads((out / "results.json").read_text())["machine"]["commit"]
    assert "non-embedding parameter" in text and "an **estimate**" in text
    assert (out / "scaling.png").read_bytes()[:4] == PNG
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("result.json")}
    assert main(argv) == 0 and stamps == {p: p.stat().st_mtime_ns for p in stamps}


# --------------------------------------------------------------------------------------------- stability
@pytest.mark.slow
def test_stability_runs_every_mode_end_to_end_and_skips_finished_runs(tmp_path, cache_dir, capsys):
    out = tmp_path / "stability"
    argv = ["stability", "--out-dir", str(out), "--depths", "3", "--learning-rates", "1e-2", "--residual", "plain",
            "hc", "mhc", "mhc-lite", "--seeds", "0", "--steps", "6", "--warmup-steps", "1", "--probes", "3",
            "--probe-batch", "2", "--compile-cache-dir", str(cache_dir), "--no-progress"]
    assert main(argv) == 0
    assert "4 of 4 runs finished" in capsys.readouterr().out
    setting = out / "runs" / "L3-lr0.01"
    runs = {mode: json.loads((setting / f"{mode}-seed0.json").read_text()) for mode in ("plain", "hc", "mhc",
                                                                                          "mhc-lite")}
    for run in runs.values():
        assert run["status"] == "finished" and len(run["loss"]) == len(run["grad_norm"]) == 6
        assert run["eval_tokens"] == 16 * 8 * 64 and 0 < run["eval_loss"] < 8  # 16 held-out batches, seq 64
        assert sorted(map(int, run["probes"])) == [0, 3, 6]
        assert all(len(gains) == 2 * 3 for probe in run["probes"].values() for gains in probe.values())
    for probe in runs["plain"]["probes"].values():  # one stream: H_res = 1 at every sublayer
        assert all(gains == [1.0] * 6 for gains in probe.values())
    hc_final = runs["hc"]["probes"]["6"]
    assert max(hc_final["forward_max"]) > 1.01  # unconstrained H_res has moved away from the identity
    assert all(m >= a for m, a in zip(hc_final["forward_max"], hc_final["forward_mean"], strict=True))
    mhc_final = runs["mhc"]["probes"]["6"]
    assert all(s >= m > 0 for s, m in zip(mhc_final["logit_spread_max"], mhc_final["logit_spread_mean"],
                                           strict=True))
    assert max(mhc_final["colsum_dev_200"]) <= max(mhc_final["colsum_dev"])
    assert max(mhc_final["backward_max"]) <= 4.0 and max(runs["mhc-lite"]["probes"]["6"]["colsum_dev"]) < 1e-5
    summary = {r["residual"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert summary["hc"]["forward_final"] == hc_final["forward_max"][-1]
    assert summary["hc"]["backward_mean_final"] == hc_final["backward_mean"][-1]
    assert summary["mhc"]["colsum_dev_200_final"] == max(mhc_final["colsum_dev_200"])
    assert summary["hc"]["final_loss"] == np.mean(runs["hc"]["loss"][-1:])  # the last 10 % of 6 steps: 1 step
    report_md = (out / "report.md").read_text()
    assert "\nCode: commit " in report_md
    assert "python -m nash_mhc.study stability" in report_md and "- **hc**: 0 of 1 runs diverged" in report_md
    assert "the backward gain of mhc is at most n = 4" in report_md and "arXiv 2512.24880" in report_md
    assert "col-sum dev, 200 it." in report_md and "mean over tokens" in report_md
    assert report_md.index("## Protocol answers") < report_md.index("## Findings")  # one seed, one rate
    protocol = json.loads((out / "results.json").read_text())["protocol"]["depths"][0]
    assert [(r["residual"], r["best_rate"], r["width"], r["edge"]) for r in protocol["residuals"]] == [
        (m, 1e-2, 1.0, "only rate") for m in ("plain", "hc", "mhc", "mhc-lite")]
    assert protocol["residuals"][1]["best_mean"] == runs["hc"]["eval_bits_per_byte"]
    assert protocol["residuals"][1]["gains"]["forward_final"] == [hc_final["forward_max"][-1]] * 3
    assert [(d["residual"], d["at"], d["n"], d["null"]) for d in protocol["vs_plain"][:2]] == [
        ("hc", "own best", 1, None), ("hc", "common rate", 1, None)]
    for figure in ("gains_depth.png", "curves.png", "sweep.png"):
        assert (out / figure).read_bytes()[:4] == PNG and (out / figure).stat().st_size > 20_000

    stamps = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*.json")}
    assert main(argv) == 0  # nothing left to train
    assert stamps == {p: p.stat().st_mtime_ns for p in stamps}
    assert main([*argv[:-1], "--steps", "7", "--no-progress"]) == 2

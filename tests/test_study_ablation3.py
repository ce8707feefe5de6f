"""``python -m nash_mhc.study ablation3``: its protocol's rules on made-up run results (the best mean over seeds,
grid growth, paired differences and their standard errors, the equal-wall-clock point, the scale use), bad flags,
and one tiny real study end to end (slow)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from helpers import suite_xla_flags

from nash_mhc.study import ablation3_protocol as protocol
from nash_mhc.study.__main__ import main
from nash_mhc.study.ablation3 import Run
from nash_mhc.study.ablation3_report import questions, variant_rows
from nash_mhc.study.variants import V3_VARIANTS, spec3, variant_flags3


# ----------------------------------------------------------------------------------------------- the rules
def test_the_rate_is_the_best_mean_over_seeds_not_the_first_seeds_best():
    cells = {1e-3: [2.00, 2.60, 2.60], 3e-3: [2.10, 2.20, 2.20], 1e-2: [2.05, 2.50, 2.40]}
    best, means = protocol.best_rate(cells)
    assert best == 3e-3 and means[3e-3] == pytest.approx(6.5 / 3) and means[1e-3] == pytest.approx(7.2 / 3)
    assert protocol.best_rate({1e-2: [1.0, None, 1.0], 3e-3: [2.0, 2.0, 2.0]})[0] == 3e-3  # a diverged seed
    assert protocol.best_rate({1e-2: [1.0, math.nan], 3e-3: [2.0, 2.0]})[0] == 3e-3
    assert protocol.best_rate({3e-3: [2.0, 1.0], 1e-3: [1.5, 1.5]})[0] == 1e-3  # a tie goes to the smaller rate
    assert protocol.best_rate({1e-3: [None], 3e-3: [math.inf]}) == (None, {1e-3: None, 3e-3: None})


def test_the_ladder_of_added_rates():
    assert [protocol.next_rate(lr, up=True) for lr in (1e-3, 3e-3, 1e-2, 3e-2)] == [3e-3, 1e-2, 3e-2, 0.1]
    assert [protocol.next_rate(lr, up=False) for lr in (1e-3, 3e-4, 1e-2)] == [3e-4, 1e-4, 3e-3]
    assert protocol.next_rate(2e-3, up=True) == pytest.approx(2e-3 * math.sqrt(10), rel=1e-3)


def landscape(optimum: float, diverge_above: float = math.inf, seeds_noise: float = 0.01):
    """Made-up selection bits per byte: a parabola in log10(rate) with its minimum at ``optimum``, a seed offset,
    diverged above ``diverge_above``."""
    def value(lr: float, seed: int) -> float | None:
        return None if lr > diverge_above else 2.0 + (math.log10(lr) - math.log10(optimum)) ** 2 + seeds_noise * seed
    return value


def simulate(initial: list[float], seeds: list[int], value, max_extra: int = protocol.MAX_EXTRA_RATES):
    """The study's loop: run what the grid asks for until it asks for nothing new; (final state, cells run)."""
    ran: dict[tuple[float, int], float | None] = {}
    while True:
        state = protocol.grow_grid(initial, seeds, lambda lr, s: ran.get((lr, s), protocol.MISSING), max_extra)
        todo = [(lr, s) for lr in state["grid"] for s in seeds if (lr, s) not in ran]
        if not todo:
            return state, ran
        assert state["state"] == "pending"
        ran.update({cell: value(*cell) for cell in todo})


def test_the_grid_grows_on_the_best_side_until_the_best_is_interior():
    seeds = [0, 1, 2]
    state, ran = simulate([1e-3, 3e-3, 1e-2], seeds, landscape(5e-2))  # best 1e-2, then 3e-2 (edge), then 0.1
    assert state["grid"] == [1e-3, 3e-3, 1e-2, 3e-2, 0.1] and state["best"] == 3e-2 and state["state"] == "interior"
    assert sorted(ran) == [(lr, s) for lr in state["grid"] for s in seeds]  # every rate on every seed, no more
    state, _ = simulate([1e-3, 3e-3, 1e-2], seeds, landscape(3e-3))  # interior from the start: no growth
    assert state["grid"] == [1e-3, 3e-3, 1e-2] and state["state"] == "interior"
    state, _ = simulate([1e-3, 3e-3, 1e-2], seeds, landscape(1e-4))  # down: 3e-4, 1e-4, 3e-5
    assert state["grid"] == [3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2] and state["best"] == 1e-4
    assert state["state"] == "interior"
    state, _ = simulate([1e-3], [0], landscape(1e-2))  # one rate: down first, then up from the top edge
    assert state["grid"] == [3e-4, 1e-3, 3e-3, 1e-2] and state["state"] == "edge: limit"


def test_the_grid_stops_at_its_hard_limits_and_at_a_diverged_neighbour():
    state, ran = simulate([1e-3, 3e-3, 1e-2], [0, 1], landscape(1e-6))
    assert state["grid"] == [3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2] and state["state"] == "edge: limit"
    assert state["best"] == 3e-5 and len(ran) == 12  # MAX_EXTRA_RATES = 3 rates added, then no more
    state, _ = simulate([1e-2, 3e-2], [0], landscape(10.0), max_extra=10)
    assert state["grid"] == [1e-2, 3e-2, 0.1, 0.3] and state["state"] == "edge: limit"  # 1.0 > LR_CEILING
    state, _ = simulate([1e-3, 3e-3, 1e-2], [0, 1], landscape(1.0, diverge_above=2e-2))
    assert state["grid"] == [1e-3, 3e-3, 1e-2, 3e-2] and state["best"] == 1e-2 and state["state"] == "interior"
    state, _ = simulate([1e-3, 3e-3], [0], landscape(1.0, diverge_above=1e-4), max_extra=1)
    assert state["state"] == "all diverged" and state["best"] is None and len(state["grid"]) == 3


def test_paired_differences_pair_by_seed_with_the_standard_error_of_the_mean():
    a = {0: 1.0, 1: 2.0, 2: 3.0, 3: 9.0}  # seed 3 has no partner
    b = {2: 2.9, 0: 0.5, 1: 1.7}
    d = protocol.paired(a, b)
    diffs = np.array([0.5, 0.3, 0.1])
    assert d["n"] == 3 and d["per_seed"] == pytest.approx({0: 0.5, 1: 0.3, 2: 0.1})
    assert d["mean"] == pytest.approx(0.3) and d["se"] == pytest.approx(diffs.std(ddof=1) / math.sqrt(3))
    assert d["interval"] == pytest.approx([0.3 - 4.303 * d["se"], 0.3 + 4.303 * d["se"]])
    assert d["null"] is True  # the interval [-0.20, 0.80] includes 0
    tight = protocol.paired({0: 1.0, 1: 2.0, 2: 3.0}, {0: 0.7, 1: 1.69, 2: 2.71})
    assert tight["null"] is False and tight["interval"][0] > 0
    # paired, not unpaired: seed-to-seed spread shared by A and B cancels
    assert tight["se"] < np.std([1.0, 2.0, 3.0], ddof=1) / math.sqrt(3) / 10
    assert protocol.paired({0: 1.0}, {0: 0.5})["null"] is None and protocol.paired({0: 1.0}, {1: 0.5})["n"] == 0
    assert protocol.paired({0: 1.0, 1: None, 2: 2.0}, {0: 0.0, 1: 1.0, 2: 1.5})["n"] == 2


def test_the_equal_wallclock_point():
    assert protocol.wallclock_step(700, 0.03, 0.12) == 175  # four times slower: a quarter of the steps
    assert protocol.wallclock_step(700, 0.03, 0.07) == 300
    assert protocol.wallclock_step(700, 0.05, 0.03) == 700  # faster than the baseline: read at S
    assert protocol.wallclock_step(10, 0.001, 5.0) == 1
    kept = list(range(25, 701, 25))
    assert protocol.checkpoint_at_or_before(kept, 175) == 175
    assert protocol.checkpoint_at_or_before(kept, 174) == 150  # never after the point
    assert protocol.checkpoint_at_or_before([*kept, 294], 299) == 294
    assert protocol.checkpoint_at_or_before(kept, 24) is None


def test_coarse_weight_sums_the_coarse_scales_averaged_over_layers():
    metrics = {"scale_weight/0": 0.7, "scale_weight/1": 0.2, "scale_weight/2": 0.1, "scale_weight/layer0/1": 0.5,
               "scale_prior/0": 0.99, "scale_prior/1": 0.005, "scale_prior/2": 0.005, "scale_tv": 0.3}
    assert protocol.coarse_weight(metrics) == pytest.approx(0.3)
    assert protocol.coarse_weight(metrics, "scale_prior") == pytest.approx(0.01)
    assert protocol.coarse_weight({"loss": 1.0}) is None


def test_v3_variants_and_their_training_flags():
    assert len(V3_VARIANTS) == 11 and V3_VARIANTS[0] == "plain+full"
    assert variant_flags3("mhc+nash@uniform-sp0") == ["--residual", "mhc", "--attention", "multiscale",
                                                      "--aggregation", "nash", "--scale-prior", "uniform",
                                                      "--sparsity-weight", "0"]
    assert variant_flags3("mhc-lite+full") == ["--residual", "mhc-lite", "--attention", "full"]
    assert spec3("mhc+gate@scale0")["sparsity_weight"] is None
    for bad in ("mhc+full@uniform", "mhc+nash@warm", "mhc+nash@scale0-spx", "mhc+dense"):
        with pytest.raises(ValueError, match="unknown variant"):
            spec3(bad)


def made_up_result(variant: str, lr: float, seed: int, bpb: float, coarse: float = 0.0) -> dict:
    return {"variant": variant, "learning_rate": lr, "seed": seed, "status": "finished", "bits_per_byte": bpb,
            "selection_bits_per_byte": bpb, "equal_flops_bits_per_byte": bpb + 0.1, "step_time_s": 0.1,
            "scale_use_end": {"report": {"scale_weight/0": 1 - coarse, "scale_weight/1": coarse}}}


def test_the_report_compares_variants_at_their_own_rates_paired_by_seed():
    seeds = [0, 1, 2]
    results = {}
    for s in seeds:  # mhc+full is best at 3e-3, plain+full at 1e-2; the other rate is worse by 1
        for v, lr, bpb in (("plain+full", 1e-2, 2.0 + s), ("mhc+full", 3e-3, 1.9 + s + 0.01 * s)):
            results[Run(v, lr, s)] = made_up_result(v, lr, s, bpb)
            other = 3e-3 if lr == 1e-2 else 1e-2
            results[Run(v, other, s)] = made_up_result(v, other, s, bpb + 1)
    grids = {v: {"grid": [3e-3, 1e-2], "best": b, "means": {}, "state": "edge: limit"}
             for v, b in (("plain+full", 1e-2), ("mhc+full", 3e-3))}
    costs = {v: {"step": 10, "flops_per_token": 1.0, "flops_method": "x"} for v in grids}
    points = {"plain+full": {s: {"bits_per_byte": 2.0 + s, "checkpoint_step": 10} for s in seeds},
              "mhc+full": {s: {"bits_per_byte": 2.5 + s, "checkpoint_step": 4} for s in seeds}}
    rows = variant_rows(["plain+full", "mhc+full"], costs, grids, results, points, seeds)
    assert len(rows[1]["cells"]) == 6 and rows[1]["per_seed"]["equal_tokens"] == pytest.approx(
        {0: 1.9, 1: 2.91, 2: 3.92})
    by = {(d["measure"]): d for d in questions(rows)["mhc"] if d["a"] == "mhc+full"}
    assert by["equal_tokens"]["mean"] == pytest.approx(-0.09) and by["equal_tokens"]["per_seed"][2] == \
        pytest.approx(-0.08)
    assert by["equal_tokens"]["null"] is False and by["equal_wallclock"]["mean"] == pytest.approx(0.5)
    assert by["equal_flops"]["se"] == pytest.approx(0.01 / math.sqrt(3))


@pytest.mark.parametrize(("argv", "message"), [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--seeds", "1", "1"], "--seeds must be distinct"),
    (["--model", "huge"], "--model must be a preset of width >= tiny's, got 'huge'"),
    (["--train-args", "--dtype 'bfloat16"], "cannot parse --train-args"),
    (["--train-args", "--no-such-flag 3"], "the training program would reject the runs' flags"),
    (["--seq-len", "128"], "--seq-len must be >= 256"),
    (["--variants", "plain+full", "mhc+full@uniform"], "unknown variant 'mhc+full@uniform'"),
    (["--learning-rates", "1.0"], "--learning-rates in [1e-05, 0.3]"),
    (["--max-extra-rates", "-1"], "--max-extra-rates >= 0"),
])
def test_bad_ablation3_flags_exit_2_with_one_line(tmp_path, capsys, argv, message):
    assert main(["ablation3", "--out-dir", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "runs").exists()


# -------------------------------------------------------------------------------------------- a real study
@pytest.mark.slow
def test_ablation3_runs_a_tiny_study_with_all_three_budgets(tmp_path, cache_dir, monkeypatch, capsys):
    monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=1 {suite_xla_flags()}")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    out = tmp_path / "study"
    argv = ["ablation3", "--out-dir", str(out), "--steps", "6", "--batch-size", "2", "--learning-rates", "1e-2",
            "--max-extra-rates", "0", "--seeds", "0", "--variants", "plain+full", "plain+convex@uniform",
            "--warmup-steps", "1", "--selection-batches", "1", "--report-batches", "1", "--eval-batch-size", "2",
            "--log-interval", "1", "--checkpoint-interval", "1", "--compile-cache-dir", str(cache_dir),
            "--no-progress"]
    assert main(argv) == 0
    assert "2 runs finished" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] and results["cells_total"] == 2
    runs = {r["variant"]: r for r in results["runs"]}
    for run in runs.values():
        assert run["status"] == "finished" and 0 < run["bits_per_byte"] < 12
        assert [step for step, _ in run["curve"]] == list(range(1, 7)) and run["checkpoint_steps"][-1] == 6
    convex = results["variants"]["plain+convex@uniform"]
    assert convex["state"] == "edge: limit" and convex["chosen_learning_rate"] == 1e-2
    assert convex["flops_method"].startswith("flops_per_token")
    assert convex["equal_flops_step"] < 6 and runs["plain+convex@uniform"]["evaluations"]["report_flops"]
    point = convex["wallclock"]["0"]
    want = protocol.wallclock_step(6, runs["plain+full"]["step_time_s"], runs["plain+convex@uniform"]["step_time_s"])
    assert point["wallclock_step"] == want and point["checkpoint_step"] == want
    if want < 6:  # evaluated at that checkpoint
        directory = Run("plain+convex@uniform", 1e-2, 0).directory(out)
        evaluated = json.loads((directory / "evals" / f"report-step{want}.json").read_text())
        assert point["bits_per_byte"] == evaluated["bits_per_byte"] and evaluated["step"] == want
    for variant in runs:  # the result holds everything: the checkpoints are gone
        train = Run(variant, 1e-2, 0).directory(out) / "train"
        assert (train / "metrics.jsonl").exists() and not [p for p in train.iterdir() if p.name.isdigit()]
    assert runs["plain+full"]["wallclock"]["checkpoint_step"] == 6  # the baseline is read at S
    end = runs["plain+convex@uniform"]["scale_use_end"]
    assert protocol.coarse_weight(end["report"]) > 0.3 and "scale_tv" in end["train"]  # started uniform
    assert runs["plain+full"]["scale_use_end"]["report"] == {}
    text = (out / "results.md").read_text()
    assert "python -m nash_mhc.study ablation3" in text and "\nCode: commit " in text
    assert text.index("## Protocol") < text.index("## Answers") < text.index("## Every cell")

    stamps = {p: p.stat().st_mtime_ns for p in Path(out).rglob("*.json") if "runs" in p.parts}
    assert main(argv) == 0  # every run finished: nothing is trained or evaluated again
    assert stamps == {p: p.stat().st_mtime_ns for p in stamps}

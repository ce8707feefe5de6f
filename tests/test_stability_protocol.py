"""The stability study's protocol answers (nash_mhc/study/stability_protocol.py) on made-up run points."""

from __future__ import annotations

import math

import pytest

from nash_mhc.study import stability_protocol as sp

GRID = [3e-3, 1e-2, 2e-2]


def point(bpb: float | None, status: str = "finished", gain: float = 1.0) -> dict:
    """A run's point: held-out bits per byte (absent when None) and its four final gains (all ``gain``)."""
    return {"status": status, **({} if bpb is None else {sp.MEASURE: bpb}), **dict.fromkeys(sp.GAIN_KEYS, gain)}


def cells(rows: dict[float, list]) -> sp.Cells:
    """{rate: {seed: point}} from {rate: [bpb or a point or None, one per seed]}."""
    return {lr: {s: (v if v is None or isinstance(v, dict) else point(v)) for s, v in enumerate(values)}
            for lr, values in rows.items()}


def test_best_rate_skips_a_rate_with_a_diverged_seed_and_reports_mean_and_se():
    found = sp.answer(cells({3e-3: [1.30, 1.32, 1.34], 1e-2: [1.20, 1.22, 1.24],
                             2e-2: [1.00, point(None, "diverged"), 1.02]}))
    assert found["best_rate"] == 1e-2  # 2e-2 has the lowest finite values but a diverged seed
    assert found["best_mean"] == pytest.approx(1.22)
    assert found["best_se"] == pytest.approx(0.02 / math.sqrt(3))  # sample std 0.02 over 3 seeds
    top = found["rates"][2]
    assert top["mean"] is None and (top["diverged"], top["missing"], top["unevaluated"]) == (1, 0, 0)
    assert sp.answer(cells({3e-3: [1.2, 1.2], 1e-2: [1.2, 1.2]}))["best_rate"] == 3e-3  # a tie: the smaller


def test_a_finished_run_without_the_held_out_value_or_a_missing_run_makes_its_rate_ineligible():
    found = sp.answer(cells({3e-3: [1.3, 1.3], 1e-2: [1.1, point(None)], 2e-2: [1.0, None]}))
    assert found["best_rate"] == 3e-3
    assert [(r["unevaluated"], r["missing"]) for r in found["rates"]] == [(0, 0), (1, 0), (0, 1)]
    assert sp.protocol({(8, "plain"): cells({1e-2: [point(None), point(None)]})}) is None  # older records: no section


def test_usable_range_keeps_rates_within_the_tolerance_and_without_divergence():
    found = sp.answer(cells({3e-3: [1.26, 1.26], 1e-2: [1.22, 1.22], 2e-2: [1.20, 1.20]}))
    assert found["best_rate"] == 2e-2 and found["usable_rates"] == [1e-2, 2e-2]  # 1.26 > 1.20 + 0.05
    assert found["width"] == pytest.approx(2.0) and found["edge"] == "high"
    loose = sp.answer(cells({3e-3: [1.26, 1.26], 1e-2: [1.22, 1.22], 2e-2: [1.20, 1.20]}), tolerance=0.1)
    assert loose["usable_rates"] == GRID and loose["width"] == pytest.approx(2e-2 / 3e-3)
    diverged = sp.answer(cells({3e-3: [1.21, 1.21], 1e-2: [1.20, 1.20], 2e-2: [1.20, point(None, "diverged")]}))
    assert diverged["usable_rates"] == [3e-3, 1e-2] and diverged["edge"] is None  # 1e-2 interior
    alone = sp.answer(cells({3e-3: [1.5, 1.5], 1e-2: [1.2, 1.2], 2e-2: [1.4, 1.4]}))
    assert alone["usable_rates"] == [1e-2] and alone["width"] == 1.0
    assert sp._width(alone["usable_rates"], alone["width"]) == "1 rate"
    assert sp.usable_rates({3e-3: None}, None) == [] and sp.width([]) is None


def test_edge_flag():
    assert sp.edge(GRID, 3e-3) == "low" and sp.edge(GRID, 2e-2) == "high" and sp.edge(GRID, 1e-2) is None
    assert sp.edge([1e-2], 1e-2) == "only rate" and sp.edge(GRID, None) is None
    assert sp.edge([2e-2, 3e-3, 1e-2], 3e-3) == "low"  # the grid's order does not matter


def test_gains_at_the_best_rate_are_median_min_max_over_seeds():
    found = sp.answer({1e-2: {0: point(1.2, gain=1.0), 1: point(1.2, gain=5.0), 2: point(1.2, gain=2.0)},
                       2e-2: {0: point(1.0, gain=99.0), 1: point(1.0, gain=99.0), 2: point(1.0, "diverged")}})
    assert found["best_rate"] == 1e-2
    assert all(found["gains"][k] == [2.0, 1.0, 5.0] for k in sp.GAIN_KEYS)


def test_paired_differences_vs_plain_at_own_best_and_at_every_common_rate():
    plain = {3e-3: [1.50, 1.60, 1.70], 1e-2: [1.40, 1.50, 1.60], 2e-2: [1.45, 1.55, 1.65]}
    mhc = {3e-3: [1.52, 1.58, 1.71], 1e-2: [1.30, 1.41, 1.49], 2e-2: [1.20, 1.31, 1.39]}
    found = sp.protocol({(8, "plain"): cells(plain), (8, "mhc"): cells(mhc)})
    row = found["depths"][0]
    assert [r["residual"] for r in row["residuals"]] == ["plain", "mhc"]
    best, *common = row["vs_plain"]
    assert (best["at"], best["rate"], best["baseline_rate"]) == ("own best", 2e-2, 1e-2)
    assert best["per_seed"] == pytest.approx({0: -0.20, 1: -0.19, 2: -0.21}) and best["null"] is False
    assert [c["rate"] for c in common] == GRID
    assert common[0]["null"] is True  # at 3e-3 the differences straddle 0: +0.02, -0.02, +0.01
    assert common[1]["mean"] == pytest.approx(-0.10) and common[1]["null"] is False
    assert found["tolerance_bits_per_byte"] == sp.TOLERANCE_BPB
    # a diverged mhc seed at 2e-2: paired on the two seeds left, and mhc's best moves to 1e-2
    mhc[2e-2][1] = point(None, "diverged")
    row = sp.protocol({(8, "plain"): cells(plain), (8, "mhc"): cells(mhc)})["depths"][0]
    assert row["vs_plain"][0]["rate"] == 1e-2 and row["vs_plain"][-1]["n"] == 2
    assert (row["vs_plain"][-1]["diverged"], row["vs_plain"][-1]["baseline_diverged"]) == (1, 0)


def test_the_report_section_states_protocol_tolerance_width_and_nulls():
    plain = {3e-3: [1.50, 1.60, 1.70], 1e-2: [1.40, 1.50, 1.60], 2e-2: [1.45, 1.55, point(None, "diverged")]}
    hc = {3e-3: [1.52, 1.58, 1.71], 1e-2: [1.30, 1.41, 1.49], 2e-2: [1.60, 1.61, 1.62]}
    text = "\n".join(sp.lines(sp.protocol({(8, "plain"): cells(plain), (8, "hc"): cells(hc)}), GRID))
    assert text.startswith("## Protocol answers") and "same held-out batches" in text and "optimistic" in text
    assert f"within {sp.TOLERANCE_BPB:g} bits/byte" in text
    assert "| 8 | plain | 1.6000 ± 0.0577 | 1.5000 ± 0.0577 | none (1/3 diverged) | 0.01 | 0.01 | 1 rate | no |" in text
    assert "| 8 | hc - plain | lr 0.003 |" in text and "**null**" in text
    assert "| lr 0.02 | +0.1050 ± 0.0450 [-0.4668, +0.6768], n=2: **null** (interval includes 0) (diverged seeds " \
        "left out: plain 1) |" in text  # t with 1 degree of freedom: 12.706
    assert "| 8 | hc - plain | own best (0.01 vs 0.01) | -0.1000 ± 0.0058" in text

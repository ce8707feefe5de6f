"""benchmarks/estimate_breakdown.py's parts of the model: which part each kind of operation is charged to."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from estimate_breakdown import LAYOUT, OTHER, PARTS, part  # noqa: E402


def test_copies_are_layout_wherever_they_come_from_and_matmuls_never_are():
    assert part("kernels/tpu/flash_attention.py:291 _head_major", "copy", False, "copy.1") == LAYOUT
    assert part("model.py:303 features", "bitcast fusion", False, "copy_bitcast_fusion.4") == LAYOUT
    assert part("(no source)", "transpose", False, "transpose.2") == LAYOUT
    # a matmul fusion rooted at a bitcast is the projection's, not a copy
    assert part("layers/attention.py:103 queries_keys", "bitcast fusion", True, "fusion.7") == "attention: projections"


def test_kernels_and_xla_of_one_file_go_to_their_own_parts():
    assert part("ops/aggregation.py:419 nash_aggregate", "Pallas kernel", False, "shard_map.1") == \
        "Nash aggregation: kernels"
    assert part("ops/aggregation.py:419 nash_aggregate", "tuple fusion", False, "fusion.3") == "Nash aggregation: XLA"
    assert part("kernels/tpu/flash_attention.py:285 flash", "Pallas kernel", True, "shard_map.2") == \
        "attention: flash kernels"
    assert part("kernels/tpu/flash_attention.py:285 flash", "reduce fusion", False, "fusion.5") == "attention: other"
    assert part("layers/attention.py:94 values", "convert fusion", False, "fusion.6") == "attention: other"


def test_files_map_to_their_parts_and_the_rest_to_everything_else():
    assert part("ops/stream_collapse.py:274 collapse", "Pallas kernel", False, "k") == "mHC streams"
    assert part("kernels/tpu/stream_collapse_kernels.py:80 _collapse_rows", "Pallas kernel", False, "k") == \
        "mHC streams"
    assert part("ops/stream_slabs.py:14 stream_stats", "reduce fusion", True, "f") == "mHC streams"
    assert part("ops/equilibrium.py:120 solve_equilibrium", "while", False, "w") == "Nash aggregation: XLA"
    assert part("ops/game.py:60 centred_gram", "reduce fusion", False, "f") == "Nash aggregation: XLA"
    assert part("kernels/tpu/sinkhorn_kernel.py:80 rounds", "Pallas kernel", False, "k") == "mHC streams"
    assert part("kernels/tpu/upsample_kernel.py:166 up", "Pallas kernel", False, "k") == "multiscale resampling"
    assert part("kernels/tpu/rope_kernel.py:109 rotate", "Pallas kernel", True, "k") == "RoPE"
    assert part("layers/ffn.py:46 _swiglu", "convolution fusion", True, "f") == "FFN"
    assert part("training/step.py:289 keep_if_finite", "select fusion", False, "f") == \
        "train step: loss, clipping, update"
    assert part("model.py:303 features", "add fusion", False, "f") == OTHER
    assert part("(no source)", "all-gather", False, "all-gather.1") == OTHER
    labels = [label for label, _ in PARTS]
    assert len(set(labels)) == len(labels)

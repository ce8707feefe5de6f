"""Compile-only fit check (nash_mhc.tpu_compile.fit): topology names, the abstract train state, and the real TPU
compiler on this CPU host (libtpu, no TPU) deciding whether the ``tiny`` step fits a v5e:2x2 slice.

The two TPU compiles (one that fits, one that cannot) run through ``python -m nash_mhc.train --compile-only``
and take one to two minutes each on a 2-core machine, so they are ``slow``; tests that need libtpu skip
without it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import pytest
from helpers import ROOT, needs_libtpu

from nash_mhc import ModelConfig, TrainConfig, make_mesh
from nash_mhc import train as train_program
from nash_mhc.tpu_compile.fit import (
    HBM_BYTES,
    TopologyError,
    abstract_batch,
    abstract_train_state,
    parse_out_of_memory,
    per_device_bytes,
    resolve_topology,
    topology_devices,
)
from nash_mhc.training.state import init_train_state

GIB = 2**30

# Cloud TPU accelerator types and their chip grids, as Google's TPU documentation lists them (v4 and v5p
# names count TensorCores, two per chip; v5e and v6e names count chips).
CLOUD_SLICES = {
    "v5litepod-1": "v5e:1x1", "v5litepod-4": "v5e:2x2", "v5litepod-8": "v5e:2x4", "v5litepod-16": "v5e:4x4",
    "v5e-32": "v5e:4x8", "v5e-64": "v5e:8x8", "v5litepod-128": "v5e:8x16", "v5litepod-256": "v5e:16x16",
    "v6e-1": "v6e:1x1", "v6e-4": "v6e:2x2", "v6e-8": "v6e:2x4", "v6e-16": "v6e:4x4", "v6e-256": "v6e:16x16",
    "v4-8": "v4:2x2x1", "v4-16": "v4:2x2x2", "v4-32": "v4:2x2x4", "v4-64": "v4:2x4x4", "v4-128": "v4:4x4x4",
    "v4-256": "v4:4x4x8", "v4-512": "v4:4x8x8", "v4-1024": "v4:8x8x8", "v4-4096": "v4:8x16x16",
    "v5p-8": "v5p:2x2x1", "v5p-16": "v5p:2x2x2", "v5p-32": "v5p:2x2x4", "v5p-128": "v5p:4x4x4",
    "v5p-8192": "v5p:16x16x16",
}


# ------------------------------------------------------------------------------------------ topology names
def test_cloud_names_resolve_to_their_chip_grids():
    for cloud, topology in CLOUD_SLICES.items():
        resolved = resolve_topology(cloud)
        assert resolved.topology == topology, cloud
        assert resolve_topology(topology) == resolved  # the topology name itself resolves the same way
    assert resolve_topology(" V5LitePod-8 ").topology == "v5e:2x4"
    assert resolve_topology("v5e-8").chips_per_host == (2, 4, 1)  # one host of 8 chips
    assert resolve_topology("v5e-16").chips_per_host == (2, 2, 1)  # hosts of 4 chips
    assert resolve_topology("v4-32").chips == 16


@pytest.mark.parametrize("name", ["v7x-8", "v5e-6", "v4-12", "v5e:2x2x1", "v4:2x2", "v5e:3x3", "v6e", "tpu"])
def test_unknown_topology_is_a_one_line_error_listing_the_valid_names(name):
    with pytest.raises(TopologyError) as info:
        resolve_topology(name)
    message = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in message
    assert message.startswith(f"unknown TPU topology {name!r}")
    for valid in ("v5litepod/v5e-{1,4,8,", "v6e-{1,4,8,", "v4-{8,16,32,", "v5p-{8,16,", "v5e:2x2", "v4:2x2x2"):
        assert valid in message


@needs_libtpu
def test_cloud_name_and_topology_name_give_the_same_devices():
    for cloud, topology, count, kind in (("v5litepod-8", "v5e:2x4", 8, "TPU v5 lite"),
                                         ("v6e-8", "v6e:2x4", 8, "TPU v6 lite"),
                                         ("v4-32", "v4:2x2x4", 16, "TPU v4"),  # megacore: one device per chip
                                         ("v5p-8", "v5p:2x2x1", 4, "TPU v5")):
        by_cloud, by_topology = topology_devices(cloud), topology_devices(topology)
        assert len(by_cloud) == len(by_topology) == count, cloud
        assert {d.device_kind for d in by_cloud} == {d.device_kind for d in by_topology} == {kind}
        assert kind in HBM_BYTES


def test_out_of_memory_messages_are_parsed():
    temps = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
             "(17.99G) exceeds available HBM (15.75G).\nmore detail")
    line, required, available = parse_out_of_memory(temps)
    assert line.startswith("RESOURCE_EXHAUSTED: Ran out of memory on HBM") and "\n" not in line
    assert (required, available) == (int(17.99 * GIB), int(15.75 * GIB))
    used = parse_out_of_memory("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 20.50G of 15.48G hbm.")
    assert used[1:] == (int(20.5 * GIB), int(15.48 * GIB))
    assert parse_out_of_memory("INVALID_ARGUMENT: something else") is None


# ------------------------------------------------------------------------------------------ abstract state
@pytest.mark.slow  # the real born-sharded initialisation compiles for 8 devices (15-90 s here)
def test_abstract_state_and_batch_match_what_training_allocates():
    """Leaf for leaf, the abstract TrainState has the shape, dtype and sharding of the born-sharded one."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 (fake) devices")
    config = ModelConfig.preset("tiny", d_model=64, num_heads=8, ffn_hidden=256)
    train_config = TrainConfig(batch_size=8)
    mesh = make_mesh(2, 4, 1)
    abstract = abstract_train_state(config, train_config, mesh)
    real = init_train_state(config, train_config, mesh, key=jax.random.key(0))
    abstract_paths, abstract_leaves = zip(*jax.tree_util.tree_flatten_with_path(abstract)[0], strict=True)
    real_paths, real_leaves = zip(*jax.tree_util.tree_flatten_with_path(real)[0], strict=True)
    assert abstract_paths == real_paths  # (the static optimizer is a fresh closure per call, so not the treedef)
    for fake, array in zip(abstract_leaves, real_leaves, strict=True):
        assert isinstance(fake, jax.ShapeDtypeStruct)
        assert (fake.shape, fake.dtype) == (array.shape, array.dtype)
        assert fake.sharding.is_equivalent_to(array.sharding, array.ndim)
    # Per-device bytes: what device 0 really holds.
    held = sum(shard.data.nbytes for leaf in real_leaves for shard in leaf.addressable_shards
               if shard.device == jax.devices()[0])
    assert per_device_bytes(abstract) == held
    batch = abstract_batch(8, config.seq_len, mesh)
    assert batch.tokens.shape == (8, config.seq_len + 1) and batch.loss_mask is None
    assert batch.tokens.sharding.shard_shape(batch.tokens.shape) == (1, config.seq_len + 1)


# -------------------------------------------------------------------------- python -m nash_mhc.train --compile-only
TINY_ON_V5E_2X2 = ["--model", "tiny", "--remat", "full", "--mesh-data", "1", "--mesh-fsdp", "4", "--compile-only"]


def sizes(line: str) -> list[float]:
    """Every "<number> MiB|GiB" in ``line``, in bytes."""
    units = {"MiB": 2**20, "GiB": GIB}
    return [float(number) * units[unit] for number, unit in re.findall(r"([\d.]+) (MiB|GiB)", line)]


def compile_only(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nash_mhc.train", *TINY_ON_V5E_2X2, *flags], cwd=ROOT,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@needs_libtpu
def test_compile_only_cli_reports_a_fit_and_exits_0():
    result = compile_only("--batch-size", "8", "--topology", "v5e:2x2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "compile-only: train step for v5e:2x2: 4 x TPU v5 lite, mesh data=1 fsdp=4 tp=1"
    assert lines[2].startswith("batch: 8 x 64 tokens (2 x 64 per data shard")
    assert lines[3].startswith("per chip: parameters + optimizer state ") and "temporaries" in lines[3]
    assert lines[4].startswith("total ") and "of 16.00 GiB (table), headroom" in lines[4]
    state, arguments, temporaries, outputs, program = sizes(lines[3])
    total, hbm, headroom = sizes(lines[4])
    assert arguments >= state > 0  # the compiler's arguments hold at least our parameters + optimizer state
    assert total == pytest.approx(arguments + temporaries + outputs + program, abs=0.2 * 2**20)  # printed to 0.1
    assert hbm == 16 * GIB and headroom == pytest.approx(hbm - total, abs=0.01 * GIB) and headroom > 0
    assert lines[5].startswith("compiler estimates per chip: ") and "FLOP" in lines[5]
    assert lines[-1] == "result: fits"
    assert "error" not in result.stderr.lower()  # libtpu's start-up complaints stay out of the way


@pytest.mark.slow
@needs_libtpu
def test_compile_only_cli_exits_4_when_the_batch_cannot_fit():
    # 65,536 sequences per chip: the TPU compiler refuses (about 140 GiB of temporaries on a 16 GiB chip).
    result = compile_only("--batch-size", str(4 * 65536), "--topology", "v5litepod-4")
    assert result.returncode == train_program.EXIT_DOES_NOT_FIT == 4, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("compile-only: train step for v5litepod-4 = v5e:2x2")
    (line,) = [line for line in lines if "the compiler ran out of memory: temporaries need" in line]
    _, needed, available, _ = sizes(line)  # the compiler's own figures
    assert needed > available > 15 * GIB
    assert lines[-1] == "result: DOES NOT FIT"


@pytest.mark.parametrize("flags", [["--compile-only", "--topology", "v5e-6"], ["--topology", "v5e:2x2"],
                                   ["--compile-only", "--topology", "tpu-v9"]])
def test_compile_only_bad_topology_is_exit_2_listing_the_valid_names(flags, capsys, tmp_path):
    assert train_program.main(["--model", "tiny", "--checkpoint-dir", str(tmp_path / "run"), *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    if "--compile-only" in flags:
        assert "valid: Cloud accelerator types v4-{8," in err and "v5litepod" in err
    else:
        assert "--topology needs --compile-only" in err
    assert not (tmp_path / "run").exists()

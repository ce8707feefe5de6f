"""Sharded inference: ``evaluate`` and ``generate`` restore a checkpoint onto a ``--mesh-*`` mesh with the
training sharding rules and give the numbers and greedy text they give on one device.

One checkpoint, shared by the module: a ``tiny`` model trained for a few steps on a (2, 2, 2) mesh of the
suite's 8 fake CPU devices and saved as the training program saves it.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from helpers import write_checkpoint

from nash_mhc import ModelConfig, TrainConfig, make_mesh
from nash_mhc.data import ByteTokenizer
from nash_mhc.evaluate import main as evaluate_main
from nash_mhc.generate import main as generate_main
from nash_mhc.inference import load_model
from nash_mhc.training import Batch, init_train_state, train_step

MESH_8 = ["--mesh-data", "1", "--mesh-fsdp", "4", "--mesh-tp", "2"]  # not the training mesh: resharded on restore


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    if jax.device_count() < 8:
        pytest.skip("needs 8 (fake) devices")
    directory = tmp_path_factory.mktemp("sharded_run")
    model_config = ModelConfig.preset("tiny", seq_len=32, vocab_size=ByteTokenizer().vocab_size,
                                      attention="full")  # (full attention: the cheapest compiles)
    train_config = TrainConfig(batch_size=8, total_steps=20, warmup_steps=1, learning_rate=1e-2)
    mesh = make_mesh(2, 2, 2)
    state = init_train_state(model_config, train_config, mesh, key=jax.random.key(0))
    text = np.frombuffer(b"def f(x):\n    return x + 1\n" * 40, np.uint8).astype(np.int32)
    rows = np.stack([text[i * 7:i * 7 + 33] for i in range(8)])
    with jax.set_mesh(mesh):
        for _ in range(6):
            state, _ = train_step(state, Batch(tokens=rows))
    write_checkpoint(directory, 6, state, model_config, train_config)
    return str(directory)


def run(main, capsys, *argv: str) -> str:
    code = main([*argv, "--compile-cache-dir", "none"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


@pytest.mark.slow  # a train step compiled for (2, 2, 2), then evaluate and generate compiled twice (about 60 s)
def test_evaluate_and_greedy_generate_on_8_devices_match_one_device(checkpoint, capsys):
    loaded = load_model(checkpoint, mesh=make_mesh(*map(int, MESH_8[1::2])))
    assert loaded.step == 6 and loaded.mesh.devices.size == 8
    wq = loaded.model.blocks.attn.wq  # sharded as training shards it, not replicated
    assert len({shard.device for shard in wq.addressable_shards}) == 8
    assert wq.sharding.shard_shape(wq.shape) != wq.shape

    numbers = [json.loads(run(evaluate_main, capsys, "--checkpoint-dir", checkpoint, "--batch-size", "8",
                              "--num-batches", "2", *mesh).strip().splitlines()[-1]) for mesh in ([], MESH_8)]
    one, eight = numbers
    assert one["tokens"] == eight["tokens"] > 0 and one["step"] == eight["step"] == 6
    for key in ("loss", "perplexity", "bits_per_byte", "aux_loss"):
        np.testing.assert_allclose(eight[key], one[key], rtol=1e-5, err_msg=key)

    prompt = ("--checkpoint-dir", checkpoint, "--prompt", "def f(x):", "--temperature", "0", "--max-new-tokens",
              "16", "--ignore-eos")
    texts = [run(generate_main, capsys, *prompt, *mesh) for mesh in ([], MESH_8)]
    assert texts[0].startswith("def f(x):") and len(texts[0]) > len("def f(x):\n")
    assert texts[1] == texts[0]


def test_mesh_flags_are_validated_before_loading(capsys, tmp_path):
    code = evaluate_main(["--checkpoint-dir", str(tmp_path / "none"), "--mesh-fsdp", "3"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "mesh" in err.lower()

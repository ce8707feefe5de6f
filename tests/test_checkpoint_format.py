"""Checkpoint formats: older model formats (1 and 2) are refused in one line; inference reads only the model."""

from __future__ import annotations

import gc
import json
import sys

import jax
import pytest

from nash_mhc import ModelConfig, TrainConfig, make_mesh
from nash_mhc.evaluate import main as evaluate_main
from nash_mhc.train import main as train_main
from nash_mhc.training import init_train_state
from nash_mhc.training.checkpoint import MODEL_FORMAT, Checkpointer


@pytest.mark.parametrize("old_format, named", [
    (1, ("learned temperature", "Hyper-Connections")),  # nash_mhc 0.1 wrote no model_format
    (2, ("1.05 lambda_max", "coefficient learning-rate group")),
])
def test_an_older_format_checkpoint_is_refused_with_one_line_naming_the_change(tmp_path, capsys, old_format, named):
    config, train_config = ModelConfig.preset("tiny"), TrainConfig(batch_size=8, total_steps=10, warmup_steps=1)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    state = init_train_state(config, train_config, mesh, key=jax.random.key(0))
    run = tmp_path / "run"
    checkpointer = Checkpointer(run)
    meta = {"step": 1, "model_config": config.to_dict(), "train_config": train_config.to_dict(),
            "data": {"dataset": "synthetic", "tokenizer": "bytes", "next_step": 1}}
    checkpointer.save(1, state, meta)
    checkpointer.wait()
    checkpointer.close()
    (meta_file,) = [p for p in run.glob("1/meta/*") if p.is_file() and p.read_text().startswith("{")]
    saved = json.loads(meta_file.read_text())
    assert saved["model_format"] == MODEL_FORMAT == 3
    if old_format == 1:
        del saved["model_format"]
    else:
        saved["model_format"] = old_format
    meta_file.write_text(json.dumps(saved))
    before = sorted(str(p) for p in run.rglob("*"))

    code = train_main(["--model", "tiny", "--dataset", "synthetic", "--no-progress", "--compile-cache-dir", "none",
                       "--batch-size", "8", "--total-steps", "2", "--checkpoint-dir", str(run)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"model format {old_format}" in err and all(words in err for words in named), err
    code = evaluate_main(["--checkpoint-dir", str(run), "--compile-cache-dir", "none"])
    err = capsys.readouterr().err
    assert code == 2 and f"model format {old_format}" in err and len(err.strip().splitlines()) == 1
    assert sorted(str(p) for p in run.rglob("*")) == before


def test_inference_restores_only_the_model(tmp_path, monkeypatch):
    """``Checkpointer.restore_model`` reads the model's arrays and no others: it restores into a TrainState
    template whose optimizer state does not match the checkpoint's (another optimizer's shapes), where a whole
    restore fails; the model's values are the saved ones. The failed restore's abandoned reads report nothing."""
    import equinox as eqx
    import numpy as np
    from helpers import write_checkpoint

    from nash_mhc.inference import load_model
    from nash_mhc.tpu_compile.fit import abstract_train_state
    from nash_mhc.training.checkpoint import CheckpointError

    config, train_config = ModelConfig.preset("tiny"), TrainConfig(batch_size=8, total_steps=10, warmup_steps=1)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    state = init_train_state(config, train_config, mesh, key=jax.random.key(3))
    write_checkpoint(tmp_path / "run", 4, state, config, train_config)

    template = abstract_train_state(config, train_config, mesh)
    opt_leaves = [x for x in jax.tree.leaves(template.opt_state) if isinstance(x, jax.ShapeDtypeStruct) and x.ndim]
    other = eqx.tree_at(lambda s: s.opt_state, template,  # every optimizer moment one row longer
                        jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] + 1, *x.shape[1:]), x.dtype,
                                                                    sharding=x.sharding)
                                     if isinstance(x, jax.ShapeDtypeStruct) and x.ndim else x, template.opt_state))
    assert opt_leaves
    checkpointer = Checkpointer(tmp_path / "run", read_only=True)
    reports = []
    monkeypatch.setattr(sys, "unraisablehook", reports.append)  # what reaches Python's report of unraisables
    with pytest.raises(CheckpointError, match="shape"):
        checkpointer.restore(4, other)
    model = checkpointer.restore_model(4, other)
    checkpointer.close()
    gc.collect()  # the failed restore's abandoned reads are finalised by here
    assert not reports, [repr(r.exc_value)[:200] for r in reports]
    for got, saved in zip(jax.tree.leaves(eqx.filter(model, eqx.is_array)),
                          jax.tree.leaves(eqx.filter(state.model, eqx.is_array)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(saved))
    loaded = load_model(str(tmp_path / "run"))
    np.testing.assert_array_equal(np.asarray(loaded.model.embedding), np.asarray(state.model.embedding))

"""The training run's set-up steps (nash_mhc.training.session), each called on its own with real inputs."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from nash_mhc.config import ModelConfig
from nash_mhc.data import DataConfig
from nash_mhc.run_config import RunConfig
from nash_mhc.sharding import MeshConfig
from nash_mhc.training import session
from nash_mhc.training.checkpoint import Checkpointer
from nash_mhc.training.config import LoopConfig, TrainConfig
from nash_mhc.training.resume import identity_differences, run_identity
from nash_mhc.training.state import init_train_state


def tiny_configs(directory, **loop) -> RunConfig:
    return RunConfig(ModelConfig.preset("tiny", residual="plain", attention="full"),
                     train=TrainConfig(batch_size=4, total_steps=2, warmup_steps=1),
                     data=DataConfig(dataset="synthetic"), mesh=MeshConfig(),
                     loop=LoopConfig(checkpoint_dir=str(directory), progress=False, **loop))


def test_check_batch_names_what_does_not_divide():
    session.check_batch(TrainConfig(batch_size=3), MeshConfig(data=1).make(devices=jax.devices()[:1]))
    with pytest.raises(ValueError, match="not divisible by data\\*fsdp = 2"):
        session.check_batch(TrainConfig(batch_size=3), MeshConfig(data=2).make(devices=jax.devices()[:2]))


def test_open_data_takes_the_vocabulary_from_the_tokenizer(tmp_path):
    configs = tiny_configs(tmp_path)
    configs = configs.replace(model=configs.model.replace(vocab_size=7))
    resolved, tokenizer, train_data, eval_data, notes = session.open_data(configs)
    assert resolved.model.vocab_size == tokenizer.vocab_size != 7
    assert train_data.num_windows > 0 and eval_data.num_windows > 0 and notes == []
    first = train_data.arrays_at(0, global_batch=4, process_index=0, process_count=1)["tokens"]
    assert first.shape == (4, configs.model.seq_len + 1)


@pytest.mark.slow  # out of the quick loop (its 5-minute budget): no invariant, the full run keeps it
def test_starting_state_fresh_then_from_the_directory_then_init_from(tmp_path):
    """A fresh start in an empty directory; the directory's own checkpoint resumes; --init-from elsewhere takes the
    weights only (step 0, not a resume)."""
    configs, tokenizer, *_ = session.open_data(tiny_configs(tmp_path / "run"))
    identity = run_identity(configs.data, tokenizer, configs.train)
    mesh = configs.mesh.make()
    start = session.starting_state(configs, identity, mesh, tmp_path / "run")
    assert (start.step, start.resume, start.own_steps, start.notes) == (0, False, [], [])

    state = init_train_state(configs.model, configs.train, mesh, key=jax.random.key(5))
    save_step(tmp_path / "run", 2, configs, state, identity)
    resumed = session.starting_state(configs, identity, mesh, tmp_path / "run")
    assert (resumed.step, resumed.resume, resumed.own_steps) == (2, True, [2])
    np.testing.assert_array_equal(resumed.state.model.embedding, state.model.embedding)

    init = configs.replace(loop=LoopConfig(checkpoint_dir=str(tmp_path / "other"), init_from=str(tmp_path / "run")))
    started = session.starting_state(init, identity, mesh, tmp_path / "other")
    assert (started.step, started.resume) == (0, False)
    np.testing.assert_array_equal(started.state.model.embedding, state.model.embedding)
    assert int(started.state.step) == 0


def save_step(directory, step, configs, state, identity) -> None:
    """A checkpoint of ``state`` at ``step`` whose meta records ``identity`` as the run's."""
    checkpointer = Checkpointer(directory)
    checkpointer.save(step, state, {"step": step, "model_config": configs.model.to_dict(),
                                    "train_config": configs.train.to_dict(), "run": identity})
    checkpointer.wait()
    checkpointer.close()


@pytest.mark.slow  # out of the quick loop (its 5-minute budget): no invariant, the full run keeps it
def test_a_resume_with_another_seed_or_batch_needs_allow_data_change(tmp_path):
    """Step s reads the global batch at s x sequences-per-update of the seed's order: another seed or batch
    re-reads or skips data, so the resume is refused naming both (before and after) unless --allow-data-change.
    Another split into microbatches moves nothing; a checkpoint that did not record them still resumes, and
    --init-from (weights only) does not look at them."""
    configs, tokenizer, *_ = session.open_data(tiny_configs(tmp_path / "run"))
    identity = run_identity(configs.data, tokenizer, configs.train)
    mesh = configs.mesh.make()
    state = init_train_state(configs.model, configs.train, mesh, key=jax.random.key(5))
    save_step(tmp_path / "run", 2, configs, state, identity)

    split = configs.train.replace(batch_size=4, grad_accum_steps=2)
    assert identity_differences(identity, run_identity(configs.data, tokenizer, split)) == []
    changed = configs.replace(train=configs.train.replace(seed=1, batch_size=8, grad_accum_steps=2))
    now = run_identity(changed.data, tokenizer, changed.train)
    with pytest.raises(ValueError, match=r"\(seed: 0 then, 1 now; sequences_per_update: 4 then, 8 now\); pass "
                                         "--allow-data-change"):
        session.starting_state(changed, now, mesh, tmp_path / "run")

    allowed = changed.replace(loop=dataclasses.replace(changed.loop, allow_data_change=True))
    start = session.starting_state(allowed, now, mesh, tmp_path / "run")
    assert start.step == 2 and start.notes == ["warning: resuming with changes allowed by --allow-data-change: "
                                               "seed: 0 then, 1 now; sequences_per_update: 4 then, 8 now"]
    old = {k: v for k, v in identity.items() if k not in ("seed", "sequences_per_update")}  # recorded before
    assert identity_differences(old, now) == []
    init = changed.replace(loop=LoopConfig(checkpoint_dir=str(tmp_path / "new"), init_from=str(tmp_path / "run")))
    started = session.starting_state(init, now, mesh, tmp_path / "new")
    assert (started.step, started.resume, started.notes) == (0, False, [])


@pytest.mark.slow  # multi-second (three restores, one failing); the subprocess fallback test covers the skip
def test_a_skipped_checkpoint_is_named_with_its_read_error_and_where_it_goes(tmp_path):
    """A step that does not restore is skipped for the next: the warning gives TensorStore's reason (Orbax's own
    message had ``<bound method ...>`` where the details belong) and says where the step goes: set aside with the
    later steps in the run's own directory (as set_aside then does), left in place in a --resume-from one."""
    configs, tokenizer, *_ = session.open_data(tiny_configs(tmp_path / "run"))
    identity = run_identity(configs.data, tokenizer, configs.train)
    mesh = configs.mesh.make()
    state = init_train_state(configs.model, configs.train, mesh, key=jax.random.key(5))
    for step in (2, 4):
        save_step(tmp_path / "run", step, configs, state, identity)
    largest = max((p for p in (tmp_path / "run" / "4" / "state").rglob("*") if p.is_file()),
                  key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[:10])

    elsewhere = configs.replace(loop=LoopConfig(checkpoint_dir=str(tmp_path / "new"),
                                                resume_from=str(tmp_path / "run")))
    start = session.starting_state(elsewhere, identity, mesh, tmp_path / "new")
    assert start.step == 2 and start.notes[0].endswith("; not deleted: it is left in place"), start.notes
    start = session.starting_state(configs, identity, mesh, tmp_path / "run")
    (warning,) = start.notes
    assert warning.startswith("warning: skipped checkpoint step 4 (cannot restore checkpoint ") and start.step == 2
    assert "<bound method" not in warning and "OUT_OF_RANGE: Error reading" in warning, warning
    assert warning.endswith("; not deleted: it is set aside with the steps after step 2"), warning
    session.set_aside_later_steps(session.paths.as_path(tmp_path / "run"), start)
    assert [p.name for p in (tmp_path / "run").glob("set_aside/*/*")] == ["4"]


def test_write_resolved_config_records_every_setting(tmp_path):
    configs = tiny_configs(tmp_path)
    session.write_resolved_config(tmp_path, configs, configs.mesh.make())
    written = json.loads((tmp_path / "config.json").read_text())
    assert set(written) == {"model_config", "train_config", "data_config", "mesh_config", "run_config", "mesh",
                            "execution_config"}
    assert ModelConfig.from_dict(written["model_config"]) == configs.model
    assert written["execution_config"] == {"kernels": "auto", "remat": "none", "remat_group": 1, "scan_unroll": 1,
                                           "loss_chunks": 1}  # ExecutionConfig()'s None fields at their defaults
    assert RunConfig.from_dict(written) == configs


def test_a_config_json_of_an_earlier_version_still_loads():
    """A format-3 run's config.json: the layer scan's settings in model_config, remat and loss_chunks in
    train_config, no execution_config (retired fields dropped, the execution at its defaults)."""
    model = ModelConfig.preset("tiny").to_dict() | {"remat": "full", "remat_group": 2, "scan_unroll": 2}
    old = {"model_config": model, "train_config": TrainConfig().to_dict() | {"remat": "none", "loss_chunks": 1},
           "data_config": {"dataset": "synthetic"}, "run_config": {"checkpoint_dir": "runs/x"}, "mesh": {"data": 1}}
    loaded = RunConfig.from_dict(old)
    assert loaded == RunConfig(ModelConfig.preset("tiny"), data=DataConfig(dataset="synthetic"),
                               loop=LoopConfig(checkpoint_dir="runs/x"))
    assert loaded.execution.remat == "none" and loaded.mesh == MeshConfig()
    with pytest.raises(ValueError, match="LoopConfig has no field 'typo'"):
        RunConfig.from_dict({**old, "run_config": {"typo": 1}})


def test_prepare_measures_the_peak_before_it_opens_the_data_or_makes_the_state(tmp_path, monkeypatch):
    """The CPU's matmul probe runs before anything else of the run is made (after the data, the state and the
    outputs it often read low, and the logged MFU as much too high); the meter and the log's peak line carry that
    one reading."""
    order = []

    def recorded(name, function):
        def wrapper(*args, **kwargs):
            order.append(name)
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(session, "device_peak", recorded("peak", lambda **kwargs: (123e9, "a recorded peak")))
    for name in ("open_data", "starting_state", "RunLogger", "Checkpointer"):
        monkeypatch.setattr(session, name, recorded(name, getattr(session, name)))
    configs = tiny_configs(tmp_path / "run")
    prepared = session.prepare(configs.replace(train=configs.train.replace(batch_size=8)))  # 8 devices
    try:
        assert order[0] == "peak" and order.count("peak") == 1 and {"open_data", "starting_state"} <= set(order)
        assert (prepared.meter.peak, prepared.meter.source) == (123e9, "a recorded peak")
        assert prepared.meter.flops_per_token == prepared.run_config.model.flops_per_token()
        assert "peak FLOP/s per device: 123.0 GFLOP/s (a recorded peak)" in prepared.summary
    finally:
        prepared.logger.close()
        prepared.checkpointer.close()
        prepared.lock.release()


def test_the_directory_probe_leaves_another_runs_directory_in_a_shared_parent(tmp_path, monkeypatch):
    """Two runs started at once under a new parent (docs/tpu.md's two CPU checks into runs/...): the probe that
    creates and removes the missing directories must not fail, nor remove, where the other run has meanwhile made
    its own directory in the parent."""
    made = session._make_directory

    def make_then_the_other_run_makes_its_own(directory):
        made(directory)
        (tmp_path / "runs" / "other").mkdir()
        (tmp_path / "runs" / "other" / "metrics.jsonl").write_text("{}\n")

    monkeypatch.setattr(session, "_make_directory", make_then_the_other_run_makes_its_own)
    session._check_directory(session.paths.as_path(tmp_path / "runs" / "mine"))
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["other"]
    assert (tmp_path / "runs" / "other" / "metrics.jsonl").read_text() == "{}\n"


def small_sft_file(path, records=600, null_every=6):
    """``records`` prompt/response lines (every ``null_every``-th response null): a held-out part of a few dozen
    tokens."""
    path.write_text("".join(json.dumps({"prompt": f"Q{i}: {i}+1?", "response": None if i % null_every == 0 else
                                        f"{i + 1}"}) + "\n" for i in range(records)))
    return path


def sft_configs(tmp_path, seq_len, **loop) -> RunConfig:
    configs = tiny_configs(tmp_path / "run", **loop)
    data = DataConfig(dataset=str(small_sft_file(tmp_path / "sft.jsonl")), prompt_field="prompt",
                      response_field="response")
    return configs.replace(model=configs.model.replace(seq_len=seq_len), data=data)


def test_a_held_out_part_without_a_window_trains_without_evaluation_when_eval_interval_is_0(tmp_path):
    """A 600-record fine-tuning file whose held-out part cannot fill a window: with --eval-interval 0 (the default)
    the run opens its data with a one-line warning and no eval windows; with evaluations asked for, the one-line
    error names the flags that fix it, --eval-interval 0 among them."""
    configs, tokenizer, train_data, eval_data, notes = session.open_data(sft_configs(tmp_path, 256))
    assert eval_data is None and train_data.num_windows > 0
    assert len(notes) == 1 and notes[0].startswith("warning: training without evaluation") and "\n" not in notes[0]
    assert "cannot fill one window of seq_len + 1 = 257 tokens" in notes[0]
    line = session.data_line(configs.data, train_data, eval_data)
    assert "no eval windows" in line and "records skipped" in line
    with pytest.raises(ValueError) as excinfo:
        session.open_data(sft_configs(tmp_path, 256, eval_interval=5))
    message = str(excinfo.value)
    assert "\n" not in message and "cannot fill one window" in message
    assert "--seq-len" in message and "--eval-interval 0" in message


def test_the_data_line_counts_the_records_skipped_for_a_null_field(tmp_path):
    """100 of 600 records have a null response: the log's data line says so (both parts counted)."""
    configs, _, train_data, eval_data, notes = session.open_data(sft_configs(tmp_path, 16))
    assert eval_data is not None and notes == []
    line = session.data_line(configs.data, train_data, eval_data)
    assert line.endswith(", 100 records skipped (100 null response)"), line
    assert line.startswith(f"data: {configs.data.dataset} / bytes: {train_data.num_tokens:,} train tokens, "
                           f"{eval_data.num_tokens:,} eval tokens")


@pytest.mark.parametrize("flag", ["init_from", "resume_from"])
def test_an_export_folder_as_a_checkpoint_is_a_one_line_error_that_says_so(tmp_path, flag):
    """model.safetensors + config.json (python -m nash_mhc.export) hold weights alone: --init-from/--resume-from
    say it is an export and what to give instead, not 'no complete checkpoint found'."""
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"weights")
    (export / "config.json").write_text('{"format": "nash_mhc-export"}')
    configs = tiny_configs(tmp_path / "run", **{flag: str(export)})
    with pytest.raises(ValueError) as excinfo:
        session.starting_state(configs, {}, configs.mesh.make(), tmp_path / "run")
    message = str(excinfo.value)
    assert "\n" not in message and "is an exported model" in message and "not a training checkpoint" in message
    assert message.startswith(f"--{flag.replace('_', '-')} {export}") and "run directory" in message

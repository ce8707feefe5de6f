"""Checkpoint integrity: divergence, corruption, concurrent runs, changed data, filesystem faults.

The subprocess tests share one trained run (``trained``: 4 tiny steps, checkpoints at 2 and 4) and copy it.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, cpu_env
from test_train_cli import SCHEDULE, run_main, steps_saved

from nash_mhc.training import checkpoint

BASE = ["--model", "tiny", "--batch-size", "8", "--dataset", "synthetic", "--no-progress", "--log-interval", "1",
        "--checkpoint-interval", "2", *SCHEDULE]  # test_train_cli's schedule: its compiled steps are in cache_dir


def command(*args: str, cache: Path) -> list[str]:
    return [sys.executable, "-m", "nash_mhc.train", *BASE, "--compile-cache-dir", str(cache), *args]


def run(*args: str, cache: Path, expect: int = 0) -> str:
    result = subprocess.run(command(*args, cache=cache), env=cpu_env(), cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == expect, f"exit {result.returncode}\n{output[-4000:]}"
    return output


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_one_line_error(output: str, *needles: str) -> None:
    lines = output.strip().splitlines()
    assert "Traceback" not in output and len([line for line in lines if line.strip()]) == 1, output[-3000:]
    assert lines[0].startswith("error: ") and all(n in lines[0] for n in needles), lines[0]


@pytest.fixture(scope="module")
def cache(cache_dir) -> Path:
    return cache_dir


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache) -> Path:
    directory = tmp_path_factory.mktemp("trained") / "run"
    run("--total-steps", "4", "--checkpoint-dir", str(directory), cache=cache)
    assert steps_saved(directory) == [2, 4]
    return directory


def copy(trained: Path, target: Path) -> Path:
    shutil.copytree(trained, target)
    return target


@pytest.mark.slow
def test_a_nan_streak_keeps_the_good_checkpoint_and_a_resume_continues_from_it(trained, tmp_path, cache):
    directory = copy(trained, tmp_path / "run")
    output = run("--total-steps", "12", "--learning-rate", "1e6", "--max-checkpoints", "2", "--max-nonfinite-steps",
                 "3", "--allow-data-change", "--checkpoint-dir", str(directory), cache=cache, expect=3)
    assert steps_saved(directory) == [2, 4]  # nothing from the streak, nothing rotated away
    assert "not finite for 3 steps in a row" in output
    assert "the newest checkpoint is step 4, the last finite one" in output
    assert "learning rate at step 4: " in output and " before, " in output  # the schedule change, said
    output = run("--total-steps", "6", "--checkpoint-dir", str(directory), cache=cache)
    assert "resuming from step 4" in output
    lines = records(directory)
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]  # the diverged lines were set aside
    assert all(r["loss"] is not None and r["loss"] < 10 for r in lines)


@pytest.mark.slow
def test_two_runs_on_one_directory_one_refuses_and_the_other_is_intact(tmp_path, cache):
    directory = tmp_path / "shared"
    procs = [subprocess.Popen(command("--total-steps", "100000", "--checkpoint-interval", "1000", "--checkpoint-dir",
                                      str(directory), cache=cache),
                              env=cpu_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        deadline = time.time() + 240
        while time.time() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.05)
        (refused,) = [p for p in procs if p.poll() is not None]
        (holder,) = [p for p in procs if p is not refused]
        _, err = refused.communicate()
        assert refused.returncode == 2, err[-3000:]
        assert_one_line_error(err, "is in use by another training run", f"pid {holder.pid}", "host ")
        # until a line with an MFU (step 1's, the compile, has none): SIGTERM right after step 1 left no such line
        while time.time() < deadline and not ((directory / "metrics.jsonl").exists()
                                               and any(r.get("mfu") is not None for r in records(directory))):
            time.sleep(0.05)
        holder.send_signal(signal.SIGTERM)
        out, err = holder.communicate(timeout=300)
        assert holder.returncode == 0, (out + err)[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    steps = [r["step"] for r in records(directory)]
    (saved,) = steps_saved(directory)
    assert steps == list(range(1, saved + 1))  # one run's lines, each step once
    assert not (directory / ".lock").exists()  # released
    throughput = [r for r in records(directory) if r.get("mfu") is not None]
    assert throughput and all(0 < r["mfu"] <= 1 for r in throughput)


@pytest.mark.slow
def test_a_corrupt_latest_checkpoint_falls_back_and_an_older_resume_sets_the_newer_aside(trained, tmp_path, cache):
    directory = copy(trained, tmp_path / "run")
    largest = max((p for p in (directory / "4" / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[:10])
    output = run("--total-steps", "6", "--checkpoint-dir", str(directory), cache=cache)
    assert "skipped checkpoint step 4 (cannot restore" in output and "resuming from step 2" in output
    assert sorted(str(p.relative_to(directory)) for p in directory.glob("set_aside/*/4/state")) != []  # kept
    assert steps_saved(directory) == [2, 4, 6]

    output = run("--total-steps", "6", "--resume-from", str(directory / "4"), "--checkpoint-dir", str(directory),
                 cache=cache)
    assert "resuming from step 4" in output and "set aside the checkpoints and metrics after step 4" in output
    assert steps_saved(directory) == [2, 4, 6]
    assert len(list(directory.glob("set_aside/*/6/state"))) == 1
    counts = Counter(r["step"] for r in records(directory))
    assert sorted(counts) == [1, 2, 3, 4, 5, 6] and set(counts.values()) == {1}
    # --log-interval 1 --checkpoint-interval 2: no save is charged to a step, step 1 (compile) reports none.
    assert all(r["mfu"] is None for r in records(directory) if r["step"] in (1, 3, 5))  # each run's first step
    assert all(0 < r["mfu"] <= 1 for r in records(directory) if r["step"] in (2, 4, 6))

    # A broken checkpoint named by --resume-from: one line, no Orbax traceback, no new directory.
    broken = copy(trained, tmp_path / "broken")
    (broken / "4" / "state" / "manifest.ocdbt").unlink()
    output = run("--resume-from", str(broken / "4"), "--checkpoint-dir", str(tmp_path / "new"), cache=cache,
                 expect=2)
    assert_one_line_error(output, "cannot restore checkpoint")
    output = run("--resume-from", str(tmp_path / "nope"), "--checkpoint-dir", str(tmp_path / "new"), cache=cache,
                 expect=2)
    assert_one_line_error(output, "does not exist")
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_resuming_onto_other_data_or_schedule_names_each_difference(trained, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some other text to train on. " * 2000)
    before = sorted(str(p) for p in trained.rglob("*"))
    code, err = run_main([*BASE[2:], "--checkpoint-dir", str(trained), "--dataset", str(corpus), "--learning-rate",
                          "2e-3", "--total-steps", "6"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "dataset: 'synthetic' then" in err and "learning_rate: 0.003 then, 0.002 now" in err
    assert "--allow-data-change" in err
    assert sorted(str(p) for p in trained.rglob("*")) == before


# ------------------------------------------------------------------------------- no training needed
def test_a_second_lock_names_the_holder_and_a_stale_lock_is_taken_over(tmp_path, capsys):
    from nash_mhc.training.run_lock import DirectoryInUse, RunLock

    (tmp_path / ".lock").write_text("host elsewhere pid 999999999\n")  # left by a process that died
    lock = RunLock(tmp_path)
    assert "taking over the stale lock" in capsys.readouterr().err
    with pytest.raises(DirectoryInUse, match=f"pid {os.getpid()}"):
        RunLock(tmp_path)
    lock.release()
    assert not (tmp_path / ".lock").exists()
    RunLock(tmp_path).release()
    assert "stale" not in capsys.readouterr().err


def test_a_run_refused_before_the_holder_has_named_itself_waits_for_the_name(tmp_path):
    import fcntl
    import threading

    from nash_mhc.training.run_lock import DirectoryInUse, RunLock

    fd = os.open(tmp_path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)  # a holder between its flock and its write
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    writer = threading.Timer(0.3, os.pwrite, (fd, b"host there pid 4242\n", 0))
    writer.start()
    try:
        with pytest.raises(DirectoryInUse, match=r"\(host there pid 4242\)"):
            RunLock(tmp_path)
    finally:
        writer.join()
        os.close(fd)


def read_only_filesystem(monkeypatch, root: Path) -> None:
    """Make writes under ``root`` fail as on a read-only mount (EROFS: not a PermissionError, and root-proof)."""
    import builtins
    import errno

    def guard(function, writes):
        def wrapper(path, *args, **kwargs):
            if writes(args, kwargs) and os.path.abspath(os.fspath(path)).startswith(str(root)):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
            return function(path, *args, **kwargs)
        return wrapper

    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT
    monkeypatch.setattr(os, "open", guard(os.open, lambda a, k: (a[0] if a else k.get("flags", 0)) & write_flags))
    monkeypatch.setattr(os, "mkdir", guard(os.mkdir, lambda a, k: True))
    monkeypatch.setattr(builtins, "open", guard(builtins.open, lambda a, k: any(
        c in (a[0] if a else k.get("mode", "r")) for c in "wax+")))


@pytest.mark.parametrize("kind", ["file", "under_file", "read_only", "read_only_parent"])
def test_unusable_checkpoint_directories_exit_2_with_one_line(tmp_path, capsys, monkeypatch, kind):
    target = tmp_path / "run"
    if kind == "file":
        target.write_text("x")
    elif kind == "under_file":
        (tmp_path / "file").write_text("x")
        target = tmp_path / "file" / "run"
    elif kind == "read_only":
        target.mkdir()
        read_only_filesystem(monkeypatch, tmp_path)
    else:
        read_only_filesystem(monkeypatch, tmp_path)
    code, err = run_main(["--checkpoint-dir", str(target), "--batch-size", "8", "--dataset", "synthetic"], capsys)
    monkeypatch.undo()
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert str(tmp_path) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == {"file": ["run"], "under_file": ["file"]}.get(
        kind, ["run"] if kind == "read_only" else [])


def test_prepare_onto_a_read_only_filesystem_exits_2(tmp_path, capsys, monkeypatch):
    from nash_mhc.data import prepare

    read_only_filesystem(monkeypatch, tmp_path)
    code = prepare.main(["--dataset", "synthetic", "--out", str(tmp_path / "shards")])
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_the_training_log_reports_the_benchmarks_mfu_without_compile_or_checkpoint_time(monkeypatch):
    """Training logs go through MFUMeter.report (the benchmarks' definition) over the one peak measured when the
    session was prepared: no probe runs while logging, so the same step times give the same MFU on every line.
    Step 1 (compilation) reports no throughput; a checkpoint's pause is not charged to any step."""
    from types import SimpleNamespace

    from nash_mhc import ModelConfig, TrainConfig
    from nash_mhc.training import loop
    from nash_mhc.training.config import LoopConfig
    from nash_mhc.training.throughput import MFUMeter

    class Probe:
        flops, runs = 4e9, 0

        def __call__(self) -> float:
            self.runs += 1
            return 0.04  # 100 GFLOP/s

    now = [0.0]
    monkeypatch.setattr(loop.time, "perf_counter", lambda: now[0])
    model, train = ModelConfig.preset("tiny"), TrainConfig(batch_size=8, total_steps=100)
    written = []
    logger = SimpleNamespace(write=written.append, progress=lambda *a: None, scalar=lambda *a: None)
    probe = Probe()
    meter = MFUMeter.for_device(model.flops_per_token(), 1, probe=probe)
    probe_runs = probe.runs
    session = SimpleNamespace(run_config=SimpleNamespace(model=model, train=train, loop=LoopConfig(log_interval=2)),
                              start_step=0, logger=logger, meter=meter, last_saved=None)
    reader = loop.MetricsReader(session)
    values = {"loss": 1.0}
    for step, seconds in ((1, 30.0), (2, 0.5), (3, 0.5)):  # 30 s: compilation
        now[0] += seconds
        reader._read(step, values)
    now[0] += 20.0  # a checkpoint save after step 3
    reader.restart_clock()
    now[0] += 0.5
    reader._read(4, values)
    assert [r["step"] for r in written] == [1, 2, 4]
    assert written[0]["mfu"] != written[0]["mfu"]  # NaN: step 1 is compilation
    assert probe.runs == probe_runs and meter.peak == pytest.approx(100e9)
    expected = MFUMeter(model.flops_per_token(), 1, 100e9, "same peak").report(8 * model.seq_len, 0.5)
    for record in written[1:]:
        assert record["mfu"] == pytest.approx(expected["mfu"], rel=1e-12)
        assert record["tokens_per_second"] == pytest.approx(expected["tokens_per_second"], rel=1e-12)


def test_the_model_rejects_token_ids_outside_the_vocabulary():
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from nash_mhc import LanguageModel, ModelConfig

    # The ids are checked before any weight is used, so a shape-only model shows it (no initialisation).
    model = eqx.filter_eval_shape(LanguageModel, ModelConfig.preset("tiny"), key=jax.random.key(0))
    for bad in (10**6, -1, model.config.vocab_size):
        with pytest.raises(ValueError, match=f"token id {bad} is outside the vocabulary"):
            model(jnp.array([[1, 2, bad]]))
    traced = eqx.filter_eval_shape(lambda m, t: m(t).logits, model, jnp.array([1, 2, model.config.vocab_size - 1]))
    assert traced.shape[0] == 3  # in range (and traced: not checked, no host copy in a jitted step)


@pytest.mark.parametrize("text, suffix, message", [
    ("[1, 2]", ".json", "must hold a table of flag values, not a list"),
    ("[model]\nd_model = 3\n", ".toml", "model in"),
    ('{"eval_steps": 2.5}', ".json", "eval-steps in"),
    ('{"no-progress": 1}', ".json", "no-progress in"),
    ('{"dtype": "f16"}', ".json", "dtype in"),
])
def test_config_file_values_are_type_checked(tmp_path, capsys, text, suffix, message):
    from nash_mhc import train as train_module

    file = tmp_path / f"run{suffix}"
    file.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        train_module.configs(["--config", str(file)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_seed_and_model_constants_out_of_range_are_refused():
    from nash_mhc import ModelConfig
    from nash_mhc import train as train_module

    with pytest.raises(ValueError, match="--seed must be an integer in"):
        train_module.configs(["--seed", str(2**64)])
    for field in ("rope_theta", "hc_identity_logit", "sparsity_weight"):
        with pytest.raises(ValueError, match=field):
            ModelConfig.preset("tiny", **{field: float("nan")})


@pytest.mark.slow
def test_generate_takes_tokenizer_to_replace_one_whose_relative_path_no_longer_resolves(trained, tmp_path, capsys):
    generate = importlib.import_module("nash_mhc.generate")

    moved = copy(trained, tmp_path / "run")
    for meta_file in moved.glob("*/meta/metadata"):  # as written by a run given `--tokenizer tok/tokenizer.json`
        meta = json.loads(meta_file.read_text())
        meta["data"]["tokenizer"] = "tok/tokenizer.json"
        meta_file.write_text(json.dumps(meta))
    argv = ["--checkpoint-dir", str(moved), "--max-new-tokens", "2", "--compile-cache-dir", "none"]
    assert generate.main(argv) == 2
    assert "tok/tokenizer.json" in capsys.readouterr().err
    assert generate.main([*argv, "--tokenizer", "bytes"]) == 0
    capsys.readouterr()


def test_checkpoints_record_local_paths_absolute(tmp_path, monkeypatch):
    from nash_mhc.training.resume import absolute_spec

    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert absolute_spec("tok/tokenizer.json") == str(tmp_path / "tok" / "tokenizer.json")
    assert absolute_spec("bytes") == "bytes" and absolute_spec("gs://b/x") == "gs://b/x"


# --------------------------------------------------------------------- changed data, tokenizers, filesystem faults
def word_level_tokenizer(path: Path) -> Path:
    """A ``tokenizer.json`` with the byte tokenizer's vocabulary size (256 words + [UNK], then EOS and PAD
    appended: 259 ids) but other ids: same model shape, other data."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(256)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


@pytest.mark.slow
def test_resuming_with_another_tokenizer_of_the_same_vocabulary_size_is_refused(trained, tmp_path, capsys):
    from nash_mhc.data import get_tokenizer

    tokenizer = word_level_tokenizer(tmp_path / "tokenizer.json")
    assert get_tokenizer(str(tokenizer)).vocab_size == 259  # the checkpoint's model fits it
    before = sorted(str(p) for p in trained.rglob("*"))
    code, err = run_main([*BASE[2:], "--checkpoint-dir", str(trained), "--tokenizer", str(tokenizer),
                          "--total-steps", "6"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "tokenizer: 'bytes' then, 'sha256:" in err and "--allow-data-change" in err
    assert sorted(str(p) for p in trained.rglob("*")) == before


def test_config_dicts_with_unknown_keys_are_refused():
    from nash_mhc import ModelConfig, TrainConfig

    data = ModelConfig.preset("tiny").to_dict()
    with pytest.raises(ValueError, match="ModelConfig has no field 'future_knob'"):
        ModelConfig.from_dict({**data, "future_knob": 1})
    with pytest.raises(ValueError, match="TrainConfig has no field 'batch_sise'"):
        TrainConfig.from_dict({"batch_sise": 8})
    assert ModelConfig.from_dict(data) == ModelConfig.preset("tiny")


@pytest.mark.slow
def test_a_checkpoint_with_an_unknown_model_field_is_refused_by_resume_generate_and_evaluate(trained, tmp_path,
                                                                                               capsys):
    from nash_mhc.evaluate import main as evaluate_main
    from nash_mhc.generate import main as generate_main

    other = copy(trained, tmp_path / "run")
    for meta_file in other.glob("*/meta/metadata"):  # as a later version with one more field would write it
        meta = json.loads(meta_file.read_text())
        meta["model_config"]["future_knob"] = 1
        meta_file.write_text(json.dumps(meta))
    code, err = run_main([*BASE[2:], "--checkpoint-dir", str(other), "--total-steps", "6"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "future_knob: checkpoint 1 vs now" in err, err
    for program in (generate_main, evaluate_main):
        assert program(["--checkpoint-dir", str(other), "--compile-cache-dir", "none"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "ModelConfig has no field 'future_knob'" in err, err


@pytest.mark.parametrize("train_args, message", [
    (["--batch-sise", "8"], "the training flags: unrecognized arguments: --batch-sise 8"),
    (["--learning-rate", "-1"], "the training flags: --learning-rate must be > 0"),
    (["--model", "huge"], "the training flags: unknown model preset 'huge'"),
])
def test_launch_run_checks_the_training_flags_before_starting_a_job(capsys, train_args, message):
    from nash_mhc import launch

    argv = ["run", "--name", "pod", "--zone", "us-east5-b", "--dry-run", "--", "--checkpoint-dir", "gs://b/run"]
    assert launch.main([*argv, *train_args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"error: {message}"), captured
    assert len(captured.err.strip().splitlines()) == 1
    assert launch.main([*argv, "--model", "tiny", "--batch-size", "16"]) == 0
    assert "--batch-size 16" in capsys.readouterr().out


def test_a_binary_txt_file_is_read_with_a_warning_naming_it(tmp_path, capsys):
    from nash_mhc.data import prepare

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "good.txt").write_text("plain text, nothing odd. " * 200)
    (corpus / "blob.txt").write_bytes(np.random.default_rng(0).integers(0, 256, 20_000, dtype=np.uint8).tobytes())
    assert prepare.main(["--dataset", str(corpus), "--out", str(tmp_path / "shards")]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "blob.txt is not UTF-8 text" in warnings[0], err  # once, for that file only


def test_after_a_failed_restore_only_the_abandoned_reads_asyncio_reports_are_dropped(caplog):
    """A failed restore leaves Orbax's other reads as failed asyncio tasks that nobody awaits; collected, asyncio
    logs each with a traceback after the one-line error. Once a restore has failed those reports are dropped, and
    the asyncio logger's other records are kept."""
    async def failing_read() -> None:
        raise ValueError("NOT_FOUND: an abandoned read")

    def abandon_a_failed_task() -> None:
        loop = asyncio.new_event_loop()
        task = loop.create_task(failing_read())
        loop.run_until_complete(asyncio.sleep(0.01))
        loop.close()
        del task
        gc.collect()

    logger = logging.getLogger("asyncio")
    before = list(logger.filters)
    # a failed restore of an earlier test in this process may have installed the filter already: start without it
    others = [f for f in before if not isinstance(f, checkpoint._AbandonedTaskFilter)]
    try:
        logger.filters[:] = others
        abandon_a_failed_task()
        assert "Task exception was never retrieved" in caplog.text  # what the filter is for
        caplog.clear()
        checkpoint._quiet_abandoned_tasks()
        checkpoint._quiet_abandoned_tasks()  # idempotent
        abandon_a_failed_task()
        logger.error("another asyncio error")
        assert "never retrieved" not in caplog.text and "another asyncio error" in caplog.text
        assert len(logger.filters) == len(others) + 1
    finally:
        logger.filters[:] = before


def test_after_a_failed_restore_a_coroutine_orbax_never_awaited_draws_no_warning():
    """A failed restore can leave a coroutine Orbax made but never awaited (``Store._get_array_metadatas``);
    collected, often at exit, it draws a two-line RuntimeWarning after the one-line error. Once a restore has
    failed that warning is dropped; other RuntimeWarnings are kept."""
    async def _get_array_metadatas() -> None:
        pass

    def abandon() -> None:
        coroutine = _get_array_metadatas()
        del coroutine
        gc.collect()

    logger = logging.getLogger("asyncio")
    before = list(logger.filters)  # _quiet_abandoned_tasks also filters asyncio's log: leave it as it was
    try:
        with warnings.catch_warnings(record=True) as caught:  # the filter goes when the block ends
            warnings.simplefilter("always")
            abandon()
            assert [str(w.message) for w in caught] == [  # what the filter is for
                "coroutine 'test_after_a_failed_restore_a_coroutine_orbax_never_awaited_draws_no_warning.<locals>."
                "_get_array_metadatas' was never awaited"]
            caught.clear()
            checkpoint._quiet_abandoned_tasks()
            abandon()
            warnings.warn("another runtime warning", RuntimeWarning, stacklevel=1)
            assert [str(w.message) for w in caught] == ["another runtime warning"]
    finally:
        logger.filters[:] = before


def test_after_a_failed_restore_only_the_abandoned_reads_unraisable_reports_are_dropped(monkeypatch):
    """A failed restore leaves Orbax's other reads unfinished: each read's coroutine, closed when collected,
    raises an Exception from the GeneratorExit (Python reports it as unraisable, with a traceback), and
    TensorStore's late callbacks find the event loop closed. The hook drops exactly those two reports."""

    class Pending:
        def __await__(self):
            yield

    def read_like_orbax(name: str, error: BaseException | None = None):
        async def read() -> None:
            try:
                await Pending()
            except BaseException as closed:
                raise (error or Exception(f"Encountered error while reading array index: {name}")) from closed

        read.__qualname__ = name
        return read

    def abandon(read) -> None:
        coroutine = read()
        coroutine.send(None)  # suspended inside the read, as a failed restore leaves the others
        del coroutine
        gc.collect()

    reports = []
    monkeypatch.setattr(sys, "unraisablehook", reports.append)
    abandon(read_like_orbax(checkpoint.ABANDONED_READ))
    assert len(reports) == 1 and isinstance(reports[0].exc_value.__cause__, GeneratorExit)  # what the hook is for
    reports.clear()
    checkpoint._quiet_abandoned_reads()
    checkpoint._quiet_abandoned_reads()  # idempotent: one hook in front of the recorder
    abandon(read_like_orbax(checkpoint.ABANDONED_READ))
    abandon(read_like_orbax("another_coroutine", RuntimeError("Event loop is closed")))
    assert reports == []
    abandon(read_like_orbax("another_coroutine"))
    abandon(read_like_orbax(checkpoint.ABANDONED_READ, ValueError("not a close")))
    assert [type(r.exc_value).__name__ for r in reports] == ["Exception", "ValueError"]

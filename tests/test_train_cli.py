"""The training program end to end: outputs, exact resume, preemption, crash safety, meshes, hosts, errors.

Each run is a real ``python -m nash_mhc.train`` subprocess on the ``tiny`` preset with a shared persistent
compilation cache, so most runs after the first skip compilation.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, cpu_env

from nash_mhc import ModelConfig, TrainConfig
from nash_mhc import train as train_module
from nash_mhc.evaluate import main as evaluate_main
from nash_mhc.train import main

SCHEDULE = ["--lr-schedule-steps", "40", "--warmup-steps", "4", "--learning-rate", "3e-3"]


def command(*args: str, cache: Path, model: str = "tiny") -> list[str]:
    return [sys.executable, "-m", "nash_mhc.train", "--model", model, "--no-progress", "--log-interval", "1",
            "--compile-cache-dir", str(cache), *args]



def train(*args: str, cache: Path, devices: int = 1, model: str = "tiny", expect: int = 0,
          timeout: int = 600, optimised: bool = False) -> subprocess.CompletedProcess:
    result = subprocess.run(command(*args, cache=cache, model=model), env=cpu_env(devices, optimised), cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == expect, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def steps_saved(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in run_dir.iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_readme_main_command_trains_writes_its_outputs_and_reaches_the_readme_perplexity(tmp_path, cache_dir,
                                                                                       capsys):
    """The README's main command; then its claim that ``evaluate`` reports a perplexity of about 10 (3.3 bits
    per byte) against about 180 untrained: checked as below 15 (under 4 bits per byte) and above 100."""
    run = tmp_path / "main"
    train("--use-small-model", "--total-steps", "100", "--batch-size", "8", "--checkpoint-dir", str(run),
          cache=cache_dir, model="small", optimised=True)  # 100 steps of `small`: compiled as users run it
    curve = losses(run)
    assert curve[1] - curve[100] >= 1.5, curve
    assert steps_saved(run) == [100]
    assert any(p.name.startswith("events.out.tfevents") for p in run.iterdir())
    resolved = json.loads((run / "config.json").read_text())
    assert resolved["model_config"]["d_model"] == 256 and "scan_unroll" not in resolved["model_config"]
    assert resolved["execution_config"] == {"kernels": "auto", "remat": "none", "remat_group": 1, "scan_unroll": 4,
                                            "loss_chunks": 1}  # small's defaults (nash_mhc.execution.DEFAULTS)
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("step", "loss", "ce_loss", "aux_loss", "learning_rate", "grad_norm", "tokens_per_second", "mfu",
                "step_time_s", "nash_residual", "nash_temperature"):
        assert key in record
    assert record["nash_residual"] <= 1e-5
    travel = {key.split("/", 1)[1]: value for key, value in record.items() if key.startswith("travel/")}
    assert set(travel) == {"aggregation_prior", "hc_alpha", "hc_bias", "hc_projection", "nash_temperature"}
    assert all(value > 0 for value in travel.values()), travel  # every coefficient group has left its start
    events = b"".join(p.read_bytes() for p in run.iterdir() if p.name.startswith("events.out.tfevents"))
    assert b"train/nash_residual" in events and b"train/nash_temperature" in events and b"travel/hc_alpha" in events
    reports = {}
    for extra in ([], ["--untrained"]):
        assert evaluate_main(["--checkpoint-dir", str(run), "--compile-cache-dir", str(cache_dir), *extra]) == 0
        reports[bool(extra)] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    trained, untrained = reports[False], reports[True]
    assert trained["perplexity"] < 15 and trained["bits_per_byte"] < 4.0, trained
    assert untrained["perplexity"] > 100, untrained


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, cache_dir) -> Path:
    """One uninterrupted 40-step run (shared by the resume, signal and --init-from tests)."""
    reference = tmp_path_factory.mktemp("reference")
    train("--total-steps", "40", "--checkpoint-dir", str(reference), *SCHEDULE, cache=cache_dir)
    assert sorted(losses(reference)) == list(range(1, 41))
    return reference


def stop_with(signum: int, run: Path, cache: Path) -> subprocess.CompletedProcess:
    """Start the 40-step run, send ``signum`` once it has logged a step, and wait for it to exit."""
    proc = subprocess.Popen(command("--total-steps", "40", "--checkpoint-dir", str(run), *SCHEDULE,
                                    "--checkpoint-interval", "1000", cache=cache),
                            env=cpu_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and losses(run)):
        time.sleep(0.05)
    proc.send_signal(signum)
    output, _ = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, output, "")


@pytest.mark.slow
def test_resume_is_bit_identical_after_sigterm(tmp_path, cache_dir, reference_run):
    """SIGTERM mid-run: exit 0 with a checkpoint; the restart logs the uninterrupted run's losses bit for bit. (A
    restart from a completed run's last checkpoint is the same restore: the sharded test below resumes one.)"""
    expected = losses(reference_run)
    signalled = tmp_path / "signalled"
    stopped_run = stop_with(signal.SIGTERM, signalled, cache_dir)
    assert stopped_run.returncode == 0, stopped_run.stdout[-3000:]
    (stop_step,) = steps_saved(signalled)
    assert 1 <= stop_step <= 40
    train("--total-steps", "40", "--checkpoint-dir", str(signalled), *SCHEDULE, cache=cache_dir)
    after = losses(signalled)
    assert all(after[s] == expected[s] for s in range(1, 41)), "resume after SIGTERM is not exact"


@pytest.mark.slow
def test_sigint_finishes_the_step_saves_it_and_exits_0(tmp_path, cache_dir, reference_run):
    """Ctrl-C: exit 0, a checkpoint at the last logged step, and that step's loss is the uninterrupted run's."""
    run = tmp_path / "interrupted"
    result = stop_with(signal.SIGINT, run, cache_dir)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "Traceback" not in result.stdout
    (saved,) = steps_saved(run)
    logged = losses(run)
    assert 1 <= saved < 40 and max(logged) == saved
    assert all(logged[s] == losses(reference_run)[s] for s in logged)


@pytest.mark.slow
def test_init_from_loads_the_weights_with_a_fresh_step_count(tmp_path, cache_dir, reference_run):
    """--init-from: steps count from 1 again, and the first loss is the trained model's (far below a fresh
    start's), not the initialisation's."""
    run = tmp_path / "warm"
    out = train("--total-steps", "2", "--checkpoint-dir", str(run), "--init-from", str(reference_run), *SCHEDULE,
                cache=cache_dir)
    assert f"initialised from {reference_run}" in out.stdout + out.stderr
    warm, trained = losses(run), losses(reference_run)
    assert sorted(warm) == [1, 2] and steps_saved(run) == [2]
    assert warm[1] < trained[1] - 1.0 and warm[1] < trained[40] + 0.5, (warm, trained[1], trained[40])


# The training program with Orbax's JSON writer blocked inside the asynchronous save of step BLOCKED_STEP: the
# state arrays of that step may be on disk (in Orbax's temporary directory), its metadata never is, and the
# save is never finalised. The child touches the marker file once it is blocked there.
BLOCKED_STEP = 6
BLOCK_INSIDE_SAVE = f"""
import pathlib, runpy, sys, time
import orbax.checkpoint as ocp
marker = pathlib.Path(sys.argv.pop(1))
original = ocp.JsonCheckpointHandler._save_fn
async def _save_fn(self, x, directory):
    if x.get("step") == {BLOCKED_STEP}:
        marker.touch()
        time.sleep(3600)
    return await original(self, x, directory)
ocp.JsonCheckpointHandler._save_fn = _save_fn
sys.argv[0] = "nash_mhc.train"
runpy.run_module("nash_mhc.train", run_name="__main__")
"""


@pytest.mark.slow
def test_kill_inside_a_save_resumes_from_the_last_complete_step_and_reproduces_the_losses(tmp_path, cache_dir,
                                                                                          reference_run):
    """kill -9 while the save of step 6 is blocked half-way: the restart resumes from step 5 (the last complete
    checkpoint) and logs the uninterrupted run's losses, bit for bit, for every step."""
    run, marker = tmp_path / "killed", tmp_path / "blocked"
    argv = command("--total-steps", "40", "--checkpoint-interval", "1", "--checkpoint-dir", str(run), *SCHEDULE,
                   cache=cache_dir)
    proc = subprocess.Popen([sys.executable, "-c", BLOCK_INSIDE_SAVE, str(marker), *argv[3:]], env=cpu_env(),
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and not marker.exists() and proc.poll() is None:
        time.sleep(0.02)
    assert marker.exists(), f"the run never reached the save of step {BLOCKED_STEP} (exit {proc.poll()})"
    proc.kill()  # SIGKILL inside the save
    proc.wait()
    assert not (run / str(BLOCKED_STEP) / "meta").exists()
    out = train("--total-steps", "40", "--checkpoint-dir", str(run), *SCHEDULE, cache=cache_dir)
    assert f"resuming from step {BLOCKED_STEP - 1}" in out.stdout + out.stderr
    after, expected = losses(run), losses(reference_run)
    assert sorted(after) == list(range(1, 41))
    assert all(after[s] == expected[s] for s in range(1, 41)), "the restart does not reproduce the losses"


@pytest.mark.slow
def test_a_second_ctrl_c_stops_a_run_hung_in_a_save_at_once(tmp_path, cache_dir):
    """The save of step 6 never finishes: the first SIGINT cannot end the run (it waits to save), the second
    ends it at once, as Ctrl-C without a handler would (killed by SIGINT)."""
    run, marker = tmp_path / "hung", tmp_path / "blocked"
    argv = command("--total-steps", "40", "--checkpoint-interval", "1", "--checkpoint-dir", str(run), *SCHEDULE,
                   cache=cache_dir)
    proc = subprocess.Popen([sys.executable, "-c", BLOCK_INSIDE_SAVE, str(marker), *argv[3:]], env=cpu_env(),
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not marker.exists() and proc.poll() is None:
            time.sleep(0.02)
        assert marker.exists(), f"the run never reached the save of step {BLOCKED_STEP} (exit {proc.poll()})"
        proc.send_signal(signal.SIGINT)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=5)  # still waiting for the hung save
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == -signal.SIGINT
        assert "send the signal again to stop at once" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_sharded_runs_match_one_device_and_resume_on_one_device(tmp_path, cache_dir, reference_run):
    """6 steps on (2,2,2) log the one-device run's losses (the reference run's first 6: same batches, same
    schedule); resumed from its last checkpoint on one device, steps 7-8 log the reference run's too."""
    sharded = tmp_path / "sharded"
    base = ["--total-steps", "6", "--batch-size", "8", "--checkpoint-interval", "3", *SCHEDULE]
    train(*base, "--checkpoint-dir", str(sharded), "--mesh-data", "2", "--mesh-fsdp", "2", "--mesh-tp", "2",
          cache=cache_dir, devices=8)
    one, eight = losses(reference_run), losses(sharded)
    for step in range(1, 7):
        assert abs(eight[step] - one[step]) <= 1e-4 * abs(one[step]), (step, eight[step], one[step])

    (sharded / "metrics.jsonl").unlink()
    out = train("--total-steps", "8", "--checkpoint-dir", str(sharded), *SCHEDULE, "--batch-size", "8",
                cache=cache_dir)  # one device
    assert "resuming from step 6" in out.stdout
    continued = losses(sharded)
    for step in (7, 8):
        assert abs(continued[step] - one[step]) <= 1e-4 * abs(one[step]), (step, continued[step], one[step])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_log_the_same_losses_once(tmp_path, cache_dir, reference_run):
    """Two processes of 4 devices each, one (2,2,2) mesh: the one-device losses (the reference run's first 4),
    logged once."""
    multi = tmp_path / "multi"
    base = ["--total-steps", "4", "--batch-size", "8", *SCHEDULE]
    port = free_port()
    procs = []
    for index in range(2):
        env = cpu_env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_PROCESS_COUNT="2",
                          JAX_PROCESS_INDEX=str(index))
        procs.append(subprocess.Popen(command(*base, "--checkpoint-dir", str(multi), "--mesh-data", "2",
                                              "--mesh-fsdp", "2", "--mesh-tp", "2", cache=cache_dir),
                                      env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    one, two = losses(reference_run), losses(multi)
    assert sorted(two) == [1, 2, 3, 4]  # one writer: every step logged exactly once
    assert len((multi / "metrics.jsonl").read_text().splitlines()) == 4
    for step in range(1, 5):
        assert abs(two[step] - one[step]) <= 1e-4 * abs(one[step])
    assert "devices: 8" in outputs[0] and "devices:" not in outputs[1]


# ------------------------------------------------------------------------------------- bad input → exit 2
def run_main(argv: list[str], capsys) -> tuple[int, str]:
    code = main(["--model", "tiny", "--no-progress", "--compile-cache-dir", "none", *argv])
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize("argv, message", [
    (["--mesh-data", "3"], "8"),  # 8 devices in the test process
    (["--seq-len", "30"], "divisible by the coarsest block"),
    (["--batch-size", "4"], "not divisible by data*fsdp = 8"),
    (["--dataset", "HuggingFaceTB/smollm-corpus", "--dataset-name", "cosmopedia-v2"], "offline"),
    (["--learning-rate", "-1"], "--learning-rate must be > 0"),
    (["--batch-size", "16", "--total-batch-tokens", "512"], "--total-batch-tokens 512 is not a multiple of"),
    (["--eval-steps", "0"], "--eval-steps must be a positive integer, got 0"),
    (["--lr-schedule-steps", "0"], "--lr-schedule-steps must be a positive integer, got 0"),
    (["--scale-prior", "1.5"], "--scale-prior must be scale0, uniform or a number in (0, 1)"),
    (["--scale-prior", "full"], "--scale-prior must be scale0, uniform or a number in (0, 1)"),
])
def test_bad_inputs_exit_2_with_one_line(tmp_path, capsys, argv, message):
    code, err = run_main([*argv, "--checkpoint-dir", str(tmp_path / "run")], capsys)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_unknown_preset_is_a_one_line_usage_error(tmp_path, cache_dir):
    result = subprocess.run([sys.executable, "-m", "nash_mhc.train", "--model", "huge", "--checkpoint-dir",
                             str(tmp_path / "x")], env=cpu_env(), cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2
    assert "unknown model preset 'huge'" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_corrupt_and_mismatched_checkpoints_exit_2_and_delete_nothing(tmp_path, capsys, reference_run):
    run = reference_run  # read, and copied; never changed
    before = sorted(str(p) for p in run.rglob("*"))
    code, err = run_main(["--num-streams", "2", "--checkpoint-dir", str(run), "--batch-size", "8"], capsys)
    assert code == 2 and "num_streams" in err and "Traceback" not in err
    assert sorted(str(p) for p in run.rglob("*")) == before

    corrupt = tmp_path / "corrupt"
    shutil.copytree(run, corrupt)
    for meta in corrupt.glob("*/meta/*"):
        meta.write_text("{not json")
    code, err = run_main(["--checkpoint-dir", str(tmp_path / "fresh"), "--resume-from", str(corrupt),
                          "--batch-size", "8"], capsys)
    assert code == 2 and "checkpoint" in err and len(err.strip().splitlines()) == 1
    code, err = run_main(["--resume-from", str(tmp_path / "missing"), "--batch-size", "8"], capsys)
    assert code == 2 and "does not exist" in err


# ----------------------------------------------------------------------------------- flags and settings
def flags(module: str) -> set[str]:
    parser = importlib.import_module(f"nash_mhc.{module}").build_parser()
    return {name for action in parser._actions for name in action.option_strings if name.startswith("--")}


@pytest.mark.parametrize("module", ["train", "generate", "evaluate", "export"])
def test_help_lists_every_flag_of_before(module):
    """tests/cli_flags.json holds every flag users have been given: none may go (the list only grows)."""
    recorded = set(json.loads((ROOT / "tests" / "cli_flags.json").read_text())[module])
    assert recorded - flags(module) == set()


@pytest.mark.parametrize("module", ["train", "generate", "evaluate", "data.prepare", "export"])
def test_every_flag_is_one_settings_field_with_its_default_only_there(module):
    """Each flag is generated from one dataclass field and defaults to "not given" (argparse.SUPPRESS), so
    the field's declaration is the only place its default is written; no field has two flags."""
    parser = importlib.import_module(f"nash_mhc.{module}").build_parser()
    actions = [a for a in parser._actions if a.dest != "help"]
    assert {a.dest for a in actions} == set(parser.owner)
    assert all(a.default is argparse.SUPPRESS for a in actions)
    fields = [(cls, field) for cls, field, _ in parser.owner.values()]
    assert len(fields) == len(set(fields))
    for cls, field, _ in parser.owner.values():
        assert dataclasses.fields(cls)[[f.name for f in dataclasses.fields(cls)].index(field)].metadata["help"]


def test_no_flags_gives_the_configs_defaults():
    from nash_mhc.data import DataConfig
    from nash_mhc.sharding import MeshConfig
    from nash_mhc.training.config import LoopConfig

    configs, cache = train_module.configs([])
    assert configs.model == ModelConfig.preset("small") and configs.train == TrainConfig()
    assert configs.data == DataConfig() and configs.mesh == MeshConfig() and configs.loop == LoopConfig()
    assert TrainConfig().lr_schedule_steps == TrainConfig().total_steps == 1000
    assert TrainConfig().warmup_steps == 100  # 10 % of the schedule
    assert cache.compile_cache_dir.endswith("xla")


def test_the_model_knobs_are_flags_that_default_to_the_preset():
    """--nash-iters, --nash-temperature, --sinkhorn-iters and --compression-ratio reach ModelConfig; not given, each
    keeps the preset's value (tiny's compression_ratio is 2, the field's default 4); bad values name the flag."""
    model = train_module.configs(["--model", "tiny", "--nash-iters", "4", "--nash-temperature", "0.5",
                                  "--sinkhorn-iters", "7", "--compression-ratio", "4"])[0].model
    assert model == ModelConfig.preset("tiny", nash_iters=4, nash_temperature=0.5, sinkhorn_iters=7,
                                       compression_ratio=4)
    assert train_module.configs(["--model", "tiny"])[0].model == ModelConfig.preset("tiny")
    for flag, value, message in (("--nash-iters", "0", "--nash-iters must be a positive integer, got 0"),
                                 ("--nash-temperature", "0", "--nash-temperature must be a finite number > 0"),
                                 ("--sinkhorn-iters", "0", "--sinkhorn-iters must be a positive integer, got 0"),
                                 ("--compression-ratio", "1", "--compression-ratio must be >= 2, got 1")):
        with pytest.raises(ValueError, match=message):
            train_module.configs(["--model", "tiny", flag, value])


def test_every_model_field_is_a_flag_or_named_library_only_in_the_usage_guide():
    """docs/usage.md's knob table lists only flags; every other ModelConfig field is in its "Library-only"
    paragraph."""
    readme = (ROOT / "docs" / "usage.md").read_text()
    table = readme[readme.index("| knob | values | meaning |"):]
    table = table[:table.index("\n\n")]
    knobs = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    library_only = readme[readme.index("Library-only ("):]
    library_only = set(re.findall(r"`(\w+)`", library_only[:library_only.index("\n\n")]))
    model_flags = {field for cls, field, _ in train_module.build_parser().owner.values() if cls is ModelConfig}
    assert len(knobs) >= 10 and set(knobs) <= model_flags
    assert {f.name for f in dataclasses.fields(ModelConfig)} - model_flags == library_only


def test_config_file_values_sit_under_the_flags(tmp_path):
    file = tmp_path / "run.json"
    file.write_text(json.dumps({"batch-size": 16, "no-progress": True, "mesh-tp": 2, "split": "train"}))
    configs, _ = train_module.configs(["--config", str(file), "--batch-size", "32", "--model", "tiny"])
    assert configs.train.batch_size == 32 and not configs.loop.progress and configs.mesh.tp == 2
    (tmp_path / "bad.toml").write_text('batch_sise = 3\n')
    with pytest.raises(SystemExit) as exit_:
        train_module.configs(["--config", str(tmp_path / "bad.toml")])
    assert exit_.value.code == 2


def test_large_presets_train_with_their_memory_settings_unless_flags_say_otherwise():
    """--model 1b and --model 3b default to remat full per layer and 8 loss chunks (docs/tpu.md, "Does it fit?");
    --remat/--remat-group override the pair, --loss-chunks alone; other presets keep no remat."""
    def memory(*argv: str) -> tuple[str, int, int]:
        execution = train_module.configs(list(argv))[0].execution
        return execution.remat, execution.remat_group, execution.loss_chunks

    assert memory("--model", "1b") == ("full", 1, 8)
    assert memory("--model", "3b") == ("full", 1, 8)
    assert memory("--model", "1b", "--remat", "none") == ("none", 1, 8)
    assert memory("--model", "3b", "--remat-group", "2") == ("none", 2, 8)
    assert memory("--model", "3b", "--loss-chunks", "2") == ("full", 1, 2)
    assert memory("--model", "3b", "--remat", "full", "--remat-group", "4") == ("full", 4, 8)
    assert memory("--model", "base") == ("none", 1, 1) == memory("--model", "tiny")
    with pytest.raises(ValueError, match="--loss-chunks 3 does not divide --seq-len 64"):
        memory("--model", "tiny", "--loss-chunks", "3")


def test_batch_size_is_the_microbatch_and_accumulation_multiplies_it():
    """--batch-size is the sequences of one forward/backward pass over all devices (nanoGPT's batch_size, MaxText's
    per-device batch times the devices); an update is --batch-size x accumulation sequences, the accumulation
    given (--grad-accum-steps) or derived (--total-batch-tokens / (batch-size x seq-len))."""
    tiny = ["--model", "tiny"]  # seq-len 64

    def batch(*argv: str) -> tuple[int, int, int]:
        train = train_module.configs([*tiny, *argv])[0].train
        return train.batch_size, train.grad_accum_steps, train.microbatch_size

    assert batch() == (8, 1, 8)
    assert batch("--batch-size", "16", "--grad-accum-steps", "4") == (64, 4, 16)
    assert batch("--batch-size", "16", "--total-batch-tokens", "4096") == (64, 4, 16)
    assert batch("--total-batch-tokens", "4096", "--grad-accum-steps", "8") == (64, 8, 8)  # agreeing is fine
    for argv in (["--total-batch-tokens", "1000"], ["--total-batch-tokens", "4096", "--grad-accum-steps", "2"]):
        with pytest.raises(ValueError, match="--total-batch-tokens"):
            train_module.configs([*tiny, *argv])

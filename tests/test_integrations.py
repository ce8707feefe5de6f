"""What users reach for around training: W&B logging, the profiler trace, fine-tuning on prompt/response data
with a masked loss, and the exported model.

One short in-process run (tiny preset, synthetic data, 8 fake devices) with ``WANDB_MODE=offline
--wandb-project p --profile-steps 3:5``, stopped at step 6 and resumed to 8, feeds the W&B, profiler, export
and fine-tuning tests.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT, suite_xla_flags

from nash_mhc import ModelConfig
from nash_mhc.data import ByteTokenizer, Corpus, make_datasets, masked_stream, open_source
from nash_mhc.evaluate import main as evaluate_main
from nash_mhc.train import main as train_main

TASKS = ROOT / "examples" / "sft" / "tasks.jsonl"
COMMON = ["--model", "tiny", "--batch-size", "8", "--no-progress", "--log-interval", "1", "--learning-rate", "3e-3",
          "--warmup-steps", "1", "--lr-schedule-steps", "8"]


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def run(tmp_path_factory, cache_dir) -> Path:
    """The directory of a W&B-offline, profiled run stopped at step 6 and resumed to 8."""
    run_dir = tmp_path_factory.mktemp("integrations") / "run"
    saved = os.environ.get("WANDB_MODE")
    os.environ["WANDB_MODE"] = "offline"
    try:
        for steps in ("6", "8"):
            code = train_main([*COMMON, "--dataset", "synthetic", "--total-steps", steps, "--checkpoint-dir",
                               str(run_dir), "--compile-cache-dir", str(cache_dir), "--wandb-project", "p",
                               "--wandb-tags", "test,offline", "--profile-steps", "3:5"])
            assert code == 0
    finally:
        import wandb

        wandb.teardown()  # W&B keeps its settings (offline) in a process-wide session until then
        if saved is None:
            os.environ.pop("WANDB_MODE", None)
        else:
            os.environ["WANDB_MODE"] = saved
    return run_dir


# ------------------------------------------------------------------------------------------------ W&B
def wandb_records(file: Path) -> list:
    """The records of a W&B run file (``run-<id>.wandb``): W&B's header, then the LevelDB log format (32 KiB
    blocks of ``crc32 length type`` chunks) around protobuf ``Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    data, records, pending, pos = file.read_bytes(), [], b"", 7
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # block padding
            pos += left
            continue
        pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.mark.slow
def test_wandb_offline_holds_the_loss_history_and_the_resume_continues_the_run(run):
    folders = sorted((run / "wandb").glob("offline-run-*"))
    assert len(folders) == 2  # the first run and the resumed one
    run_id = (run / "wandb_run_id").read_text().strip()
    history, scale_use = {}, []
    for folder in folders:
        records = wandb_records(next(folder.glob("run-*.wandb")))
        runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert [(r.run_id, r.project) for r in runs] == [(run_id, "p")]
        assert list(runs[0].tags) == ["test", "offline"]
        for record in records:
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                if "train/loss" in items:
                    history[items["_step"]] = items["train/loss"]
                    scale_use.append("scale_weight/layer1/2" in items and "train/scale_tv" in items)
    logged = losses(run)
    assert sorted(history) == list(range(1, 9))
    assert scale_use and all(scale_use)  # W&B gets the scale use of every logged step, as TensorBoard does
    assert all(abs(history[s] - logged[s]) <= 1e-6 * abs(logged[s]) for s in logged)


def test_wandb_errors_are_one_line_exit_2(tmp_path, capsys, monkeypatch):
    base = [*COMMON, "--dataset", "synthetic", "--total-steps", "2", "--compile-cache-dir", "none"]
    assert train_main([*base, "--wandb-entity", "me", "--checkpoint-dir", str(tmp_path / "a")]) == 2
    assert "--wandb-entity needs --wandb-project" in one_line_error(capsys)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a key
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    assert train_main([*base, "--wandb-project", "p", "--checkpoint-dir", str(tmp_path / "b")]) == 2
    assert "no W&B API key" in one_line_error(capsys)
    monkeypatch.setitem(sys.modules, "wandb", None)  # the package is not installed
    assert train_main([*base, "--wandb-project", "p", "--checkpoint-dir", str(tmp_path / "c")]) == 2
    assert "pip install 'nash-mhc[wandb]'" in one_line_error(capsys)
    assert not any((tmp_path / name).exists() for name in "abc")


def test_a_bad_wandb_project_or_run_id_file_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    """W&B refused 'a/b:c' only once config.json, metrics.jsonl, the events file and wandb_run_id were written,
    and an empty wandb_run_id with "Run ID cannot be empty", naming no file."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    base = [*COMMON, "--dataset", "synthetic", "--total-steps", "2", "--compile-cache-dir", "none"]
    assert train_main([*base, "--wandb-project", "a/b:c", "--checkpoint-dir", str(tmp_path / "a")]) == 2
    assert "--wandb-project 'a/b:c' is not a W&B project name (1 to 128 characters, none of / \\ # ? % :)" in \
        one_line_error(capsys)
    assert not (tmp_path / "a").exists()
    for held, message in [("\n", "is empty: write the id of the W&B run"), ("a/b", "holds 'a/b', not a W&B run id")]:
        (tmp_path / "b").mkdir(exist_ok=True)
        (tmp_path / "b" / "wandb_run_id").write_text(held)
        assert train_main([*base, "--wandb-project", "p", "--checkpoint-dir", str(tmp_path / "b")]) == 2
        assert f"error: {tmp_path / 'b' / 'wandb_run_id'} {message}" in one_line_error(capsys)
        assert [p.name for p in (tmp_path / "b").iterdir()] == ["wandb_run_id"]


# ------------------------------------------------------------------------------------------- profiler
@pytest.mark.slow
def test_profile_steps_leave_a_trace_under_the_checkpoint_dir(run):
    traces = list((run / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0  # one window: steps 3..5 of the first run


@pytest.mark.parametrize("value, message", [("5:3", "need 1 <= A <= B"), ("0:2", "need 1 <= A <= B"),
                                            ("a:b", "must be A:B")])
def test_bad_profile_steps_are_one_line_exit_2(tmp_path, capsys, value, message):
    assert train_main([*COMMON, "--profile-steps", value, "--checkpoint-dir", str(tmp_path / "x")]) == 2
    assert message in one_line_error(capsys)


def test_a_profile_window_outside_the_runs_steps_is_a_warning_naming_both(tmp_path):
    """--profile-steps 10:20 with --total-steps 5, or 3:5 in a run resumed from step 4, exited 0 with no trace
    and no word: each is a warning at the start of the run naming the window and the run's steps."""
    from nash_mhc.training.profiling import ProfileConfig, Profiler

    def profiler(window: str, start: int, total: int) -> Profiler:
        return Profiler(ProfileConfig(window), tmp_path, start, total)

    assert (profiler("3:5", 0, 8).window, profiler("3:5", 0, 8).note) == ((3, 5), None)
    assert profiler("3:5", 4, 8).window is None and profiler("3:5", 4, 8).note == (
        "warning: --profile-steps 3:5 starts before this run's steps 5 to 8; no trace is written")
    assert profiler("1:2", 4, 8).note == ("warning: --profile-steps 1:2 lies outside this run's steps 5 to 8; no "
                                          "trace is written")
    assert (profiler("6:10", 4, 8).window, profiler("6:10", 4, 8).note) == (
        (6, 8), "warning: --profile-steps 6:10 ends after this run's steps 5 to 8; the trace stops at step 8")


@pytest.mark.slow  # the run's set-up (peak probe, data, state): multi-second
def test_the_profile_window_warning_starts_the_runs_log(tmp_path, monkeypatch):
    from nash_mhc.training import loop

    summaries = []

    def train(session, step_fn) -> int:  # the loop's start: its summary, then nothing trained
        summaries.append(session.summary)
        session.logger.close()
        session.checkpointer.close()
        session.lock.release()
        return 0

    monkeypatch.setattr(loop, "train", train)
    assert train_main([*COMMON, "--dataset", "synthetic", "--total-steps", "5", "--profile-steps", "10:20",
                       "--compile-cache-dir", "none", "--checkpoint-dir", str(tmp_path / "run")]) == 0
    assert summaries[0][-1] == ("warning: --profile-steps 10:20 lies outside this run's steps 1 to 5; no trace is "
                                "written")


# ----------------------------------------------------------------------------------------- fine-tuning
def test_prompt_response_pairs_pack_with_the_exact_mask():
    """Each example is prompt + response + EOS, masked 1 on the response and EOS only; windows keep the mask."""
    eos = ByteTokenizer.eos_id
    pairs = [("ab", "cd"), ("e", "fgh"), ("ij", "k")]
    ids, mask = masked_stream(Corpus("pairs", "train", lambda: pairs), ByteTokenizer())
    expected_ids, expected_mask = [], []
    for prompt, response in pairs:
        expected_ids += [*prompt.encode(), *response.encode(), eos]
        expected_mask += [0] * len(prompt) + [1] * (len(response) + 1)
    assert ids.tolist() == expected_ids and mask.tolist() == expected_mask

    from nash_mhc.data import PackedDataset

    data = PackedDataset(ids, 3, loss_mask=mask, shuffle=False)  # windows of 4 tokens
    batch, weights = data.batch_at(0, global_batch=3), data.mask_at(0, global_batch=3)
    stream = np.array(expected_mask[:12]).reshape(3, 4)
    np.testing.assert_array_equal(batch, np.array(expected_ids[:12]).reshape(3, 4))
    np.testing.assert_array_equal(weights, stream[:, 1:])  # the weight of each target


def test_jsonl_parquet_and_datasets_records_give_the_same_pairs(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [json.loads(line) for line in TASKS.read_text().splitlines()]
    pq.write_table(pa.table({"q": [r["prompt"] for r in records], "a": [r["response"] for r in records]}),
                   tmp_path / "tasks.parquet")
    datasets.Dataset.from_dict({"q": [r["prompt"] for r in records], "a": [r["response"] for r in records]}
                               ).save_to_disk(str(tmp_path / "saved"))
    pairs = [(r["prompt"], r["response"]) for r in records]
    for path, fields in ((TASKS, ("prompt", "response")), (tmp_path / "tasks.parquet", ("q", "a")),
                         (tmp_path / "saved", ("q", "a"))):
        train, held = (list(open_source(str(path), part, text_field=fields).documents()) for part in ("train", "eval"))
        assert held and sorted(train + held) == sorted(pairs), path
        remaining = iter(pairs)  # train keeps the records' order, without the held-out ones
        assert all(any(pair == other for other in remaining) for pair in train), path


def sft_batch() -> tuple[np.ndarray, np.ndarray]:
    train, _, _ = make_datasets(str(TASKS), "bytes", 64, 0, prompt_field="prompt", response_field="response")
    return train.batch_at(0, global_batch=8), train.mask_at(0, global_batch=8)


@pytest.mark.slow  # two value-and-grad compiles
def test_masked_positions_contribute_nothing_to_the_loss_or_the_gradient():
    """Targets under mask 0 (prompt tokens) changed at random: the same loss and gradient, bit for bit; a target
    under mask 1 changed: another loss. The loss is the float64 masked mean NLL of the model's logits."""
    from nash_mhc import LanguageModel, make_mesh
    from nash_mhc.training.step import forward_terms

    tokens, mask = sft_batch()
    assert 0 < mask.mean() < 0.5  # prompts are longer than the answers
    model = LanguageModel(ModelConfig.preset("tiny", vocab_size=ByteTokenizer.vocab_size), key=jax.random.key(0))
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    @eqx.filter_jit
    def loss_and_grad(model, targets):
        def loss(model):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                ce_sum, count, aux_sum, _ = forward_terms(model, jnp.asarray(inputs), targets, jnp.asarray(mask),
                                                          mesh)
            return ce_sum / count + 0.01 * aux_sum
        return eqx.filter_value_and_grad(loss)(model)

    rng = np.random.default_rng(0)
    changed = np.where(mask > 0, targets, rng.integers(0, 256, targets.shape))
    assert (changed != targets).sum() > 100
    with jax.set_mesh(mesh):
        (loss, grad), (loss2, grad2) = loss_and_grad(model, targets), loss_and_grad(model, changed)
        first = np.argwhere(mask > 0)[0]
        unmasked = targets.copy()
        unmasked[tuple(first)] = (unmasked[tuple(first)] + 1) % 256
        loss3, _ = loss_and_grad(model, unmasked)
    assert float(loss) == float(loss2) and float(loss3) != float(loss)
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(grad2), strict=True):
        np.testing.assert_array_equal(a, b)
    logits = np.asarray(model(jnp.asarray(inputs)).logits, np.float64)[..., :ByteTokenizer.vocab_size]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    with jax.set_mesh(mesh), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        ce_sum, count, _, _ = forward_terms(model, jnp.asarray(inputs), jnp.asarray(targets), jnp.asarray(mask), mesh)
    assert float(count) == mask.sum()
    np.testing.assert_allclose(float(ce_sum) / float(count), (nll * mask).sum() / mask.sum(), rtol=1e-5)


@pytest.mark.slow
def test_fine_tuning_from_a_run_trains_on_the_responses_and_evaluate_reports_the_masked_loss(run, tmp_path,
                                                                                             capsys, cache_dir):
    sft = tmp_path / "sft"
    code = train_main([*COMMON, "--dataset", str(TASKS), "--prompt-field", "prompt", "--response-field", "response",
                       "--init-from", str(run), "--total-steps", "3", "--checkpoint-dir", str(sft),
                       "--compile-cache-dir", str(cache_dir)])
    assert code == 0 and sorted(losses(sft)) == [1, 2, 3]
    assert json.loads((sft / "config.json").read_text())["data_config"]["prompt_field"] == "prompt"
    assert evaluate_main(["--checkpoint-dir", str(sft), "--num-batches", "0", "--batch-size", "2",
                          "--compile-cache-dir", "none"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    _, held_out, _ = make_datasets(str(TASKS), "bytes", 64, 0, prompt_field="prompt", response_field="response")
    expected = sum(held_out.mask_at(i, global_batch=2).sum() for i in range(report["batches"]))
    assert report["tokens"] == expected < report["batches"] * 2 * 64  # the responses' tokens only
    assert report["bytes"] < report["tokens"]  # EOS is counted as a token, not a byte
    # plain text (another --dataset) counts every position
    assert evaluate_main(["--checkpoint-dir", str(sft), "--num-batches", "3", "--batch-size", "2",
                          "--compile-cache-dir", "none", "--dataset", "synthetic"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] == 3 * 2 * 64


def test_prompt_fields_errors_are_one_line_exit_2(tmp_path, capsys):
    for argv, message in ((["--dataset", str(TASKS), "--prompt-field", "prompt"], "give both --prompt-field and"),
                          (["--dataset", "synthetic", "--prompt-field", "p", "--response-field", "r"],
                           "has no prompt/response records"),
                          (["--dataset", str(TASKS), "--prompt-field", "question", "--response-field", "response"],
                           "field 'question' not found"),
                          (["--dataset", str(TASKS), "--prompt-field", "prompt", "--response-field", "prompt"],
                           "--prompt-field and --response-field must name two different fields, got 'prompt'")):
        assert train_main([*COMMON, *argv, "--checkpoint-dir", str(tmp_path / "x")]) == 2
        assert message in one_line_error(capsys)


# ----------------------------------------------------------------------------------------------- export
def test_export_help_shows_the_whole_description():
    """The description is the docstring's whole first paragraph (two lines for export), not its first line."""
    from nash_mhc.export import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "a trained model as ``model.safetensors`` + ``config.json`` (+ its tokenizer), readable without the " \
           "training stack by ``nash_mhc.load_exported(DIR)``." in text


@pytest.mark.slow
def test_export_then_load_gives_the_checkpoints_logits_without_the_training_stack(run, tmp_path, capsys):
    from nash_mhc.export import main as export_main
    from nash_mhc.inference import load_model

    out = tmp_path / "export"
    assert export_main(["--checkpoint-dir", str(run), "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 8
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (2, 64), 0, 256), np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    checkpoint = np.asarray(load_model(str(run)).model(jnp.asarray(tokens)).logits)
    # A fresh interpreter that loads only the export: same logits, and Orbax never imported.
    script = ("import sys, numpy as np, jax.numpy as jnp, nash_mhc; m = nash_mhc.load_exported(sys.argv[1]); "
              "np.save(sys.argv[2], np.asarray(m(jnp.asarray(np.load(sys.argv[3]))).logits)); "
              "assert not [k for k in sys.modules if k.startswith('orbax')], 'orbax imported'")
    env = {**os.environ, "XLA_FLAGS": suite_xla_flags()}  # compiled as in this process: the same bits
    subprocess.run([sys.executable, "-c", script, str(out), str(tmp_path / "logits.npy"), str(tmp_path / "tokens.npy")],
                   check=True, env={**env, "JAX_PLATFORMS": "cpu"}, cwd=ROOT, timeout=300)
    np.testing.assert_array_equal(np.load(tmp_path / "logits.npy"), checkpoint)

    reports = []
    for directory in (run, out):  # evaluate reads either, with the same numbers
        assert evaluate_main(["--checkpoint-dir", str(directory), "--num-batches", "2", "--compile-cache-dir",
                              "none"]) == 0
        reports.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert reports[0] == reports[1]

    assert export_main(["--checkpoint-dir", str(run), "--out", str(out)]) == 2
    assert "already exists" in one_line_error(capsys)
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    (other / "config.json").write_text(json.dumps({"format": "some-other-model", "model_config": {}}))
    assert evaluate_main(["--checkpoint-dir", str(other), "--compile-cache-dir", "none"]) == 2
    assert "is not a nash_mhc export" in one_line_error(capsys)
    (other / "config.json").write_text(json.dumps({**json.loads((out / "config.json").read_text()),
                                                   "model_format": 1}))
    assert evaluate_main(["--checkpoint-dir", str(other), "--compile-cache-dir", "none"]) == 2
    assert "model format 1" in one_line_error(capsys)


@pytest.mark.slow
def test_generate_accepts_the_export_folder(run, tmp_path, capsys):
    from nash_mhc.export import main as export_main
    from nash_mhc.generate import main as generate_main

    out = tmp_path / "export"
    assert export_main(["--checkpoint-dir", str(run), "--out", str(out)]) == 0
    capsys.readouterr()
    texts = []
    for directory in (run, out):
        assert generate_main(["--checkpoint-dir", str(directory), "--prompt", "Ab", "--max-new-tokens", "16",
                              "--temperature", "0", "--compile-cache-dir", "none"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("Ab")

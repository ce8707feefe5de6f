"""Train → generate → evaluate end to end, and ``python -m nash_mhc.evaluate``'s numbers and errors.

One short real training run (``python -m nash_mhc.train`` on the tiny preset and the offline stdlib corpus,
a scaled-down stand-in for the README's main command) feeds every test of this file.
"""

from __future__ import annotations

import json
import math
import string
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, cpu_env

from nash_mhc.data import ByteTokenizer, HFTokenizer, PackedDataset, count_bytes
from nash_mhc.evaluate import main as evaluate_main
from nash_mhc.training.evaluation import batch_range

STEPS = 80



def python_m(module: str, *args: str, expect: int = 0) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", module, *args], env=cpu_env(), cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == expect, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    return result


@pytest.fixture(scope="module")
def run(tmp_path_factory, cache_dir) -> Path:
    """The run directory of a tiny model trained for a few dozen steps on the stdlib."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    python_m("nash_mhc.train", "--model", "tiny", "--total-steps", str(STEPS), "--batch-size", "8",
             "--learning-rate", "3e-3", "--warmup-steps", "5", "--eval-interval", str(STEPS), "--eval-steps", "2",
             "--checkpoint-dir", str(run_dir), "--compile-cache-dir", str(cache_dir), "--no-progress")
    return run_dir


def evaluate(capsys, run_dir: Path, *args: str) -> dict:
    code = evaluate_main(["--checkpoint-dir", str(run_dir), "--num-batches", "4", "--compile-cache-dir", "none",
                          *args])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out.strip().splitlines()[-1])


@pytest.mark.slow
def test_training_logs_the_numbers_evaluate_reports(capsys, run):
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (logged,) = [r for r in records if "eval_loss" in r]
    assert logged["step"] == STEPS
    # The training program's eval (2 batches of 8) is the first 2 batches of `evaluate`'s held-out windows.
    record = evaluate(capsys, run, "--num-batches", "2")
    # Byte tokenizer: every predicted token but EOS is one byte, so tokens >= bytes, and bpb is loss / ln 2 times
    # tokens / bytes (to float64 rounding: these windows predict no EOS, and the ratio, exactly 1, came out
    # 0.9999999999999999 on a 2-core Xeon VM, 2026-11-29).
    assert record["bytes"] <= record["tokens"] < 1.05 * record["bytes"], record
    ratio = logged["eval_bpb"] * math.log(2) / logged["eval_loss"]
    assert ratio == pytest.approx(record["tokens"] / record["bytes"], rel=1e-12), (logged, record)
    assert math.isclose(record["loss"], logged["eval_loss"], rel_tol=1e-5)
    assert math.isclose(record["perplexity"], logged["eval_ppl"], rel_tol=1e-4)
    assert math.isclose(record["bits_per_byte"], logged["eval_bpb"], rel_tol=1e-5)


@pytest.mark.slow
def test_every_log_and_evaluate_show_how_much_each_scale_carries(capsys, run):
    """Every logged step of metrics.jsonl and TensorBoard, and evaluate's JSON line, carry each scale's mean
    weight and prior per layer and averaged over layers, and the weights' distance from the prior
    (nash_mhc.training.scale_use; their float64 reference: tests/test_scale_use.py); each layer's shares add
    up to 1."""
    layers, scales = range(2), range(3)  # the tiny preset
    names = {"scale_tv", *(f"scale_tv/layer{i}" for i in layers)} | {
        f"scale_{kind}/{where}{level}" for kind in ("weight", "prior") for level in scales
        for where in ("", *(f"layer{i}/" for i in layers))}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert len(train) >= 2
    record = evaluate(capsys, run)
    for shown in (*train, record):
        assert {k for k in shown if k.startswith("scale_")} == names, shown
        for kind in ("weight", "prior"):
            for i in layers:
                assert sum(shown[f"scale_{kind}/layer{i}/{level}"] for level in scales) == pytest.approx(1, abs=1e-5)
        assert 0 <= shown["scale_tv"] <= 1
    events = b"".join(p.read_bytes() for p in run.iterdir() if p.name.startswith("events.out.tfevents"))
    assert b"scale_weight/layer1/2" in events and b"scale_prior/0" in events and b"train/scale_tv" in events


@pytest.mark.slow
def test_trained_model_beats_its_initialisation(capsys, run):
    trained = evaluate(capsys, run)
    untrained = evaluate(capsys, run, "--untrained")
    for record in (trained, untrained):
        assert set(record) >= {"loss", "perplexity", "bits_per_byte", "tokens", "bytes", "step"}
        assert record["tokens"] == 4 * 8 * 64 and record["dataset"] == "stdlib" and record["split"] == "eval"
        assert math.isclose(record["perplexity"], math.exp(record["loss"]), rel_tol=1e-9)
        nats = record["loss"] * record["tokens"]
        assert math.isclose(record["bits_per_byte"], nats / math.log(2) / record["bytes"], rel_tol=1e-9)
    assert trained["step"] == STEPS and untrained["step"] == 0
    assert untrained["perplexity"] > 100  # about the 259-way uniform guess
    assert trained["perplexity"] < 0.3 * untrained["perplexity"], (trained, untrained)


@pytest.mark.slow
def test_generate_continues_def_with_python_looking_text(run, cache_dir):
    result = python_m("nash_mhc.generate", "--checkpoint-dir", str(run), "--prompt", "def ", "--temperature",
                      "0.8", "--seed", "0", "--ignore-eos", "--compile-cache-dir", str(cache_dir))
    text = result.stdout
    assert text.startswith("def ")
    continuation = text[len("def "):]
    assert len(continuation) >= 40, repr(text)
    printable = sum(ch in string.printable for ch in continuation) / len(continuation)
    assert printable >= 0.95, repr(text)
    assert len(set(continuation) & set("()[]:=._,'\"#")) >= 2, repr(text)
    assert any(ch.isalpha() for ch in continuation), repr(text)


@pytest.mark.slow
def test_first_batch_reads_the_next_batches_and_window_seed_fixes_their_order(capsys, run):
    whole = evaluate(capsys, run, "--num-batches", "4")
    first = evaluate(capsys, run, "--num-batches", "2")
    rest = evaluate(capsys, run, "--num-batches", "2", "--first-batch", "2")
    assert (first["first_batch"], rest["first_batch"], rest["batches"]) == (0, 2, 2)
    # batches [0, 4) are batches [0, 2) and [2, 4): token-weighted nats and bytes add up
    assert rest["tokens"] + first["tokens"] == whole["tokens"] and rest["bytes"] + first["bytes"] == whole["bytes"]
    nats = [r["loss"] * r["tokens"] for r in (whole, first, rest)]
    assert math.isclose(nats[0], nats[1] + nats[2], rel_tol=1e-6)
    assert rest["loss"] != first["loss"]  # other windows
    assert evaluate(capsys, run, "--window-seed", "0")["window_seed"] == 0
    other = evaluate(capsys, run, "--window-seed", "5")
    assert other["window_seed"] == 5 and other["loss"] != evaluate(capsys, run, "--window-seed", "0")["loss"]


@pytest.mark.parametrize("argv, message", [
    (("--first-batch", "100000"), "past the held-out pass"),
    (("--first-batch", "-1"), "--first-batch"),
    (("--checkpoint-dir", "/nonexistent/run"), "does not exist"),
    (("--batch-size", "0"), "--batch-size"),
    (("--num-batches", "-1"), "--num-batches"),
    (("--dataset", "no-such-corpus"), "no-such-corpus"),
    (("--step", "3"), "no checkpoint at step 3"),
    (("--split", "test"), "invalid choice"),
])
@pytest.mark.slow
def test_evaluate_bad_input_exits_2_with_one_line(capsys, run, argv, message):
    if "--checkpoint-dir" not in argv:
        argv = ("--checkpoint-dir", str(run), *argv)
    try:
        code = evaluate_main([*argv, "--compile-cache-dir", "none"])
        err = capsys.readouterr().err
    except SystemExit as exit_:  # argparse errors
        code, err = exit_.code, capsys.readouterr().err
    assert code == 2
    assert err.startswith("error:") and err.count("\n") == 1 and message in err, err


def test_cli_errors_are_one_line_without_traceback_in_a_real_process(tmp_path):
    result = python_m("nash_mhc.generate", "--checkpoint-dir", str(tmp_path), "--prompt", "x", expect=2)
    assert result.stderr.startswith("error: no complete checkpoint") and result.stderr.count("\n") == 1


def test_selection_and_report_batches_hold_disjoint_windows():
    """The ablation's two held-out splits, batches [0, N_sel) and [N_sel, N_sel + N_rep) of one pass, are
    disjoint sets of windows that together are the pass's first (N_sel + N_rep) x B windows; a range is cut at
    the end of the pass, never wrapped into the next one, and a first batch past it is an error."""
    data = PackedDataset(np.arange(1000 * 9, dtype=np.int32), 8, seed=3)  # 1000 windows of 9 tokens
    batch, selection, report = 8, 16, 32
    windows = [{int(w) for i in batch_range(data.num_windows, batch, first, count)
                for w in data.window_indices(i, global_batch=batch)}
               for first, count in ((0, selection), (selection, report))]
    assert not windows[0] & windows[1]
    assert len(windows[0]) == selection * batch and len(windows[1]) == report * batch
    assert windows[0] | windows[1] == set(data.permutation(0)[:(selection + report) * batch].tolist())
    assert batch_range(1000, 8, 120, 32) == range(120, 125)  # 125 batches in the pass: cut, not wrapped
    assert batch_range(1000, 8, 0, 0) == range(0, 125)
    with pytest.raises(ValueError, match="first batch 125 is past the held-out pass: it has 125 batches"):
        batch_range(1000, 8, 125, 1)


def test_bytes_are_counted_independently_of_the_tokenizer():
    tokenizer = ByteTokenizer()
    ids = np.array([[ord("a"), 0xC3, 0xA9, tokenizer.eos_id], [tokenizer.bos_id, 32, 33, tokenizer.pad_id]])
    assert count_bytes(tokenizer, ids) == 5

    from tokenizers import Tokenizer, models

    # A word-level tokenizer (no byte-level ids): bytes come from the decoded text, "héllo héllo héllo" per row.
    words = HFTokenizer(Tokenizer(models.WordLevel({"héllo": 0, "[UNK]": 1}, unk_token="[UNK]")), name="words")
    assert count_bytes(words, np.zeros((2, 3), np.int32)) == 2 * len("héllo héllo héllo".encode())


@pytest.mark.parametrize("split, hint", [("eval", "use --split train or a larger --dataset"),
                                         ("train", "use a larger --dataset")])
def test_a_dataset_too_small_for_the_models_context_names_only_evaluates_flags(tmp_path, capsys, split, hint):
    """evaluate has no --seq-len (the context length is the model's): its hint names --split and --dataset."""
    import jax

    from nash_mhc import LanguageModel, ModelConfig
    from nash_mhc.exported import export_model

    model = LanguageModel(ModelConfig.preset("tiny", vocab_size=ByteTokenizer.vocab_size), key=jax.random.key(0))
    export_model(model, ByteTokenizer(), tmp_path / "export")
    (tmp_path / "small.txt").write_text("a few words of text\n" * 3)
    code = evaluate_main(["--checkpoint-dir", str(tmp_path / "export"), "--dataset", str(tmp_path / "small.txt"),
                          "--split", split, "--compile-cache-dir", "none"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "cannot fill one window" in err, err
    assert err.rstrip().endswith(hint) and "--seq-len" not in err

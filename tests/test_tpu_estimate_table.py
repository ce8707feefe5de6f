"""benchmarks/tpu_estimate.py's table: each row from the run's own label, or else the first earlier label that
has it, named in the "run" column; the ratio to plain + full whichever run each came from."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from host import compiling_host  # noqa: E402
from tpu_estimate import key, table  # noqa: E402


def result(variant: str, label: str, seconds: float) -> dict:
    return {"preset": "3b", "slice": "v6e-8", "variant": variant, "per_chip": 8, "label": label, "seq_len": 4096,
            "seconds": seconds, "fits": True, "tokens_per_second_per_chip": 8 * 4096 / seconds, "mfu": 0.2,
            "hbm_bytes": 2**40, "kernel_cycles": 1, "cycles": 4, "compile_seconds": 120.0}


def test_rows_come_from_the_runs_label_first_then_the_earlier_ones_in_order():
    rows = [result("plain+full", "old", 1.0), result("mhc+full", "older", 1.25), result("mhc+full", "old", 1.2),
            result("mhc+multiscale+nash", "old", 2.0), result("mhc+multiscale+nash", "new", 1.8)]
    results = {key(r["preset"], r["slice"], r["variant"], r["per_chip"], r["label"]): r for r in rows}
    lines, missing = table(results, ["3b"], ["v6e-8"], ["plain+full", "mhc+full", "mhc+multiscale+nash"],
                           {("3b", "v6e-8"): 8}, ["new", "old", "older"])
    body = {line.split(" | ")[3]: line for line in lines[2:]}
    assert body["plain+full"].endswith("| `old` |") and "| 1,000 ms |" in body["plain+full"]
    assert body["mhc+full"].endswith("| `old` |") and "| 1.20 |" in body["mhc+full"]
    assert body["mhc+multiscale+nash"].endswith("| `new` |") and "| 1.80 |" in body["mhc+multiscale+nash"]
    assert missing == []
    only_new, missing = table(results, ["3b"], ["v6e-8"], ["plain+full", "mhc+multiscale+nash"],
                              {("3b", "v6e-8"): 8}, ["new"])
    assert len(only_new) == 3 and missing == ["3b plain+full on v6e-8"]
    assert only_new[2].endswith("| `new` |") and "| 1,800 ms |" in only_new[2]


def test_each_ratio_is_to_plain_full_at_the_rows_own_remat_group():
    """A row at another remat group than the table's plain + full row (an earlier run's) is compared with the
    plain + full compile at its own group; the group and the memory per chip are columns of their own."""
    def at(variant: str, label: str, seconds: float, group: int) -> dict:
        return {**result(variant, label, seconds), "total_bytes": 3 * 2**30 * group,
                "flags": f"--model 3b --remat full --remat-group {group} --loss-chunks 8"}

    rows = [at("plain+full", "new", 1.0, 1), at("plain+full", "old", 1.25, 4), at("mhc+full", "old", 1.5, 4),
            at("mhc+multiscale+nash", "new", 1.3, 1)]
    results = {key(r["preset"], r["slice"], r["variant"], r["per_chip"], r["label"]): r for r in rows}
    lines, missing = table(results, ["3b"], ["v6e-8"], ["plain+full", "mhc+full", "mhc+multiscale+nash"],
                           {("3b", "v6e-8"): 8}, ["new", "old"])
    body = {line.split(" | ")[3]: line.split(" | ") for line in lines[2:]}
    header = lines[0].split(" | ")
    group, memory, ratio = header.index("remat group"), header.index("memory per chip"), header.index(
        "step time ÷ plain+full")
    assert [body[v][group] for v in ("plain+full", "mhc+full", "mhc+multiscale+nash")] == ["1", "4", "1"]
    assert [body[v][memory] for v in ("plain+full", "mhc+full", "mhc+multiscale+nash")] == [
        "3.0 GiB", "12.0 GiB", "3.0 GiB"]
    assert body["mhc+full"][ratio] == "1.20" and body["mhc+multiscale+nash"][ratio] == "1.30"
    assert missing == []


@pytest.mark.parametrize("script", ["tpu_estimate", "fit_table"])
def test_a_table_only_rewrite_keeps_the_machine_the_table_names(tmp_path, script):
    """``--table-only`` compiles nothing, so the machine the rows were compiled on stays in the doc; a run that
    compiles names its own. Both compile tables (the estimate table and the fit table) write it so."""
    module = importlib.import_module(script)
    write = ((lambda doc, compiled: module.write_doc(doc, [], [], "cmd", compiled, ["x"])) if script == "tpu_estimate"
             else (lambda doc, compiled: module.write_doc(doc, [], [], "cmd", compiled)))
    doc, elsewhere = tmp_path / "tpu.md", "a shared 2-core VM (Elsewhere CPU 9999), CPU only"  # not this host's
    assert elsewhere != compiling_host()
    doc.write_text(f"intro\n{module.START}\n\non {elsewhere} (no TPU: old text\n{module.END}\nrest\n")
    write(doc, False)
    assert f"\non {elsewhere} (no TPU: libtpu's" in doc.read_text()
    write(doc, True)
    text = doc.read_text()
    assert f"\non {compiling_host()} (no TPU: " in text and "Elsewhere CPU" not in text
    assert text.startswith("intro\n") and text.endswith(f"{module.END}\nrest\n")


@pytest.mark.parametrize(("script", "doc"), [("tpu_estimate", "docs/results/tpu_estimate/README.md"),
                                             ("fit_table", "docs/tpu.md")])
def test_each_table_is_written_into_its_page(script, doc):
    """docs/ teaches, docs/results/ records: the estimate table lives in the estimate study's record, the fit table
    (a result users need) in the TPU guide; each script's default --doc has the markers it writes between."""
    module = importlib.import_module(script)
    root = Path(__file__).resolve().parent.parent
    assert root / doc == module.DOC
    text = module.DOC.read_text()
    assert text.count(module.START) == 1 and text.count(module.END) == 1
    assert text.index(module.START) < text.index(module.END)
    assert "tpu-estimate start" not in (root / "docs" / "tpu.md").read_text()


def test_the_band_has_a_column_of_its_own_and_older_rows_say_they_predate_it():
    banded = {**result("plain+full", "new", 1.0), "slow_seconds": 1.25}
    older = result("mhc+full", "old", 1.2)  # compiled before the band: no slow_seconds
    results = {key(r["preset"], r["slice"], r["variant"], r["per_chip"], r["label"]): r for r in (banded, older)}
    lines, _ = table(results, ["3b"], ["v6e-8"], ["plain+full", "mhc+full"], {("3b", "v6e-8"): 8}, ["new", "old"])
    header = lines[0].split(" | ")
    slow = header.index("kernels at 60 %")
    assert header[slow - 1] == "est. step time"
    body = {line.split(" | ")[3]: line.split(" | ") for line in lines[2:]}
    assert body["plain+full"][slow] == "1,250 ms" and body["mhc+full"][slow] == "predates the band"
    assert all(len(line.split(" | ")) == len(header) for line in lines)

"""The package's layout: every import inside ``nash_mhc`` points down (no module reaches itself again through
its imports, lazy function-level imports included)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers import ROOT


def modules() -> dict[str, Path]:
    """``{dotted name: file}`` of every module of the package (a package is its ``__init__.py``)."""
    out = {}
    for path in sorted((ROOT / "nash_mhc").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """``{module: the package modules it imports}``; ``from X import y`` counts as importing ``X.y`` when that is
    a module, else ``X``."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
        graph[name] = {t for t in targets if t in known and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_cycles_and_only_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_absolute_relative_and_lazy_imports():
    graph = import_graph()
    assert "nash_mhc.data.windows" in graph["nash_mhc.data.prepared"]  # from nash_mhc.data.windows import ...
    assert "nash_mhc.training.loop" in graph["nash_mhc.train"]  # a function-level import
    assert "nash_mhc.data.sources.arrow" in graph["nash_mhc.data.sources"]  # from package import submodule


def test_no_layer_module_imports_the_kernels():
    """The layers call the ops; the ops choose between their XLA form and a kernel (nash_mhc.kernels.tpu)."""
    graph = import_graph()
    layers = [name for name in graph if name.startswith("nash_mhc.layers")]
    assert len(layers) >= 5 and any(t.startswith("nash_mhc.kernels.tpu") for t in graph["nash_mhc.ops.attention"])
    reach = {name: sorted(t for t in graph[name] if t.startswith("nash_mhc.kernels")) for name in layers}
    assert not any(reach.values()), reach


DISPATCH = ("platform_dependent", "platform_vjp", "tpu_kernels", "pallas_call")  # ops.dispatch's choosing functions


def dispatch_uses(path: Path, names: tuple[str, ...] = DISPATCH) -> list[str]:
    """``line: what`` of every use of ``names`` in ``path``'s code (an import, a name or an attribute, called or
    passed on), of every import of Pallas, and of every function with a ``*_ref`` parameter (a kernel body)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        used = []
        if isinstance(node, ast.ImportFrom | ast.Import):
            module = f"{node.module}." if isinstance(node, ast.ImportFrom) else ""
            used = [a.name for a in node.names if a.name in names]
            used += [f"import {module}{a.name}" for a in node.names
                     if f"{module}{a.name}".startswith("jax.experimental.pallas")]
        elif isinstance(node, ast.Name | ast.Attribute):
            used = [name] if (name := getattr(node, "id", getattr(node, "attr", None))) in names else []
        elif isinstance(node, ast.FunctionDef):
            used = [f"{node.name}({a.arg})" for a in node.args.args if a.arg.endswith("_ref")]
        found += [f"{node.lineno}: {what}" for what in used]
    return found


def test_the_layers_call_ops_and_only_dispatch_calls_pallas_in_the_ops():
    """A layer calls ops functions, never the choice between an op's forms itself (``platform_dependent`` and the
    rest of :data:`DISPATCH`); in nash_mhc/ops only dispatch.py calls ``pallas_call`` or imports Pallas, and no
    module there defines a kernel body: the kernels are in nash_mhc/kernels/tpu."""
    layers = sorted((ROOT / "nash_mhc" / "layers").glob("*.py"))
    ops = [p for p in sorted((ROOT / "nash_mhc" / "ops").glob("*.py")) if p.name != "dispatch.py"]
    assert len(layers) >= 5 and len(ops) >= 10
    found = {str(p.relative_to(ROOT)): uses for p in layers if (uses := dispatch_uses(p))}
    found |= {str(p.relative_to(ROOT)): uses for p in ops if (uses := dispatch_uses(p, ("pallas_call",)))}
    assert not found, found
    seen = dispatch_uses(ROOT / "nash_mhc" / "ops" / "dispatch.py")  # the check sees what it looks for
    assert {"pallas_call", "platform_dependent", "import jax.experimental.pallas"} <= {s.split(": ")[1] for s in seen}
    kernel = dispatch_uses(ROOT / "nash_mhc" / "kernels" / "tpu" / "stream_mix_kernel.py")
    assert any(line.endswith(": mix_kernel(x_ref)") for line in kernel), kernel


def test_no_import_cycles_in_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_low_layers_do_not_reach_the_programs_or_the_training_shell():
    graph = import_graph()
    shell = {"nash_mhc.training.loop", "nash_mhc.training.checkpoint", "nash_mhc.train", "nash_mhc.evaluate"}
    for module in ("nash_mhc.hardware", "nash_mhc.settings", "nash_mhc.config", "nash_mhc.sharding",
                   "nash_mhc.data", "nash_mhc.training.step"):
        assert not reachable(graph, module) & shell, module
    assert not reachable(graph, "nash_mhc.data") - {m for m in graph if m.startswith("nash_mhc.data")} - {
        "nash_mhc.settings", "nash_mhc.paths"}  # nothing of the rest but the settings helper and the path layer


MAX_MODULE_LINES = 400


def long_modules(limit: int = MAX_MODULE_LINES) -> dict[str, int]:
    """``{path: lines}`` of every module of the package longer than ``limit`` lines."""
    lengths = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in modules().values()}
    return {path: count for path, count in lengths.items() if count > limit}


def test_no_module_is_over_400_lines():
    """Small files, one concern each: a module over the limit is split along its seams."""
    assert not long_modules(), long_modules()
    assert long_modules(limit=100)  # the check sees the modules (some exceed 100 lines)


_TIME_UNIT = (r"(?:ms|[µμ]s|us|ns|s per step|s/step|sec|seconds?|s|min|minutes?|h|hours?|days?"
              r"|[GT]FLOP/s|tokens/s)")
TIMING = re.compile(rf"(?<![\w.])\d+(?:\.\d+)?(?:\s?[-–]\s?\d+(?:\.\d+)?)?\s?{_TIME_UNIT}(?![\w/])")
"""A number with a time or speed unit: ``216.2 ms``, ``1.25 s``, ``10-25 s``, ``2 h 10 min``, ``25 GFLOP/s``."""


def docstrings(path: Path) -> list[tuple[int, str]]:
    """``(line, docstring)`` of the module and of every class and function in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [(node.body[0].lineno, doc) for node in ast.walk(tree)
            if isinstance(node, kinds) and (doc := ast.get_docstring(node, clean=False))]


def timings_in_docstrings(paths) -> list[str]:
    """``file:line: excerpt`` of every timing in the docstrings of ``paths``."""
    found = []
    for path in paths:
        for line, doc in docstrings(path):
            for match in TIMING.finditer(doc):
                excerpt = " ".join(doc[max(match.start() - 40, 0):match.end() + 20].split())
                found.append(f"{path.relative_to(ROOT)}:{line + doc.count(chr(10), 0, match.start())}: {excerpt}")
    return found


def test_the_timing_pattern_finds_timings_and_only_timings():
    timings = ["231.0 → 216.2 ms per step", "took 1.25 s", "10-25 s each", "about 2 h 10 min", "0.10 ms per layer",
               "25 GFLOP/s", "14,687 tokens/s", "2.6 µs", "3-5 h for the study", "0.8 s per step", "49 min"]
    others = ["eps = 1e-6", "[B, T, 4, 4]", "3 x 3 matrices", "version 0.4.35", "v6e-8", "1.83 x plain + full",
              "8 x 2048 per chip", "float32 sums", "n = 4 streams", "16 heads", "`1b` preset", "1.5e6 cycles",
              "20 MB", "3 modes", "2 steps", "the 5 hidden layers", "min(a, b)"]
    assert [t for t in timings if not TIMING.search(t)] == []
    assert [t for t in others if TIMING.search(t)] == []


def test_no_docstring_in_the_package_carries_a_measured_time():
    """Timings belong in docs/results/<name>/ (written by committed commands); docstrings explain."""
    found = timings_in_docstrings(modules().values())
    assert not found, "timings in docstrings (move them to docs/results/):\n" + "\n".join(found)

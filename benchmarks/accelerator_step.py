"""Train-step speed on one accelerator (a GPU, a TPU chip; a CPU works too): one preset's model variants and,
optionally, nanoGPT's PyTorch model at the same shapes, each in a process of its own, one after the other.

    python benchmarks/accelerator_step.py [--preset base] [--dtype bfloat16] [--batch-size 16] [--steps 20] \
        [--variants plain+full mhc+full mhc+multiscale+nash] [--scan-unroll N] [--nanogpt PATH/TO/nanoGPT/model.py] \
        [--json OUT]

Contestants (same shapes: the preset's layers, width, heads, sequence and padded vocabulary; random tokens):

* ours: :func:`nash_mhc.training.train_step` on a one-device mesh (``nanogpt_compare.train_step_of``), AdamW
  (weight decay 0.1), clipping at 1.0, the preset's memory settings, ``--dtype`` as compute dtype (parameters
  float32);
* ``--nanogpt``: nanoGPT's ``GPT`` (bias off, dropout 0) with its own ``configure_optimizers`` and the step of its
  ``train.py`` (autocast to ``--dtype``, backward, ``clip_grad_norm_(1.0)``, step, ``zero_grad``), eager and, with
  ``--torch-compile``, ``torch.compile``-d; on the GPU when torch sees one, TF32 allowed as its ``train.py`` does.

Each contestant compiles / warms up (3 steps), then runs ``--blocks`` blocks of ``--steps`` steps dispatched back
to back and waited for once per block; reported: the median block's mean step time, tokens/s, MFU (the model
FLOPs of the plain + full variant per token for nanoGPT, the variant's own for ours, over the vendor peak of
``nash_mhc.training.throughput``), the device's peak memory and the ratio to plain + full. One process at a time
owns the accelerator (JAX reserves most of a GPU's memory), so the contestants are not alternated: on a
dedicated accelerator the drift that the CPU harness (``nanogpt_compare.py``) alternates against is small.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import statistics
import time
from pathlib import Path

VARIANTS = {"plain+full": dict(residual="plain", attention="full"),
            "mhc+full": dict(residual="mhc", attention="full"),
            "mhc+multiscale+nash": dict(residual="mhc", attention="multiscale", aggregation="nash")}
WARMUP = 3


def model_config(preset: str, variant: str, dtype: str | None):
    from nash_mhc import ModelConfig

    overrides = dict(VARIANTS[variant])
    if dtype:
        overrides["dtype"] = dtype
    return ModelConfig.preset(preset, **overrides)


def execution_of(preset: str, scan_unroll: int | None = None):
    """The ExecutionConfig the step runs under: the preset's defaults, ``scan_unroll`` when given."""
    from nash_mhc import ExecutionConfig

    return ExecutionConfig(scan_unroll=scan_unroll).for_preset(preset)


def ours(preset: str, variant: str, dtype: str | None, batch_size: int, scan_unroll: int | None = None):
    """(step callable returning the loss as an array, the variant's ModelConfig, the device); the step is traced
    and run under :func:`execution_of`."""
    import jax
    from nanogpt_compare import train_step_of

    config, execution = model_config(preset, variant, dtype), execution_of(preset, scan_unroll)
    step = train_step_of(config, batch_size, learning_rate=3e-4)

    def run(*args, **kwargs):
        with execution.use():
            return step(*args, **kwargs)

    return run, config, jax.devices()[0]


def nanogpt(model_py: Path, preset: str, dtype: str | None, batch_size: int, compile_: bool):
    """nanoGPT's training step at the preset's shapes (same tuple as :func:`ours`)."""
    import contextlib
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("nanogpt_model", model_py)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = model_config(preset, "plain+full", dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    gpt = module.GPT(module.GPTConfig(block_size=config.seq_len, vocab_size=config.padded_vocab_size,
                                      n_layer=config.num_layers, n_head=config.num_heads, n_embd=config.d_model,
                                      dropout=0.0, bias=False)).to(device)
    gpt.train()
    optimizer = gpt.configure_optimizers(0.1, 3e-4, (0.9, 0.95), device)
    model = torch.compile(gpt) if compile_ else gpt
    data = torch.randint(0, config.vocab_size, (batch_size, config.seq_len + 1), device=device)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    autocast = (torch.amp.autocast(device_type=device, dtype=getattr(torch, config.dtype))
                if config.dtype != "float32" else contextlib.nullcontext())

    def step():
        with autocast:
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(gpt.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step, batch_size * config.seq_len, config.flops_per_token(), device


def run(name: str, args: argparse.Namespace, connection) -> None:
    """One contestant's process: its figures (or its error) sent back through ``connection``."""
    try:
        if name.startswith("nanoGPT"):
            import torch

            step, tokens, flops, device = nanogpt(args.nanogpt, args.preset, args.dtype, args.batch_size,
                                                  "compile" in name)
            sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
            wait = lambda loss: (sync(), float(loss.item()))[1]  # noqa: E731
            device_kind = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
            peak_memory = lambda: torch.cuda.max_memory_allocated() if device == "cuda" else None  # noqa: E731
            flops_device = None
        else:
            import jax

            step, config, flops_device = ours(args.preset, name, args.dtype, args.batch_size, args.scan_unroll)
            tokens, flops = args.batch_size * config.seq_len, config.flops_per_token()
            wait = lambda loss: float(jax.block_until_ready(loss))  # noqa: E731
            device_kind = flops_device.device_kind
            stats = lambda: (flops_device.memory_stats() or {}).get("peak_bytes_in_use")  # noqa: E731
            peak_memory = stats
        start = time.perf_counter()
        wait(step())
        first = time.perf_counter() - start
        for _ in range(WARMUP - 1):
            wait(step())
        blocks = []
        for _ in range(args.blocks):
            start = time.perf_counter()
            for _ in range(args.steps - 1):
                step()
            loss = wait(step())
            blocks.append((time.perf_counter() - start) / args.steps)
        from nash_mhc.training.throughput import MFUMeter, table_peak

        if flops_device is not None:
            meter = MFUMeter.for_device(flops, 1, device=flops_device, dtype=config.dtype)
            peak, source = meter.peak, meter.source
        else:
            peak = table_peak(device_kind)
            source = f"{device_kind} table" if peak else "none"
        seconds = statistics.median(blocks)
        connection.send({"name": name, "device": device_kind, "first_step_s": first, "step_s": seconds,
                         "blocks_s": blocks, "tokens_per_second": tokens / seconds,
                         "mfu": tokens / seconds * flops / peak if peak else None, "peak_source": source,
                         "peak_memory_bytes": peak_memory(), "loss": loss})
    except Exception as error:  # one contestant failing (out of memory, say) still reports the others
        first_line = (str(error).splitlines() or [""])[0][:300]
        connection.send({"name": name, "error": f"{type(error).__name__}: {first_line}"})
    connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="base")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: the preset's")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=3, help="timed blocks (the median block is reported)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--scan-unroll", type=int, default=None,
                        help="layers per iteration of our layer scan (default: the preset's)")
    parser.add_argument("--nanogpt", type=Path, default=None, help="nanoGPT's model.py: time it too")
    parser.add_argument("--torch-compile", action="store_true", help="with --nanogpt: also torch.compile it")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a contestant may take in all")
    args = parser.parse_args()
    if args.steps < 1 or args.blocks < 1:
        parser.error(f"--steps and --blocks must be at least 1, got {args.steps} and {args.blocks}")
    if args.scan_unroll is not None and args.scan_unroll < 1:
        parser.error(f"--scan-unroll must be at least 1, got {args.scan_unroll}")
    if args.nanogpt is not None and not args.nanogpt.is_file():
        parser.error(f"--nanogpt {args.nanogpt}: no such file")
    names = list(args.variants)
    if args.nanogpt is not None:
        names += ["nanoGPT eager"] + (["nanoGPT compiled"] if args.torch_compile else [])
    context = multiprocessing.get_context("spawn")
    results = []
    for name in names:
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=run, args=(name, args, send))
        process.start()
        send.close()
        try:
            if receive.poll(args.timeout):
                results.append(receive.recv())
            else:
                process.kill()
                results.append({"name": name, "error": f"no result within --timeout {args.timeout:.0f} s"})
        except EOFError:
            process.join()
            results.append({"name": name, "error": f"process died (exit code {process.exitcode})"})
        process.join()
        print(json.dumps(results[-1]), flush=True)
    base = next((r for r in results if r["name"] == "plain+full" and "error" not in r), None)
    unroll = f"scan_unroll {args.scan_unroll}" if args.scan_unroll else "the preset's scan_unroll"
    print(f"\n{args.preset}, batch {args.batch_size}, dtype {args.dtype or 'preset'}, {unroll}; median of "
          f"{args.blocks} blocks of {args.steps} steps")
    print("| contestant | device | step time | tokens/s | MFU | peak memory | ÷ plain + full step time | first step |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        if "error" in r:
            print(f"| {r['name']} | {r['error']} | | | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f} %" if r["mfu"] else "n/a"
        memory = f"{r['peak_memory_bytes'] / 2**30:.1f} GiB" if r["peak_memory_bytes"] else "n/a"
        ratio = f"{r['step_s'] / base['step_s']:.2f}" if base else "n/a"
        print(f"| {r['name']} | {r['device']} | {1e3 * r['step_s']:.1f} ms | {r['tokens_per_second']:,.0f} | {mfu} "
              f"| {memory} | {ratio} | {r['first_step_s']:.1f} s |")
    if args.json:
        args.json.write_text(json.dumps({"preset": args.preset, "batch_size": args.batch_size, "dtype": args.dtype,
                                         "steps": args.steps, "blocks": args.blocks, "results": results}, indent=1))


if __name__ == "__main__":
    main()

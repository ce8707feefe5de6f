"""``python -m nash_mhc.train``: train a Nash-MHC language model (flags → configs → training.loop).

With no flags it trains the ``small`` preset on the offline default corpus (the running Python's
standard-library sources, byte tokenizer) on all local devices along the ``data`` mesh axis.
Exit codes: 0 finished (or stopped by SIGTERM/SIGINT after saving), 2 bad arguments or inputs (one line on
stderr), 3 loss not finite for too many steps in a row, 4 ``--compile-only`` found that the train step does not
fit the devices' memory, anything else a crash.

``--compile-only [--topology v5e:2x4]`` trains nothing: it builds the abstract train state and batch of the
same flags (nothing allocated, no data read; only the tokenizer is loaded, for the vocabulary size), compiles
the train step that training runs on the ``--mesh-*`` mesh over the local devices or over a TPU topology's
abstract devices (needs libtpu, the ``tpu`` extra; no TPU), and prints the memory per chip
(:mod:`nash_mhc.tpu_compile.fit`) and, for a TPU, the compiler's estimated step time, tokens/s per chip and MFU
(:mod:`nash_mhc.tpu_compile.estimate`; an estimate, not a measurement).

``--wandb-project NAME`` also logs the run to Weights & Biases (:mod:`nash_mhc.training.wandb_log`), and
``--profile-steps A:B`` writes a profiler trace of those steps (:mod:`nash_mhc.training.profiling`).
``--prompt-field``/``--response-field`` train on prompt/response records with the loss on the responses only
(:mod:`nash_mhc.data.sft`); with ``--init-from`` that is fine-tuning.

Every flag is generated from one field declaration (:mod:`nash_mhc.settings`): the model flags from
``ModelConfig`` (default: the preset's value), then ``DataConfig``, ``TrainConfig``, ``MeshConfig``
(``--mesh-*``), ``LoopConfig``, ``CompileCache``, ``ExecutionConfig`` (``--kernels``, ``--remat``, ...),
``WandbConfig``, ``ProfileConfig`` and :class:`Program` below. :func:`configs` nests the model, execution,
optimisation, data, mesh and loop configs in one :class:`~nash_mhc.run_config.RunConfig`. To add a flag, declare
a field with ``setting(default, help)`` in the config it belongs to.
"""

from __future__ import annotations

import dataclasses
import sys

from nash_mhc.cli import CompileCache, SettingsParser, fail
from nash_mhc.config import ModelConfig
from nash_mhc.data import DataConfig
from nash_mhc.execution import ExecutionConfig
from nash_mhc.platforms import select_platform
from nash_mhc.run_config import RunConfig
from nash_mhc.settings import POSITIVE_INT, check_settings, setting
from nash_mhc.sharding import MeshConfig
from nash_mhc.training.config import LoopConfig, TrainConfig
from nash_mhc.training.profiling import ProfileConfig
from nash_mhc.training.wandb_log import WandbConfig


@dataclasses.dataclass(frozen=True)
class Program:
    """Flags that choose how the configs are built."""

    config: str | None = setting(None, "JSON or TOML file of flag values (keys as flag names); flags override it")
    model: str = setting("small", f"model preset: {', '.join(ModelConfig.PRESETS)}")
    use_small_model: bool = setting(False, "shorthand for --model small")
    batch_size: int = setting(TrainConfig.batch_size // TrainConfig.grad_accum_steps,
                              "sequences per forward/backward pass over all devices and hosts (a microbatch, as "
                              "nanoGPT's batch_size); one optimizer update is batch-size x grad-accum-steps sequences",
                              check=POSITIVE_INT)
    total_batch_tokens: int | None = setting(None, "tokens per optimizer update: sets the accumulation steps to "
                                                   "N / (batch-size x seq-len)", check=POSITIVE_INT)

    def __post_init__(self) -> None:
        check_settings(self)

    @property
    def preset(self) -> str:
        return "small" if self.use_small_model else self.model


EXIT_DOES_NOT_FIT = 4


@dataclasses.dataclass(frozen=True)
class CompileOnly:
    """Compile the train step and report whether it fits, instead of training."""

    compile_only: bool = setting(False, "compile the train step for the devices (or --topology) without "
                                        "allocating it, print memory per chip against its HBM (and on a TPU the "
                                        "compiler's estimated step time) and exit: 0 fits, 4 does not fit")
    topology: str | None = setting(None, "with --compile-only: a TPU topology (v5e:2x4, v4:2x2x4) or Cloud "
                                         "accelerator type (v5litepod-8, v6e-8, v4-32) to compile for on this "
                                         "host (needs libtpu); default: the local devices")

    def __post_init__(self) -> None:
        if self.topology is not None and not self.compile_only:
            raise ValueError("--topology needs --compile-only (training runs on the local devices)")


def build_parser() -> SettingsParser:
    parser = SettingsParser("python -m nash_mhc.train", __doc__)
    parser.add_settings(Program)
    parser.add_settings(ModelConfig, "model", default_text="the preset's")
    parser.add_settings(DataConfig, "data")
    parser.add_settings(TrainConfig, "optimisation")
    parser.add_settings(MeshConfig, "mesh", prefix="mesh-")
    parser.add_settings(LoopConfig, "run")
    parser.add_settings(CompileCache, "run")
    parser.add_settings(ExecutionConfig, "run")
    parser.add_settings(WandbConfig, "Weights & Biases")
    parser.add_settings(ProfileConfig, "run")
    parser.add_settings(CompileOnly, "compile-only")
    return parser


def configs(argv: list[str] | None = None, parser: SettingsParser | None = None) -> tuple[RunConfig, CompileCache]:
    """(RunConfig, CompileCache) from the command line; ValueError (naming the flag) on inconsistent values."""
    parser = parser or build_parser()
    given = parser.given(argv)
    program = parser.build(Program, given)
    try:
        model = ModelConfig.preset(program.preset, **parser.values(ModelConfig, given))
    except ValueError as error:
        raise parser.named(ModelConfig, error) from None
    accumulation = parser.values(TrainConfig, given).get("grad_accum_steps", TrainConfig.grad_accum_steps)
    if program.total_batch_tokens is not None:
        per_microbatch = program.batch_size * model.seq_len
        if program.total_batch_tokens % per_microbatch:
            raise ValueError(f"--total-batch-tokens {program.total_batch_tokens} is not a multiple of batch-size x "
                             f"seq-len = {program.batch_size} x {model.seq_len} = {per_microbatch}")
        if accumulation != program.total_batch_tokens // per_microbatch and "grad_accum_steps" in given:
            raise ValueError(f"--grad-accum-steps {accumulation} contradicts --total-batch-tokens "
                             f"{program.total_batch_tokens} = {program.total_batch_tokens // per_microbatch} x "
                             f"{per_microbatch}; give one of them")
        accumulation = program.total_batch_tokens // per_microbatch
    batch = {"batch_size": program.batch_size * accumulation, "grad_accum_steps": accumulation}
    # the execution flags not given take the preset's values (nash_mhc.execution.DEFAULTS); RunConfig checks them
    execution = parser.build(ExecutionConfig, given).for_preset(program.preset)
    run_config = RunConfig(model=model, execution=execution, train=parser.build(TrainConfig, given, **batch),
                           data=parser.build(DataConfig, given), mesh=parser.build(MeshConfig, given),
                           loop=parser.build(LoopConfig, given))
    return run_config, parser.build(CompileCache, given)


def compile_only(run_config: RunConfig, options: CompileOnly) -> int:
    """``--compile-only``: print the fit report of the train step; 0 fits (or unknown memory), 4 does not."""
    from nash_mhc import hardware
    from nash_mhc.tpu_compile import fit

    try:
        if options.topology is not None:
            fit.resolve_topology(options.topology)  # a bad name fails before anything is loaded
        else:
            hardware.init_devices()
        model = run_config.model.replace(vocab_size=run_config.data.load_tokenizer().vocab_size)
        mesh = run_config.mesh
        report = fit.check_fit(model, run_config.train, topology=options.topology, data=mesh.data,
                               fsdp=mesh.fsdp, tp=mesh.tp)
    except (ValueError, FileNotFoundError) as error:
        return fail(error)
    print("\n".join(fit.report_lines(report)), flush=True)
    return EXIT_DOES_NOT_FIT if report.fits is False else 0


def main(argv: list[str] | None = None) -> int:
    select_platform()  # before anything starts a JAX backend
    parser = build_parser()
    try:
        run_config, cache = configs(argv, parser)
        given = parser.given(argv)
        options, wandb_config = parser.build(CompileOnly, given), parser.build(WandbConfig, given)
        profile = parser.build(ProfileConfig, given)
    except ValueError as error:
        return fail(error)
    with run_config.execution.use():  # the steps (train, eval; or the compile) are traced under --kernels, --remat
        return _run(run_config, cache, options, wandb_config, profile)


def _run(run_config: RunConfig, cache: CompileCache, options: CompileOnly, wandb_config: WandbConfig,
         profile: ProfileConfig) -> int:
    if options.compile_only:  # (no persistent cache: what is measured is a compile)
        return compile_only(run_config, options)

    from nash_mhc import hardware
    from nash_mhc.kernels import trust
    from nash_mhc.ops import dispatch
    from nash_mhc.training import loop, profiling, session, wandb_log  # Orbax, TensorBoard: after argument errors
    from nash_mhc.training.step import train_step

    try:
        hardware.initialize_distributed()
        wandb_log.check_available(wandb_config, run_config.loop.checkpoint_dir)  # package, run id, key
        cache.use()  # a local directory or a bucket (gs://...)
        # auto checks the step's kernels before it trusts them (TPU): a failing one runs its XLA form. The devices
        # first: a platform JAX cannot start is a one-line error (HardwareError), not the check's traceback
        hardware.init_devices()
        disabled = trust.trusted_kernels(dispatch.kernels_setting(), run_config.model, run_config.train,
                                         cache.compile_cache_dir)
        run_session = session.prepare(run_config)
    except (ValueError, OSError) as error:  # bad input, or a filesystem that refuses it
        return fail(error)
    try:
        sink = wandb_log.start(wandb_config, run_config.loop.checkpoint_dir, run_session.run_config.to_dict())
    except Exception as error:  # noqa: BLE001 - W&B could not start the run (network, permissions)
        run_session.logger.close()
        run_session.checkpointer.close()
        if run_session.lock is not None:
            run_session.lock.release()
        return fail(f"W&B: {error}")
    if sink is not None:
        run_session.logger.add_sink(sink)
    with profiling.Profiler(profile, run_config.loop.checkpoint_dir, run_session.start_step,
                            run_config.train.total_steps) as profiler:
        if profiler.note is not None:
            run_session.summary.append(profiler.note)
        with dispatch.disable_kernels(disabled):
            return loop.train(run_session, profiler.wrap(train_step))


if __name__ == "__main__":
    sys.exit(main())

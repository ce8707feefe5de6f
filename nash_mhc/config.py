"""Frozen, validated model configuration and named presets.

Dimension letters used across the package:
  T  tokens (sequence positions)      D  d_model            V  padded vocabulary
  n  residual streams (mHC)           H  attention heads    K  head dim (D / H)
  L  attention scales                 F  FFN hidden size    s_l = r**l block size at scale l
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, TypeVar

from nash_mhc.settings import setting

RESIDUAL_MODES = ("mhc", "mhc-lite", "hc", "plain")
MHC_LITE_MAX_STREAMS = 6  # mhc-lite has one logit per permutation matrix: n! of them
ATTENTION_MODES = ("multiscale", "full")
AGGREGATION_MODES = ("nash", "gate", "convex")
DTYPES = ("float32", "bfloat16")
VOCAB_MULTIPLE = 128
SCALE_PRIORS = ("scale0", "uniform")  # or a number in (0, 1): the weight of scale 0
SCALE0_PRIOR_WEIGHT = 0.99  # scale_prior "scale0": softmax(b)_0 at initialisation where every scale is available


def round_up(x: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``x``."""
    return -(-x // multiple) * multiple


def default_ffn_hidden(d_model: int) -> int:
    """SwiGLU hidden size: 8/3 * D (2/3 of the classic 4D, applied once), rounded to the nearest 128."""
    return max(128, int(round(8 * d_model / 3 / 128)) * 128)


def _scale_prior(value: Any, fail: Any) -> str:
    """``scale_prior`` checked and written one way: a name of :data:`SCALE_PRIORS`, or a number in (0, 1) as the
    shortest text of its float (``0.50`` → ``"0.5"``), so equal models compare equal."""
    if value in SCALE_PRIORS:
        return value
    try:
        weight = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        weight = math.nan
    if not 0 < weight < 1:  # NaN fails too
        fail(f"scale_prior must be {', '.join(SCALE_PRIORS)} or a number in (0, 1) (the weight of scale 0), "
             f"got {value!r}")
    return repr(weight)


ConfigT = TypeVar("ConfigT", bound="ConfigMethods")


class ConfigMethods:
    """replace / to_dict / from_dict shared by the frozen config dataclasses."""

    def replace(self: ConfigT, **changes: Any) -> ConfigT:
        return dataclasses.replace(self, **changes)

    # fields an earlier version had and this one moved elsewhere (nash_mhc.execution): dropped when read back
    RETIRED: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[ConfigT], data: dict[str, Any]) -> ConfigT:
        """Build from a dict (e.g. a checkpoint's JSON). Missing keys take their defaults; a retired field
        (:attr:`RETIRED`) is dropped; any other key that is not a field (a checkpoint from another version, a typo)
        raises ValueError naming it."""
        return config_from_dict(cls, data)


def config_from_dict(cls: type, data: dict[str, Any]) -> Any:
    """The config dataclass ``cls`` from a dict, by :meth:`ConfigMethods.from_dict`'s rules, for any config class
    (one without :attr:`ConfigMethods.RETIRED` retires nothing)."""
    data = {k: v for k, v in data.items() if k not in getattr(cls, "RETIRED", ())}
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(f"{cls.__name__} has no field {', '.join(map(repr, unknown))} (written by another "
                         "version of nash_mhc?)")
    return cls(**data)


@dataclasses.dataclass(frozen=True)
class ModelConfig(ConfigMethods):
    """Architecture of a Nash-MHC language model (see docs/design.md).

    Normalisations done in ``__post_init__`` (so equal models compare equal):
      * ``residual="plain"`` forces ``num_streams = 1`` (the plain pre-norm baseline has one stream);
      * ``attention="full"`` forces ``num_scales = 1`` (scale 0 only);
      * ``ffn_hidden=0`` means "derive from d_model" (:func:`default_ffn_hidden`).

    Nash aggregation (:mod:`nash_mhc.ops.aggregation`): at most ``nash_iters`` safeguarded Newton steps per
    position, to a residual of 1e-6 in float32; ``nash_temperature`` is the initial value of each layer's
    learned temperature tau (the game adds 1.05·λmax(C) to it, which keeps the equilibrium unique whatever
    tau learns).
    """

    vocab_size: int = 259
    seq_len: int = setting(256, "context length")
    d_model: int = setting(256, "model width D")
    num_layers: int = setting(4, "transformer layers")
    num_heads: int = setting(4, "attention heads (must divide the width)")
    num_streams: int = setting(4, "mHC residual streams n")
    num_scales: int = setting(3, "attention scales L")
    compression_ratio: int = setting(4, "block size ratio r between attention scales (scale l pools r**l tokens)")
    residual: str = setting("mhc", "residual connection mode", choices=RESIDUAL_MODES)
    attention: str = setting("multiscale", "attention mode", choices=ATTENTION_MODES)
    aggregation: str = setting("nash", "multiscale aggregation", choices=AGGREGATION_MODES)
    scale_prior: str = setting("scale0", "start of the multiscale aggregation, its prior softmax(b) where every "
                                         "scale is available: 'scale0' (0.99 on scale 0: starts as full attention), "
                                         "'uniform' (every scale equal), or a number in (0, 1): the weight of scale "
                                         "0, the rest split equally among the coarse scales")
    sinkhorn_iters: int = setting(20, "Sinkhorn iterations that make each mHC H_res doubly stochastic")
    nash_iters: int = setting(16, "at most this many Newton steps to the Nash equilibrium (tolerance 1e-6)")
    nash_temperature: float = setting(0.1, "initial learned temperature tau of the Nash aggregation")
    sparsity_weight: float = setting(0.01, "weight of the aggregation-entropy aux loss")
    dtype: str = setting("float32", "compute dtype (parameters stay float32)", choices=DTYPES)
    ffn_hidden: int = 0
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    hc_identity_logit: float = 4.0
    # how the layer scan runs is not the architecture: format-3 checkpoints carry these, nash_mhc.execution has them
    RETIRED: ClassVar[tuple[str, ...]] = ("remat", "remat_group", "scan_unroll")

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        # Compiles in seconds on a laptop CPU; used by the test-suite.
        "tiny": dict(vocab_size=259, seq_len=64, d_model=64, num_layers=2, num_heads=4, num_streams=4,
                     num_scales=3, compression_ratio=2),
        # `--use-small-model`: trains visibly on a 2-core CPU in minutes.
        "small": dict(vocab_size=259, seq_len=256, d_model=256, num_layers=4, num_heads=4, num_streams=4,
                      num_scales=3, compression_ratio=4),
        "base": dict(vocab_size=49152, seq_len=1024, d_model=768, num_layers=12, num_heads=12,
                     num_streams=4, num_scales=3, compression_ratio=4),
        "medium": dict(vocab_size=49152, seq_len=1024, d_model=1024, num_layers=24, num_heads=16,
                       num_streams=4, num_scales=3, compression_ratio=4),
        "1b": dict(vocab_size=49152, seq_len=2048, d_model=2048, num_layers=16, num_heads=16,
                   num_streams=4, num_scales=3, compression_ratio=4, dtype="bfloat16"),
        "3b": dict(vocab_size=49152, seq_len=4096, d_model=2048, num_layers=28, num_heads=16,
                   num_streams=4, num_scales=4, compression_ratio=4, dtype="bfloat16",
                   tie_embeddings=False),
    }

    def __post_init__(self) -> None:
        def fail(msg: str) -> None:
            raise ValueError(f"ModelConfig: {msg}")

        for name in ("vocab_size", "seq_len", "d_model", "num_layers", "num_heads", "num_streams",
                     "num_scales", "sinkhorn_iters"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                fail(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.nash_iters, int) or isinstance(self.nash_iters, bool) or self.nash_iters < 1:
            fail(f"nash_iters must be a positive integer, got {self.nash_iters!r}")
        if self.compression_ratio < 2:
            fail(f"compression_ratio must be >= 2, got {self.compression_ratio}")
        for name, value, allowed in (("residual", self.residual, RESIDUAL_MODES),
                                     ("attention", self.attention, ATTENTION_MODES),
                                     ("aggregation", self.aggregation, AGGREGATION_MODES),
                                     ("dtype", self.dtype, DTYPES)):
            if value not in allowed:
                fail(f"unknown {name} {value!r}; choose one of {', '.join(allowed)}")
        if self.d_model % self.num_heads:
            fail(f"num_heads={self.num_heads} must divide d_model={self.d_model}")
        if (self.d_model // self.num_heads) % 2:
            fail(f"head dim d_model/num_heads={self.d_model // self.num_heads} must be even for RoPE")
        for name in ("nash_temperature", "norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < float("inf"):
                fail(f"{name} must be a finite number > 0, got {value!r}")
        if not isinstance(self.hc_identity_logit, int | float) or not math.isfinite(self.hc_identity_logit):
            fail(f"hc_identity_logit must be a finite number, got {self.hc_identity_logit!r}")
        object.__setattr__(self, "scale_prior", _scale_prior(self.scale_prior, fail))
        if not self.sparsity_weight >= 0:  # NaN fails too
            fail(f"sparsity_weight must be >= 0, got {self.sparsity_weight}")
        if self.ffn_hidden < 0:
            fail(f"ffn_hidden must be >= 0 (0 = derived), got {self.ffn_hidden}")
        if self.residual == "mhc-lite" and self.num_streams > MHC_LITE_MAX_STREAMS:
            fail(f"residual mhc-lite mixes the n! permutation matrices of n streams: num_streams must be <= "
                 f"{MHC_LITE_MAX_STREAMS}, got {self.num_streams}")
        if self.residual == "plain" and self.num_streams != 1:
            object.__setattr__(self, "num_streams", 1)
        if self.attention == "full" and self.num_scales != 1:
            object.__setattr__(self, "num_scales", 1)
        if self.ffn_hidden == 0:
            object.__setattr__(self, "ffn_hidden", default_ffn_hidden(self.d_model))
        if self.seq_len % self.coarsest_block:
            fail(f"seq_len={self.seq_len} must be divisible by the coarsest block "
                 f"compression_ratio**(num_scales-1)={self.coarsest_block}")

    # ----------------------------------------------------------------------------------------- presets
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named preset (``tiny small base medium 1b 3b``) with field overrides."""
        if name not in cls.PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(cls.PRESETS)}")
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s): {', '.join(sorted(unknown))}")
        return cls(**{**cls.PRESETS[name], **overrides})

    # ------------------------------------------------------------------------------- derived sizes
    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary rounded up to a multiple of 128 (embedding rows / logits columns)."""
        return round_up(self.vocab_size, VOCAB_MULTIPLE)

    @property
    def scale0_prior_weight(self) -> float:
        """softmax(b)_0 of the aggregation prior at initialisation where every scale is available (``scale_prior``)."""
        if self.scale_prior in SCALE_PRIORS:
            return SCALE0_PRIOR_WEIGHT if self.scale_prior == "scale0" else 1.0 / self.num_scales
        return float(self.scale_prior)

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """s_l = r**l for every active scale l."""
        return tuple(self.compression_ratio**level for level in range(self.num_scales))

    @property
    def coarsest_block(self) -> int:
        return self.block_sizes[-1]

    @property
    def num_hc_coefficients(self) -> int:
        """Columns of the projection Φ: mhc n (pre) + n (post) + n² (res), mhc-lite n + n + n! (one logit per
        permutation matrix), both over all n·D values; hc 1 (pre) + 1 (post) + n (res) over each stream's D values."""
        n = self.num_streams
        return {"mhc": 2 * n + n * n, "mhc-lite": 2 * n + math.factorial(n)}.get(self.residual, 2 + n)

    @property
    def hc_rows(self) -> int:
        """Rows of the projection Φ: the flattened streams n·D (mhc, mhc-lite) or one stream's D (hc)."""
        return self.d_model if self.residual == "hc" else self.num_streams * self.d_model

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward).

        Convention (PaLM appendix B, made causal and multiscale): ``6 * N`` for the multiply-adds of the weight
        matmuls every token takes part in, and, per layer and scale l with coarse length T_l = T / s_l,
        ``6 * D * T_l**2 / T`` for causal QKᵀ and AV (half of the non-causal 12·D·T_l²/T). N counts per layer:
        the scale-0 Q and K (2·D²) and a coarse scale's own Q and K (2·D² / s_l: it sees one coarse token per s_l
        fine tokens), V and the output (2·D²), the SwiGLU (3·D·F), the hyper-connection projection of both
        sublayers (mhc / mhc-lite: Φ of n·D rows; hc: Θ of D rows, applied to each of the n streams) and the
        gate aggregation's projection (L·D); plus the LM head over the real vocabulary (the padding columns are
        computed, but they are not model FLOPs). ``tests/test_config.py`` checks it against XLA's count.
        """
        T = self.seq_len if seq_len is None else seq_len
        D, n, L = self.d_model, self.num_streams, self.num_scales
        attention = 2 * D * D * (1 + sum(1 / s for s in self.block_sizes[1:])) + 2 * D * D
        hc = 0 if n == 1 else 2 * self.hc_rows * self.num_hc_coefficients * (n if self.residual == "hc" else 1)
        gate = L * D if self.aggregation == "gate" and L > 1 else 0
        weights = self.num_layers * (attention + 3 * D * self.ffn_hidden + hc + gate) + self.vocab_size * D
        attn = sum(6 * D * (T / s) ** 2 / T for s in self.block_sizes)
        return 6.0 * weights + self.num_layers * attn

    def flops_per_token_all(self, seq_len: int | None = None) -> float:
        """Every arithmetic op of the train step per token, forward + backward (:mod:`nash_mhc.flops`: Sinkhorn,
        the stream collapse and update, norms, softmax, resampling, the Nash solve at ``nash_iters``, attention as
        computed): for "equal FLOPs" comparisons; :meth:`flops_per_token` stays the MFU's matmul count."""
        from nash_mhc.flops import flops_per_token_all

        return flops_per_token_all(self, seq_len)

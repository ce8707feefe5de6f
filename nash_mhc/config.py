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

RESIDUAL_MODES = ("mhc", "hc", "plain")
ATTENTION_MODES = ("multiscale", "full")
AGGREGATION_MODES = ("nash", "convex")
DTYPES = ("float32", "bfloat16")
REMAT_POLICIES = ("none", "full", "dots")
VOCAB_MULTIPLE = 128


def round_up(x: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``x``."""
    return -(-x // multiple) * multiple


def default_ffn_hidden(d_model: int) -> int:
    """SwiGLU hidden size: 8/3 * D (2/3 of the classic 4D, applied once), rounded to the nearest 128."""
    return max(128, int(round(8 * d_model / 3 / 128)) * 128)


ConfigT = TypeVar("ConfigT", bound="ConfigMethods")


class ConfigMethods:
    """replace / to_dict / from_dict shared by the frozen config dataclasses."""

    def replace(self: ConfigT, **changes: Any) -> ConfigT:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[ConfigT], data: dict[str, Any]) -> ConfigT:
        """Build from a dict (e.g. a checkpoint's JSON). Missing keys take their defaults; a key that is not a field
        (a checkpoint from another version, a typo) raises ValueError naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{cls.__name__} has no field {', '.join(map(repr, unknown))} (written by another "
                             "version of nash_mhc?)")
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class ModelConfig(ConfigMethods):
    """Architecture of a Nash-MHC language model (see DESIGN.md §1).

    Normalisations done in ``__post_init__`` (so equal models compare equal):
      * ``residual="plain"`` forces ``num_streams = 1`` (the plain pre-norm baseline has one stream);
      * ``attention="full"`` forces ``num_scales = 1`` (scale 0 only);
      * ``ffn_hidden=0`` means "derive from d_model" (:func:`default_ffn_hidden`).

    Nash aggregation (:mod:`nash_mhc.ops.aggregation`): ``nash_iters`` best-response steps per position
    (the residual is at most sqrt(2)·2^-nash_iters, so 16 give <= 2.2e-5); ``nash_temperature`` is the
    initial value of each layer's learned temperature tau (the game adds 2|C|_F to it, which keeps the
    equilibrium unique whatever tau learns).
    """

    vocab_size: int = 259
    seq_len: int = setting(256, "context length")
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_streams: int = setting(4, "mHC residual streams n")
    num_scales: int = setting(3, "attention scales L")
    compression_ratio: int = setting(4, "block size ratio r between attention scales (scale l pools r**l tokens)")
    residual: str = setting("mhc", "residual connection mode", choices=RESIDUAL_MODES)
    attention: str = setting("multiscale", "attention mode", choices=ATTENTION_MODES)
    aggregation: str = setting("nash", "multiscale aggregation", choices=AGGREGATION_MODES)
    sinkhorn_iters: int = setting(20, "Sinkhorn iterations that make each mHC H_res doubly stochastic")
    nash_iters: int = setting(16, "best-response steps of the Nash aggregation (equilibrium residual <= sqrt(2)*2^-N)")
    nash_temperature: float = setting(0.1, "initial learned temperature tau of the Nash aggregation")
    sparsity_weight: float = setting(0.01, "weight of the aggregation-entropy aux loss")
    dtype: str = setting("float32", "compute dtype (parameters stay float32)", choices=DTYPES)
    ffn_hidden: int = 0
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    hc_identity_logit: float = 4.0
    remat: str = setting("none", "rematerialisation policy of the layer scan", choices=REMAT_POLICIES)
    remat_group: int = setting(1, "with --remat: layers per rematerialised group; the layer scan keeps only each "
                                  "group's input for the backward pass (must divide num_layers)")

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
        if not isinstance(self.remat_group, int) or isinstance(self.remat_group, bool) or self.remat_group < 1 \
                or self.num_layers % self.remat_group:
            fail(f"remat_group must be a positive divisor of num_layers = {self.num_layers}, got {self.remat_group!r}")
        if self.compression_ratio < 2:
            fail(f"compression_ratio must be >= 2, got {self.compression_ratio}")
        for name, value, allowed in (("residual", self.residual, RESIDUAL_MODES),
                                     ("attention", self.attention, ATTENTION_MODES),
                                     ("aggregation", self.aggregation, AGGREGATION_MODES),
                                     ("dtype", self.dtype, DTYPES),
                                     ("remat", self.remat, REMAT_POLICIES)):
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
        if not self.sparsity_weight >= 0:  # NaN fails too
            fail(f"sparsity_weight must be >= 0, got {self.sparsity_weight}")
        if self.ffn_hidden < 0:
            fail(f"ffn_hidden must be >= 0 (0 = derived), got {self.ffn_hidden}")
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
    def block_sizes(self) -> tuple[int, ...]:
        """s_l = r**l for every active scale l."""
        return tuple(self.compression_ratio**level for level in range(self.num_scales))

    @property
    def coarsest_block(self) -> int:
        return self.block_sizes[-1]

    @property
    def num_hc_coefficients(self) -> int:
        """Columns of the projection Φ: mhc n (pre) + n (post) + n² (res) over all n·D values; hc 1 (pre) +
        1 (post) + n (res) over each stream's D values."""
        n = self.num_streams
        return 2 * n + n * n if self.residual == "mhc" else 2 + n

    # ---------------------------------------------------------------------------- parameter count
    def param_counts(self) -> dict[str, int]:
        """Exact parameter counts by group, matching the leaves of :class:`nash_mhc.LanguageModel`."""
        D, F, V, n, S = self.d_model, self.ffn_hidden, self.padded_vocab_size, self.num_streams, self.num_scales
        attn_matmul = 2 * S * D * D + 2 * D * D  # per-scale Q,K; shared V; output
        downsample = sum(self.block_sizes[1:]) * D
        aggregation = 0 if S == 1 else S + (1 if self.aggregation == "nash" else 0)  # prior (+ temperature)
        ffn_matmul = 3 * D * F
        norms = 2 * D
        hc = 0
        hc_matmul = 0
        if n > 1:
            rows = n * D if self.residual == "mhc" else D  # Φ sees the flattened streams (mhc) or one stream (hc)
            hc_matmul = 2 * rows * self.num_hc_coefficients  # Φ for both sublayers
            hc = 2 * (rows + 3 + 2 * n + n * n)  # norm gain, α_pre/post/res, b_pre, b_post, b_res
        per_layer_matmul = attn_matmul + ffn_matmul + hc_matmul
        per_layer_other = downsample + aggregation + norms + hc
        embed = V * D
        head = 0 if self.tie_embeddings else D * V
        return {
            "embedding": embed,
            "head": head,
            "final_norm": D,
            "layers_matmul": self.num_layers * per_layer_matmul,
            "layers_other": self.num_layers * per_layer_other,
        }

    def num_params(self) -> int:
        return sum(self.param_counts().values())

    def matmul_params(self) -> int:
        """Multiply-adds per token of the weight matmuls: layer matmuls and the LM head over the real
        vocabulary (the padding columns are computed, but they are not model FLOPs).

        Each parameter counts once, except hc's per-stream Θ, which every one of the n streams uses.
        """
        hc_reuse = 0
        if self.residual == "hc" and self.num_streams > 1:
            hc_reuse = (self.num_streams - 1) * 2 * self.d_model * self.num_hc_coefficients * self.num_layers
        return self.param_counts()["layers_matmul"] + hc_reuse + self.vocab_size * self.d_model

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward).

        Convention (PaLM appendix B, made causal and multiscale): ``6 * N_matmul`` for the weight matmuls
        (every layer matmul incl. the mHC Φ, plus the LM head), where a coarse scale's own Q and K
        projections (2·D² each scale l ≥ 1) see one coarse token per s_l fine tokens and so count 1/s_l;
        and, per layer and scale l with coarse length T_l = T / s_l, ``6 * D * T_l**2 / T`` for causal QKᵀ
        and AV (half of the non-causal 12·D·T_l²/T).
        """
        T = self.seq_len if seq_len is None else seq_len
        coarse_qk = sum(2 * self.d_model**2 * (1 - 1 / s) for s in self.block_sizes[1:])
        weights = self.matmul_params() - self.num_layers * coarse_qk
        attn = sum(6 * self.d_model * (T / s) ** 2 / T for s in self.block_sizes)
        return 6.0 * weights + self.num_layers * attn


def describe(config: ModelConfig) -> str:
    """One-line human summary used by the CLIs."""
    return (f"d={config.d_model} layers={config.num_layers} heads={config.num_heads} "
            f"streams={config.num_streams} scales={config.num_scales}(r={config.compression_ratio}) "
            f"residual={config.residual} attention={config.attention} aggregation={config.aggregation} "
            f"params={config.num_params() / 1e6:.2f}M flops/token={config.flops_per_token() / 1e6:.1f}M "
            f"dtype={config.dtype}")

"""Qwen3 / Qwen3-MoE hyper-parameters, read from a Hugging Face ``config.json``.

Torch-free on purpose: validating a config must not import torch. ``from_config``
collects every missing or invalid key and raises one CheckpointError naming the file;
``to_config`` writes a dict that transformers' ``Qwen3Config`` / ``Qwen3MoeConfig``
load unchanged (legacy ``rope_theta`` / ``rope_scaling`` keys, which every
transformers version reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xspec.errors import CheckpointError
from xspec.models.config_fields import (
    MAX_INT,
    is_number,
    is_positive,
    token_id_problem,
    yarn_problems,
)
from xspec.models.families import check_family

MODEL_TYPES = ("qwen3", "qwen3_moe")
ROPE_TYPES = ("default", "linear", "yarn")
# transformers' Qwen3Config (dense) declares head_dim=128 as a default, so a dense
# config.json without head_dim means 128 there, not hidden/heads (Qwen3MoeConfig has
# no such field and uses hidden/heads).
_HF_DENSE_HEAD_DIM_DEFAULT = 128

_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
)
_REQUIRED_MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


@dataclass(kw_only=True)
class Qwen3Args:
    """Everything the model math needs; names follow config.json."""

    model_type: str = "qwen3"  # qwen3 | qwen3_moe
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (MoE models: the mlp_only / non-sparse layers)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None  # normalised: always has "rope_type"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # MoE (qwen3_moe only)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    @property
    def is_moe(self) -> bool:
        return self.model_type == "qwen3_moe"

    def layer_is_sparse(self, i: int) -> bool:
        """transformers' rule: MoE unless listed in mlp_only_layers or off the sparse step."""
        return (
            self.is_moe
            and self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    # -- config.json ------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: dict, where: str | Path) -> Qwen3Args:
        """Validate a parsed config.json; ``where`` (the file) is named in the error."""
        check_family(config, where, ("qwen3",))
        problems: list[str] = []
        if "num_experts" not in config and "num_local_experts" in config:
            # transformers >= 5 saves Qwen3MoeConfig.num_experts under this alias
            config = config | {"num_experts": config["num_local_experts"]}
        model_type = config.get("model_type")
        if model_type not in MODEL_TYPES:
            problems.append(f"model_type is {model_type!r}; this loader reads {list(MODEL_TYPES)}")
            model_type = "qwen3"
        required = list(_REQUIRED) + (list(_REQUIRED_MOE) if model_type == "qwen3_moe" else [])
        problems += [f"missing key {k!r}" for k in required if k not in config]
        kw: dict[str, Any] = {"model_type": model_type}
        for key in (*_REQUIRED, "intermediate_size"):
            if key in config:
                kw[key] = _positive_int(config, key, problems)
        kw["rms_norm_eps"] = _positive_float(config, "rms_norm_eps", 1e-6, problems)
        kw["tie_word_embeddings"] = _bool(config, "tie_word_embeddings", False, problems)
        kw["bos_token_id"] = _token_id(config, "bos_token_id", problems)
        kw["eos_token_id"] = config.get("eos_token_id")
        kw["rope_theta"], kw["rope_scaling"] = _rope(config, problems)
        kw["head_dim"] = _head_dim(config, model_type, problems)
        _unsupported(config, problems)
        if model_type == "qwen3_moe":
            _moe_fields(config, kw, problems)
        elif "intermediate_size" not in config:
            problems.append("missing key 'intermediate_size'")
        if not problems:
            args = cls(**kw)
            problems += args._consistency()
            if not problems:
                return args
        raise CheckpointError(
            f"{where}: invalid Qwen3 config ({len(problems)} problem(s)); fix these keys",
            problems=problems,
        )

    def _consistency(self) -> list[str]:
        """Cross-key checks once every key parsed."""
        problems = []
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            problems.append(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.bos_token_id is not None and self.bos_token_id >= self.vocab_size:
            problems.append(
                f"bos_token_id ({self.bos_token_id}) is outside the vocabulary "
                f"(vocab_size {self.vocab_size})"
            )
        if self.is_moe:
            if self.num_experts_per_tok > self.num_experts:
                problems.append(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                    f"({self.num_experts})"
                )
            bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
            if bad:
                problems.append(
                    f"mlp_only_layers {bad} outside 0..{self.num_hidden_layers - 1} "
                    "(num_hidden_layers)"
                )
        return problems

    def to_config(self) -> dict[str, Any]:
        """A config.json dict that transformers loads into the equivalent model."""
        arch = "Qwen3MoeForCausalLM" if self.is_moe else "Qwen3ForCausalLM"
        config: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.is_moe:
            config |= {
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": list(self.mlp_only_layers),
            }
        else:
            config["max_window_layers"] = self.num_hidden_layers
        return config

    @classmethod
    def tiny(cls, moe: bool) -> Qwen3Args:
        """The built-in tiny presets: byte vocab (0..255) + bos 256 / eos 257, d=128, 4 layers.

        Dense is tied (like Qwen3-0.6B); MoE is untied (like Qwen3-30B-A3B).
        """
        common: dict[str, Any] = {
            "vocab_size": 512,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 2048,
            "rope_theta": 10_000.0,  # hd=32 at 1e6 would barely rotate within 2048 positions
            "bos_token_id": 256,
            "eos_token_id": 257,
        }
        if not moe:
            return cls(model_type="qwen3", tie_word_embeddings=True, **common)
        return cls(
            model_type="qwen3_moe",
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            **common,
        )


# -- per-key parsers: each appends to ``problems`` instead of raising ------------------


def _positive_int(config: dict, key: str, problems: list[str]) -> int:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_INT:
        problems.append(f"{key!r} must be a positive integer up to {MAX_INT}, got {value!r}")
        return 1
    return value


def _positive_float(config: dict, key: str, default: float, problems: list[str]) -> float:
    value = config.get(key, default)
    if not is_positive(value):
        problems.append(f"{key!r} must be a positive number, got {value!r}")
        return default
    return float(value)


def _token_id(config: dict, key: str, problems: list[str]) -> int | None:
    value = config.get(key)
    if problem := token_id_problem(key, value):
        problems.append(problem)
        return None
    return value


def _bool(config: dict, key: str, default: bool, problems: list[str]) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        problems.append(f"{key!r} must be true or false, got {value!r}")
        return default
    return value


def _head_dim(config: dict, model_type: str, problems: list[str]) -> int:
    if config.get("head_dim") is not None:
        return _positive_int(config, "head_dim", problems)
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0):
        return 1  # the missing/invalid key is already reported
    if hidden % heads:
        problems.append(
            f"head_dim is absent and hidden_size ({hidden}) is not divisible by "
            f"num_attention_heads ({heads}); add 'head_dim'"
        )
        return 1
    derived = hidden // heads
    if model_type == "qwen3" and derived != _HF_DENSE_HEAD_DIM_DEFAULT:
        # transformers would silently use 128 here, so the checkpoint is ambiguous.
        problems.append(
            f"head_dim is absent: hidden_size/num_attention_heads = {derived}, but transformers' "
            f"Qwen3Config defaults it to {_HF_DENSE_HEAD_DIM_DEFAULT}; add 'head_dim' explicitly"
        )
    return derived


def _rope(config: dict, problems: list[str]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalised rope_scaling) from legacy keys or transformers-5 rope_parameters."""
    params = config.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        problems.append(f"'rope_parameters' must be an object, got {params!r}")
        params = None
    params = dict(params or {})
    theta = config.get("rope_theta", params.pop("rope_theta", None))
    if theta is None:
        problems.append("missing key 'rope_theta' (or 'rope_parameters.rope_theta')")
        theta = 10_000.0
    elif not (is_number(theta) and theta > 1):
        problems.append(f"'rope_theta' must be a number > 1, got {theta!r}")
        theta = 10_000.0
    scaling = config.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is None:
        return float(theta), None
    if not isinstance(scaling, dict):
        problems.append(f"'rope_scaling' must be an object or null, got {scaling!r}")
        return float(theta), None
    scaling = {k: v for k, v in scaling.items() if k not in ("type", "rope_theta")} | {
        "rope_type": scaling.get("rope_type", scaling.get("type", "default"))
    }
    kind = scaling["rope_type"]
    if kind not in ROPE_TYPES:
        problems.append(
            f"rope_scaling type {kind!r} is not supported (supported: {list(ROPE_TYPES)})"
        )
        return float(theta), None
    needs = {
        "default": (),
        "linear": ("factor",),
        "yarn": ("factor", "original_max_position_embeddings"),
    }
    problems += yarn_problems(scaling, needs[kind]) if kind != "default" else []
    return float(theta), (None if kind == "default" else scaling)


def _unsupported(config: dict, problems: list[str]) -> None:
    """Features transformers has but real Qwen3 checkpoints do not use: refuse, don't guess."""
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config.get('hidden_act')!r} is not supported (only 'silu')")
    if config.get("attention_bias", False):
        problems.append("attention_bias=true is not supported (Qwen3 projections have no bias)")
    if config.get("use_sliding_window", False):
        problems.append("use_sliding_window=true is not supported (every layer is full attention)")
    layer_types = config.get("layer_types")
    if layer_types is not None and not isinstance(layer_types, list):
        problems.append(f"'layer_types' must be a list of layer types, got {layer_types!r}")
    elif layer_types and any(t != "full_attention" for t in layer_types):
        problems.append("layer_types other than 'full_attention' are not supported")


def _moe_fields(config: dict, kw: dict[str, Any], problems: list[str]) -> None:
    for key in _REQUIRED_MOE:
        if key in config:
            kw[key] = _positive_int(config, key, problems)
    kw["norm_topk_prob"] = _bool(config, "norm_topk_prob", False, problems)
    step = config.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or not 0 < step <= MAX_INT:
        problems.append(f"'decoder_sparse_step' must be a positive integer, got {step!r}")
        step = 1
    kw["decoder_sparse_step"] = step
    only = config.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        problems.append(f"'mlp_only_layers' must be a list of layer indices, got {only!r}")
        only = []
    kw["mlp_only_layers"] = list(only)
    hidden_layers = config.get("num_hidden_layers")
    # a dense layer exists when one is listed, or the sparse step skips one (arithmetic,
    # not a walk over the layers: the count may be anything a file says)
    needs_dense = isinstance(hidden_layers, int) and (
        any(isinstance(i, int) and 0 <= i < hidden_layers for i in only)
        or (step > 1 and hidden_layers > 0)
    )
    if needs_dense and "intermediate_size" not in config:
        problems.append("missing key 'intermediate_size' (needed by the dense mlp_only layers)")
    kw.setdefault("intermediate_size", kw.get("moe_intermediate_size", 1))

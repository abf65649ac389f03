"""DeepSeek-V4 hyper-parameters, read from the official ``config.json``.

Torch-free on purpose: validating a config must not import torch. Field names are the
config.json names. ``from_config`` collects every missing or invalid key and raises one
:class:`CheckpointError` naming the file; ``to_config`` writes a dict that both xspec
and transformers' ``DeepseekV4Config`` read (transformers folds the legacy
``compress_ratios`` / ``num_hash_layers`` / ``qk_rope_head_dim`` / ``rope_scaling`` keys
into its own fields).

``compress_ratios`` has one entry per main layer plus one per MTP / DSpark draft layer;
the target uses the first ``num_hidden_layers`` (:attr:`target_compress_ratios`), the
rest stay available to drafters (:attr:`draft_compress_ratios`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from xspec.errors import CheckpointError
from xspec.models.config_fields import int_problem, is_number, token_id_problem, yarn_problems
from xspec.models.families import check_family

COMPRESS_RATIOS = (0, 4, 128)  # SWA-only, CSA (overlapping, indexer), HCA
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")

_REQUIRED_INTS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "hc_mult",
)
# Optional keys and their defaults (the Flash values, as transformers' DeepseekV4Config).
_OPTIONAL_INTS = {
    "max_position_embeddings": 1048576,
    "sliding_window": 128,
    "n_shared_experts": 1,
    "num_hash_layers": 3,
    "hc_sinkhorn_iters": 20,
    "num_nextn_predict_layers": 1,
}
_OPTIONAL_FLOATS = {
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
}


@dataclass(kw_only=True)
class DeepseekV4Args:
    """Everything the DeepSeek-V4 model math needs; names follow config.json."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int  # q and shared-KV head dim, laid out [nope | rope]
    qk_rope_head_dim: int  # rope covers the last qk_rope_head_dim dims
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    compress_ratios: list[int]  # main layers, then MTP / DSpark layers
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    hc_mult: int
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0  # SWA-only layers
    compress_rope_theta: float = 160000.0  # CSA / HCA layers, their compressors, indexer
    rope_scaling: dict[str, Any] | None = None  # YaRN for the compressed layers only
    sliding_window: int = 128
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    num_hash_layers: int = 3
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 1
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"  # dtype of the stored weights (informational)
    # DSpark (Flash-0731) drafter fields; None when the checkpoint has no DSpark stages.
    dspark_block_size: int | None = None
    dspark_noise_token_id: int | None = None
    dspark_target_layer_ids: list[int] | None = None
    dspark_markov_rank: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # unread keys, kept for to_config

    # -- derived -----------------------------------------------------------------------

    @property
    def target_compress_ratios(self) -> list[int]:
        """Ratios of the main (target) layers."""
        return list(self.compress_ratios[: self.num_hidden_layers])

    @property
    def draft_compress_ratios(self) -> list[int]:
        """Ratios of the MTP / DSpark layers stored after the main layers."""
        return list(self.compress_ratios[self.num_hidden_layers :])

    def is_hash_layer(self, layer_id: int) -> bool:
        """The first ``num_hash_layers`` layers route by ``tid2eid[token_id]``."""
        return layer_id < self.num_hash_layers

    @property
    def yarn(self) -> dict[str, Any] | None:
        """The YaRN parameters of the compressed layers, or None (plain RoPE)."""
        if not self.rope_scaling:
            return None
        kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
        return self.rope_scaling if kind == "yarn" else None

    # -- config.json -------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: dict, where: Path | str) -> DeepseekV4Args:
        """Validate a parsed config.json; ``where`` (the file) is named in the error."""
        check_family(config, where, ("deepseek_v4", "deepseek_v4_mtp"))
        problems: list[str] = []
        kw: dict[str, Any] = {}
        for key in _REQUIRED_INTS:
            if key not in config:
                problems.append(f"missing key {key!r}")
            else:
                kw[key] = _int(config, key, problems, minimum=1)
        for key, default in _OPTIONAL_INTS.items():
            minimum = 0 if key in ("num_hash_layers", "num_nextn_predict_layers") else 1
            kw[key] = _int(config, key, problems, minimum=minimum, default=default)
        for key, fallback in _OPTIONAL_FLOATS.items():
            kw[key] = _float(config, key, problems, default=fallback)
        kw["compress_ratios"] = _ratios(config, problems)
        kw["rope_scaling"] = _rope_scaling(config, problems)
        kw["scoring_func"] = config.get("scoring_func", "sqrtsoftplus")
        if kw["scoring_func"] not in SCORING_FUNCS:
            problems.append(
                f"scoring_func is {kw['scoring_func']!r}; supported: {list(SCORING_FUNCS)}"
            )
        for key, default in (("norm_topk_prob", True), ("tie_word_embeddings", False)):
            kw[key] = config.get(key, default)
            if not isinstance(kw[key], bool):
                problems.append(f"{key} must be true or false, got {kw[key]!r}")
        kw["bos_token_id"] = config.get("bos_token_id", 0)
        if problem := token_id_problem("bos_token_id", kw["bos_token_id"]):
            problems.append(problem)
        kw["eos_token_id"] = config.get("eos_token_id", 1)
        kw["torch_dtype"] = str(config.get("torch_dtype", config.get("dtype", "bfloat16")))
        for key in ("dspark_block_size", "dspark_noise_token_id", "dspark_markov_rank"):
            kw[key] = _int(config, key, problems, minimum=0) if key in config else None
        kw["dspark_target_layer_ids"] = config.get("dspark_target_layer_ids")
        _unsupported(config, problems)
        known = {f for f in cls.__dataclass_fields__ if f != "extra"} | _DERIVED_KEYS
        kw["extra"] = {k: v for k, v in config.items() if k not in known}
        if not problems:
            args = cls(**kw)
            problems += args.problems()
            if not problems:
                return args
        raise CheckpointError(
            f"{where}: invalid DeepSeek-V4 config ({len(problems)} problem(s)); fix these keys",
            problems=problems,
        )

    def problems(self) -> list[str]:
        """Cross-key consistency checks (each entry names the keys involved)."""
        out: list[str] = []
        n = self.num_hidden_layers
        if len(self.compress_ratios) < n:
            out.append(
                f"compress_ratios has {len(self.compress_ratios)} entries, fewer than "
                f"num_hidden_layers ({n}); it needs one per layer"
            )
        if self.qk_rope_head_dim % 2:
            out.append(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even (pairwise RoPE)")
        if self.head_dim <= self.qk_rope_head_dim:
            out.append(
                f"head_dim ({self.head_dim}) must exceed qk_rope_head_dim ({self.qk_rope_head_dim})"
            )
        if self.index_head_dim <= self.qk_rope_head_dim:
            out.append(
                f"index_head_dim ({self.index_head_dim}) must exceed qk_rope_head_dim "
                f"({self.qk_rope_head_dim}): the indexer ropes its last qk_rope_head_dim dims"
            )
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            out.append(
                f"num_attention_heads*head_dim ({self.num_attention_heads * self.head_dim}) must be "
                f"divisible by o_groups ({self.o_groups})"
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            out.append(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts "
                f"({self.n_routed_experts})"
            )
        if self.bos_token_id is not None and self.bos_token_id >= self.vocab_size:
            out.append(
                f"bos_token_id ({self.bos_token_id}) is outside the vocabulary "
                f"(vocab_size {self.vocab_size})"
            )
        if self.tie_word_embeddings:
            out.append(
                "tie_word_embeddings is true; DeepSeek-V4 has an untied head, set it to false"
            )
        ids = self.dspark_target_layer_ids
        if ids is not None and (
            not isinstance(ids, list) or any(not isinstance(i, int) or not 0 <= i < n for i in ids)
        ):
            out.append(f"dspark_target_layer_ids {ids!r} must be a list of layer ids in [0, {n})")
        return out

    def to_config(self) -> dict[str, Any]:
        """The config.json dict (xspec and transformers' DeepseekV4Config read it)."""
        cfg = {k: v for k, v in asdict(self).items() if k != "extra"}
        for key in [k for k in cfg if k.startswith("dspark_")]:
            if cfg[key] is None:
                del cfg[key]
        cfg.update(
            architectures=["DeepseekV4ForCausalLM"],
            model_type="deepseek_v4",
            num_key_value_heads=1,  # shared-KV MQA
            hidden_act="silu",
            topk_method="noaux_tc",
        )
        return {**self.extra, **cfg}

    @classmethod
    def tiny(cls) -> DeepseekV4Args:
        """The tiny preset config: every Flash feature (SWA, CSA, HCA, hash layers) at toy size."""
        return cls(
            vocab_size=512,
            hidden_size=256,
            num_hidden_layers=5,
            num_attention_heads=8,
            head_dim=64,
            qk_rope_head_dim=16,
            q_lora_rank=128,
            o_groups=4,
            o_lora_rank=64,
            sliding_window=128,
            compress_ratios=[0, 0, 4, 128, 4, 0],  # last entry: the MTP layer
            compress_rope_theta=160000.0,
            rope_theta=10000.0,
            # original < max_position_embeddings so the official code applies YaRN too
            rope_scaling={
                "type": "yarn",
                "factor": 4,
                "original_max_position_embeddings": 256,
                "beta_fast": 32,
                "beta_slow": 1,
            },
            max_position_embeddings=4096,
            index_n_heads=4,
            index_head_dim=32,
            index_topk=8,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=128,
            scoring_func="sqrtsoftplus",
            norm_topk_prob=True,
            routed_scaling_factor=1.5,
            swiglu_limit=10.0,
            num_hash_layers=3,
            hc_mult=4,
            hc_sinkhorn_iters=20,
            hc_eps=1e-6,
            rms_norm_eps=1e-6,
            num_nextn_predict_layers=1,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=1,
            torch_dtype="float32",
        )


# Keys to_config writes that from_config derives instead of storing in ``extra``.
_DERIVED_KEYS = {
    "architectures",
    "model_type",
    "num_key_value_heads",
    "hidden_act",
    "topk_method",
    "dtype",
}


def _int(
    config: dict, key: str, problems: list[str], *, minimum: int, default: int | None = None
) -> Any:
    value = config.get(key, default)
    if problem := int_problem(key, value, minimum):
        problems.append(problem)
        return default
    return value


def _float(config: dict, key: str, problems: list[str], *, default: float) -> float:
    value = config.get(key, default)
    if not is_number(value):
        problems.append(f"{key} must be a finite number, got {value!r}")
        return default
    if value <= 0:
        problems.append(f"{key} must be > 0, got {value}")
    return float(value)


def _ratios(config: dict, problems: list[str]) -> list[int]:
    ratios = config.get("compress_ratios")
    if ratios is None:
        problems.append("missing key 'compress_ratios' (one entry per layer, each 0, 4 or 128)")
        return []
    if not isinstance(ratios, list):
        problems.append(f"compress_ratios must be a list, got {ratios!r}")
        return []
    bad = [(i, r) for i, r in enumerate(ratios) if r not in COMPRESS_RATIOS or isinstance(r, bool)]
    if bad:
        problems.append(
            f"compress_ratios entries must be one of {list(COMPRESS_RATIOS)}; bad (index, value): {bad}"
        )
    return [int(r) for r in ratios if r in COMPRESS_RATIOS]


def _rope_scaling(config: dict, problems: list[str]) -> dict[str, Any] | None:
    scaling = config.get("rope_scaling")
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        problems.append(f"rope_scaling must be an object or null, got {scaling!r}")
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        problems.append(f"rope_scaling type {kind!r} is not supported; use 'yarn' or null")
        return None
    problems += yarn_problems(scaling)
    return dict(scaling)


def _unsupported(config: dict, problems: list[str]) -> None:
    if config.get("num_key_value_heads", 1) != 1:
        problems.append(
            f"num_key_value_heads is {config['num_key_value_heads']}; DeepSeek-V4 uses one shared KV head (1)"
        )
    if config.get("kv_lora_rank") is not None:
        problems.append(
            "kv_lora_rank is set; DeepSeek-V4 has no KV LoRA (wkv maps hidden -> head_dim)"
        )
    if config.get("first_k_dense_replace", 0):
        problems.append(
            "first_k_dense_replace > 0 is not supported: every DeepSeek-V4 layer is MoE"
        )

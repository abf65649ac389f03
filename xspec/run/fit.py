"""Does every request of the CLI's workload fit the model's context (and the memory
plan)? :func:`context_fit` answers before anything is loaded, :func:`loaded_fit` after
the build; :func:`xspec.run.workloads.workload_problems` / ``load_workload`` apply them."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

from xspec.build import Built, checkpoint_config, resolve_gamma, trained_context
from xspec.config import RunConfig
from xspec.registry import models, spec_methods
from xspec.run.workloads import ContextFit
from xspec.tokenizer import Tokenizer, load_tokenizer


def context_fit(cfg: RunConfig) -> ContextFit | None:
    """The context every request of the CLI's workload must fit, before anything is
    loaded: ``model.max_context``, else the checkpoint's ``max_position_embeddings``
    (config.json, in the family's ``checkpoint_path``); the drafter's gamma; the
    checkpoint's tokenizer to count text prompts (loaded on first use). None when the
    limit is unknown (a plugin family that names no directory): :func:`loaded_fit`
    checks after the build. Call it on a config :func:`check` passed."""
    ckpt_dir, config = checkpoint_config(models.get(cfg.model.arch), cfg.model)
    checkpoint_limit = trained_context(config)
    limit = cfg.model.max_context or checkpoint_limit
    if limit is None:
        return None
    gamma = resolve_gamma(cfg, spec_methods.get(cfg.spec.method)).value
    encode = None
    if ckpt_dir is not None and isinstance(config.get("vocab_size"), int):
        ids = json.dumps([config.get("bos_token_id"), config.get("eos_token_id")])
        encode = _lazy_encode(
            ckpt_dir,
            config["vocab_size"],
            ids,
            cfg.model.tokenizer.value,
            cfg.model.path is not None,
        )
    if cfg.model.max_context is not None:
        source = f"model.max_context={cfg.model.max_context}"
        return ContextFit(limit, gamma, encode, source, raise_to=checkpoint_limit)
    return ContextFit(limit, gamma, encode, "the checkpoint's max_position_embeddings")


def loaded_fit(built: Built) -> ContextFit:
    """:func:`context_fit` of a built run: the target's own limit, the run's tokenizer and
    the memory plan (a request it can never hold is refused before the run too)."""
    m = built.cfg.model.max_context
    source = f"model.max_context={m}" if m is not None else "the model's max_position_embeddings"
    plan = built.engine.plan
    memory = plan.problem if plan is not None else None
    target, gamma = built.target, built.drafter.gamma
    return ContextFit(target.max_context, gamma, built.tokenizer.encode, source, memory=memory)


def _lazy_encode(
    path: Path, vocab: int, special_ids: str, kind: str, required: bool
) -> Callable[[str], list[int]]:
    """``encode`` of the checkpoint's tokenizer, loaded at the first call (a workload
    without text prompts never loads it). ``special_ids``: JSON ``[bos, eos]``."""

    def encode(text: str) -> list[int]:
        return _tokenizer_at(path, vocab, special_ids, kind, required).encode(text)

    return encode


@functools.lru_cache(maxsize=4)  # the jobs of a sweep share their model's tokenizer
def _tokenizer_at(path: Path, vocab: int, special_ids: str, kind: str, required: bool) -> Tokenizer:
    bos, eos = json.loads(special_ids)
    return load_tokenizer(path, vocab, bos, eos, kind=kind, required=required)

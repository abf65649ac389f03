"""Per-request sampling: parameters, logits processing, seeded draws.

One processing function, :func:`logits_to_probs`, turns raw logits into the
distribution a request samples from. Speculative decoding applies it *identically* to
the target's and the draft's logits, so the rejection sampler compares p and q in the
same processed space (temperature, top-k, top-p), which is what makes it exact.

Randomness: every random request owns a ``torch.Generator`` (:func:`make_generator`),
seeded from its ``SamplingParams.seed``. Greedy requests have no generator and never
consume randomness, so a greedy request's output never depends on its batch mates.
Draws use inverse-CDF sampling with one uniform per token (``inverse_cdf``), so the
number of uniforms a request consumes depends only on its own trajectory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from xspec.errors import RequestError

__all__ = [
    "MAX_LOGPROBS",
    "SamplingParams",
    "TokenLogprob",
    "as_logit_bias",
    "draw_uniforms",
    "inverse_cdf",
    "logits_to_probs",
    "make_generator",
    "nonfinite_rows",
    "regime_of",
    "sample",
    "token_logprobs",
]

MAX_LOGPROBS = 20  # top alternatives per token at most (OpenAI's bound)
MAX_REPETITION_PENALTY = 10.0
LOGPROBS_MODES = ("raw", "processed")
_MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed accepts unsigned 64-bit seeds
_GREEDY_BELOW = 1e-5  # temperatures below this are treated as 0 (greedy)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. The defaults are greedy decoding."""

    temperature: float = 0.0  # 0 (or < 1e-5) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # per-request seed; None = nondeterministic
    # logits processors (xspec.spec.processors), applied before temperature/top-k/top-p
    presence_penalty: float = 0.0  # minus this for every token generated at least once
    frequency_penalty: float = 0.0  # minus this times each token's count in the output
    repetition_penalty: float = 1.0  # vLLM's: prompt and output tokens' logits / (or *) it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, added to logits
    min_tokens: int = 0  # the stop ids are masked until this many tokens are generated
    # the target's log-probabilities: top-k alternatives per generated / prompt token
    logprobs: int | None = None  # None = off; 0 = the chosen token only
    prompt_logprobs: int | None = None  # None = off; the first prompt token's is None
    logprobs_mode: str = "raw"  # "raw": the model's; "processed": what the request samples from

    def problems(self) -> list[str]:
        """Every invalid field, as messages naming the key and the fix; empty if valid."""
        return self._sampling_problems() + self._processor_problems()

    def _sampling_problems(self) -> list[str]:
        out: list[str] = []
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            out.append(
                f"sampling.temperature must be a finite number >= 0 (got {t!r}); use 0 for greedy"
            )
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            out.append(
                f"sampling.top_k must be an integer >= 0 (got {k!r}); use 0 to disable top-k"
            )
        if not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            out.append(f"sampling.top_p must be in (0, 1] (got {p!r}); use 1.0 to disable top-p")
        if s is not None and (
            isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= _MAX_SEED
        ):
            out.append(f"sampling.seed must be null or an integer in [0, 2**64) (got {s!r})")
        return out

    def _processor_problems(self) -> list[str]:
        out: list[str] = []
        for key in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, key)
            if not _is_real(v) or not -2.0 <= v <= 2.0:
                out.append(f"sampling.{key} must be a number in [-2, 2] (got {v!r}); 0 is off")
        r = self.repetition_penalty
        if not _is_real(r) or not 0.0 < r <= MAX_REPETITION_PENALTY:
            out.append(
                f"sampling.repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] "
                f"(got {r!r}); 1 is off"
            )
        bias = self.logit_bias
        if not isinstance(bias, tuple) or not all(
            isinstance(e, tuple) and len(e) == 2 and _is_int(e[0]) and e[0] >= 0 and _is_real(e[1])
            for e in bias
        ):
            out.append(
                f"sampling.logit_bias must map token ids (integers >= 0) to numbers (got {bias!r})"
            )
        elif bad := [e for e in bias if not -100.0 <= e[1] <= 100.0]:
            out.append(f"sampling.logit_bias values must be in [-100, 100] (got {bad[:4]})")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            out.append(f"sampling.min_tokens must be an integer >= 0 (got {self.min_tokens!r})")
        for key in ("logprobs", "prompt_logprobs"):
            v = getattr(self, key)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                out.append(
                    f"sampling.{key} must be null or an integer in [0, {MAX_LOGPROBS}] "
                    f"(got {v!r}): the alternatives returned per token"
                )
        if self.logprobs_mode not in LOGPROBS_MODES:
            out.append(
                f"sampling.logprobs_mode must be one of {', '.join(LOGPROBS_MODES)} "
                f"(got {self.logprobs_mode!r})"
            )
        return out

    @property
    def has_processors(self) -> bool:
        """Whether any logits processor changes this request's logits."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    @cached_property
    def valid(self) -> bool:
        """No :meth:`problems`; computed once (the fields are frozen), since every
        processing call checks each of its rows' parameters."""
        return not self.problems()

    @property
    def greedy(self) -> bool:
        # Like vLLM, temperatures below 1e-5 are greedy: logits / 1e-30 overflows to inf
        # and the softmax would be NaN.
        return self.temperature < _GREEDY_BELOW


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def as_logit_bias(bias: Mapping[Any, Any] | None) -> tuple[tuple[int, float], ...]:
    """A ``{token id: bias}`` mapping (ids may be strings, as JSON keys are) as the
    sorted pairs :class:`SamplingParams` holds; what is not an id is kept for its check."""
    if not bias:
        return ()
    pairs = []
    for k, v in bias.items():
        key = int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() else k
        pairs.append((key, float(v) if _is_real(v) else v))
    return tuple(sorted(pairs, key=lambda e: (0, e[0], "") if _is_int(e[0]) else (1, 0, str(e[0]))))


def regime_of(params: SamplingParams, *, words: bool = False) -> str:
    """The sampling regime a request is in: a short label for metrics and acceptance
    estimates (``greedy``, ``T=0.8``, with ``,top_k=..`` / ``,top_p=..`` when set), or
    with ``words`` a phrase for messages (``greedy (temperature 0)``, ``temperature 0.8,
    top_k 5``). Greedy is one regime whatever its top-k and top-p (they do not change an
    argmax)."""
    if params.greedy:
        return "greedy (temperature 0)" if words else "greedy"
    parts = [("T", f"{params.temperature:g}")]
    if params.top_k:
        parts.append(("top_k", str(params.top_k)))
    if params.top_p < 1.0:
        parts.append(("top_p", f"{params.top_p:g}"))
    if words:
        return ", ".join(f"{'temperature' if k == 'T' else k} {v}" for k, v in parts)
    return ",".join(f"{k}={v}" for k, v in parts)


def nonfinite_rows(logits: Tensor) -> Tensor:
    """``logits [N, V]`` -> ``[N]`` bool: rows holding a NaN or an infinity.

    Raw model logits are finite; a row that is not is a numerical fault of its request
    (overflow in a low-precision dtype, a bad weight), which must end that request only.
    """
    return ~torch.isfinite(logits).all(dim=-1)


def make_generator(
    params: SamplingParams, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """The request's private generator: seeded from ``params.seed``; None for greedy."""
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()  # fresh nondeterministic seed, as the user asked for
    else:
        gen.manual_seed(params.seed)
    return gen


def _check_params(params: Sequence[SamplingParams], num_rows: int) -> None:
    if len(params) != num_rows:
        raise ValueError(
            f"logits_to_probs: {num_rows} logits rows but {len(params)} SamplingParams"
        )
    if all(sp.valid for sp in params):  # each object's check is done once and kept
        return
    problems = [f"row {i}: {msg}" for i, sp in enumerate(params) for msg in sp.problems()]
    raise RequestError("invalid sampling parameters:", problems=problems)


def logits_to_probs(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Process logits into sampling distributions, one ``SamplingParams`` per row.

    logits: [N, V] any float dtype -> probs: [N, V] float32, each row sums to 1.

    Greedy rows: one-hot at the argmax (ties -> lowest index). Other rows: divide by
    temperature, keep the top-k (exactly k tokens; ties at the boundary keep the lowest
    indices), keep the smallest top-p nucleus of what remains (mass >= top_p, at least
    one token), softmax. Applied unchanged to target and draft logits.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits_to_probs expects logits [N, V], got shape {tuple(logits.shape)}")
    num_rows, vocab = logits.shape
    _check_params(params, num_rows)
    logits = logits.float()  # [N, V]
    device = logits.device

    rand_rows = [i for i, sp in enumerate(params) if not sp.greedy]
    probs = None  # [N, V]: the greedy rows' one-hots, when there are greedy rows
    if len(rand_rows) < num_rows:
        # Greedy rows: torch.argmax returns the first maximal index, i.e. ties -> lowest
        # index. (Computed for every row; random rows are overwritten below.)
        probs = torch.zeros_like(logits)
        probs.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        if not rand_rows:
            return probs

    # Random rows only: temperature, then top-k, then top-p, then softmax.
    rand_params = [params[i] for i in rand_rows]
    idx = torch.tensor(rand_rows, device=device)  # [M]
    temps = torch.tensor([sp.temperature for sp in rand_params], device=device)  # [M]
    scaled = (logits if probs is None else logits[idx]) / temps[:, None]  # [M, V]

    k_rows = [j for j, sp in enumerate(rand_params) if 0 < sp.top_k < vocab]
    if k_rows:
        sub = torch.tensor(k_rows, device=device)
        k_host = [rand_params[j].top_k for j in k_rows]
        k = torch.tensor(k_host, device=device)  # [Mk]
        keep = _top_k_mask(scaled[sub], k, max(k_host))  # [Mk, V]
        scaled[sub] = scaled[sub].masked_fill(~keep, float("-inf"))

    # Rows with top_p == 1 skip this: float cumsums can reach 1.0 early and drop a tail.
    p_rows = [j for j, sp in enumerate(rand_params) if sp.top_p < 1.0]
    if p_rows:
        sub = torch.tensor(p_rows, device=device)
        top_p = torch.tensor([rand_params[j].top_p for j in p_rows], device=device)  # [Mp]
        # Tokens top-k removed are -inf and rank last, so the best max(k) candidates
        # hold every kept token; only rows without top-k need a full-vocabulary sort.
        cap = max(
            rand_params[j].top_k if 0 < rand_params[j].top_k < vocab else vocab for j in p_rows
        )
        keep = _top_p_mask(scaled[sub], top_p, cap)  # [Mp, V]
        scaled[sub] = scaled[sub].masked_fill(~keep, float("-inf"))

    if probs is None:  # every row random (a sampled batch: no greedy row to keep)
        return scaled.softmax(dim=-1)
    probs[idx] = scaled.softmax(dim=-1)
    return probs


def _ranked(scores: Tensor, cap: int) -> tuple[Tensor, Tensor]:
    """The ``cap`` best entries of each row, by value descending then index ascending.

    scores [M, V] -> (values [M, cap], token ids [M, cap]). Ties must be ordered by
    index so the same logits always give the same top-k/top-p sets; torch.topk does not
    promise an order among ties, hence the re-sort of its (small) result.
    """
    if cap >= scores.shape[-1]:
        return scores.sort(dim=-1, descending=True, stable=True)
    values, ids = scores.topk(cap, dim=-1)  # [M, cap], tie order unspecified
    ids, perm = ids.sort(dim=-1)  # index ascending ...
    values, perm2 = values.gather(1, perm).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(1, perm2)  # ... then value descending, stable keeps index order


def _top_k_mask(scores: Tensor, k: Tensor, k_max: int) -> Tensor:
    """Exactly ``k[i]`` best tokens per row, ties at the boundary to the lowest indices.

    scores [M, V], k [M] int64 in [1, V), k_max = max(k) (a host int: no device read)
    -> keep [M, V] bool.
    """
    kth = scores.topk(k_max, dim=-1).values.gather(1, (k - 1)[:, None])  # [M, 1]
    above = scores > kth  # [M, V] certainly kept
    tied = scores == kth  # [M, V] kept in index order while room is left
    room = k[:, None] - above.sum(dim=-1, keepdim=True)  # [M, 1] >= 1
    return above | (tied & (tied.cumsum(dim=-1) <= room))


def _top_p_mask(scores: Tensor, top_p: Tensor, cap: int) -> Tensor:
    """Smallest set of best tokens whose mass reaches ``top_p`` (always >= 1 token).

    scores [M, V] (-inf = removed), top_p [M] in (0, 1), cap >= kept tokens per row
    -> keep [M, V] bool.
    """
    values, ids = _ranked(scores, cap)  # [M, cap] each
    ranked_probs = values.softmax(dim=-1)  # [M, cap]: every kept token is among the cap best
    mass_before = ranked_probs.cumsum(dim=-1) - ranked_probs  # [M, cap] mass of better tokens
    # Keep a token iff the tokens ranked above it hold < top_p; rank 0 always stays.
    nucleus = mass_before < top_p[:, None]
    nucleus[:, 0] = True
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, ids, nucleus)


def draw_uniforms(
    generators: Sequence[torch.Generator | None], counts: Sequence[int], device: torch.device
) -> Tensor:
    """Draw ``counts[i]`` uniforms in [0, 1) from ``generators[i]`` for every row i.

    Returns u: [N, max(counts)] float32 on ``device``; row i holds its draws in columns
    ``0..counts[i]-1`` (the rest is 0). Rows with a None generator must have count 0.
    Rows that share one generator object draw in a single call, in row order: that is
    how the statistical tests get 1e5 samples in one batch. A request with its own
    generator consumes exactly ``counts[i]`` values, whatever its batch mates do.
    """
    width = max(counts, default=0)
    groups: dict[int, tuple[torch.Generator, list[int]]] = {}
    for i, (gen, n) in enumerate(zip(generators, counts)):
        if gen is None:
            if n:
                raise ValueError(f"row {i} has no generator (greedy) but needs {n} random draws")
            continue
        if n:
            groups.setdefault(id(gen), (gen, []))[1].append(i)
    # One draw per generator, then one copy into place: a batch of requests with their
    # own generators is one small call each, not a few tensor ops per request.
    draws, slots = [], []  # draws[g]: group g's values; slots: their flat [N * W] indices
    for gen, rows in groups.values():
        draws.append(torch.rand(sum(counts[i] for i in rows), generator=gen, device=gen.device))
        slots += [i * width + j for i in rows for j in range(counts[i])]
    size = len(counts) * width
    if not draws:
        return torch.zeros(len(counts), width, device=device)
    flat = torch.cat([d.to(device) for d in draws])  # [sum n]
    if len(slots) == size and slots == list(range(size)):  # every row full, in order
        return flat.view(len(counts), width)
    u = torch.zeros(size, device=device)  # [N * W]
    u[torch.tensor(slots, device=device)] = flat
    return u.view(len(counts), width)


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """Token whose CDF interval holds ``u * total``: probs [M, V] >= 0, u [M] -> [M] int64.

    A zero-probability token has an empty interval, so it is never returned. Rows need
    not be normalised (the residual distributions of verify are not).
    """
    cdf = probs.float().cumsum(dim=-1)  # [M, V]
    target = u.float() * cdf[:, -1]  # [M], strictly below the row total since u < 1
    idx = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)  # first cdf > target
    return idx.clamp_(max=probs.shape[-1] - 1)


def sample(
    probs: Tensor,
    generators: Sequence[torch.Generator | None],
    *,
    check_greedy: bool = True,
    uniforms: Tensor | None = None,
) -> Tensor:
    """Draw one token per row: probs [N, V] -> tokens [N] int64.

    Rows whose generator is None are greedy: their probs must be one-hot (as
    :func:`logits_to_probs` makes them) and they take the argmax without consuming
    randomness. Other rows draw one uniform from their own generator, or take theirs
    from ``uniforms [N]`` (drawn beforehand with :func:`draw_uniforms`: a block drafter
    draws every position's at once; greedy rows' entries are ignored). ``check_greedy``
    verifies the one-hot rows (a device read); callers passing ``logits_to_probs``
    output skip it, so sampling never waits for the device.
    """
    if probs.dim() != 2 or len(generators) != probs.shape[0]:
        raise ValueError(
            f"sample expects probs [N, V] and N generators, got {tuple(probs.shape)} and {len(generators)}"
        )
    greedy = [g is None for g in generators]
    tokens = probs.argmax(dim=-1)  # [N]
    if all(greedy) and not check_greedy:
        return tokens
    is_greedy = torch.tensor(greedy, dtype=torch.bool, device=probs.device)  # [N]
    if check_greedy and bool((is_greedy & (probs.amax(dim=-1) != 1.0)).any()):
        raise ValueError("sample: a row without generator (greedy) has probs that are not one-hot")
    if all(greedy):
        return tokens
    if uniforms is None:
        uniforms = draw_uniforms(generators, [0 if g else 1 for g in greedy], probs.device)[:, 0]
    elif uniforms.shape != (probs.shape[0],):
        raise ValueError(
            f"sample: uniforms must be [{probs.shape[0]}], got {tuple(uniforms.shape)}"
        )
    return torch.where(is_greedy, tokens, inverse_cdf(probs, uniforms))


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probability: the token there, its logprob, and the ``k`` most
    likely tokens of that position's distribution (``(id, logprob)``, best first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logprobs: Tensor, tokens: Tensor, k: int) -> list[TokenLogprob]:
    """``logprobs [N, V]`` (log-softmax rows), ``tokens [N]`` -> one :class:`TokenLogprob`
    per row with its top ``k`` (ties to the lowest id); one host copy."""
    chosen = logprobs.gather(1, tokens[:, None].long())[:, 0]  # [N]
    if k > 0:
        values, ids = _ranked(logprobs, k)  # [N, k] each
        top_v, top_i = values.tolist(), ids.tolist()
    else:
        top_v = top_i = [[] for _ in range(len(tokens))]
    return [
        TokenLogprob(t, lp, tuple(zip(i, v)))
        for t, lp, i, v in zip(tokens.tolist(), chosen.tolist(), top_i, top_v)
    ]

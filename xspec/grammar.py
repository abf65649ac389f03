"""Grammars that constrain generation: JSON, JSON Schema, regex, a choice, Lark / GBNF.

A request's constraint is a :class:`GrammarSpec` (what the user asked for, checked);
:class:`GrammarCompiler` turns it into a :class:`Grammar` for one tokenizer, once (an LRU
of compiled grammars keyed by the spec); each request then takes its own
:class:`Constraint` (the matcher's state along the committed tokens).

The engine is llguidance (a lexer/parser split that computes a token mask in tens of
microseconds for a 128k vocabulary; its matcher rolls back, which speculation needs).
What speculation asks of a constraint:

- :meth:`Constraint.allowed`, :meth:`Constraint.push` and :meth:`Constraint.pop`: the
  mask here, a tentative step and its rollback, from which the speculative step walks
  its drafts (:func:`xspec.spec.constrained.constrain_drafts`, which also redraws and
  proposes forced tokens).
- :meth:`Constraint.path_masks`: the masks along a given draft path (the committed
  prefix, then each draft prefix). The matcher walks the drafts as far as the
  grammar allows and rolls back, so after the call it is where it was. A draft the grammar
  forbids has masked probability 0 and is rejected for certain, and a stop token ends the
  request: the rows past either are never sampled (they repeat the last reachable mask,
  so every row stays a distribution).
- :meth:`Constraint.forced`: the tokens the grammar forces from here (JSON punctuation,
  a schema's keys): a step can propose them instead of the drafter's guesses.
- :meth:`Constraint.commit`: the tokens the step committed.

Limits: a grammar is compiled under llguidance's parser limits (grammar size, lexer fuel
per token), so a pathological schema is refused when compiled or fails its request, never
stalls a step; a spec's text is bounded by :data:`MAX_SPEC_CHARS`.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import torch

from xspec.errors import RequestError
from xspec.json_schema import compact_schema
from xspec.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

GrammarKind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]
KINDS: tuple[GrammarKind, ...] = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20  # a schema or grammar's text; larger is a 400, not a compile
MAX_CHOICES = 4096
CACHE_SIZE = 64  # compiled grammars kept per tokenizer
# JSON is written as Python's json.dumps writes it: ", " and ": ", no other whitespace
# (flexible whitespace lets a model pad forever). A schema's own "x-guidance" object
# overrides this (llguidance's JSON options, e.g. {"whitespace_flexible": true}).
JSON_LAYOUT: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_REASONING_CHARS = 1 << 16  # a reasoning bound past this is a 400 (its lexer grows with it)


@dataclass(frozen=True)
class Reasoning:
    """Free text the output starts with, before its grammar applies: the model's
    reasoning, up to ``end`` (thinking mode). ``opened``: the prompt opened it
    (DeepSeek-V4's ends with ``<think>``), else the model writes ``start`` first (Qwen3),
    and may put up to two newlines after ``end`` (as Qwen3's template writes them).
    ``max_chars``: at most this many characters of reasoning, then ``end`` is forced
    (None: unbounded; a model that never closes its reasoning runs to ``max_tokens``)."""

    opened: bool = True
    max_chars: int | None = None
    start: str = "<think>"
    end: str = "</think>"

    def lark(self) -> str:
        """The Lark terminal of the reasoning with its tags: text that never holds
        ``end`` (llguidance's ``&`` / ``~`` on regexes), then ``end``."""
        size = "*" if self.max_chars is None else f"{{0,{self.max_chars}}}"
        body = f"(/(?s:.{size})/ & ~/(?s:.*){_regex(self.end)}(?s:.*)/)"
        if self.opened:
            return f"{body} {json.dumps(self.end)}"
        return f"{json.dumps(self.start)} {body} {json.dumps(self.end)} /\\n{{0,2}}/"


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to. ``source``: the JSON Schema (as canonical
    JSON text), the regex, the choices (a JSON list) or the Lark / GBNF grammar; empty
    for ``json_object``. Build with the class methods, which check their input."""

    kind: GrammarKind
    source: str = ""
    reasoning: Reasoning | None = None  # free text first (:meth:`after_reasoning`)

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: Any, where: str = "json_schema") -> GrammarSpec:
        if isinstance(schema, bool):  # JSON Schema's true / false schemas
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise RequestError(f"{where} must be a JSON Schema object, got {_kind(schema)}")
        return cls("json_schema", _bounded(json.dumps(schema), where))  # key order is output order

    @classmethod
    def regex(cls, pattern: Any, where: str = "regex") -> GrammarSpec:
        if not isinstance(pattern, str) or not pattern:
            raise RequestError(f"{where} must be a non-empty string, got {_kind(pattern)}")
        return cls("regex", _bounded(pattern, where))

    @classmethod
    def choice(cls, choices: Any, where: str = "choice") -> GrammarSpec:
        if (
            not isinstance(choices, list)
            or not choices
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise RequestError(f"{where} must be a non-empty list of non-empty strings")
        if len(choices) > MAX_CHOICES:
            raise RequestError(f"{where} has {len(choices)} choices; at most {MAX_CHOICES}")
        return cls("choice", _bounded(json.dumps(choices), where))

    @classmethod
    def grammar(cls, text: Any, where: str = "grammar") -> GrammarSpec:
        if not isinstance(text, str) or not text.strip():
            raise RequestError(f"{where} must be a non-empty Lark or GBNF grammar string")
        return cls("grammar", _bounded(text, where))

    def after_reasoning(self, *, opened: bool = True, max_chars: int | None = None) -> GrammarSpec:
        """This constraint after the model's reasoning (thinking mode): the output is free
        text up to ``</think>`` (:class:`Reasoning`), then this grammar's."""
        if max_chars is not None and not 0 <= max_chars <= MAX_REASONING_CHARS:
            raise RequestError(
                f"the reasoning bound must be in [0, {MAX_REASONING_CHARS}] characters, "
                f"got {max_chars}"
            )
        return dataclasses.replace(self, reasoning=Reasoning(opened, max_chars))

    def llguidance(self) -> str:
        """The grammar in llguidance's input form; RequestError if it cannot be read."""
        grammar = self._answer()
        if self.reasoning is None:
            return grammar
        # the answer is a grammar of its own, which the reasoning's Lark rule names (@answer)
        top = json.loads(grammar) if grammar.lstrip().startswith("{") else _lark_top(grammar)
        top["grammars"][0]["name"] = "answer"
        lark = f"start: REASONING @answer\nREASONING: {self.reasoning.lark()}"
        top["grammars"].insert(0, {"name": "reasoning", "lark_grammar": lark})
        return json.dumps(top)

    def _answer(self) -> str:
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_LAYOUT)
        if self.kind == "json_schema":
            schema = compact_schema(json.loads(self.source))
            return LLMatcher.grammar_from_json_schema(schema, JSON_LAYOUT)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in json.loads(self.source))
            return LLMatcher.grammar_from_lark(f"start: {alternatives}")
        try:
            lark = any_to_lark(self.source)  # GBNF converted; Lark passes through
        except Exception as e:  # the converter raises bare Exceptions on bad GBNF
            raise RequestError(f"grammar: cannot read it as Lark or GBNF ({e})") from None
        return LLMatcher.grammar_from_lark(lark)


def request_spec(response_format: Any = None, structured_outputs: Any = None) -> GrammarSpec | None:
    """The constraint of a request's OpenAI ``response_format`` (``text``, ``json_object``,
    ``json_schema`` with its ``schema``; ``strict`` or not, the schema is enforced) or vLLM's
    ``structured_outputs`` (exactly one of ``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object``); None when neither constrains. RequestError names the field."""
    if response_format is not None and structured_outputs is not None:
        raise RequestError("set response_format or structured_outputs, not both")
    if structured_outputs is not None:
        return _structured_outputs(structured_outputs)
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise RequestError("response_format must be an object with a 'type'")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object()
    if kind == "json_schema":
        body = response_format.get("json_schema")
        if not isinstance(body, dict) or "schema" not in body:
            raise RequestError(
                "response_format.json_schema must be an object with a 'schema' (and a 'name')"
            )
        return GrammarSpec.json_schema(body["schema"], "response_format.json_schema.schema")
    raise RequestError(f"response_format.type={kind!r}: use 'text', 'json_object' or 'json_schema'")


_STRUCTURED = ("json", "regex", "choice", "grammar", "json_object")


def _structured_outputs(body: Any) -> GrammarSpec | None:
    if not isinstance(body, dict):
        raise RequestError(
            f"structured_outputs must be an object with one of {', '.join(_STRUCTURED)}"
        )
    if unknown := sorted(set(body) - set(_STRUCTURED)):
        raise RequestError(
            f"structured_outputs.{unknown[0]} is not supported; use one of {', '.join(_STRUCTURED)}"
        )
    given = [k for k in _STRUCTURED if body.get(k) not in (None, False)]
    if len(given) > 1:
        raise RequestError(f"structured_outputs sets {' and '.join(given)}; set exactly one")
    if not given:
        return None
    key, value = given[0], body[given[0]]
    where = f"structured_outputs.{key}"
    if key == "json":
        if isinstance(value, str):  # vLLM takes the schema as JSON text too
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
                raise RequestError(f"{where} is a string that is not a JSON Schema") from None
        return GrammarSpec.json_schema(value, where)
    if key == "regex":
        return GrammarSpec.regex(value, where)
    if key == "choice":
        return GrammarSpec.choice(value, where)
    if key == "grammar":
        return GrammarSpec.grammar(value, where)
    if value is not True:
        raise RequestError(f"{where} must be true or unset")
    return GrammarSpec.json_object()


def _lark_top(lark: str) -> dict[str, Any]:
    """A Lark grammar as llguidance's top-level grammar object (a list of grammars)."""
    return {"grammars": [{"name": "lark", "lark_grammar": lark}]}


def _regex(text: str) -> str:
    """``text`` as a literal inside a Lark ``/.../`` regex."""
    return "".join("\\" + c if c in r"\/.^$*+?()[]{}|-" else c for c in text)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _bounded(text: str, where: str) -> str:
    if len(text) > MAX_SPEC_CHARS:
        raise RequestError(f"{where} is {len(text):,} characters; at most {MAX_SPEC_CHARS:,}")
    return text


class Grammar:
    """One compiled grammar for one tokenizer; :meth:`constraint` starts a request's."""

    def __init__(
        self,
        spec: GrammarSpec,
        prototype: Any,
        vocab_size: int,
        stop_ids: frozenset[int],
        forced_tokens: bool = True,
    ) -> None:
        self.spec, self._prototype = spec, prototype
        self.vocab_size, self.stop_ids, self.forced_tokens = vocab_size, stop_ids, forced_tokens

    def constraint(self) -> Constraint:
        m = self._prototype.deep_copy()
        return Constraint(m, self.vocab_size, self.stop_ids, forced_tokens=self.forced_tokens)


class GrammarCompiler:
    """Compiles specs for one tokenizer and model vocabulary (``vocab_size`` logits; ids
    past the tokenizer's own vocabulary are never allowed). The compiled grammars are
    kept, least recently used first out, :data:`CACHE_SIZE` of them. ``forced_tokens``
    False: :meth:`Constraint.forced` offers none (``spec.forced_tokens``). Thread-safe: a
    server compiles on worker threads (llguidance releases the GIL while it compiles)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, forced_tokens: bool = True) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.forced_tokens = forced_tokens
        self._ll: Any = None
        self._cache: OrderedDict[GrammarSpec, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def _lltokenizer(self) -> Any:
        with self._lock:
            if self._ll is None:
                self._ll = _lltokenizer(self.tokenizer, self.vocab_size)
            return self._ll

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The grammar of ``spec``; RequestError (llguidance's message: where in the
        schema or grammar, what is wrong) when it cannot be compiled."""
        with self._lock:
            if (hit := self._cache.get(spec)) is not None:
                self._cache.move_to_end(spec)
                return hit
        from llguidance import LLMatcher

        source = spec.llguidance()
        matcher = LLMatcher(self._lltokenizer(), source, log_level=0)
        if matcher.is_error():
            raise RequestError(
                f"{spec.kind}: the grammar cannot be compiled: {matcher.get_error()}"
            )
        grammar = Grammar(
            spec, matcher, self.vocab_size, self.tokenizer.stop_ids, self.forced_tokens
        )
        with self._lock:
            self._cache[spec] = grammar
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar


def _lltokenizer(tokenizer: Tokenizer, vocab_size: int) -> Any:
    from llguidance import LLTokenizer, TokenizerWrapper

    stops = sorted(tokenizer.stop_ids)
    if not stops:
        raise RequestError(
            "constrained generation needs a stop token (the grammar ends in one); this "
            "model's config names no eos_token_id"
        )
    if isinstance(tokenizer, HFTokenizer):
        text = tokenizer.path.read_text(encoding="utf-8")
        return LLTokenizer(text, n_vocab=vocab_size, eos_token=stops)
    if isinstance(tokenizer, ByteTokenizer):
        return LLTokenizer(TokenizerWrapper(_ByteVocab(tokenizer, vocab_size)), eos_token=stops)
    raise RequestError(f"constrained generation does not support {type(tokenizer).__name__}")


class _ByteVocab:
    """The byte tokenizer in the shape llguidance's TokenizerWrapper reads: each id's
    bytes (special ids get a name no text produces) and an encoder."""

    def __init__(self, tokenizer: ByteTokenizer, vocab_size: int) -> None:
        self._tok = tokenizer
        low, high = tokenizer.offset, tokenizer.offset + 256
        self.tokens = [
            bytes([i - low]) if low <= i < high else f"<|xspec_{i}|>".encode()
            for i in range(vocab_size)
        ]
        self.special_token_ids = [i for i in range(vocab_size) if not low <= i < high]
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id

    def __call__(self, text: bytes | str) -> list[int]:
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        return [b + self._tok.offset for b in data]


class Constraint:
    """One request's place in its grammar: the matcher after the committed tokens."""

    def __init__(
        self, matcher: Any, vocab_size: int, stop_ids: frozenset[int], forced_tokens: bool = True
    ) -> None:
        self._m, self.vocab_size, self.stop_ids = matcher, vocab_size, stop_ids
        self.forced_tokens = forced_tokens
        self._words = (vocab_size + 31) // 32
        self._shifts = torch.arange(32, dtype=torch.int32)

    @property
    def finished(self) -> bool:
        """The grammar is complete and admits nothing more (only a stop token)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        return self._m.get_error() or None

    def _mask_into(self, words: torch.Tensor) -> None:
        self._m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def _unpack(self, words: torch.Tensor) -> torch.Tensor:
        bits = (words.unsqueeze(-1) >> self._shifts) & 1
        return bits.reshape(*words.shape[:-1], -1)[..., : self.vocab_size].bool()

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar admits next."""
        words = torch.zeros(self._words, dtype=torch.int32)
        self._mask_into(words)
        return self._unpack(words)

    def path_masks(self, drafts: list[int]) -> torch.Tensor:
        """[len(drafts) + 1, vocab] bool: row j is the mask after the committed tokens and
        ``drafts[:j]``. Past the first draft the grammar forbids, rows repeat the last
        reachable one (that draft is rejected for certain; those rows are never sampled).
        The matcher ends where it started."""
        words = torch.zeros(len(drafts) + 1, self._words, dtype=torch.int32)
        self._mask_into(words[0])
        walked = 0
        for j, token in enumerate(drafts, 1):
            allowed = 0 <= token < self.vocab_size and (words[j - 1, token // 32] >> token % 32) & 1
            # a stop token ends the request: rows past it are never sampled either
            if not allowed or token in self.stop_ids or not self.push(token):
                words[j:] = words[j - 1]
                break
            walked += 1
            self._mask_into(words[j])
        self.pop(walked)
        return self._unpack(words)

    def push(self, token: int) -> bool:
        """Advance by one (not a stop) token the mask allows, tentatively; False if the
        grammar refuses it. :meth:`pop` takes pushed tokens back."""
        return bool(self._m.consume_token(token))

    def pop(self, count: int) -> None:
        """Take back the last ``count`` pushed tokens."""
        if count:
            self._m.rollback(count)

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces from here (may be empty; always
        empty when the compiler was made with ``forced_tokens=False``)."""
        if limit <= 0 or not self.forced_tokens:
            return []
        return list(self._m.compute_ff_tokens()[:limit])

    def commit(self, tokens: list[int]) -> None:
        """Advance past tokens the step committed (each was sampled under the mask), up
        to a stop token."""
        # a stop token ends the request (the mask admits one only where the grammar is
        # complete); the matcher is not fed it: its rollback history counts no stop
        end = next((i for i, t in enumerate(tokens) if t in self.stop_ids), len(tokens))
        tokens = tokens[:end]
        if tokens and not self._m.consume_tokens(tokens):
            raise RuntimeError(f"grammar matcher refused committed tokens: {self._m.get_error()}")

"""What a speculative step counts, in one place: the Prometheus counters
(:class:`xspec.metrics.SpecDecodeMetrics`, results.json), a request's ``usage.spec_decode``
(the server), and ``python -m xspec.bench`` all count with :class:`SpecCounts` and
:func:`acceptance_length`, so their figures agree for the same requests.

vLLM's definitions, per verify row (one request in one decode step):

- a **draft** is a row that carried >= 1 draft token (``num_drafts``); a row that drafted
  nothing (no drafter, an adaptive depth of 0, a request at its last token) is not one;
- ``num_draft_tokens``: the draft tokens the row sent to verification;
- ``num_accepted_tokens``: the draft tokens it kept (its committed tokens - 1: the last one
  is the target's correction or bonus token);
- **acceptance length** = 1 + accepted / drafts: the tokens a drafting row commits.

Torch-free: the benchmark client imports it.
"""

from __future__ import annotations

from dataclasses import dataclass


def acceptance_length(num_accepted_tokens: int, num_drafts: int) -> float:
    """vLLM's and SGLang's acceptance length: ``1 + accepted / drafts``, the tokens a verify
    row that carried drafts commits (its accepted drafts plus the correction/bonus token),
    averaged over those rows. 1.0 when nothing was drafted (each step then commits one
    token). It equals xspec's ``mean_accepted_length + 1``."""
    return 1.0 + (num_accepted_tokens / num_drafts if num_drafts else 0.0)


@dataclass
class SpecCounts:
    """vLLM's three speculative counters over some verify rows (one request's, a run's)."""

    num_drafts: int = 0  # rows that carried >= 1 draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0  # the correction/bonus token excluded

    def add_row(self, draft_tokens: int, accepted: int) -> None:
        """Count one verify row: ``draft_tokens`` verified, ``accepted`` of them kept."""
        self.num_drafts += draft_tokens > 0
        self.num_draft_tokens += draft_tokens
        self.num_accepted_tokens += accepted

    def __add__(self, other: SpecCounts) -> SpecCounts:
        return SpecCounts(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
        )

    @property
    def acceptance_length(self) -> float:
        return acceptance_length(self.num_accepted_tokens, self.num_drafts)

    def usage(self) -> dict[str, int | float]:
        """The ``usage.spec_decode`` object of a response (vLLM's
        ``--per-request-spec-decode-metrics`` names)."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_length": self.acceptance_length,
        }

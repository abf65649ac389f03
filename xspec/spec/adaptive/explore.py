"""When the adaptive decision takes the other kind of step, plain or drafting, to measure it.

The step-cost model learns the cost of drafting relative to a plain step only from steps
of both kinds close together (:class:`~.online.OnlineStepCost`), and a kind the decision
stopped taking is never measured again otherwise. :class:`Exploration` therefore takes the
kind that is not the best now and then: each bucket of batch sizes gets a few runs of
each kind early, and a kind predicted near the best (within :data:`EXPLORE_WIDE`) is
re-explored at a spacing that bounds what re-exploring costs (:data:`EXPLORE_BUDGET` of
the time, by the model).

:class:`Probes` is the recovery of a batch size where drafting is cheap (see
:meth:`~.policy.AdaptiveDepth.decide`): while its steps are plain, drafts are offered again
after :data:`PROBE_FIRST` plain steps, then after twice as many each time a probe did not
bring drafting back, so ``n`` plain steps hold at most ``log2(n / PROBE_FIRST) + 1``
probes.
"""

from __future__ import annotations

from xspec.spec.adaptive.cost import batch_bucket
from xspec.spec.adaptive.online import OnlineStepCost
from xspec.spec.adaptive.scan import Choice

__all__ = [
    "EXPLORE_BUDGET",
    "EXPLORE_EVERY",
    "EXPLORE_RUN",
    "EXPLORE_STEPS",
    "EXPLORE_WIDE",
    "GAP_DECAY",
    "PROBE_FIRST",
    "Exploration",
    "Probes",
    "StepKinds",
]

EXPLORE_RUN = 2  # consecutive steps an exploration takes (a contrast needs a second)
EXPLORE_STEPS = 2 * EXPLORE_RUN  # steps of each kind per batch-size bucket wanted
EXPLORE_EVERY = 32  # and once again after at least this many steps of a bucket without it
EXPLORE_BUDGET = 0.0025  # ... and gap / this many: re-exploring costs this, by the model
EXPLORE_WIDE = 0.5  # ... when the other kind is predicted within this of the best (the gap)
GAP_DECAY = 0.9  # ... the gap as an EMA over the bucket's steps (one request's dip is not it)
PROBE_FIRST = 4  # Probes: plain steps before the first probe (then twice as many each time)


class StepKinds:
    """Per batch-size bucket and kind of step (plain, drafting): how many steps took it,
    and how many steps of the bucket have gone by since it was last taken (what the
    exploration decides on)."""

    def __init__(self) -> None:
        self._steps: dict[tuple[int, bool], int] = {}
        self._since: dict[tuple[int, bool], int] = {}

    def steps(self, drafting: bool, requests: int) -> int:
        """Steps of this kind taken in the bucket of ``requests``."""
        return self._steps.get((batch_bucket(requests), drafting), 0)

    def since(self, drafting: bool, requests: int) -> int:
        """Steps of the bucket of ``requests`` since this kind of step was last taken."""
        return self._since.get((batch_bucket(requests), drafting), 0)

    def observe(self, drafting: bool, requests: int) -> None:
        key, other = (batch_bucket(requests), drafting), (batch_bucket(requests), not drafting)
        self._steps[key] = self._steps.get(key, 0) + 1
        self._since[key] = 0
        self._since[other] = self._since.get(other, 0) + 1


class Exploration:
    """Which steps explore the kind of step that is not the best (the module docstring).
    ``cost``: the step-cost model whose contrasts and switch costs it reads (None: none)."""

    def __init__(self, cost: OnlineStepCost | None) -> None:
        self.cost = cost
        self.kinds = StepKinds()
        self.gaps: dict[int, float] = {}  # bucket -> EMA of the gap (:meth:`_gap`)
        # the exploration under way: (bucket, the kind explored, steps of it still to take)
        self._exploring: tuple[int, bool, int] | None = None

    def observe(self, drafting: bool, requests: int) -> None:
        """One step of ``requests`` requests was taken, drafting or plain."""
        self.kinds.observe(drafting, requests)

    def explore(self, requests: int, choice: Choice) -> bool:
        """Whether this step takes ``choice``'s other kind instead of its best, for
        :data:`EXPLORE_RUN` consecutive steps of the bucket (an exploration: the cost
        model counts no run's first step, which pays for the switch, so a contrast needs
        two).

        While the bucket has fewer than :data:`EXPLORE_STEPS` steps of that kind: after
        EXPLORE_RUN steps of the best kind (alternating, so that each run is a contrast),
        whatever the values, as long as no bucket has a contrast (until then the machine's
        speed and the cost of drafting are not apart, and a gap between the kinds means
        nothing); once another bucket has, only within :data:`EXPLORE_WIDE` of the best
        and after :data:`EXPLORE_EVERY` steps of the bucket without it. Afterwards, once
        more whenever the other kind is within EXPLORE_WIDE of the best (``gap = 1 -
        other / best``, as the bucket's EMA: :meth:`_gap`), after ``max(EXPLORE_EVERY,
        loss / EXPLORE_BUDGET)`` steps of the bucket without it (:meth:`_loss`)."""
        kind = any(d > 0 for d in choice.other or [])
        known = choice.value > 0 and choice.seconds > 0
        gap = self._gap(requests, 1.0 - choice.other_value / choice.value) if known else 0.0
        bucket, held = batch_bucket(requests), self._exploring
        self._exploring = None
        if (
            held is not None
            and held[:2] == (bucket, kind)
            and self.kinds.since(kind, requests) == 0
        ):
            # under way (the bucket's last step was its first): its next step
            if held[2] > 1:
                self._exploring = (bucket, kind, held[2] - 1)
            return True
        if self._starts(requests, kind, gap, known, choice):
            if EXPLORE_RUN > 1:
                self._exploring = (bucket, kind, EXPLORE_RUN - 1)
            return True
        return False

    def _starts(self, requests: int, kind: bool, gap: float, known: bool, choice: Choice) -> bool:
        """Whether an exploration of ``kind`` starts at this step (:meth:`explore`)."""
        since = self.kinds.since(kind, requests)
        if self.kinds.steps(kind, requests) < EXPLORE_STEPS:
            if self.cost is not None and self.cost.contrasted(requests):
                # another bucket's contrasts told speed and drafting apart: far behind,
                # never; else once the bucket has had EXPLORE_EVERY steps without it
                return gap <= EXPLORE_WIDE and since >= EXPLORE_EVERY
            return since >= EXPLORE_RUN  # a steady figure of the best kind on each side
        if not known or gap > EXPLORE_WIDE:
            return False
        return since >= max(EXPLORE_EVERY, self._loss(requests, kind, gap, choice))

    def _loss(self, requests: int, kind: bool, gap: float, choice: Choice) -> float:
        """Steps of the bucket to wait before re-exploring ``kind``: an exploration's
        loss, in steps of the best kind, over :data:`EXPLORE_BUDGET`: :data:`EXPLORE_RUN`
        steps of the other kind at ``gap`` below the best, and the two switches, into the
        other kind and back (:meth:`~.online.OnlineStepCost.switch_cost`)."""
        ratio = choice.other_seconds / choice.seconds
        switches = 0.0
        if self.cost is not None:
            cost = self.cost.switch_cost
            switches = cost(requests, kind) * ratio + cost(requests, not kind)
        return (EXPLORE_RUN * gap * ratio + switches) / EXPLORE_BUDGET

    def _gap(self, requests: int, gap: float) -> float:
        """This step's gap into its bucket's EMA (:data:`GAP_DECAY`; the first step's own):
        what the exploration goes by. The gap moves from step to step with the requests'
        own acceptance; the kinds' standing is the bucket's."""
        bucket = batch_bucket(requests)
        ema = self.gaps.get(bucket)
        ema = gap if ema is None else gap + GAP_DECAY * (ema - gap)
        self.gaps[bucket] = ema
        return ema


class Probes:
    """Per batch-size bucket, when a run of plain steps is offered drafts again (the
    module docstring): the plain steps in a row and the wait before the next probe,
    :data:`PROBE_FIRST` at first, doubled by every probe after which the steps went
    plain again, back to PROBE_FIRST once the decision itself drafts."""

    def __init__(self) -> None:
        self._state: dict[int, tuple[int, int]] = {}  # bucket -> (plain in a row, wait)

    def due(self, requests: int) -> bool:
        """Whether this plain step of ``requests`` requests is a probe instead."""
        run, wait = self._state.get(batch_bucket(requests), (0, PROBE_FIRST))
        return run >= wait

    def wait(self, requests: int) -> int:
        """Plain steps in a row the bucket of ``requests`` waits before its next probe."""
        return self._state.get(batch_bucket(requests), (0, PROBE_FIRST))[1]

    def observe(self, requests: int, drafting: bool, probed: bool) -> None:
        """One step: ``drafting`` or plain; ``probed``: it drafted as a probe (or an
        exploration), not by the decision."""
        bucket = batch_bucket(requests)
        run, wait = self._state.get(bucket, (0, PROBE_FIRST))
        if not drafting:
            self._state[bucket] = (run + 1, wait)
        elif probed:
            self._state[bucket] = (0, 2 * wait if run >= wait else wait)
        else:
            self._state[bucket] = (0, PROBE_FIRST)

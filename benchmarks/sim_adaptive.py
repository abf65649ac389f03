"""The per-step decision of ``spec.adaptive`` on a synthetic machine: no model, no noise
from the host, the same answer every run.

    python benchmarks/sim_adaptive.py [--seeds 8] [--steps 800] [--batch 32]
        [--draft-bias 1.47] [--tail-every 60] [--tail 10] [--spells 20:1.0 20:1.7 8:1.7 50:1.7]
        [--spell-noise 0.08] [--switch-cost 0.08 0.05]

What the benchmark machine cannot show cleanly (its speed moves by 20-50 % within
minutes, docs/adaptive.md) is whether the plain / drafting choice itself is right. Here a
:class:`~xspec.spec.adaptive.Speculation` is driven with step times from a known law:

- the profile: a plain step of R requests takes 1.0 s, verifying 5 drafts each 2.0 s,
  the draft forward 0.5 s (the step-cost model is seeded with exactly this);
- the machine: drafting steps of ``--batch`` requests really take ``--draft-bias`` times
  what the profile says (a cost the profile does not see; 1.47 makes a plain step about
  1.25x a drafting step's value at acceptance 0.7, the crossover seen at T=0.8 and 32
  requests), tail steps of 2 requests ``0.7`` times (drafting is then better than
  predicted, as the real tails are);
- every ``--tail-every`` steps, ``--tail`` steps of 2 requests (the end of a wave);
- the machine's speed in spells: ``LEN:RATIO`` switches, every LEN steps, at random
  between 1.0 and RATIO (all step times multiplied), times 8 % log-normal noise
  (``--spell-noise``: the log sd in the slow spells instead; a machine slowed by other
  loads is noisier, 0.17-0.25 beside two CPU hogs);
- each draft position accepted with probability 0.7;
- ``--switch-cost P D``: the first step of a kind after a step of the other kind (of the
  same batch size) takes ``1 + P`` (plain) or ``1 + D`` (drafting) times its time. The
  engine's are about 0.08 and 0.05 at 16 requests (docs/adaptive.md); 0 by default.

Printed per spell pattern: the share of the big-batch steps (after a 120-step warm-up)
that drafted, per seed and the mean, and which kind is right; and the committed tokens
per second of those steps over the better of the two fixed choices (every step plain,
every step drafting) on the same machine (the same spells and noise), the mean of the
seeds' ratios. With the defaults plain is
(0 is right; re-exploration alone is about 0.01-0.03); ``--draft-bias 0.9`` makes
drafting right (1 is). A change to the cost model has to hold in both directions: one
that never drafts at the crossover can shut drafting out where it wins.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics

from xspec.sampling import SamplingParams
from xspec.spec.adaptive import Speculation
from xspec.spec.schedule import OnlineStepCost, StepCost

GAMMA = 5
ACCEPT = 0.7
NOISE = 0.08
WARMUP = 120
TAIL_REQUESTS = 2
TAIL_BIAS = 0.7
PROFILE = StepCost(
    requests=[1, 64],
    drafts=[0, GAMMA],
    seconds=[[1.0, 2.0], [1.0, 2.0]],
    draft_seconds=[0.5, 0.5],
)


def simulate(
    a: argparse.Namespace, seed: int, spell: int, ratio: float, kind: str = "adaptive"
) -> tuple[float, float]:
    """One run: the share of big-batch steps after the warm-up that drafted, and their
    committed tokens per second. ``kind``: ``adaptive`` (the decision), or every step
    ``plain`` or ``drafting`` (forced: the fixed choices to compare it with). The machine
    (its spells and noise) is the same for every kind of one seed."""
    machine, accept = random.Random(seed), random.Random(seed + 10_000)
    cost = OnlineStepCost(PROFILE)
    s = Speculation(GAMMA, cost=cost)
    if kind != "adaptive":
        s.force = (lambda caps: caps) if kind == "drafting" else (lambda caps: [0] * len(caps))
    histories = {r: [s.new_history() for _ in range(r)] for r in (TAIL_REQUESTS, a.batch)}
    params = [SamplingParams(temperature=0.8)] * a.batch
    speed, drafted, counted, tokens, seconds_total = 1.0, 0, 0, 0, 0.0
    last: dict[int, bool] = {}  # batch size -> whether its last step drafted
    for t in range(a.steps):
        if t % spell == 0:
            speed = machine.choice([1.0, ratio])
        sigma = a.spell_noise if speed != 1.0 else NOISE
        noise = math.exp(machine.gauss(0.0, sigma))
        tail = t % a.tail_every >= a.tail_every - a.tail
        R = TAIL_REQUESTS if tail else a.batch
        h = histories[R]
        depths = s.depths(params[:R], h, [GAMMA] * R)
        drafting = sum(d > 0 for d in depths)
        rows = R + sum(depths)
        bias = (TAIL_BIAS if tail else a.draft_bias) if drafting else 1.0
        seconds = PROFILE.seconds_at(R, rows, drafting) * speed * bias * noise
        if last.setdefault(R, drafting > 0) != (drafting > 0):  # a switch: its first step
            seconds *= 1.0 + a.switch_cost[drafting > 0]
        last[R] = drafting > 0
        accepted = []
        for d in depths:
            k = 0
            while k < d and accept.random() < ACCEPT:
                k += 1
            accepted.append(k)
        s.observe(h, depths, accepted, seconds=seconds)
        if t >= WARMUP and not tail:
            counted += 1
            drafted += drafting > 0
            tokens += R + sum(accepted)
            seconds_total += seconds
    return drafted / max(counted, 1), tokens / seconds_total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--draft-bias", type=float, default=1.47)
    ap.add_argument("--tail-every", type=int, default=60)
    ap.add_argument("--tail", type=int, default=10)
    ap.add_argument("--spells", nargs="+", default=["20:1.0", "20:1.7", "8:1.7", "50:1.7"])
    ap.add_argument("--spell-noise", type=float, default=NOISE)
    ap.add_argument(
        "--switch-cost",
        type=float,
        nargs=2,
        default=[0.0, 0.0],
        metavar=("PLAIN", "DRAFTING"),
        help="the first step of a kind after the other kind costs 1 + this more",
    )
    a = ap.parse_args()
    if min(a.switch_cost) < 0:
        ap.error(f"--switch-cost {a.switch_cost} must be >= 0")
    if a.spell_noise < 0:
        ap.error(f"--spell-noise {a.spell_noise} must be >= 0 (a log sd)")
    if not 0 <= a.tail < a.tail_every:
        ap.error(f"--tail {a.tail} must be below --tail-every {a.tail_every}")
    spells = []
    for pattern in a.spells:
        try:
            length, speed = pattern.split(":")
            spell, slow = int(length), float(speed)
        except ValueError:
            ap.error(f"--spells {pattern!r}: expected LEN:RATIO, e.g. 20:1.7")
        if spell < 1 or slow <= 0:
            ap.error(f"--spells {pattern!r}: LEN must be >= 1 and RATIO > 0")
        spells.append((pattern, spell, slow))
    # a plain step: R tokens in its profiled time; a drafting step: R (1 + sum_j ACCEPT^j)
    tokens = 1 + sum(ACCEPT**j for j in range(1, GAMMA + 1))
    drafting = tokens / (PROFILE.seconds_at(a.batch, a.batch * (GAMMA + 1)) * a.draft_bias)
    value = drafting / (1 / PROFILE.seconds_at(a.batch, a.batch, 0))  # drafting / plain
    better = "drafting" if value > 1 else "plain"
    print(
        f"share of {a.batch}-request steps that drafted; drafting makes {value:.2f}x a plain "
        f"step's value, so {better} is right (share {1 if value > 1 else 0}); per seed and mean"
    )
    for pattern, spell, slow in spells:
        runs = [simulate(a, seed, spell, slow) for seed in range(a.seeds)]
        shares = [share for share, _ in runs]
        best = [
            max(simulate(a, seed, spell, slow, kind)[1] for kind in ("plain", "drafting"))
            for seed in range(a.seeds)
        ]
        ratio = statistics.fmean(value / b for (_, value), b in zip(runs, best))
        per_seed = " ".join(f"{x:.2f}" for x in shares)
        print(
            f"  spells {pattern:>7}: mean {statistics.fmean(shares):.3f}  [{per_seed}]  "
            f"tokens/s {ratio:.3f}x the better fixed kind's"
        )


if __name__ == "__main__":
    main()

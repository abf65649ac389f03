"""Adaptive speculation (``spec.adaptive``, ``spec.gamma_schedule``; docs/adaptive.md).

How many tokens each request drafts and verifies, 0 to gamma, decided per step from the
acceptance the requests realised and a model of what a step costs on this machine. One
:class:`~xspec.spec.policy.DepthPolicy`, :class:`AdaptiveDepth`, is what the speculative
step sees of it; :mod:`xspec.build` is the one module outside this package that builds
it (and the drafters with a confidence head read their calibration file from
:mod:`.calibration`). The modules, by concern:

* :mod:`.policy`: :class:`AdaptiveDepth`, the decision (decide / trim / observe);
* :mod:`.acceptance`: acceptance estimates (per regime, per request), the confidence
  correction and the yield check;
* :mod:`.scan`: Algorithm 1 (the trim after drafting) and the depth scan before it;
* :mod:`.explore`: when the other kind of step (plain / drafting) is taken to measure it;
* :mod:`.cost`: the measured step-cost table; :mod:`.online`: the model that corrects
  it from the step times measured as the workload runs;
* :mod:`.profile`: measuring the table at start-up and caching it;
* :mod:`.calibration`: the draft's confidence calibration files (read side).
"""

from xspec.spec.adaptive.policy import AdaptiveDepth

__all__ = ["AdaptiveDepth"]

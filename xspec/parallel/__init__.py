"""Data and expert parallelism on torch.distributed (``torchrun ... -m xspec parallel.dp=D
parallel.ep=E``); see docs/parallel.md.

* :mod:`.topology`: which rank decodes which requests and holds which experts (no torch);
* :mod:`.runtime`: the process groups, the backend the platform names, fault handling;
* :mod:`.expert`: one rank's share of the experts and the MoE row exchange;
* :mod:`.lockstep`: every rank runs the same MoE forwards every iteration.

The DP engine (requests spread over the replicas, results gathered on rank 0) is
:mod:`xspec.engine.parallel`.

Importing this package imports nothing heavy.
"""

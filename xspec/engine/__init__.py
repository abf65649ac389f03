"""The serving engine: continuous batching over the speculative step with memory-planned
admission (:mod:`.engine`, :mod:`.memory`), the step-cost profile adaptive verification
reads (:mod:`.step_cost`), and the data-parallel engine under torchrun (:mod:`.parallel`)."""

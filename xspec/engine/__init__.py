"""The serving engine: continuous batching over the speculative step with memory-planned
admission (:mod:`.engine`, :mod:`.memory`), its thread loop (:mod:`.loop`), and the
data-parallel engine under torchrun (:mod:`.parallel`)."""

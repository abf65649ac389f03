"""Benchmarks of a running server: ``python -m xspec.bench serve`` loads any
OpenAI-compatible endpoint (xspec's, vLLM's, SGLang's) and reports TTFT, TPOT, ITL,
end-to-end latency, goodput and speculative acceptance; ``compare`` tabulates runs.
It imports neither torch nor the engine: it is a client."""

"""``python -m xspec.serve``: an OpenAI-compatible HTTP server on the streaming engine
(docs/serving.md). :mod:`xspec.serve.app` has the endpoints, :mod:`xspec.serve.protocol`
the request bodies, :mod:`xspec.serve.text` the streamed text deltas."""

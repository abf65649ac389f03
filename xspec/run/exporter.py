"""``metrics.port``: Prometheus text over HTTP while the CLI runs.

One exporter per process (a multirun's jobs share it). It serves, at
``http://<metrics.host>:<metrics.port>/metrics``:

* the speculative counters of the running job's engine (``xspec_spec_decode_*``, see
  :mod:`xspec.metrics`), read at scrape time from the engine's current
  :class:`~xspec.metrics.SpecDecodeMetrics` (they restart at each job, like a restarted
  server's: Prometheus' ``rate`` handles counter resets). They mirror vLLM's
  ``vllm:spec_decode_num_drafts``, ``_num_draft_tokens``, ``_num_accepted_tokens`` and
  ``_num_accepted_tokens_per_pos{position}``, plus the gauge
  ``xspec_spec_decode_acceptance_length`` (SGLang's ``spec_accept_length``);
  docs/metrics.md maps each name;
* per-request histograms recorded from each finished :class:`Generation`, labelled
  with the job's ``model`` and ``spec``: ``xspec_request_queue_seconds`` (arrival to
  admission), ``xspec_request_ttft_seconds``, ``xspec_request_tpot_seconds`` (requests
  with >= 2 output tokens), ``xspec_request_e2e_seconds`` (the latencies count from
  admission), ``xspec_request_prompt_tokens``, ``xspec_request_output_tokens``, and the
  counter ``xspec_request_errors``.

The exporter binds when created, so a port in use is a clear error before any job runs.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import start_wsgi_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from xspec.engine.engine import Engine, Generation
from xspec.errors import ConfigError
from xspec.metrics import SpecDecodeMetrics

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKEN_BUCKETS = tuple(float(2**k) for k in range(18))  # 1 .. 131072
_LABELS = ("model", "spec")


class _CurrentSpecMetrics(Collector):
    """Yields the counters of whatever SpecDecodeMetrics the getter returns right now."""

    def __init__(self, current: Callable[[], SpecDecodeMetrics | None]) -> None:
        self.current = current

    def collect(self) -> Iterator[Metric]:
        metrics = self.current()
        if metrics is not None:
            yield from metrics.registry.collect()


class RequestMetrics:
    """The registry and its metrics (above), without a server: the HTTP server of
    ``python -m xspec.serve`` renders it on its own ``/metrics`` (:meth:`render`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self._engine: Engine | None = None
        reg.register(
            _CurrentSpecMetrics(lambda: None if self._engine is None else self._engine.metrics)
        )

        def hist(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, _LABELS, buckets=tuple(buckets), registry=reg)

        self.queue = hist(
            "xspec_request_queue_seconds", "Time from arrival to admission", _LATENCY_BUCKETS
        )
        self.ttft = hist(
            "xspec_request_ttft_seconds", "Time from admission to first token", _LATENCY_BUCKETS
        )
        self.tpot = hist(
            "xspec_request_tpot_seconds", "Time per output token after the first", _LATENCY_BUCKETS
        )
        self.e2e = hist(
            "xspec_request_e2e_seconds", "Time from admission to the last token", _LATENCY_BUCKETS
        )
        self.prompt_tokens = hist("xspec_request_prompt_tokens", "Prompt tokens", _TOKEN_BUCKETS)
        self.output_tokens = hist("xspec_request_output_tokens", "Output tokens", _TOKEN_BUCKETS)
        self.errors = Counter(
            "xspec_request_errors", "Requests stopped early with an error", _LABELS, registry=reg
        )

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric now."""
        return generate_latest(self.registry)

    def follow(self, engine: Engine) -> None:
        """Serve this engine's speculative counters from now on (the current job's; read
        at each scrape, so the reset after the warm-up is followed)."""
        self._engine = engine

    def observe(self, gens: Iterable[Generation], model: str, spec: str) -> None:
        """Record finished requests into the histograms."""
        for g in gens:
            labels = (model, spec)
            self.queue.labels(*labels).observe(g.queue_s)
            self.ttft.labels(*labels).observe(g.ttft_s)
            if g.tpot_s is not None:
                self.tpot.labels(*labels).observe(g.tpot_s)
            self.e2e.labels(*labels).observe(g.latency_s)
            self.prompt_tokens.labels(*labels).observe(len(g.prompt_ids))
            self.output_tokens.labels(*labels).observe(len(g.token_ids))
            if g.error is not None:
                self.errors.labels(*labels).inc()


class MetricsExporter(RequestMetrics):
    """:class:`RequestMetrics` served at ``http://host:port/metrics`` (the CLI's)."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__()
        reg = self.registry
        try:
            self._server, _ = start_wsgi_server(port, addr=host, registry=reg)
        except OSError as e:
            reason = "already in use" if e.errno == errno.EADDRINUSE else f"unavailable ({e})"
            raise ConfigError(
                f"metrics.port={port}: cannot serve metrics on {host}:{port}, the port is "
                f"{reason}; pick another port, 0 for any free one, or metrics.port=null"
            ) from None
        self.host = host

    @property
    def server(self) -> WSGIServer:
        return self._server

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

"""The CLI's run-and-report layer, above :mod:`xspec.build`: workloads (prompts, files,
synthetic), running them with warm-up and repeats (:mod:`.report`), ``results.json`` and
the sweep summary (:mod:`.results`), and the Prometheus exporter (:mod:`.exporter`)."""

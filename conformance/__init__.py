"""The shared conformance suite that every backend, in-tree or third-party, must pass.

Run it with `candelabra conformance --backend NAME`, or with pytest and the plugin
`candelabra.conformance.plugin`. Levels: "ops" (every op against a float64 oracle), "models"
(every architecture against transformers on torch, which that level needs installed) and
"engine" (continuous batching, chunked prefill, prefix caching and preemption change no output).
"""

LEVELS = ("ops", "models", "engine")

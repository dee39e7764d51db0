"""The shared conformance suite that every backend, in-tree or third-party, must pass.

Run it with `candelabra conformance --backend NAME`, or with pytest and the plugin
`candelabra.conformance.plugin`. Levels: "ops" (every op against a float64 oracle), "models"
(every architecture against transformers on torch, which that level needs installed) and
"engine" (continuous batching, chunked prefill, prefix caching and preemption change no output),
and, asked for by name, "parallel" (tensor parallelism over two ranks against one).
"""

LEVELS = ("ops", "models", "engine")
# Asked for by name only (--level parallel): it starts a process per rank.
OPT_IN_LEVELS = ("parallel",)

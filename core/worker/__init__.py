"""The worker: runs scheduled steps of a model on a backend."""

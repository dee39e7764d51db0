"""The OpenAI-compatible HTTP server: protocol models, request handling, metrics, launch."""

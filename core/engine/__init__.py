"""The engine: requests in, tokens and text out; sequences, sampling parameters, output processing."""

"""Scheduling: which sequences run each step, and where their KV blocks live."""

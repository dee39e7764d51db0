"""The PyTorch backend: every op on any torch device, and the fast CPU path."""

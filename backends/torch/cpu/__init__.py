"""The torch backend's own C kernels for x86-64 and aarch64 CPUs, one module per kernel family."""

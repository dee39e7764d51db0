"""The cuda backend: the torch backend with Triton kernels and CUDA graphs."""

"""The one table C and Python share (backends/torch/cpu/kernel_abi.py): it agrees with gguf's block sizes,
types every entry point, and a C definition that strays from it does not compile."""

import ctypes

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from candelabra.backends.torch.cpu import kernel_abi, kernel_build, kernel_library


def test_each_formats_block_is_ggufs():
    for name, values, size in kernel_abi.FORMATS:
        assert GGML_QUANT_SIZES[GGMLQuantizationType[name]] == (values, size), name


def test_codes_and_statuses_are_distinct():
    for table in (kernel_abi.FORMAT_CODES, kernel_abi.DTYPE_CODES, kernel_abi.BLOCK_KERNEL_CODES):
        assert sorted(table.values()) == list(range(len(table)))
    for statuses in (kernel_abi.BLOCK_STATUSES, kernel_abi.ATTENTION_STATUSES):
        assert len({code for _, code, _ in statuses}) == len(statuses)
    assert kernel_abi.status_message(-4) == "row out of range"
    assert kernel_abi.status_message(-99) == "status -99"
    assert kernel_abi.status_message(-5, kernel_abi.ATTENTION_STATUSES) == "a slot is outside the cache"


def test_every_entry_point_of_the_loaded_library_is_typed_from_the_table():
    loaded = kernel_library.kernels()
    if loaded.library is None:
        pytest.skip(loaded.detail)
    for name, (returns, parameters) in kernel_abi.FUNCTIONS.items():
        function = getattr(loaded.library, name)
        assert len(function.argtypes) == len(parameters), name
        assert function.restype is {"const char *": ctypes.c_char_p, "int": ctypes.c_int, "uint64_t": ctypes.c_uint64}[
            returns], name
    matmul = loaded.library.gguf_blocks_matmul.argtypes
    assert matmul[3] is ctypes.c_int64 and matmul[2] is ctypes.c_void_p  # N, and the blocks' pointer


def test_the_header_names_every_code_and_prototype():
    header = kernel_abi.header()
    assert "F_Q6_K = 7" in header and "FORMAT_COUNT = 8" in header and "D_BF16 = 1" in header
    assert "static const int BYTES_PER_BLOCK[FORMAT_COUNT] = {34, 18, 20, 22, 24, 144, 176, 210};" in header
    assert ("CANDELABRA_EXPORT int gguf_blocks_decode(int format, const uint8_t *blocks, int64_t N, int64_t K, "
            "const int64_t *ids, int64_t first, int64_t count, void *y, int dtype, int threads);") in header


@pytest.mark.slow
def test_a_c_definition_that_strays_from_the_table_does_not_compile(monkeypatch, tmp_path):
    if kernel_build.find_compiler() is None:
        pytest.skip("no C compiler here")
    returns, parameters = kernel_abi.FUNCTIONS["gguf_blocks_matmul"]
    strayed = {**kernel_abi.FUNCTIONS, "gguf_blocks_matmul": (returns, parameters[:-1])}  # one parameter short
    monkeypatch.setattr(kernel_build, "abi_header", lambda: _header_with(strayed))
    error = kernel_build.build(kernel_build.VARIANTS[-1], tmp_path / "lib.so")
    assert error and "gguf_blocks_matmul" in error and "conflicting types" in error


def _header_with(functions) -> str:
    saved = kernel_abi.FUNCTIONS
    kernel_abi.FUNCTIONS = functions
    try:
        return kernel_abi.header()
    finally:
        kernel_abi.FUNCTIONS = saved


def test_the_read_sums_every_word_of_the_buffer():
    loaded = kernel_library.kernels()
    if loaded.library is None:
        pytest.skip(loaded.detail)
    words = np.random.default_rng(31).integers(0, 2**63, size=1_000_003, dtype=np.uint64)
    expected = int(words.sum(dtype=np.uint64))  # numpy wraps mod 2**64 as the C does
    for threads in (1, 2, 3):
        assert loaded.library.candelabra_read_words(words.ctypes.data, words.size, threads) == expected
    assert loaded.library.candelabra_read_words(words.ctypes.data, 0, 2) == 0

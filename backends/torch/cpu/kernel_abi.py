"""What the C kernels and Python agree on, in one table: the codes of formats, dtypes, kernels and
statuses, and every entry point's signature.

C reads this table as `kernel_abi.h`, which the build writes from it (`header`); Python types its
ctypes calls from it (`bind`) and names a status from it (`status_message`). A C definition that
strays from its prototype here fails to compile. The module needs nothing beyond the standard
library, since setup.py loads it by path to write the header before torch is installed.
"""

from __future__ import annotations

import ctypes

# GGUF block formats the kernels read: (name, values per block, bytes per block); the code is the position.
FORMATS = (("Q8_0", 32, 34), ("Q4_0", 32, 18), ("Q4_1", 32, 20), ("Q5_0", 32, 22), ("Q5_1", 32, 24),
           ("Q4_K", 256, 144), ("Q5_K", 256, 176), ("Q6_K", 256, 210))
# (dtype name, C name): the dtypes of x, y and the KV cache.
DTYPES = (("float32", "D_F32"), ("bfloat16", "D_BF16"), ("float16", "D_F16"))
# (kernel name, C name): how a block product multiplies x.
BLOCK_KERNELS = (("blocks_float", "KERNEL_FLOAT"), ("blocks_int8", "KERNEL_INT8"))
# (C name, code, message) of what the block entry points return, then the attention ones.
BLOCK_STATUSES = (("OK", 0, "ok"), ("BAD_FORMAT", -1, "unknown format"), ("BAD_SHAPE", -2, "K is not whole blocks"),
                  ("BAD_DTYPE", -3, "unsupported dtype"), ("BAD_ROW", -4, "row out of range"),
                  ("NO_MEMORY", -5, "out of memory"), ("BAD_KERNEL", -6, "unknown kernel"))
ATTENTION_STATUSES = (
    ("DA_OK", 0, "ok"), ("DA_BAD_DTYPE", -1, "unsupported cache dtype"),
    ("DA_BAD_SHAPE", -2, "a sequence's length does not fit its block table or the heads"),
    ("DA_NO_MEMORY", -3, "out of memory"), ("DA_BAD_BLOCK", -4, "a block table names a block the cache does not have"),
    ("DA_BAD_SLOT", -5, "a slot is outside the cache"),
    ("DA_BAD_POSITION", -6, "a position is outside the rotary table"))

_MATMUL = ("int format", "int kernel", "const uint8_t *blocks", "int64_t N", "int64_t K", "const void *x", "void *y",
           "int64_t M", "int dtype", "int threads")
_ROTARY = ("const int64_t *table_rows", "const float *cos_sin", "int64_t table_length", "int rotary_dim", "int gptj",
           "const int64_t *slots", "void *key", "void *value", "int64_t blocks", "int block_size")
_ATTENTION = ("const int64_t *block_tables", "int64_t table_width", "const int64_t *seq_lens", "int64_t sequences",
              "int heads", "int kv_heads", "int d", "float scale", "float softcap", "int64_t window", "float *out",
              "int threads")
# name: (return type, parameters as C declares them)
FUNCTIONS = {
    "gguf_blocks_matmul": ("int", _MATMUL),
    "gguf_blocks_matmul_gated": ("int", _MATMUL),
    "gguf_blocks_matmul_normed": ("int", (*_MATMUL[:6], "const void *residual", "void *summed",
                                          "const void *norm_weight", "float eps", "float offset", *_MATMUL[6:])),
    "gguf_blocks_decode": ("int", ("int format", "const uint8_t *blocks", "int64_t N", "int64_t K",
                                   "const int64_t *ids", "int64_t first", "int64_t count", "void *y", "int dtype",
                                   "int threads")),
    "gguf_blocks_describe": ("const char *", ()),
    "decode_attention": ("int", ("const float *q", "const void *key", "const void *value", "int dtype",
                                 "int64_t blocks", "int block_size", *_ATTENTION)),
    "rotary_and_write": ("int", ("int64_t tokens", "const void *q", "int64_t q_stride", "const void *k",
                                 "int64_t k_stride", "const void *v", "int64_t v_stride", "int dtype", *_ROTARY,
                                 "int heads", "int kv_heads", "int d", "void *q_out", "int threads")),
    "rotary_and_decode_attention": ("int", ("const void *q", "int64_t q_stride", "const void *k", "int64_t k_stride",
                                            "const void *v", "int64_t v_stride", "int dtype", *_ROTARY, *_ATTENTION)),
    "decode_attention_describe": ("const char *", ()),
    # The 64-bit words of a buffer summed (mod 2**64) by `threads` threads: a read as fast as memory gives.
    "candelabra_read_words": ("uint64_t", ("const uint64_t *words", "int64_t count", "int threads")),
    # The digest of the sources the library was built from (`sources_digest`), set by the build.
    "candelabra_kernel_sources": ("const char *", ()),
}

FORMAT_CODES = {name: code for code, (name, _, _) in enumerate(FORMATS)}
DTYPE_CODES = {name: code for code, (name, _) in enumerate(DTYPES)}
BLOCK_KERNEL_CODES = {name: code for code, (name, _) in enumerate(BLOCK_KERNELS)}

_CTYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64, "float": ctypes.c_float,
           "const char *": ctypes.c_char_p}


def _type_of(declaration: str) -> str:
    """The C type of a parameter declaration ("const void *x" -> "const void *", "int64_t N" -> "int64_t")."""
    return declaration[:declaration.rindex("*") + 1] if "*" in declaration else declaration.rsplit(" ", 1)[0]


def _ctype(c_type: str):
    return ctypes.c_void_p if c_type.endswith("*") and c_type != "const char *" else _CTYPES[c_type]


def bind(library: ctypes.CDLL) -> ctypes.CDLL:
    """`library` with every entry point's argument and return types set from FUNCTIONS."""
    for name, (returns, parameters) in FUNCTIONS.items():
        function = getattr(library, name)
        function.argtypes = [_ctype(_type_of(parameter)) for parameter in parameters]
        function.restype = _ctype(returns)
    return library


def status_message(status: int, statuses=BLOCK_STATUSES) -> str:
    return next((message for _, code, message in statuses if code == status), f"status {status}")


def _enum(pairs) -> str:
    return "enum { " + ", ".join(f"{name} = {code}" for name, code in pairs) + " };"


def header() -> str:
    """kernel_abi.h: the enums, each format's block sizes, and every entry point's prototype."""
    lines = ["/* Written from backends/torch/cpu/kernel_abi.py by the build: change that table, not this file. */",
             "#ifndef CANDELABRA_KERNEL_ABI_H", "#define CANDELABRA_KERNEL_ABI_H", "", "#include <stdint.h>", "",
             _enum([*((f"F_{name}", code) for name, code in FORMAT_CODES.items()), ("FORMAT_COUNT", len(FORMATS))]),
             "static const int VALUES_PER_BLOCK[FORMAT_COUNT] = {" + ", ".join(str(v) for _, v, _ in FORMATS) + "};",
             "static const int BYTES_PER_BLOCK[FORMAT_COUNT] = {" + ", ".join(str(b) for _, _, b in FORMATS) + "};",
             _enum([(c_name, code) for code, (_, c_name) in enumerate(DTYPES)]),
             _enum([(c_name, code) for code, (_, c_name) in enumerate(BLOCK_KERNELS)]),
             _enum([(name, code) for name, code, _ in BLOCK_STATUSES]),
             _enum([(name, code) for name, code, _ in ATTENTION_STATUSES]), "",
             "/* the entry points: the only names the library shows (it is built with -fvisibility=hidden) */",
             '#define CANDELABRA_EXPORT __attribute__((visibility("default")))']
    for name, (returns, parameters) in FUNCTIONS.items():
        separator = "" if returns.endswith("*") else " "
        lines.append(f"CANDELABRA_EXPORT {returns}{separator}{name}({', '.join(parameters) or 'void'});")
    return "\n".join([*lines, "", "#endif", ""])

"""How the process's C heap hands memory to torch's CPU tensors.

glibc's malloc serves a large block with a fresh mmap and returns it to the OS on free, so every
step's large temporaries (logits, sampling rows, dense weight slices) fault in new zeroed pages
each time: at decode sizes that cost more than the arithmetic. Raising the mmap threshold to its
maximum (32 MiB) and never trimming the heap keeps freed blocks for the next step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("candelabra")

# mallopt parameters, from glibc's malloc.h
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest on 64-bit
TOP_PAD = 64 * 2**20
TRIM_THRESHOLD = 2**31 - 1  # never give the top of the heap back


def give_freed_memory_back() -> bool:
    """Return the heap's free memory to the OS now (glibc's malloc_trim); False where there is no
    malloc_trim. Loading a model frees far more than a step needs again: 440 MB for the default model."""
    trim = _glibc_function("malloc_trim")
    if trim is None:
        return False
    trim(ctypes.c_size_t(0))
    return True


def keep_freed_memory_for_reuse() -> bool:
    """Tune glibc's malloc as above; False where the C library is not glibc (macOS, musl)."""
    mallopt = _glibc_function("mallopt")
    if mallopt is None:
        return False
    settings = ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TOP_PAD, TOP_PAD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    done = all(mallopt(ctypes.c_int(option), ctypes.c_int(value)) == 1 for option, value in settings)
    if not done:
        log.info("torch backend: glibc's mallopt refused a setting; large temporaries are allocated afresh")
    return done


def _glibc_function(name: str):
    """The C library's function `name`, or None where the C library lacks it (not glibc)."""
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name) if library else None
    except (OSError, AttributeError):
        return None

"""What a failed comparison says: the measured error, and what it most likely means.

A vendor reads these messages to find the bug, so each names the likely cause where the numbers
point to one: values that are not finite where the reference is, or an error of the size that
rounding to a lower precision than the case's dtype gives (arithmetic or accumulation in that
dtype while the backend declares a wider one).
"""

from __future__ import annotations

import numpy as np

from candelabra.conformance.compare import LOW_PRECISION, ROUNDING_FLIP_SHARE, nmse, round_to, ulps_apart

# Lower-precision dtypes whose rounding error a failure is compared with, per the case's dtype.
_LOWER_DTYPES = {"float32": ("float16", "bfloat16"), "float16": ("bfloat16",), "bfloat16": ()}

# An error within this factor of one rounding to a lower dtype reads as arithmetic in that dtype: a few
# roundings of intermediates add up to tens of times one rounding of the result, and much more than
# that is a wrong result rather than a lost precision.
_ROUNDING_BAND = (0.3, 30.0)


def describe_mismatch(output: np.ndarray, reference: np.ndarray, error: float, limit: float, dtype: str) -> str:
    """The reason `output` fails against `reference` at NMSE `error` over `limit`, in words."""
    output, reference = np.asarray(output), np.asarray(reference)
    if output.shape != reference.shape:
        return f"shape {output.shape}, expected {reference.shape}"
    unexpected = ~np.isfinite(output) & np.isfinite(reference)
    if unexpected.any():
        nan = int(np.count_nonzero(np.isnan(output) & unexpected))
        inf = int(np.count_nonzero(unexpected)) - nan
        kinds = " and ".join(part for part in (f"{nan} NaN" if nan else "", f"{inf} infinite" if inf else "") if part)
        first = tuple(int(i) for i in np.argwhere(unexpected)[0])
        return (f"{kinds} of {reference.size} values where the reference is finite (the first at index {first}): "
                "an overflow, a division by zero, or an element never written (each op first runs once on NaN "
                "inputs, so memory it leaves unwritten holds NaN) or read before it was")
    missing = np.isfinite(output) & ~np.isfinite(reference)
    if missing.any():
        return (f"{int(np.count_nonzero(missing))} values finite where the reference is infinite "
                "(a mask, such as -inf for a forbidden token, not applied)")
    message = f"NMSE {error:.3g} > {limit:.0e}"
    rows = _rows_holding_the_error(output, reference, limit)
    if rows:
        return (f"{message}, all of it in rows {_some(rows)} of {len(reference)} (the other rows are right): rows "
                "not computed, or left unwritten and holding whatever the memory held")
    if dtype in LOW_PRECISION:
        finite = np.isfinite(reference)
        share = float(np.mean(ulps_apart(output[finite], reference[finite], dtype) == 1)) if finite.any() else 0.0
        if share > ROUNDING_FLIP_SHARE:
            return (f"{message}; {share:.0%} of the elements are one unit in the last place off the exact result "
                    f"rounded once, more than one rounding leaves: is the result rounded twice, or an intermediate "
                    f"kept in {dtype} instead of float32?")
    rounding = {lower: nmse(round_to(reference, lower), reference) for lower in _LOWER_DTYPES.get(dtype, ())}
    if rounding:
        sizes = ", ".join(f"{lower} {value:.2g}" for lower, value in rounding.items())
        message += f" (the exact result rounded once to {sizes})"
        like = [lower for lower, value in rounding.items()
                if value > 0 and _ROUNDING_BAND[0] * value <= error <= _ROUNDING_BAND[1] * value]
        if like:
            lower = " or ".join(like)
            message += (f": the size of {lower} arithmetic; is a step computed or accumulated in {lower} "
                        f"while the case's dtype is {dtype}?")
    return message


def _rows_holding_the_error(output: np.ndarray, reference: np.ndarray, limit: float) -> list[int]:
    """The rows (first axis) wrong beyond `limit` when they are fewer than half and every other row
    meets it; else []."""
    if output.ndim < 2 or len(output) < 2:
        return []
    flat_out = np.asarray(output, np.float64).reshape(len(output), -1)
    flat_ref = np.asarray(reference, np.float64).reshape(len(reference), -1)
    if not (np.isfinite(flat_out).all() and np.isfinite(flat_ref).all()):
        return []
    scale = np.maximum(np.sum(flat_ref**2, axis=1), np.finfo(np.float64).tiny)
    with np.errstate(over="ignore"):  # a row that should be zeros and is not: an infinite error, as it should be
        wrong = np.flatnonzero(np.sum((flat_out - flat_ref) ** 2, axis=1) / scale > limit)
    return [int(row) for row in wrong] if 0 < len(wrong) < len(output) / 2 else []


def describe_cache_slots(output: np.ndarray, expected: np.ndarray, slots: np.ndarray, new_rows: np.ndarray,
                         no_slot: int) -> str | None:
    """Which slots of a cache part ([blocks, block_size, ...]) differ from `expected`, by kind: the
    step's own slots written wrong, slots the step's NO_SLOT padding tokens were written to, and other
    slots outside the step that changed. None when the two are equal. `new_rows` are the step's rows
    as written (`[tokens, ...]`), `slots` their slot mapping."""
    if output.shape != expected.shape:
        return f"shape {output.shape}, expected {expected.shape}"
    flat_out = output.reshape(-1, *output.shape[2:])
    flat_expected = expected.reshape(flat_out.shape)
    differ = np.flatnonzero(np.any((flat_out != flat_expected).reshape(len(flat_out), -1), axis=1))
    if len(differ) == 0:
        return None
    written = set(int(s) for s in slots if s != no_slot)
    padding_rows = new_rows[slots == no_slot]
    wrong, padded, outside = [], [], []
    for slot in differ:
        if any(np.array_equal(flat_out[slot], row) for row in padding_rows):
            padded.append(slot)
        elif slot in written:
            wrong.append(slot)
        else:
            outside.append(slot)
    parts = []
    if wrong:
        parts.append(f"{len(wrong)} of the step's {len(written)} slots hold wrong values (slots {_some(wrong)})")
    if padded:
        parts.append(f"{len(padded)} slots hold a padding token's values (slots {_some(padded)}): "
                     f"a token whose slot is NO_SLOT ({no_slot}) was written, which must be skipped")
    if outside:
        parts.append(f"{len(outside)} slots outside the step changed (slots {_some(outside)})")
    return "; ".join(parts)


def _some(values: list[int], shown: int = 5) -> str:
    listed = ", ".join(str(v) for v in values[:shown])
    return listed + (f" and {len(values) - shown} more" if len(values) > shown else "")

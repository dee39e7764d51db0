"""The searches llama.cpp's k-quant reference quantizers run on each sub-block of 16 or 32 values to
choose its scale (make_qkx2_quants, make_qx_quants, make_q3_quants in ggml-quants.c), here on every
sub-block at once.

Each takes float32 values [values, sub-blocks], one sub-block a column (so sums over a sub-block add
its values in order, as the C loops do), and returns the sub-block's scale (and minimum) and its
codes [values, sub-blocks] as float32 whole numbers. Where the C code tries candidate scales one
after another and keeps the best, every sub-block tries them together and keeps its own best.
"""

from __future__ import annotations

import numpy as np

from candelabra.core.weights.quantize.block_math import F32, first_largest_magnitude, nearest

# Below this largest magnitude a sub-block counts as zeros (ggml-quants.c's GROUP_MAX_EPS).
ZERO_BLOCK = F32(1e-15)


def scale_and_minimum(values: np.ndarray, weights: np.ndarray, top: int, first_step: float, step: float,
                      steps: int, absolute: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """make_qkx2_quants: codes 0..`top` with value = scale * code - minimum, the scale and minimum
    chosen to lower the weighted error (absolute or squared) over candidate scales `top` +
    `first_step` + i * `step`, i = 0..`steps`. Each better candidate's minimum also becomes the
    offset the next candidates round from, as in the C loop. Returns (scale, minimum, codes)."""
    low = np.minimum(values.min(axis=0), F32(0))
    high = values.max(axis=0)
    total_weight = weights.sum(axis=0)
    weighted_sum = _sum_of_products(weights, values)
    flat = high == low
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inverse = F32(top) / (high - low)
        scale = F32(1) / inverse
        codes = _codes_from(values, inverse, low, top)
        best_error = _error(values, weights, codes, scale, low, absolute)
        chosen_inverse, chosen_low = inverse, low
        for index in range(steps + 1):
            inverse = (F32(first_step) + F32(step) * F32(index) + F32(top)) / (high - low)
            codes = _codes_from(values, inverse, low, top)
            sum_l = _sum_of_products(weights, codes)
            sum_l2 = _sum_of_products(weights, codes, codes)
            sum_xl = _sum_of_products(weights, codes, values)
            determinant = total_weight * sum_l2 - sum_l * sum_l
            this_scale = (total_weight * sum_xl - weighted_sum * sum_l) / determinant
            this_low = (sum_l2 * weighted_sum - sum_l * sum_xl) / determinant
            above_zero = this_low > 0
            this_low = np.where(above_zero, F32(0), this_low)
            this_scale = np.where(above_zero, sum_xl / sum_l2, this_scale)
            error = _error(values, weights, codes, this_scale, this_low, absolute)
            better = (determinant > 0) & (error < best_error)
            best_error = np.where(better, error, best_error)
            scale = np.where(better, this_scale, scale)
            chosen_inverse = np.where(better, inverse, chosen_inverse)
            chosen_low = np.where(better, low, chosen_low)
            low = np.where(better, this_low, low)
        codes = _codes_from(values, chosen_inverse, chosen_low, top)
    codes[:, flat] = 0
    return np.where(flat, F32(0), scale), -low, codes


def _codes_from(values: np.ndarray, inverse: np.ndarray, low: np.ndarray, top: int) -> np.ndarray:
    codes = values - low
    codes *= inverse
    np.rint(codes, out=codes)
    return np.clip(codes, 0, top, out=codes)


def _error(values, weights, codes, scale, low, absolute: bool) -> np.ndarray:
    difference = codes * scale
    difference += low
    difference -= values
    if absolute:
        return _sum_of_products(np.abs(difference, out=difference), weights)
    return _sum_of_products(difference, difference, weights)


def _sum_of_products(*factors: np.ndarray) -> np.ndarray:
    """Σ over each column of the factors' product, multiplied left to right and added in order
    down the column (as the C loops do; numpy's einsum keeps both orders, in one pass)."""
    subscripts = ",".join(["ij"] * len(factors)) + "->j"
    return np.einsum(subscripts, *factors)


def symmetric_scale(values: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants with weights x²: codes 0..2 * `top` - 1 with value = scale * (code - `top`), the
    scale the best (weighted least squares) of 19 candidates around the one that maps the value of
    largest magnitude to -`top`. Returns (scale, codes); a sub-block of zeros gets scale 0 and codes 0."""
    peak = first_largest_magnitude(values, axis=0)
    zero = np.abs(peak) < ZERO_BLOCK
    weights = values * values
    weighted_values = weights * values
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        chosen = F32(-top) / peak
        sum_lx, sum_l2 = _fit(values, weights, weighted_values, chosen, top)
        scale = np.where(sum_l2 != 0, sum_lx / sum_l2, F32(0))
        best = scale * sum_lx
        for step in (*range(-9, 0), *range(1, 10)):
            inverse = -(F32(top) + F32(0.1) * F32(step)) / peak
            sum_lx, sum_l2 = _fit(values, weights, weighted_values, inverse, top)
            better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
            scale = np.where(better, sum_lx / sum_l2, scale)
            best = np.where(better, scale * sum_lx, best)
            chosen = np.where(better, inverse, chosen)
        codes = _signed_codes(values, chosen, top)
    codes += top
    codes[:, zero] = 0
    return np.where(zero, F32(0), scale), codes


def _fit(values, weights, weighted_values, inverse, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Σ w·x·l and Σ w·l² for the codes l that `inverse` rounds the values to."""
    codes = _signed_codes(values, inverse, top)
    return _sum_of_products(weighted_values, codes), _sum_of_products(weights, codes, codes)


def _signed_codes(values: np.ndarray, inverse: np.ndarray, top: int) -> np.ndarray:
    codes = values * inverse
    np.rint(codes, out=codes)
    return np.clip(codes, -top, top - 1, out=codes)


def refined_symmetric_scale(values: np.ndarray, top: int, passes: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """make_q3_quants with its refinement: the codes that map the value of largest magnitude to
    -`top`, then up to `passes` passes over the values in order, each moving one value's code to
    where the least-squares fit of the others puts it when that lowers the error. Codes 0..2 * `top`
    - 1, value = scale * (code - `top`). Returns (scale, codes); zeros get scale 0 and codes 0."""
    peak = first_largest_magnitude(values, axis=0)
    zero = np.abs(peak) < ZERO_BLOCK
    weights = values * values
    weighted_values = weights * values
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        codes = _signed_codes(values, F32(-top) / peak, top)
        sum_lx = _sum_of_products(weighted_values, codes)
        sum_l2 = _sum_of_products(weights, codes, codes)
        for _ in range(passes):
            changed = False
            for i, (value, weight, weighted_value, code) in enumerate(zip(values, weights, weighted_values, codes)):
                others_lx = sum_lx - weighted_value * code
                others_l2 = sum_l2 - weight * code * code
                moved = nearest(value * others_l2 / others_lx)
                np.clip(moved, -top, top - 1, out=moved)
                new_lx = others_lx + weighted_value * moved
                new_l2 = others_l2 + weight * moved * moved
                accept = ((others_lx > 0) & (moved != code) & (new_l2 > 0)
                          & (new_lx * new_lx * sum_l2 > sum_lx * sum_lx * new_l2))
                if accept.any():
                    codes[i] = np.where(accept, moved, code)
                    sum_lx = np.where(accept, new_lx, sum_lx)
                    sum_l2 = np.where(accept, new_l2, sum_l2)
                    changed = True
            if not changed:
                break
        scale = np.where(sum_l2 > 0, sum_lx / sum_l2, F32(0))
    codes += top
    codes[:, zero] = 0
    return np.where(zero, F32(0), scale), codes

"""The MLX backend: listed and available after set-up, every op passing at every dtype, and an
honest probe when MLX is missing."""

import json
import os
import sys

import pytest

from candelabra.backends.metal import MetalBackend
from candelabra.core.contract.ops import OP_NAMES
from candelabra.core.contract.weights import INT4_GROUP_FORMATS, QuantizedTensor, WeightRole
from candelabra.core.weights.random_quantized import random_quantized
from support import probe_without, run_candelabra

if not MetalBackend.probe().available:
    # CI installs the metal extra, so there a missing MLX is a failure, not a skip.
    if os.environ.get("CI"):
        raise RuntimeError(f"CI must run the metal backend: {MetalBackend.probe().reason}")
    pytest.skip(f"metal backend unavailable: {MetalBackend.probe().reason}", allow_module_level=True)


def test_metal_is_listed_as_available():
    run = run_candelabra("backends", "--json")
    metal = next(b for b in json.loads(run.stdout)["backends"] if b["name"] == "metal")
    assert metal["available"] and metal["distribution"].startswith("candelabra ")
    expected = "gpu" if sys.platform == "darwin" else "cpu"
    assert metal["detail"].startswith(expected)


def test_metal_implements_every_op_numpy_does_at_three_dtypes():
    backend = MetalBackend()
    assert set(backend.dtypes) == {"float32", "float16", "bfloat16"}
    assert all(backend.ops.supports(op) for op in OP_NAMES)


@pytest.mark.slow
def test_metal_passes_every_op_case_at_every_dtype(tmp_path):
    results = tmp_path / "metal.json"
    run = run_candelabra("conformance", "--backend", "metal", "--level", "ops", "--json", str(results))

    assert run.returncode == 0, run.stdout[-5000:] + run.stderr
    document = json.loads(results.read_text())
    assert {case["status"] for case in document["cases"] if not case["weight_format"]} == {"passed"}
    quantized = [case for case in document["cases"] if case["weight_format"]]
    kept = [case for case in quantized if case["weight_format"] in INT4_GROUP_FORMATS and case["op"] == "linear"]
    assert kept and {case["status"] for case in kept} == {"passed"}
    # GGUF's formats, and experts in any format, are dequantized by the core before they reach metal
    assert {case["status"] for case in quantized if case not in kept} == {"not supported"}
    assert set(document["summary_by_dtype"]["paged_attention"]) == {"float32", "float16", "bfloat16"}


@pytest.mark.parametrize("format, mlx_group", [("INT4_G64", 64), ("INT4_G256", 128)])
def test_a_grouped_int4_weight_stays_an_mlx_quantized_array_and_multiplies_x_in_its_own_column_order(
        format, mlx_group):
    import mlx.core as mx
    import numpy as np

    from candelabra.backends.metal.quantized import MlxInt4Weight

    rng = np.random.default_rng(30)
    plain = random_quantized(rng, format, 24, 512)
    weight = QuantizedTensor(format, plain.blocks, plain.shape, rng.permutation(512))
    backend = MetalBackend()
    kept = backend.upload_weight("proj.weight", WeightRole.LINEAR, weight, "float32")
    assert isinstance(kept, MlxInt4Weight) and kept.group_size == mlx_group and kept.packed.dtype == mx.uint32
    np.testing.assert_array_equal(np.array(kept.dense()), weight.dequantize())
    x = rng.standard_normal((3, 512)).astype(np.float32)
    out = np.array(backend.ops.linear(mx.array(x), kept))
    np.testing.assert_allclose(out, x.astype(np.float64) @ weight.dequantize().T, rtol=1e-4, atol=1e-4)


def test_probe_explains_a_missing_mlx():
    first, second = probe_without("mlx", "candelabra.backends.metal.backend:MetalBackend")
    assert first.startswith("False mlx is not installed") and "pip install 'candelabra[metal]'" in first
    assert second.startswith("refused: mlx is not installed")


def test_cache_write_and_attention_evaluate_as_one_step():
    """write_kv returns the new cache lazily; one evaluate computes it and the attention on it."""
    import mlx.core as mx
    import numpy as np

    from candelabra.core.contract.kv_cache import KVCacheSpec
    from candelabra.core.contract.step_metadata import StepMetadata

    backend = MetalBackend()
    (cache,) = backend.allocate_kv_cache(KVCacheSpec(1, 4, 16, 2, 64, "bfloat16"))
    meta = StepMetadata.build([3], [3], [[2]], block_size=16)
    rng = np.random.default_rng(3)
    q, k, v = (backend.to_device(rng.standard_normal((3, h, 64)), "bfloat16") for h in (4, 2, 2))
    cache = backend.ops.write_kv(cache, k, v, backend.prepare_step(meta).slot_mapping)
    out = backend.ops.paged_attention(q, cache, backend.prepare_step(meta), scale=0.125)
    backend.evaluate(out, cache)
    stored = backend.to_host(cache.key)[2, :3]
    np.testing.assert_array_equal(stored, backend.to_host(k))
    assert out.shape == (3, 4, 64) and out.dtype == mx.bfloat16

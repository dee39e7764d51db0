"""The GEMV tilings measured at start-up for a model's shapes that the GPU's tables lack, int4 and 16-bit
(against cuBLAS): which weights are found, the candidates timed and the fastest kept and saved, the
backend's linear taking it from then on, and what switches it off."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from candelabra.backends.cuda import gemv_tuning
from candelabra.backends.cuda.availability import assume_gpu, assume_multiprocessors
from candelabra.backends.cuda.kernels import dense_gemv, gemv_tilings
from candelabra.backends.cuda.kernels import int4_matmul as kernel
from candelabra.backends.cuda.quantized import Int4CudaWeight
from candelabra.conformance.quantized_weights import random_quantized
from candelabra.core.models.layer_weights import LatentAttention, Layer, Norm
from support import float64_values, kernel_device, skip_where_the_kernels_cannot_run

GPU = "NVIDIA TEST-GPU"


def int4(rng, rows: int, columns: int, format: str = "Q4_K") -> Int4CudaWeight:
    return Int4CudaWeight.from_quantized(random_quantized(rng, format, rows, columns), torch.float16, kernel_device())


def tiny_model(rng, layers: int = 2):
    norm = Norm(torch.ones(8))
    made = [Layer(qkv=int4(rng, 48, 1024), qkv_bias=None, out=int4(rng, 40, 1024), out_bias=None,
                  mlp_in=int4(rng, 48, 1024), mlp_out=torch.zeros(4, 4)) for _ in range(layers)]
    made[1].latent_attention = LatentAttention(int4(rng, 24, 512), None, norm, None, None, q_up=int4(rng, 40, 1024))
    return SimpleNamespace(layers=made, lm_head=int4(rng, 96, 512))


def test_the_models_int4_weights_are_found_by_shape_each_once():
    model = tiny_model(np.random.default_rng(1))
    model.layers[1].out = model.layers[0].out  # one weight in two places is timed once
    found = gemv_tuning.weights_by_shape(model)
    assert {shape: len(weights) for shape, weights in found.items()} == {
        (48, 1024): 4, (40, 1024): 2, (24, 512): 1, (96, 512): 1}
    assert all(isinstance(w, Int4CudaWeight) for weights in found.values() for w in weights)


@skip_where_the_kernels_cannot_run()
def test_each_shape_keeps_the_candidate_its_stopwatch_timed_fastest_and_it_computes_the_product(caplog):
    rng = np.random.default_rng(2)
    weights = {(40, 1024): [int4(rng, 40, 1024), int4(rng, 40, 1024)], (24, 128): [int4(rng, 24, 128, "Q4_0")]}
    timed = []

    def stopwatch(calls):  # runs every product, and times each candidate faster than the one before
        for call in calls:
            assert call().shape == (1, 40)
        timed.append(len(calls))
        return 100.0 - len(timed)

    with assume_multiprocessors(1), caplog.at_level(logging.INFO, logger="candelabra"):
        # 2 programs leave K whole, 4 and 8 split its 4 steps of 256 in two
        chosen = gemv_tuning.fastest_tilings(weights, kernel_device(), stopwatch)
    fastest = 100.0 - len(timed) + 1  # the last candidate's (the fallback was timed after it)
    assert (f"int4 [40, 1024] x 2 weights, one row: the fallback tiling {fastest - 1:.1f} µs" in caplog.text
            and f"the best {fastest:.1f} µs (32 x 256, 2 warps, K in 2, in turn)" in caplog.text), caplog.text
    # K = 128 fits no candidate (steps of 256 and 512): left to the fallback
    assert list(chosen) == [(40, 1024)] and set(timed) == {2} and len(timed) > len(gemv_tuning.CANDIDATES)
    last_block_n, last_block_k, last_warps, last_stages = gemv_tuning.CANDIDATES[-1]
    kept = chosen[40, 1024]
    assert (kept.block_n, kept.block_k, kept.num_warps, kept.num_stages) == (last_block_n, last_block_k, last_warps,
                                                                              last_stages)
    x = torch.randn(1, 1024, dtype=torch.float16, device=kernel_device())
    w = weights[40, 1024][0]
    config = kernel.TileConfig.of_gemv(kept)
    expected = kernel.int4_matmul(x, w.packed, w.scales, w.zeros).float()
    got = kernel.int4_matmul(x, w.packed, w.scales, w.zeros, config).float()
    assert float(((got - expected) ** 2).mean() / (expected ** 2).mean()) < 1e-6


def test_the_measured_tilings_are_saved_beside_the_users_own_and_chosen_from_then_on(user_tables, monkeypatch):
    mine = gemv_tilings.GemvTiling(block_n=64, block_k=512, split_k=1, num_warps=4, num_stages=1)
    gemv_tilings.write_table(gemv_tilings.table_file(user_tables, GPU), GPU, {(7, 512): mine}, "by hand")
    measured = gemv_tilings.GemvTiling(block_n=16, block_k=512, split_k=2, num_warps=2, num_stages=2)
    path = gemv_tuning.save(GPU, {(4096, 4096): measured})
    assert gemv_tilings.read_table(path) == {(7, 512): mine, (4096, 4096): measured}
    monkeypatch.setattr(kernel, "interpreting", lambda: False)
    with assume_multiprocessors(132), assume_gpu(GPU):
        config = kernel.choose_config(1, 4096, 4096, torch.device("cuda"))
    assert (config.block_n, config.split_k, config.num_stages) == (16, 2, 2)


def test_nothing_is_measured_on_cpu_tensors_under_the_interpreter_or_when_switched_off(user_tables, monkeypatch):
    model = tiny_model(np.random.default_rng(4))
    assert gemv_tuning.tune_missing_shapes(model, torch.device("cpu")) == {}
    monkeypatch.setattr(gemv_tuning, "interpreting", lambda: False)
    monkeypatch.setenv(gemv_tuning.SWITCH, "0")
    assert gemv_tuning.tune_missing_shapes(model, torch.device("cuda")) == {}
    assert not user_tables.exists()


def test_a_failed_measurement_is_logged_and_serving_goes_on_with_the_fallback(user_tables, monkeypatch, caplog):
    model = tiny_model(np.random.default_rng(5))
    monkeypatch.setattr(gemv_tuning, "interpreting", lambda: False)
    monkeypatch.delenv(gemv_tuning.SWITCH, raising=False)
    monkeypatch.setattr(gemv_tuning, "gpu_name", lambda device: GPU)

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(gemv_tuning, "fastest_tilings", out_of_memory)
    with caplog.at_level(logging.WARNING, logger="candelabra"):
        assert gemv_tuning.tune_missing_shapes(model, torch.device("cuda")) == {}
    assert "measuring the int4 GEMV's tilings on NVIDIA TEST-GPU failed (OutOfMemoryError" in caplog.text
    assert not user_tables.exists()


def test_shapes_the_gpus_tables_hold_are_measured_again_only_when_asked(user_tables, monkeypatch):
    model = tiny_model(np.random.default_rng(6))
    known = gemv_tilings.GemvTiling(block_n=32, block_k=512, split_k=1, num_warps=2, num_stages=1)
    gemv_tilings.write_table(gemv_tilings.table_file(user_tables, GPU), GPU,
                             {shape: known for shape in ((48, 1024), (40, 1024), (24, 512))}, "earlier")
    monkeypatch.setattr(gemv_tuning, "interpreting", lambda: False)
    monkeypatch.delenv(gemv_tuning.SWITCH, raising=False)
    monkeypatch.setattr(gemv_tuning, "gpu_name", lambda device: GPU)
    asked = []
    monkeypatch.setattr(gemv_tuning, "fastest_tilings", lambda by_shape, device, stopwatch: (
        asked.append(sorted(by_shape)) or {shape: known for shape in by_shape}))
    assert gemv_tuning.tune_missing_shapes(model, torch.device("cuda")) == {"int4": {(96, 512): known}}
    assert asked == [[(96, 512)]]
    assert set(gemv_tilings.measured_tilings(GPU)) == {(48, 1024), (40, 1024), (24, 512), (96, 512)}
    assert gemv_tuning.tune_missing_shapes(model, torch.device("cuda")) == {}  # all known now
    # with CANDELABRA_GEMV_TUNING=all every shape is measured again, and the user's table holds the new times'
    # choices over the old
    faster = dataclasses.replace(known, block_n=16)
    asked.clear()
    monkeypatch.setattr(gemv_tuning, "fastest_tilings", lambda by_shape, device, stopwatch: (
        asked.append(sorted(by_shape)) or {shape: faster for shape in by_shape}))
    monkeypatch.setenv(gemv_tuning.SWITCH, "all")
    assert gemv_tuning.tune_missing_shapes(model, torch.device("cuda")) == {"int4": {
        shape: faster for shape in ((24, 512), (40, 1024), (48, 1024), (96, 512))}}
    assert asked == [[(24, 512), (40, 1024), (48, 1024), (96, 512)]]
    assert set(gemv_tilings.measured_tilings(GPU).values()) == {faster}


def dense(rng, rows: int, columns: int, dtype=torch.float16) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal((rows, columns)) / np.sqrt(columns)).to(kernel_device(), dtype)


def test_the_models_16_bit_matrices_are_found_by_shape_and_nothing_else():
    rng = np.random.default_rng(7)
    model = tiny_model(rng)
    model.layers[0].out = dense(rng, 40, 1024)
    model.layers[1].out = dense(rng, 40, 1024, torch.bfloat16)
    model.layers[1].mlp_out = model.layers[0].out  # one weight in two places is timed once
    model.layers[0].qkv_bias = dense(rng, 1, 48).reshape(48)  # a vector is no linear weight
    model.lm_head = dense(rng, 96, 512)
    found = gemv_tuning.weights_by_shape(model, "dense")
    # the float32 [4, 4] and the int4 weights are not the 16-bit GEMV's
    assert {shape: len(weights) for shape, weights in found.items()} == {(40, 1024): 2, (96, 512): 1}


def stopwatch_timing(order: list[float]):
    """A stopwatch that runs every call and gives the times of `order`, in turn (the last one after)."""
    timed = []

    def stopwatch(calls):
        for call in calls:
            call()
        timed.append(len(calls))
        return order[min(len(timed), len(order)) - 1]

    return stopwatch, timed


def gemv_outruns_cublas(columns: int):
    """A stopwatch that runs every call, each a one-row product of `columns` outputs, and times cuBLAS (timed
    first) at 9 µs and then each candidate faster than the one before."""
    timings = []

    def stopwatch(calls):
        for call in calls:
            assert call().shape == (1, columns)
        timings.append(len(calls))
        return 9.0 if len(timings) == 1 else 8.0 - 0.01 * len(timings)

    return stopwatch


@skip_where_the_kernels_cannot_run()
def test_cublas_serves_a_shape_where_it_was_timed_fastest_and_the_fastest_gemv_elsewhere(caplog):
    rng = np.random.default_rng(8)
    weights = {(40, 1024): [dense(rng, 40, 1024), dense(rng, 40, 1024)], (24, 512): [dense(rng, 24, 512)]}
    # cuBLAS is timed first at each shape: 5 µs, then every candidate 10 µs
    with assume_multiprocessors(1), caplog.at_level(logging.INFO, logger="candelabra"):
        stopwatch, _ = stopwatch_timing([5.0, 10.0])
        assert gemv_tuning.fastest_dense({(24, 512): weights[24, 512]}, kernel_device(), stopwatch) == {
            (24, 512): None}
        assert "[24, 512] x 1 weights, one row: cuBLAS 5.0 µs" in caplog.text and "cuBLAS serves" in caplog.text

        candidates = []

        def gemv_wins(calls):
            for call in calls:
                assert call().shape == (1, 40)
            candidates.append(len(calls))
            return 9.5 if len(candidates) == 1 else 9.0 - 0.01 * len(candidates)  # cuBLAS first

        chosen = gemv_tuning.fastest_dense({(40, 1024): weights[40, 1024]}, kernel_device(), gemv_wins)

    kept = chosen[40, 1024]
    # the last candidate timed is the fastest; K = 1024 fits every candidate, some at fewer splits than asked
    assert len(candidates) > len(gemv_tuning.DENSE_CANDIDATES) and kept is not None
    assert (kept.block_n, kept.block_k, kept.num_warps, kept.num_stages) == gemv_tuning.DENSE_CANDIDATES[-1]
    assert "the GEMV serves" in caplog.text
    x = dense(rng, 1, 1024)
    expected = float64_values(x) @ float64_values(weights[40, 1024][0]).T
    got = dense_gemv.dense_gemv(x, weights[40, 1024][0], kept)
    assert float(((float64_values(got) - expected) ** 2).mean() / (expected ** 2).mean()) < 1e-6


def test_a_gated_mlps_down_projections_are_found_with_their_activation():
    rng = np.random.default_rng(10)
    layers = [Layer(qkv=dense(rng, 48, 512), qkv_bias=None, out=dense(rng, 40, 512), out_bias=None,
                    mlp_in=dense(rng, 64, 512), mlp_out=dense(rng, 40, 32)) for _ in range(2)]
    gemma = SimpleNamespace(config=SimpleNamespace(hidden_act="gelu_pytorch_tanh"), gated_mlp=True, layers=layers)
    assert gemv_tuning.gated_downs(gemma) == {(40, 32): "gelu_tanh"}
    llama = SimpleNamespace(config=SimpleNamespace(hidden_act="silu"), gated_mlp=True, layers=layers)
    assert gemv_tuning.gated_downs(llama) == {(40, 32): "silu"}
    phi = SimpleNamespace(config=SimpleNamespace(hidden_act="gelu_new"), gated_mlp=False, layers=layers)
    assert gemv_tuning.gated_downs(phi) == {}
    layers[1].mlp_out = int4(rng, 40, 1024)  # an int4 down projection runs the activation's kernel, then its GEMV
    assert gemv_tuning.gated_downs(llama) == {(40, 32): "silu"}


@skip_where_the_kernels_cannot_run()
def test_a_gated_down_projection_is_timed_as_gated_linear_runs_it_on_each_side(monkeypatch, caplog):
    from candelabra.backends.cuda.kernels import activations

    rng = np.random.default_rng(11)
    weights = [dense(rng, 40, 512), dense(rng, 40, 512)]
    activated, gates = [], []
    real_gated, real_gemv = activations.gated, dense_gemv.dense_gemv
    monkeypatch.setattr(activations, "gated", lambda x, a: activated.append((x.shape, a)) or real_gated(x, a))
    monkeypatch.setattr(dense_gemv, "dense_gemv", lambda *args, gated=None: (
        gates.append(gated) or real_gemv(*args, gated=gated)))
    stopwatch = gemv_outruns_cublas(columns=40)
    with assume_multiprocessors(1), caplog.at_level(logging.INFO, logger="candelabra"):
        chosen = gemv_tuning.fastest_dense({(40, 512): weights}, kernel_device(), stopwatch, {(40, 512): "silu"})
    assert "[40, 512] x 2 weights, one row, silu-gated x: cuBLAS 9.0 µs" in caplog.text
    # cuBLAS's side ran the activation's kernel over [gate | up] before each product; every GEMV was gated
    assert activated and set(activated) == {((1, 1024), "silu")} and gates and set(gates) == {"silu"}
    kept = chosen[40, 512]
    x = dense(rng, 1, 1024)
    expected = float64_values(activations.silu_and_mul(x)) @ float64_values(weights[0]).T
    got = real_gemv(x, weights[0], kept, gated="silu")
    assert float(((float64_values(got) - expected) ** 2).mean() / (expected ** 2).mean()) < 1e-6


def test_the_projections_of_an_rms_norms_output_are_found_for_the_norm_in_their_gemv():
    rng = np.random.default_rng(12)
    layers = [Layer(qkv=dense(rng, 48, 512), qkv_bias=None, out=dense(rng, 40, 512), out_bias=None,
                    mlp_in=dense(rng, 64, 512), mlp_out=dense(rng, 40, 32)) for _ in range(2)]
    layers[1].mlp_in = int4(rng, 72, 1024)  # an int4 projection runs the norm's kernel, then its GEMV
    llama = SimpleNamespace(norm_kind="rms", layers=layers, lm_head=dense(rng, 96, 512),
                            attention_projection=lambda layer: (layer.qkv, layer.qkv_bias))
    assert gemv_tuning.normed_projections(llama) == {(48, 512), (64, 512), (96, 512)}
    layers[0].experts = object()  # a layer of experts has no dense first projection
    assert gemv_tuning.normed_projections(llama) == {(48, 512), (96, 512)}
    phi = SimpleNamespace(**{**vars(llama), "norm_kind": "layer"})
    assert gemv_tuning.normed_projections(phi) == frozenset()


@skip_where_the_kernels_cannot_run()
def test_a_normed_projection_is_timed_as_rms_norm_linear_runs_it_on_each_side(monkeypatch, caplog):
    from candelabra.backends.cuda.kernels import norms

    rng = np.random.default_rng(13)
    weights = [dense(rng, 40, 512), dense(rng, 40, 512)]
    normalised, gemvs = [], []
    real_norm, real_gemv = norms.add_rms_norm, dense_gemv.normed_dense_gemv
    monkeypatch.setattr(norms, "add_rms_norm", lambda x, *args: normalised.append(x.shape) or real_norm(x, *args))
    monkeypatch.setattr(dense_gemv, "normed_dense_gemv", lambda x, norm, *args: (
        gemvs.append(norm.residual.shape) or real_gemv(x, norm, *args)))
    stopwatch = gemv_outruns_cublas(columns=40)
    with assume_multiprocessors(1), caplog.at_level(logging.INFO, logger="candelabra"):
        chosen = gemv_tuning.fastest_dense({(40, 512): weights}, kernel_device(), stopwatch,
                                           normed=frozenset({(40, 512)}))
    assert "[40, 512] x 2 weights, one row, x normalised after a residual add: cuBLAS 9.0 µs" in caplog.text
    # cuBLAS's side ran the norm's kernel over x and a residual before each product; every GEMV normalised
    assert normalised and set(normalised) == {(1, 512)} and gemvs and set(gemvs) == {(1, 512)}
    x, residual = dense(rng, 1, 512), dense(rng, 1, 512)
    norm_weight = dense(rng, 1, 512).reshape(512)
    expected = float64_values(real_norm(x, residual, norm_weight, 1e-6)[0]) @ float64_values(weights[0]).T
    got, _ = real_gemv(x, norms.RowNorm(norm_weight, 1e-6, 0.0, residual), weights[0], chosen[40, 512])
    assert float(((float64_values(got) - expected) ** 2).mean() / (expected ** 2).mean()) < 1e-5



def test_a_gated_mlps_gate_and_up_weights_are_found_with_their_down_projection_and_activation():
    rng = np.random.default_rng(14)
    layers = [Layer(qkv=dense(rng, 48, 512), qkv_bias=None, out=dense(rng, 40, 512), out_bias=None,
                    mlp_in=dense(rng, 64, 512), mlp_out=dense(rng, 512, 32)) for _ in range(3)]
    layers[1].mlp_in = int4(rng, 72, 1024)  # an int4 gate and up weight is not the 16-bit GEMV's
    layers[2].experts = object()  # a layer of experts has no dense MLP
    llama = SimpleNamespace(config=SimpleNamespace(hidden_act="silu"), gated_mlp=True, norm_kind="rms", layers=layers)
    assert gemv_tuning.gated_mlps(llama) == {(64, 512): ((512, 32), "silu")}
    gemma = SimpleNamespace(**{**vars(llama), "config": SimpleNamespace(hidden_act="gelu_pytorch_tanh")})
    assert gemv_tuning.gated_mlps(gemma) == {(64, 512): ((512, 32), "gelu_tanh")}
    for other in ({"norm_kind": "layer"}, {"gated_mlp": False}):
        assert gemv_tuning.gated_mlps(SimpleNamespace(**{**vars(llama), **other})) == {}


@skip_where_the_kernels_cannot_run()
@pytest.mark.parametrize("gate_up_by", ["gemv", "cublas", "table"])
def test_gate_and_up_are_timed_writing_the_gated_values_and_down_as_served_after_them(gate_up_by, monkeypatch,
                                                                                     caplog):
    from candelabra.backends.cuda.kernels import activations

    rng = np.random.default_rng(15)
    by_shape = {(64, 512): [dense(rng, 64, 512)], (40, 32): [dense(rng, 40, 32), dense(rng, 40, 32)]}
    gemvs, activated = [], []
    real_normed, real_plain, real_gated = dense_gemv.normed_dense_gemv, dense_gemv.dense_gemv, activations.gated
    monkeypatch.setattr(dense_gemv, "normed_dense_gemv", lambda *args, gate_output=None: (
        gemvs.append(("normed", gate_output)) or real_normed(*args, gate_output=gate_output)))
    monkeypatch.setattr(dense_gemv, "dense_gemv", lambda *args, gated=None: (
        gemvs.append(("plain", gated)) or real_plain(*args, gated=gated)))
    monkeypatch.setattr(activations, "gated", lambda x, a: activated.append((x.shape, a)) or real_gated(x, a))
    timed = []

    def stopwatch(calls):  # cuBLAS first at each shape; gate and up's GEMVs faster or slower than it
        for call in calls:
            call()
        timed.append(len(calls))
        first = len(timed) == 1 or len(calls) == 2 and timed.count(2) == 1
        if len(calls) == 1:
            return 9.0 if first else (8.0 if gate_up_by == "gemv" else 10.0)
        return 9.0 if first else 8.0

    measured = by_shape if gate_up_by != "table" else {(40, 32): by_shape[40, 32]}
    known = {(64, 512): gemv_tilings.GemvTiling(8, 256, 1, 2, 1)} if gate_up_by == "table" else {}
    with assume_multiprocessors(1), caplog.at_level(logging.INFO, logger="candelabra"):
        chosen = gemv_tuning.fastest_dense(measured, kernel_device(), stopwatch, {(40, 32): "silu"},
                                           mlps={(64, 512): ((40, 32), "silu")}, known=known)
    down_gated = gate_up_by == "cublas"
    if gate_up_by != "table":
        assert "[64, 512] x 1 weights, one row, x normalised after a residual add, silu-gated output" in caplog.text
        assert (chosen[64, 512] is None) == down_gated
        assert ((1, 64), "silu") in activated  # cuBLAS's side: the norm, cuBLAS, then the activation's kernel
        assert gemvs[0] == ("normed", "silu")
    assert ("[40, 32] x 2 weights, one row, silu-gated x" in caplog.text) == down_gated
    assert {kind for kind in gemvs if kind[0] == "plain"} == {("plain", "silu" if down_gated else None)}
    assert chosen[40, 32] is not None

@skip_where_the_kernels_cannot_run()
def test_start_up_measures_both_kinds_saves_them_and_the_backends_linear_follows(user_tables, monkeypatch):
    from candelabra.backends.cuda.ops import CudaOps

    rng = np.random.default_rng(9)
    model = SimpleNamespace(layers=[Layer(qkv=dense(rng, 48, 512), qkv_bias=None, out=dense(rng, 40, 512),
                                          out_bias=None, mlp_in=int4(rng, 56, 1024))], lm_head=dense(rng, 96, 512))
    monkeypatch.setattr(gemv_tuning, "interpreting", lambda: False)
    monkeypatch.delenv(gemv_tuning.SWITCH, raising=False)
    monkeypatch.setattr(gemv_tuning, "gpu_name", lambda device: GPU)
    # cuBLAS, timed first at each dense shape, is fastest at [40, 512] alone; the last candidate elsewhere
    timings_by_columns: dict[int, int] = {}

    def stopwatch(calls):
        columns = calls[0]().shape[-1]
        timings = timings_by_columns[columns] = timings_by_columns.get(columns, 0) + 1
        if timings == 1 and columns != 56:
            return 5.0 if columns == 40 else 60.0
        return 50.0 - timings

    monkeypatch.setattr(gemv_tuning, "graph_median_us", stopwatch)
    with assume_multiprocessors(1):
        measured = gemv_tuning.tune_missing_shapes(model, torch.device("cuda"))
    assert set(measured) == {"int4", "dense"} and set(measured["int4"]) == {(56, 1024)}
    assert set(measured["dense"]) == {(48, 512), (40, 512), (96, 512)} and measured["dense"][40, 512] is None
    assert gemv_tilings.read_table(gemv_tilings.table_file(user_tables, GPU, "dense"), "dense") == measured["dense"]
    assert gemv_tuning.tune_missing_shapes(model, torch.device("cuda")) == {}  # all known now

    launched = []
    monkeypatch.setattr(dense_gemv, "dense_gemv", lambda *args, **kwargs: launched.append(args[1].shape) or
                        torch.zeros(1, args[1].shape[0], dtype=torch.float16))
    ops = CudaOps(kernel_device())
    with assume_gpu(GPU):
        for weight in (model.layers[0].qkv, model.layers[0].out, model.lm_head):
            ops.linear(dense(rng, 1, 512), weight)
    assert launched == [(48, 512), (96, 512)]  # [40, 512] stayed with cuBLAS

"""The int4 GEMV's measured tilings: the tables (the package's and a user's), the tiling `choose_config`
takes from them, the tables' tilings computing the product, and bench/cuda_int4_tiles.py writing one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from candelabra.backends.cuda.availability import assume_gpu, assume_multiprocessors
from candelabra.backends.cuda.compile_check import TARGETS
from candelabra.backends.cuda.kernels import gemv_tilings
from candelabra.backends.cuda.kernels import int4_matmul as kernel
from candelabra.backends.cuda.kernels.gemv_tilings import GemvTiling, read_table, table_file, write_table
from candelabra.backends.cuda.quantized import Int4CudaWeight
from candelabra.conformance.compare import nmse, round_to
from candelabra.conformance.quantized_weights import random_quantized
from support import kernel_device, skip_where_the_kernels_cannot_run

ROOT = Path(__file__).resolve().parents[1]
H200 = "NVIDIA H200"
LLAMA_GATE_UP = (28672, 4096)


def package_tables() -> dict[str, dict]:
    return {json.loads(path.read_text())["device"]: read_table(path)
            for path in sorted(gemv_tilings.PACKAGE_TABLES.glob("*.json")) if not path.name.endswith(".dense.json")}


def test_every_package_table_reads_under_its_gpus_name_and_is_built_by_a_compile_target():
    tables = package_tables()
    assert H200 in tables and set(tables[H200]) >= {LLAMA_GATE_UP, (4096, 14336), (128256, 4096)}
    claimed = {gpu for target in TARGETS.values() for gpu in target.gpus}
    for device in tables:
        assert table_file(gemv_tilings.PACKAGE_TABLES, device).is_file()
        assert device in claimed, f"no compile_check target builds {device}'s tilings"


def test_a_table_is_written_and_read_back_and_the_users_wins_over_the_packages(user_tables):
    package = gemv_tilings.measured_tilings(H200)[LLAMA_GATE_UP]
    mine = GemvTiling(block_n=64, block_k=256, split_k=2, num_warps=4, num_stages=1)
    path = table_file(user_tables, H200)
    write_table(path, H200, {LLAMA_GATE_UP: mine, (10, 512): mine}, "by hand")
    assert path.name == "nvidia-h200.json" and json.loads(path.read_text())["measured"] == "by hand"
    assert read_table(path) == {LLAMA_GATE_UP: mine, (10, 512): mine}
    tilings = gemv_tilings.measured_tilings(H200)
    assert tilings[LLAMA_GATE_UP] == mine != package
    assert tilings[128256, 4096] == package_tables()[H200][128256, 4096]  # the package's where mine has none
    assert gemv_tilings.measured_tilings("NVIDIA B300") == {}


@pytest.mark.parametrize(("entry", "problem"), [
    ({"width": 512, "block_n": 32, "block_k": 512, "split_k": 1, "num_warps": 2, "num_stages": 1}, "KeyError"),
    ({"columns": 8, "width": 512, "block_n": 24, "block_k": 512, "split_k": 1, "num_warps": 2, "num_stages": 1},
     "powers of two"),
    ({"columns": 8, "width": 768, "block_n": 32, "block_k": 512, "split_k": 1, "num_warps": 2, "num_stages": 1},
     "must divide K"),
    # two steps split three ways: one split would take none
    ({"columns": 8, "width": 1024, "block_n": 32, "block_k": 512, "split_k": 3, "num_warps": 2, "num_stages": 1},
     "split them with a step for each split"),
    ({"columns": 8, "width": 512, "block_n": 32, "block_k": 512, "split_k": 1, "num_warps": 2, "num_stages": 3},
     "num_stages is 1 or 2"),
])
def test_a_table_that_is_not_one_is_refused_naming_the_file_and_the_fault(tmp_path, entry, problem):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"device": H200, "gemv": [entry]}))
    with pytest.raises(ValueError, match=problem) as refused:
        read_table(path)
    assert str(path) in str(refused.value) and "--save-table" in str(refused.value)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="JSONDecodeError"):
        read_table(path)


def test_one_row_takes_the_gpus_measured_tiling_for_its_shape_and_the_fallback_elsewhere(monkeypatch, user_tables):
    monkeypatch.setattr(kernel, "interpreting", lambda: False)
    measured = gemv_tilings.measured_tilings(H200)[LLAMA_GATE_UP]
    cuda = torch.device("cuda")
    with assume_multiprocessors(132), assume_gpu(H200):
        config = kernel.choose_config(1, *LLAMA_GATE_UP, cuda)
        other_shape = kernel.choose_config(1, 4096, 8192, cuda)
        two_rows = kernel.choose_config(2, *LLAMA_GATE_UP, cuda)
    with assume_multiprocessors(132), assume_gpu(None):
        unmeasured = kernel.choose_config(1, *LLAMA_GATE_UP, cuda)
    assert (config.block_m, config.block_n, config.block_k, config.split_k, config.num_warps,
            config.num_stages) == (1, measured.block_n, measured.block_k, measured.split_k, measured.num_warps,
                                   measured.num_stages)
    fallback = kernel.GEMV_CONFIG
    for chosen in (other_shape, unmeasured):
        assert (chosen.block_n, chosen.block_k, chosen.num_warps, chosen.num_stages) == (
            fallback.block_n, fallback.block_k, fallback.num_warps, fallback.num_stages)
    assert two_rows.block_m > 1
    # a user's tiling whose step would end inside a weight's scale group is passed over for that weight
    write_table(table_file(user_tables, H200), H200,
                {LLAMA_GATE_UP: GemvTiling(block_n=32, block_k=128, split_k=1, num_warps=2, num_stages=1)}, "")
    with assume_multiprocessors(132), assume_gpu(H200):
        assert kernel.choose_config(1, *LLAMA_GATE_UP, cuda, group=128).block_k == 128
        assert kernel.choose_config(1, *LLAMA_GATE_UP, cuda, group=256).block_k == fallback.block_k


@skip_where_the_kernels_cannot_run()
def test_every_measured_tiling_computes_the_dequantized_product():
    """Each tiling a package table holds, on a weight two of its steps deep and split as the table says
    where K allows (int4_matmul lowers a split K does not divide into)."""
    device = kernel_device()
    rng = np.random.default_rng(31)
    tilings = {tiling for table in package_tables().values() for tiling in table.values()}
    assert tilings
    for tiling in sorted(tilings, key=repr):
        width, columns = 2 * tiling.block_k, 3 * tiling.block_n + 5
        weight = random_quantized(rng, "Q4_K", columns, width)
        x = round_to(rng.standard_normal((1, width)), "float16")
        expected = x.astype(np.float64) @ weight.dequantize().astype(np.float64).T
        kept = Int4CudaWeight.from_quantized(weight, torch.float16, device)
        config = kernel.TileConfig.of_gemv(tiling)
        out = kernel.int4_matmul(torch.from_numpy(x).to(device, torch.float16), kept.packed, kept.scales,
                                 kept.zeros, config)
        assert nmse(out.float().cpu().numpy(), expected) <= 1e-6, tiling


def bench_run(device: str, timings: dict[str, dict[str, float]]) -> dict:
    """A run as bench/cuda_int4_tiles.py --json writes it, with these µs per shape and label."""
    labels = {"gemv n32 w2": (32, 2), "gemv n16 w2": (16, 2), "gemv n64 w4": (64, 4)}
    results = {}
    for shape, by_label in timings.items():
        results[shape] = {label: {"us": us, "tiling": {"block_m": 1 if label in labels else 16,
                                                       "block_n": labels.get(label, (64, 4))[0], "block_k": 512,
                                                       "split_k": 2, "group_m": 8,
                                                       "num_warps": labels.get(label, (64, 4))[1],
                                                       "num_stages": 1, "scale_after_dot": True}}
                          for label, us in by_label.items()}
    return {"device": device, "rows": 1, "results": results, "config": "llama-3-8b", "measured": "2026-11-27"}


def test_the_bench_saves_each_shapes_fastest_gemv_from_an_earlier_run(tmp_path):
    shapes = ("qkv", "out", "gate_up", "down", "lm_head")
    timings = {shape: {"gemv n32 w2": 10.0, "gemv n16 w2": 12.0, "gemv n64 w4": 11.0, "dot n64": 1.0}
               for shape in shapes}
    timings["gate_up"]["gemv n16 w2"] = 9.0
    run = tmp_path / "run.json"
    run.write_text(json.dumps(bench_run("NVIDIA H100 80GB HBM3", timings)))
    table = tmp_path / "h100.json"
    saved = subprocess.run([sys.executable, str(ROOT / "bench" / "cuda_int4_tiles.py"), "--from-json", str(run),
                            "--save-table", str(table)], capture_output=True, text=True, cwd=tmp_path,
                           env={**os.environ, "CANDELABRA_KERNEL_TABLES": str(tmp_path / "unused")})
    assert saved.returncode == 0, saved.stderr[-3000:]
    written = json.loads(table.read_text())
    assert written["device"] == "NVIDIA H100 80GB HBM3" and written["measured"].startswith("2026-11-27")
    tilings = read_table(table)
    assert len(tilings) == 5 and tilings[LLAMA_GATE_UP].block_n == 16  # the tensor-core tile is no GEMV
    assert {t.block_n for shape, t in tilings.items() if shape != LLAMA_GATE_UP} == {32}
    assert "gate_up  28672" in saved.stdout

    del timings["lm_head"]
    run.write_text(json.dumps(bench_run("NVIDIA H100 80GB HBM3", timings)))
    refused = subprocess.run([sys.executable, str(ROOT / "bench" / "cuda_int4_tiles.py"), "--from-json", str(run),
                              "--save-table", str(table)], capture_output=True, text=True, cwd=tmp_path)
    assert refused.returncode != 0 and "not llama-3-8b's" in refused.stderr


def test_a_users_table_that_does_not_read_is_passed_over_with_a_warning_and_written_anew(user_tables, caplog):
    from candelabra.backends.cuda.gemv_tuning import save

    path = table_file(user_tables, H200)
    path.parent.mkdir(parents=True)
    path.write_text('{"device": "NVIDIA H200", "gemv": [{"columns": 8}]}')
    with caplog.at_level("WARNING", logger="candelabra"):
        tilings = gemv_tilings.measured_tilings(H200)
    assert tilings == package_tables()[H200]
    assert str(path) in caplog.text and "passed over" in caplog.text
    mine = GemvTiling(block_n=64, block_k=512, split_k=1, num_warps=4, num_stages=1)
    save(H200, {(8, 512): mine})
    assert read_table(path) == {(8, 512): mine}
    assert gemv_tilings.measured_tilings(H200)[8, 512] == mine

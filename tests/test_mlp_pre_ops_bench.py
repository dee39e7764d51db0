"""bench/mlp_pre_ops.py runs on a GGUF model and reports each way of running a decode's MLP."""

import subprocess
import sys

from gguf import GGMLQuantizationType

from candelabra.conformance.gguf_models import convert_to_gguf, settings_of, tiny_model
from live_server import byte_pair_tokenizer
from support import REPO


def test_the_bench_times_the_mlp_fused_and_in_turn_beside_its_products(tmp_path):
    path = tmp_path / "qwen2-q5_0.gguf"
    convert_to_gguf(tiny_model("qwen2"), "qwen2", path, GGMLQuantizationType.Q5_0,
                    metadata=byte_pair_tokenizer(settings_of("qwen2")["vocab_size"]))

    run = subprocess.run([sys.executable, str(REPO / "bench" / "mlp_pre_ops.py"), "--model", str(path),
                          "--rounds", "3", "--rows", "2"], capture_output=True, text=True, timeout=300)

    assert run.returncode == 0, run.stderr[-3000:]
    rows = {line.split("  ")[0]: line.split() for line in run.stdout.splitlines()}
    assert {"the two products", "norm and gate fused", "torch ops in turn"} <= set(rows)
    assert rows["the two products"][-1] == "0"  # each way is measured against the products themselves
    assert "2 row(s), medians of 3 rounds" in run.stdout

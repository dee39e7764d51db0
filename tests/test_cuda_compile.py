"""Every Triton kernel of the cuda backend, compiled for Hopper (sm_90a) and Ampere (sm_80) without a GPU:
the specializations serving launches for bench/configs' models and the conformance suite's test models
(see CI_PLAN for the share CI builds), each checked for compile errors, spills and shared memory
(backends/cuda/compile_check.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from candelabra.backends.cuda.compile_check import (
    INSTRUCTION_BUDGETS,
    SPILL_FREE,
    TARGETS,
    Compiled,
    loads_before_wait,
    longest_loop,
    parse_ptxas_report,
)

REPO = Path(__file__).resolve().parents[1]
PTXAS_REPORT = """ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function '_attention_tile_kernel' for 'sm_90a'
ptxas info    : Function properties for _attention_tile_kernel
    24 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 24 bytes cumulative stack size
"""


def test_the_ptxas_report_gives_registers_and_spill_stores():
    assert parse_ptxas_report(PTXAS_REPORT) == (255, 12)
    assert parse_ptxas_report("no report: the build came from a cache") == (None, None)


def test_a_variant_fails_on_a_compile_error_a_spill_or_too_much_shared_memory():
    fine = Compiled("_rms_norm_kernel", "BLOCK=1024", "sm_90a", registers=25, spilled=0, shared=16)
    assert fine.problems == []
    assert Compiled("_rms_norm_kernel", "v", "sm_90a", error="CompilationError: x").problems == [
        "does not compile: CompilationError: x"]
    # a spill fails where a docstring claims none: 16-bit attention on sm_90a, but not float32's, nor sm_80's
    assert "spills 12 bytes, where kernels/paged_attention.py" in Compiled(
        "_attention_tile_kernel", "DOT_DTYPE=bf16", "sm_90a", registers=64, spilled=12).problems[0]
    assert Compiled("_attention_tile_kernel", "DOT_DTYPE=fp32", "sm_90a", registers=64, spilled=12).problems == []
    assert Compiled("_attention_tile_kernel", "DOT_DTYPE=bf16", "sm_80", registers=64, spilled=12).problems == []
    assert Compiled("_int4_matmul_kernel", "DOT_PRECISION=ieee", "sm_90a", registers=255, spilled=8).problems
    limit = TARGETS["sm_80"].shared_memory_per_block
    too_much = Compiled("_rms_norm_kernel", "v", "sm_80", registers=32, spilled=0, shared=limit + 1)
    assert "more than the 166912 a block may have" in too_much.problems[0]
    assert Compiled("_rms_norm_kernel", "v", "sm_90a", shared=limit + 1).problems == []  # 227 KiB there


# nvdisasm's listing of a kernel with a loop of five instructions, a short loop inside it, and a forward branch
SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   ISETP.GE.AND P0, PT, R12, 0x1, PT ;
        /*0020*/              @!P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0030*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
.L_x_2:
        /*0040*/                   LOP3.LUT R8, R4, 0x780000, R9, 0xf8, !PT ;
        /*0050*/               @P1 BRA `(.L_x_2) ;
        /*0060*/                   FFMA R10, R8, R11, R10 ;
        /*0070*/               @P2 BRA `(.L_x_1) ;
.L_x_0:
        /*0080*/                   EXIT ;
"""


def test_the_longest_loop_runs_from_a_label_to_the_furthest_branch_back_to_it():
    assert longest_loop(SASS) == 5
    past_64k = SASS.replace("/*00", "/*1ff")  # addresses of five hex digits, as a large kernel's are
    assert "/*1ff30*/" in past_64k and longest_loop(past_64k) == 5
    assert longest_loop(SASS.replace("@P2 BRA `(.L_x_1)", "NOP")) == 2
    assert longest_loop("") == 0


def test_the_loads_a_program_issues_before_it_waits_for_the_kernel_before_are_counted():
    sass = """
        /*00e0*/                   PREEXIT ;
        /*0270*/               @P1 LDG.E.128 R16, desc[UR12][R8.64] ;
        /*02a0*/               @P1 LDG.E.128 R12, desc[UR12][R2.64] ;
        /*0530*/                   ACQBULK ;
        /*0540*/                   LDG.E.128 R20, desc[UR12][R4.64] ;
"""
    assert loads_before_wait(sass) == 2
    assert loads_before_wait(sass.replace("ACQBULK", "NOP")) == 3  # never waits: all of them
    assert loads_before_wait("/*0100*/ ACQBULK ;\n/*0270*/ @P1 LDG.E.128 R16, desc[UR12][R8.64] ;") == 0
    # a GEMV launched as a dependent that loaded nothing before its wait would stream nothing meanwhile
    fault = "loads none of its weight before it waits (no LDG ahead of ACQBULK in its SASS), so nothing"
    assert fault in Compiled("_dense_gemv_kernel", "GATE=-1", "sm_90a", per_unit=4.1,
                             dependent_fault=fault).problems[0]


def test_a_gemv_variant_fails_over_its_instruction_budget_or_where_they_were_not_counted():
    budget = INSTRUCTION_BUDGETS["_int4_gemv_kernel"][0]
    variant = "BLOCK_N=32 BLOCK_K=512 SPLIT=True PREFETCH=True bf16/fp32/i32/u8 w2s1"
    assert Compiled("_int4_gemv_kernel", variant, "sm_90a", per_unit=budget.most).problems == []
    over = Compiled("_int4_gemv_kernel", variant, "sm_90a", per_unit=budget.most + 0.01).problems
    assert len(over) == 1 and "instructions a weight in its loop, where kernels/int4_matmul.py" in over[0]
    assert "were not counted" in Compiled("_int4_gemv_kernel", variant, "sm_90a").problems[0]
    # shallow K-tiles and other targets are not held to it; a variant that does not compile says only that
    assert Compiled("_int4_gemv_kernel", variant.replace("512", "128"), "sm_90a", per_unit=6.0).problems == []
    # nor the 16-wide tilings a measured table holds, where they streamed fastest
    assert Compiled("_int4_gemv_kernel", variant.replace("=32", "=16"), "sm_90a", per_unit=4.8).problems == []
    assert Compiled("_int4_gemv_kernel", variant.replace("w2s1", "w4s1"), "sm_90a", per_unit=4.8).problems == []
    assert Compiled("_int4_gemv_kernel", variant, "sm_80", per_unit=6.0).problems == []
    assert Compiled("_int4_gemv_kernel", variant, "sm_90a", error="E: x").problems == ["does not compile: E: x"]
    assert budget.units({"BLOCK_N": 32, "BLOCK_K": 512}, 2) == 256
    # the 16-bit GEMV is held to 4.5 a weight, but with a gated MLP's activation computed as it loads x to 12
    plain = "BLOCK_N=8 BLOCK_K=512 VECTOR=8 SPLIT=True PREFETCH=False HAS_BIAS=False GATE=-1 DEPENDENT=True"
    assert Compiled("_dense_gemv_kernel", plain, "sm_90a", per_unit=4.6).problems
    assert Compiled("_dense_gemv_kernel", plain.replace("GATE=-1", "GATE=0"), "sm_90a", per_unit=6.3).problems == []
    assert "(gated x) says at most 12.0" in Compiled("_dense_gemv_kernel", plain.replace("GATE=-1", "GATE=2"),
                                                     "sm_90a", per_unit=12.5).problems[0]
    # and normalising x as it loads it to 6.5
    normed = plain.replace("DEPENDENT", "NORM=True RESIDUAL=True DEPENDENT")
    assert Compiled("_dense_gemv_kernel", normed, "sm_90a", per_unit=6.2).problems == []
    assert "(normalised x) says at most 6.5" in Compiled("_dense_gemv_kernel", normed, "sm_90a",
                                                         per_unit=6.6).problems[0]


def test_the_projections_of_an_rms_norms_output_are_built_with_the_norm():
    from candelabra.backends.cuda.compile_check import DEFAULT_CONFIGS, workloads_from

    configs = {w.label: w for w in workloads_from([DEFAULT_CONFIGS])}
    llama = configs["llama-3-8b"]
    assert llama.normed_shapes() == {(6144, 4096): (True, False), (128256, 4096): (False,)}
    assert llama.gated_mlp_in() == ((28672, 4096), "silu")  # gate and up writing the gated values
    deepseek = configs["deepseek-v2-lite"]  # no compressed queries; its first layer's MLP is dense
    assert deepseek.normed_shapes() == {(3072 + 512 + 64, 2048): (True, False), (102400, 2048): (False,)}
    assert deepseek.gated_mlp_in() == ((2 * 10944, 2048), "silu")
    assert configs["gemma-2-2b"].gated_mlp_in()[1] == "gelu_tanh"
    assert configs["phi-2"].normed_shapes() == {} and configs["phi-2"].gated_mlp_in() is None  # layer norms


def test_the_recorder_refuses_to_run_under_the_interpreter():
    script = ("from candelabra.backends.cuda.compile_check import TARGETS, recording_launches\n"
              "with recording_launches(TARGETS['sm_90a']): pass\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode != 0 and "TRITON_INTERPRET=1" in run.stderr


def test_launch_code_plans_its_grids_for_the_targets_sm_count():
    """The int4 GEMV splits K for a decode by the SMs it has to fill, eight programs an SM: 256 column
    tiles of 32 and 16 steps of 512 along K take 8 splits for sm_90a's 132 SMs and 4 for sm_80's 108."""
    script = """
import torch
from candelabra.backends.cuda.compile_check import TARGETS, recording_launches
from candelabra.backends.cuda.kernels.int4_matmul import int4_matmul
for name in ("sm_90a", "sm_80"):
    with recording_launches(TARGETS[name]) as launches:
        int4_matmul(torch.empty(1, 8192, dtype=torch.bfloat16), torch.empty(8192, 4096, dtype=torch.uint8),
                    torch.empty(8192, 256, dtype=torch.bfloat16), torch.empty(8192, 256, dtype=torch.bfloat16))
    print(name, len(launches), launches[0].name, *launches[0].grid)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["sm_90a", "1", "_int4_gemv_kernel", "256", "8", "1",
                                  "sm_80", "1", "_int4_gemv_kernel", "256", "4", "1"]


# What CI compiles: every dense model of bench/configs in bfloat16 (the dtype they serve in) for Hopper,
# Llama-3-8B in bfloat16 for Ampere too and in float32 (the paths that spill first) for Hopper; of the
# mixture-of-experts models (bench/configs' Qwen3-30B-A3B and DeepSeek-V2-Lite, the conformance suite's
# tiny MoE models), the fused-MoE kernels alone, in bfloat16 for both (about 30 s on 2 cores); of the
# latent-attention ones (DeepSeek-V2-Lite,
# and again with DeepSeek-V3's 128 heads, for the tiles of 64 heads V3 launches), the kernels of their
# attention. The conformance test models' other kernels (head dimensions of 16 and 32 that nothing served
# has), Qwen3-30B-A3B's (13 a target, 10 of them attention with 8 query heads a KV head) and every other
# dtype are in the whole grid, `python -m candelabra.backends.cuda.compile_check` (docs/cuda-backend.md): the
# test models' 130 variants took four of CI's 30 minutes on 2 cores. The int8 and fp8 KV caches' variants
# of the cache write and of attention are built for Hopper at Llama-3-8B (and DeepSeek-V2-Lite's latent
# attention) in bfloat16 for a split decode, a chunk beside decodes and a long prefill (about 20 s).
CI_PLAN = """
import json, sys
from dataclasses import replace
from pathlib import Path
from candelabra.backends.cuda.compile_check import DEFAULT_CONFIGS, TARGETS, Workload, check, workloads_from
from candelabra.conformance.model_cases import MODEL_CASES, config_json
configs = workloads_from([DEFAULT_CONFIGS])
dense = [w for w in configs if not w.experts]
routed = [w for w in configs if w.experts] + [Workload.from_hf_config(case.name, config_json(case))
                                              for case in MODEL_CASES
                                              if case.routes_experts and not case.kv_cache_dtype]
llama = [w for w in configs if w.label == "llama-3-8b"]
fused_moe = frozenset({"_count_picks_kernel", "_place_picks_kernel", "_gate_up_kernel", "_down_kernel",
                       "_sum_picks_kernel"})
latent = frozenset({"_latent_attention_kernel", "_rotary_kernel", "_rms_norm_kernel"})
v3_heads = [replace(w, label="deepseek-v3 heads", heads=128) for w in configs if w.label == "deepseek-v2-lite"]
both = [TARGETS["sm_90a"], TARGETS["sm_80"]]
quantized_kv = frozenset({"_attention_tile_kernel", "_write_kv_kernel", "_rotary_kernel"})
kv_steps = [[1], [17, 1, 1, 1], [2048]]
results = (check(dense, [TARGETS["sm_90a"]], ("bfloat16",)) + check(llama, [TARGETS["sm_80"]], ("bfloat16",))
           + check(llama, [TARGETS["sm_90a"]], ("float32",))
           + check(routed, both, ("bfloat16",), kernels=fused_moe)
           + check([w for w in configs if w.mla] + v3_heads, both, ("bfloat16",), kernels=latent)
           + check(llama, [TARGETS["sm_90a"]], ("bfloat16",), kernels=quantized_kv, kv_dtypes=("int8", "fp8"),
                   steps=kv_steps)
           + check([w for w in configs if w.mla], [TARGETS["sm_90a"]], ("bfloat16",), kernels=latent,
                   kv_dtypes=("int8", "fp8"), steps=kv_steps))
Path(sys.argv[1]).write_text(json.dumps([vars(r) | {"problems": r.problems} for r in results]))
"""


@pytest.mark.slow
def test_every_kernel_compiles_for_hopper_and_ampere_without_spills_or_too_much_shared_memory(tmp_path):
    results = tmp_path / "compiled.json"
    compiler_env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", CI_PLAN, str(results)], capture_output=True, text=True,
                         timeout=1800, env=compiler_env)
    assert run.returncode == 0, run.stderr[-5000:]
    compiled = json.loads(results.read_text())
    for entry in sorted(compiled, key=lambda e: (e["kernel"], e["target"], e["variant"])):
        print(f"{entry['kernel']:24} {entry['target']:7} regs {entry['registers']} spilled {entry['spilled']} "
              f"shared {entry['shared']} {entry['mma']:5} {entry['variant']}"
              + (f" loop {entry['per_unit']:.2f} a unit" if entry["per_unit"] is not None else ""))
    problems = [f"{e['kernel']} [{e['variant']}] on {e['target']}: {p}" for e in compiled for p in e["problems"]]
    assert not problems, "\n".join(problems)
    assert {entry["target"] for entry in compiled} == {"sm_90a", "sm_80"}
    kernels = {entry["kernel"] for entry in compiled}
    assert kernels >= {"_attention_tile_kernel", "_rms_norm_kernel", "_gated_kernel",
                       "_elementwise_kernel", "_rotary_kernel", "_write_kv_kernel", "_sample_rows",
                       "_chunk_statistics_kernel", "_int4_matmul_kernel", "_count_picks_kernel",
                       "_place_picks_kernel", "_gate_up_kernel", "_down_kernel", "_sum_picks_kernel",
                       "_latent_attention_kernel", "_search_start_kernel", "_search_pass_kernel",
                       "_search_narrow_kernel", "_dense_gemv_kernel"}
    assert all(entry["registers"] for entry in compiled)
    attention = [entry for entry in compiled if entry["kernel"] == "_attention_tile_kernel"]
    assert {"wgmma", "mma"} <= {entry["mma"] for entry in attention}
    # a decode step's tiles rotating q and writing the step's keys (neox's pairs), over whole heads and phi-2's
    # first 32 features of 80; mixed steps' tiles not
    words = {word for entry in attention for word in entry["variant"].split()}
    assert {"ROTARY=1", "ROTARY=0", "ROTARY_DIM=128", "ROTARY_DIM=32"} <= words
    latent = [entry for entry in compiled if entry["kernel"] == "_latent_attention_kernel"]
    assert {"wgmma", "mma"} <= {entry["mma"] for entry in latent}
    assert {"deepseek-v2-lite", "deepseek-v3 heads"} <= {model for entry in latent for model in entry["models"]}
    for kernel in ("_attention_tile_kernel", "_write_kv_kernel", "_rotary_kernel", "_latent_attention_kernel"):
        codes = {code for entry in compiled if entry["kernel"] == kernel for code in ("int8", "fp8")
                 if f"CODES={code} " in entry["variant"]}
        assert codes == {"int8", "fp8"}, f"{kernel} was not built over int8 and fp8 KV caches"
    assert not set(SPILL_FREE) - kernels
    # every kernel launches as a dependent of the kernel before it on Hopper (each variant's PTX waited for
    # it before writing: `problems` above), never on Ampere, which has no such launch
    for entry in compiled:
        assert f"DEPENDENT={entry['target'] == 'sm_90a'}" in entry["variant"].split(), entry
    # Llama-3-8B's batch-1 int4 GEMV, the bfloat16 one, is held to its instruction budget on sm_90a where no
    # table tiles it; the H200's table's tilings are built too
    budget = INSTRUCTION_BUDGETS["_int4_gemv_kernel"][0]
    gemv = [entry for entry in compiled if entry["kernel"] == "_int4_gemv_kernel" and entry["target"] == "sm_90a"
            and "bf16" in entry["variant"]]
    counted = [entry for entry in gemv if budget.covers("sm_90a", entry["variant"])]
    assert counted and all(entry["per_unit"] is not None for entry in counted)
    assert {"BLOCK_N=16", "BLOCK_N=32"} <= {word for entry in gemv for word in entry["variant"].split()}
    # the int4 GEMV normalising x as it loads it too, counted where the budget covers it
    assert any("NORM=True" in entry["variant"].split() for entry in counted)
    # the 16-bit GEMV of a gated MLP's down projection, SiLU's (Llama) and GELU tanh's (Gemma), counted too
    dense = [entry for entry in compiled if entry["kernel"] == "_dense_gemv_kernel" and entry["target"] == "sm_90a"]
    gated = [entry for entry in dense if "GATE=-1" not in entry["variant"].split()]
    assert {"GATE=0", "GATE=2"} <= {word for entry in gated for word in entry["variant"].split()}
    # and a pre-norm's projection normalising x as it loads it, after a residual add and without
    normed = [entry["variant"].split() for entry in dense if "NORM=True" in entry["variant"].split()]
    assert {"RESIDUAL=True", "RESIDUAL=False"} <= {word for words in normed for word in words}
    # and a gated MLP's gate and up writing the gated values, SiLU's and GELU tanh's, of 16-bit and int4 weights
    assert {"GATE_OUT=0", "GATE_OUT=2"} <= {word for words in normed for word in words}
    assert any("GATE_OUT=0" in entry["variant"].split() for entry in counted)
    assert all(entry["per_unit"] is not None for entry in dense)

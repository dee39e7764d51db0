#!/usr/bin/env bash
# The cuda backend on a machine with an NVIDIA GPU, from this checkout, in named steps, each sized to end
# inside 9 minutes from a cold Triton cache (sized from the work each does; no GPU has timed them yet):
#
#   bash bench/gpu_check.sh [--out FOLDER] [--budget SECONDS] [--pack FILE] STEP [STEP ...]
#
# runs the steps in the order given; `all` is every step in order, `first` the ones a device session of
# 15 minutes runs in its first call, most telling first (FIRST below), `second` those of its second call. With --budget each step runs under what is
# left of SECONDS and a step that would start with under 20 s left is skipped; with --pack the output
# folder is written again as one gzipped tar after every step (a caller that takes back a few files
# alone, as this workplace's device tool, gets everything so, even when it stops the call).
#
#   env                 nvidia-smi, versions, `candelabra backends`
#   compile             the sm_90a compile table of Llama-3-8B's kernels
#   ops                 conformance ops level at every dtype the backend declares (bfloat16, float16,
#                       float32), at the suite's real shapes
#   models-fp16         conformance models level in float16
#   models-bf16         conformance models level in bfloat16
#   engine              conformance engine level in float16 and bfloat16
#   tests               the cuda backend's own tests (tests/test_cuda_*.py), which run the kernels on the GPU
#                       wherever torch sees one, the compile check for sm_90a and sm_80 among them
#   bench-bf16          bench/cuda_decode.py: batch 1/16/64 decode beside the roofline measured in the
#                       same run, TTFT at 2,048 tokens (Llama-3-8B shapes, dummy weights, bfloat16)
#   bench-int4          bench/cuda_decode.py: Q4_K (int4) and GPTQ-style INT4_G128 batch 1 against bfloat16 batch 1
#   bench-cublas        bench/cuda_decode.py at batch 1 with CANDELABRA_DENSE_GEMV=0: every bfloat16 product on
#                       cuBLAS, against bench-bf16's, which takes the 16-bit GEMV where start-up measured it faster
#   bench-no-pdl        bench/cuda_decode.py at batch 1 with CANDELABRA_PDL=0: each kernel launched after the one
#                       before has finished, against bench-bf16's dependent launches (kernels/dependent_launch.py)
#   bench-unfused       bench/cuda_decode.py at batch 1 with CANDELABRA_DECODE_FUSIONS=0: rotary in its own kernel
#                       and a gated MLP's activation apart from gate and up's GEMV, against bench-bf16's fusions
#   retuned             bench/cuda_decode.py at batch 1 in bfloat16 with CANDELABRA_GEMV_TUNING=all: every 16-bit
#                       shape measured again at start-up, GEMV against cuBLAS (the package's table was measured
#                       before dependent launches), into a table folder of its own, printed
#   int4-tuned          bench/cuda_decode.py at Qwen2.5-7B's shapes, which no table holds: the int4 GEMV's tilings
#                       measured at start-up (into a table folder of its own, printed), then int4 batch 1
#   bench-in-turn       bench/cuda_decode.py --no-async-scheduling: bench-bf16 and bench-int4 with each step
#                       waiting for the one before's tokens, then bench/cuda_profile.py so: what scheduling
#                       ahead (the default) gains (compare with bench-bf16, bench-int4 and profile)
#   bench-transformers  bench/cuda_decode.py: transformers' generate at batch 1/16/64
#   profile             bench/cuda_profile.py: a trace of graph replays, the host's share of a step,
#                       top-p sampling against greedy at 152k and 128k vocabularies
#                       and bench/cuda_mixed_attention.py: a mixed step's decodes tiled apart against in one launch
#   attention-split     bench/cuda_attention_split.py: decode attention at batch 1 and 4, contexts of 128 to 16,384,
#                       with keys split into segments of at least 1, 2, 4, 8, 16 steps or not at all; then at
#                       batch 1, 16 and 64 with the decode tile stepping through 64 or 32 keys in 3 or 2 stages
#   profile-no-pdl      bench/cuda_profile.py at batch 1 with CANDELABRA_PDL=0: each kernel's exposed time without
#                       dependent launches, beside profile's with them
#   profile-int4        bench/cuda_profile.py at batch 1 with Q4_K (int4) weights: where an int4 step's time goes
#   int4-tiles          bench/cuda_int4_tiles.py: the int4 kernels' tilings at one row, per Llama-3-8B linear shape
#   host                bench/host_step_time.py: the engine's host phases of a decode step at batch 1, 16, 64
#                       (a tiny model, 256- and 4,096-token prompts): what the GPU waits for between steps
#
# Each step writes STEP.log (everything it printed) and its JSON under the output folder: the first
# argument after --out, else $OUT, else ./gpu-check. A step that fails says so and the next still runs;
# the exit status is that of the last failure.
#
# On a machine with torch (CUDA), Triton and transformers but no network, candelabra is installed from
# this checkout without dependencies, after the wheels in .whl/ (gguf, which such machines lack:
# `pip download --no-deps --only-binary=:all: -d .whl gguf` beforehand, where there is a network).
set -uo pipefail
cd "$(dirname "$0")/.."
STEPS=(env compile ops models-fp16 models-bf16 engine tests bench-bf16 bench-no-pdl bench-unfused retuned bench-int4 bench-cublas
       int4-tuned bench-in-turn bench-transformers profile profile-no-pdl attention-split profile-int4 int4-tiles host)
# Batch 1 with short contexts whole in one attention program (kernels/key_segments.py) and the decode
# fusions (rotary in the attention's launch, gate and up writing the gated values), with and without those
# fusions and dependent launches (without was 2% ahead on 27 November, night, within about the spread of two
# runs), and the profile, whose attention and GEMV exposed times say what is left; then correctness (about
# 430 s by the step times of the H200 runs of 27 November). Then where splitting a decode's keys starts to pay
# and which decode tiling is fastest (attention-split, about 60 s), int4 batch 1 at Llama-3-8B's shapes (about
# 190 s; 1.66x bfloat16 in the afternoon), the profile without dependent launches, cuBLAS alone, transformers
# and in-turn scheduling, as the budget allows.
FIRST=(env bench-bf16 bench-unfused bench-no-pdl profile ops models-bf16 engine)
SECOND=(attention-split bench-int4 profile-no-pdl bench-cublas bench-transformers bench-in-turn)

results=${OUT:-./gpu-check}
budget=0 pack=""
steps=()
while (($#)); do
    case "$1" in
        --out) results=$2; shift 2 ;;
        --budget) budget=$2; shift 2 ;;
        --pack) pack=$2; shift 2 ;;
        all) steps+=("${STEPS[@]}"); shift ;;
        first) steps+=("${FIRST[@]}"); shift ;;
        second) steps+=("${SECOND[@]}"); shift ;;
        *)
            if [[ " ${STEPS[*]} " != *" $1 "* ]]; then
                echo "unknown step '$1'; the steps are: ${STEPS[*]} (or all, first, second)" >&2
                exit 2
            fi
            steps+=("$1"); shift ;;
    esac
done
if ((${#steps[@]} == 0)); then
    echo "usage: bash bench/gpu_check.sh [--out FOLDER] [--budget SECONDS] [--pack FILE] STEP [STEP ...];" \
         "the steps are: ${STEPS[*]} (or all, first, second)" >&2
    exit 2
fi
if ! [[ $budget =~ ^[0-9]+$ ]]; then
    echo "--budget takes whole seconds, not '$budget'" >&2
    exit 2
fi
mkdir -p "$results"
results=$(cd "$results" && pwd)

if ! python3 -c "import candelabra.backends.cuda" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps .whl/*.whl
    fi
    python3 -m pip install -q --no-deps --no-build-isolation -e .
fi
python3 -c "import gguf" 2>/dev/null || echo "warning: gguf is not installed; steps that read GGUF files fail" >&2
# The kernels compiled for the GPU, even where the caller's shell turned Triton's interpreter on.
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
candelabra() { python3 -m candelabra.core.cli "$@"; }
# Conformance's cases spread over the cores where pytest-xdist is installed, so that Triton's compiles do
# (on a 16-core H200 machine the ops level took 37 s so, each models level about 25, the engine level 27).
# Each worker then keeps torch's CPU threads (transformers' reference) to a few.
parallel=() spread=() threads=${OMP_NUM_THREADS:-$(nproc)}
if python3 -c "import xdist" 2>/dev/null; then
    parallel=(-- -n "$(nproc)") spread=(-n "$(nproc)" --dist loadfile) threads=${OMP_NUM_THREADS:-2}
fi

run_step() {
    case "$1" in
        env)
            nvidia-smi
            python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'CUDA', torch.version.cuda, \
'triton', triton.__version__, 'transformers', transformers.__version__)"
            candelabra backends ;;
        compile)
            python3 -m candelabra.backends.cuda.compile_check --quiet --target sm_90a --dtype bfloat16 \
                --config bench/configs/llama-3-8b --json "$results/compile-sm_90a.json" ;;
        ops)
            OMP_NUM_THREADS=$threads candelabra conformance --backend cuda --level ops --json "$results/ops.json" "${parallel[@]}" ;;
        models-fp16)
            OMP_NUM_THREADS=$threads candelabra conformance --backend cuda --level models --dtype float16 --json "$results/models-fp16.json" "${parallel[@]}" ;;
        models-bf16)
            OMP_NUM_THREADS=$threads candelabra conformance --backend cuda --level models --dtype bfloat16 --json "$results/models-bf16.json" "${parallel[@]}" ;;
        engine)
            # both dtypes, whichever fails
            OMP_NUM_THREADS=$threads candelabra conformance --backend cuda --level engine --dtype float16 --json "$results/engine-fp16.json" "${parallel[@]}"
            local half=$?
            OMP_NUM_THREADS=$threads candelabra conformance --backend cuda --level engine --dtype bfloat16 --json "$results/engine-bf16.json" "${parallel[@]}"
            local brain=$?
            return $((half ? half : brain)) ;;
        tests)
            OMP_NUM_THREADS=$threads python3 -m pytest -q -p no:cacheprovider "${spread[@]}" tests/test_cuda_*.py ;;
        bench-bf16)
            python3 bench/cuda_decode.py --parts bfloat16 --json "$results/bench-bf16.json" ;;
        bench-int4)
            python3 bench/cuda_decode.py --parts int4 --batches 1 --int4-formats Q4_K INT4_G128 \
                --json "$results/bench-int4.json" ;;
        bench-cublas)
            CANDELABRA_DENSE_GEMV=0 python3 bench/cuda_decode.py --parts bfloat16 --batches 1 \
                --json "$results/bench-cublas.json" ;;
        bench-unfused)
            CANDELABRA_DECODE_FUSIONS=0 python3 bench/cuda_decode.py --parts bfloat16 --batches 1 \
                --json "$results/bench-unfused.json" ;;
        bench-no-pdl)
            CANDELABRA_PDL=0 python3 bench/cuda_decode.py --parts bfloat16 --batches 1 \
                --json "$results/bench-no-pdl.json" ;;
        retuned)
            rm -rf "$results/retuned-tables" &&
            CANDELABRA_KERNEL_TABLES="$results/retuned-tables" CANDELABRA_GEMV_TUNING=all python3 bench/cuda_decode.py \
                --parts bfloat16 --batches 1 --json "$results/retuned.json" &&
            cat "$results"/retuned-tables/cuda/*.json ;;
        int4-tuned)
            rm -rf "$results/tables" &&
            CANDELABRA_KERNEL_TABLES="$results/tables" python3 bench/cuda_decode.py --config bench/configs/qwen2.5-7b \
                --parts int4 --batches 1 --json "$results/int4-tuned.json" &&
            cat "$results"/tables/cuda/*.json ;;
        bench-in-turn)
            python3 bench/cuda_decode.py --parts bfloat16 int4 --no-async-scheduling --json "$results/bench-in-turn.json" &&
            python3 bench/cuda_profile.py --no-async-scheduling --no-sampling --out "$results/profile-in-turn" ;;
        bench-transformers)
            python3 bench/cuda_decode.py --parts transformers --json "$results/bench-transformers.json" ;;
        profile)
            python3 bench/cuda_profile.py --out "$results/profile" &&
            python3 bench/cuda_mixed_attention.py ;;
        attention-split)
            python3 bench/cuda_attention_split.py ;;
        profile-no-pdl)
            CANDELABRA_PDL=0 python3 bench/cuda_profile.py --no-sampling --batches 1 --out "$results/profile-no-pdl" ;;
        profile-int4)
            python3 bench/cuda_profile.py --quantization Q4_K --no-sampling --batches 1 --out "$results/profile-int4" ;;
        int4-tiles)
            python3 bench/cuda_int4_tiles.py --rows 1 --json "$results/int4-tiles.json" ;;
        host)
            python3 bench/host_step_time.py --backend cuda --steps 100 &&
            python3 bench/host_step_time.py --backend cuda --steps 100 --prompt-tokens 4096 --concurrency 64 ;;
    esac
}

packed() {
    [[ -z $pack ]] || { tar -czf "$pack.part" -C "$results" . && mv "$pack.part" "$pack"; }
}

status=0
for step in "${steps[@]}"; do
    started=$SECONDS
    left=$((budget - SECONDS))
    if ((budget && left < 20)); then
        echo "== $step: skipped, ${left} s of the ${budget} s budget left" | tee -a "$results/skipped.log"
        continue
    fi
    if ((budget)); then
        # the step in a shell of its own (writing its own log), so that the time limit stops all it started
        timeout --kill-after=10 "$left" bash "$0" --out "$results" "$step"
        code=$?
        if ((code == 124 || code == 137)); then
            echo "== $step: stopped at the budget, after $((SECONDS - started)) s" | tee -a "$results/$step.log"
        fi
    else
        echo "== $step"
        run_step "$step" 2>&1 | tee "$results/$step.log"
        code=${PIPESTATUS[0]}
        echo "== $step: exit $code after $((SECONDS - started)) s" | tee -a "$results/$step.log"
    fi
    ((code)) && status=$code
    packed
done
packed
exit $status

#!/usr/bin/env bash
# The cuda backend on a machine with an NVIDIA GPU, from this checkout, in two runs of a few minutes:
#
#   bash bench/gpu_check.sh conformance   # every level: ops at every dtype, models and engine in float16
#                                         # and then in bfloat16, at the suite's real shapes
#   bash bench/gpu_check.sh bench         # bench/cuda_decode.py: decode tok/s against the roofline and
#                                         # transformers, TTFT, int4 against bfloat16
#
# It installs this checkout without dependencies when candelabra is not importable, for machines that
# have torch, Triton and transformers but no network; any wheel in .whl/ (gguf, which such a machine
# lacks) is installed first. Results go to $OUT when set, else to the current folder.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
    conformance|bench) ;;
    *) echo "usage: bash bench/gpu_check.sh conformance|bench" >&2; exit 2 ;;
esac

if ! python3 -c "import candelabra.backends.cuda" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps .whl/*.whl
    fi
    python3 -m pip install -q --no-deps --no-build-isolation -e .
fi
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
results=${OUT:-.}
candelabra() { python3 -m candelabra.core.cli "$@"; }

case "${1:-}" in
    conformance)
        candelabra backends
        candelabra conformance --backend cuda --dtype float16 --json "$results/cuda-conformance-float16.json"
        candelabra conformance --backend cuda --level models --level engine --dtype bfloat16 \
            --json "$results/cuda-conformance-bfloat16.json"
        ;;
    bench)
        python3 bench/cuda_decode.py --json "$results/cuda-decode.json"
        ;;
esac

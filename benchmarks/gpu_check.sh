#!/usr/bin/env bash
# kvflow's CUDA check, on one GPU, in one go: the CUDA tests, then
# `kvflow bench copy --device cuda` and `kvflow bench ttft --device cuda`. Results go to $OUT
# (default: bench-results/gpu/): gpu.txt, cuda-tests.log and .xml, copy.json, ttft.json, and
# each step's log. The exit status is the first failing step's. Every step has a time limit,
# and the limits add up to 7.5 minutes: the script ends in under 8 whatever happens.
#
# Needs python3 with a CUDA build of torch, numpy, pytest and hypothesis (CUDA images for
# PyTorch have them) and a C compiler for the native copy loop. Nothing is fetched: wheels
# placed in .whl/ (e.g. pytest-asyncio, pytest-timeout) are installed from there first.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/bench-results/gpu}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
status=0
step() {  # step NAME SECONDS COMMAND...: run, log to $out/NAME.log, remember the first failure
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc"
    [ "$status" -ne 0 ] || status=$rc
}

if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --target /tmp/kvflow-site .whl/*.whl &&
        export PYTHONPATH=$PYTHONPATH:/tmp/kvflow-site
fi
{ nvidia-smi; "$py" -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"; } \
    >"$out/gpu.txt" 2>&1
step build 60 "$py" setup.py -q build_ext --inplace
# pytest-asyncio may be missing: the CUDA tests need none of the project's pytest plugins
step cuda-tests 180 "$py" -m pytest -c benchmarks/gpu_pytest.ini --rootdir . -q -rs \
    --junitxml="$out/cuda-tests.xml" tests/cuda tests/test_cuda.py
step copy 90 "$py" -m kvflow bench copy --device cuda --blocks 16KiB,64KiB,256KiB,1MiB \
    --bytes 256MiB --threads 1,2 --repeats 7 --json "$out/copy.json"
# per-layer compute well above per-layer load: a 16-layer Llama-8B-shaped model, 8192 tokens,
# 6144 of them loaded (24 MiB of KV per layer), 2048 computed
step ttft 120 "$py" -m kvflow bench ttft --device cuda --layers 16 --hidden 4096 --heads 32 \
    --kv-heads 8 --head-dim 128 --mlp 14336 --dtype bfloat16 --block-size 16 --chunk-blocks 16 \
    --tokens 8192 --hit-rate 0.75 --repeats 5 --json "$out/ttft.json"
echo "gpu_check: exit $status; results in $out"
exit "$status"

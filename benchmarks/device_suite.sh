#!/usr/bin/env bash
# Issue 32's runs on a GPU box, in two calls that each end well inside a 10-minute limit (the first also warms a
# cold Triton cache, about 2.5 minutes). Run from the repository root, on a box with CUDA PyTorch and Triton; a box
# without network needs the wheels that benchmarks/RESULTS.md "Rerunning the tables" downloads into .whl/:
#
#     bash benchmarks/device_suite.sh crowd OUT_FOLDER   # part 3: every workload at 10/50/100/200 users (about 7 min)
#     bash benchmarks/device_suite.sh alone OUT_FOLDER   # the CUDA checks, then parts 1, 2 and 4 (about 5 min)
#
# Each writes device.txt (the card and versions), its JSON files and a log into OUT_FOLDER; RESULTS.md says which
# table each file fills. The Triton cache is kept in .triton-cache/ (git ignores it), so a second call on the same
# machine starts warm.
set -euo pipefail
stage=${1:?crowd or alone}
out=$(realpath "${2:?an output folder}")
cd "$(dirname "$0")/.."
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton-cache
{
    date -u +"%Y-%m-%d %H:%M UTC"
    git rev-parse --short HEAD 2>/dev/null || true
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python -c "import sys; from importlib.metadata import distributions
found = {}
for d in distributions():  # the first of a name on sys.path is the one imported
    found.setdefault(d.metadata['Name'].lower(), d.version)
print('python', sys.version.split()[0], *(f'{name} {found.get(name)}' for name in
      ('torch', 'triton', 'torchvision', 'transformers', 'flash-linear-attention')))"
    nproc
} | tee "$out/device.txt"
python -c "from benchmarks.real_shape import ensure_real_shape_checkpoint as e; e()"

case $stage in
crowd)
    {
        python benchmarks/concurrency.py --mode engine --workload text,image-448,follow-up --levels 10,50,100,200 \
            --duration 6 --grace 8 --json "$out/crowd.json"
        python benchmarks/concurrency.py --mode engine --workload image-1344,video-16 --image-format jpeg \
            --levels 10,50,100,200 --duration 6 --grace 8 --json "$out/heavy.json"
    } 2>&1 | tee "$out/crowd.log"
    ;;
alone)
    {
        python tests/kernels_check.py
        python tests/continued_graphs_check.py --prompts 64,48
        python tests/continued_graphs_check.py --prompts 16,5,1 --turn-tokens 150
        python benchmarks/jpeg_on_device.py --runs 10 --paths 1 --json "$out/lone_photo.json"
        python benchmarks/follow_ups.py --turns 10 --runs 2 --json "$out/follow_ups.json"
        python benchmarks/single_request.py --runs 3 --count-syncs --json "$out/single.json"
        python benchmarks/decode_step.py --batches 1,200 --no-eager --profile 12 --json "$out/decode.json"
        python benchmarks/experiments/follow_up_wave.py --prompts 1,4,8
    } 2>&1 | tee "$out/alone.log"
    ;;
*)
    echo "unknown stage: $stage (crowd or alone)" >&2
    exit 2
    ;;
esac

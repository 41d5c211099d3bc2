#!/usr/bin/env bash
# What a session lent a GPU runs, in one call from the repository root (issues 19 and 36):
# the CUDA synchronisation count of a training step, the training speed against the raw loop,
# photo training on one GPU worker with each augmentation policy (the data wait, and the
# decoding rate with few CPUs, for the CPUs a GPU needs), and nvJPEG's decoding rate (issue 51).
# Output under $OUT (or /tmp/gpu-out).
#
# The lent machines' python3 has torch with CUDA and no package registry: Ray and the rest of
# imgtrain's dependencies that it lacks travel as wheels in .whl/ (docs/NOTES.md, "GPU sessions"),
# and are installed here into /tmp/site. The data sets come along in data/.
set -u
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH="/tmp/site:$PWD/src" PATH="/tmp/site/bin:$PATH"
  # the benchmarks start `ray` from beside the Python that runs them
  ln -sf /tmp/site/bin/ray "$(dirname "$(python3 -c 'import sys; print(sys.executable)')")/ray"
fi
python3 -c "import torch, ray, imgtrain, mlxtend, simplejpeg; \
print('torch', torch.__version__, torch.cuda.get_device_name(0), 'ray', ray.__version__)" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
nproc >> "$out/gpu.txt"

step() {  # a time limit per step, so that one slow step leaves the others their turn
  local limit=$1 name=$2
  shift 2
  echo "== $name (at most $limit s)"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt"
  ray stop --force > /dev/null 2>&1  # what a step cut short left running
}
# Two calls, each under the device tool's 600 s: `bench/gpu_session.sh` (the session's figures,
# 570 s at most) first, then `bench/gpu_session.sh decode` (issue 51's GPU decoding, 300 s at most).
if [ "${1:-session}" = decode ]; then
  # issue 51: the data wait with the photos decoded on the GPU against the CPUs, per policy, interleaved
  step "${DECODE_S:-240}" data_pipeline_decode python3 bench/data_pipeline.py --gpu --images 12000 \
    --policies randaugment,trivialaugment --decode cpu,gpu
  step "${DECODE_TESTS_S:-60}" device_photos_cuda python3 -m pytest -q -p no:cacheprovider \
    tests/data/test_device_photos_cuda.py
else
  step "${PROBE_S:-40}" decode_probe python3 bench/gpu_decode_probe.py
  step "${SYNCS_S:-60}" step_syncs python3 -m pytest -q -p no:cacheprovider tests/training/test_step_syncs.py
  step "${THROUGHPUT_S:-300}" train_throughput python3 bench/train_throughput.py --gpu \
    --rows raw,local,ray-1,to-accuracy --time-to-accuracy 0.985 --repeats 3 --epochs 4
  step "${PIPELINE_S:-170}" data_pipeline python3 bench/data_pipeline.py --gpu --images 12000 \
    --policies randaugment,trivialaugment,autoaugment
fi
find bench/results -newer "$out/gpu.txt" -name '*.json' -exec cp {} "$out/" \;
ls "$out"

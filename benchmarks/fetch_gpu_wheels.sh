#!/usr/bin/env bash
# Downloads, on a machine with network, the one wheel that gpu_check.sh needs and the H200 image lacks:
# Ultralytics, for the yolofast-vs-Ultralytics train step on the GPU (goal: >= 2x its images/s).
# The GPU machine has no network: the device tool carries .whl/ (run with carry [".whl"]), and
# gpu_check.sh installs what it finds there into /tmp/site. Ultralytics is measured, never a dependency,
# and none of its code is copied into this repository (.whl/ is git-ignored).
#
# --no-deps: the modules the benchmark imports (ultralytics.cfg, ultralytics.nn.tasks, ultralytics.utils.loss)
# need only torch, numpy, opencv, PIL and yaml, which the image has (checked with --no-deps in a Python
# 3.12 + torch 2.11 venv here: the step ran and gave yolofast's loss).
#
#   bash benchmarks/fetch_gpu_wheels.sh      # ULTRALYTICS_VERSION=8.4.190 by default
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .whl "ultralytics==${ULTRALYTICS_VERSION:-8.4.190}"
ls -l .whl

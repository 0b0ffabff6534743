"""Training data pipeline: samples/s per core of yolofast vs Ultralytics (1 thread, alternating blocks).

    python benchmarks/bench_data.py --data ../shared/data/coco128/coco128.yaml
    PYTHONPATH=. ~/ultra-venv/bin/python benchmarks/bench_data.py --data ../shared/data/coco128/coco128.yaml

Same as ``yolofast bench data``; Ultralytics is timed when it is importable in the interpreter.
"""

import sys

from yolofast.data.bench import bench_data_main

if __name__ == "__main__":
    sys.exit(bench_data_main(sys.argv[1:]))

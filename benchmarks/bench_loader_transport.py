"""DataLoader workers: how a batch travels back to the main process, in one run.

    PYTHONPATH=. nice -n 10 python benchmarks/bench_loader_transport.py \
        --data ../shared/data/coco128/coco128.yaml [--workers 2 --rounds 6 --batches 24]

Alternating idle-to-idle rounds (``yolofast.data.bench.loader_rounds``) of workers=0, workers=W with the
reused shared blocks (``yolofast.data.batch_ring``, the default) and workers=W with a fresh shared block
per batch (the transport before them). Prints batches per wall second and CPU seconds per batch of all
processes: the CPU figures hold under load, the wall clock only on free cores.
"""

import argparse
import os
import statistics

import cv2
import torch

from yolofast.data import build_dataloader, build_dataset, check_data, collate_fn
from yolofast.data.bench import cpu_name, loader_rounds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--batches", type=int, default=24)
    a = ap.parse_args()
    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    data = check_data(a.data)

    def loader(workers):
        ds = build_dataset(data["train"], imgsz=a.imgsz, augment=True, nc=data["nc"], batch_size=a.batch)
        return build_dataloader(ds, a.batch, workers, shuffle=True, seed=0)

    w = a.workers
    loaders = {"workers=0": loader(0), f"workers={w}": loader(w), f"workers={w}, fresh blocks": loader(w)}
    loaders[f"workers={w}, fresh blocks"].collate_fn = collate_fn  # a new shared block per batch
    load0 = os.getloadavg()[0]
    rates, cpu = loader_rounds(loaders, a.batches, a.rounds)
    print(f"{cpu_name()}, {os.cpu_count()} cores, batch {a.batch}, imgsz {a.imgsz}, {a.rounds} rounds of "
          f"{a.batches} batches; load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after")
    tot = {k: [m + x for m, x in zip(v["main"], v["workers"])] for k, v in cpu.items()}
    c0 = statistics.median(tot["workers=0"])
    print(f"{'':28s} {'batches/s':>10s} {'ratio':>6s} {'CPU s/batch':>12s} {'main':>7s} "
          f"{'on free cores':>14s}")
    for k in loaders:
        r = [b / a for a, b in zip(rates["workers=0"], rates[k])]
        c = statistics.median(tot[k])
        print(f"{k:28s} {statistics.median(rates[k]):10.2f} {statistics.median(r):5.2f}x {c:12.4f} "
              f"{statistics.median(cpu[k]['main']):7.4f} {max(loaders[k].num_workers, 1) * c0 / c:13.2f}x")


if __name__ == "__main__":
    main()

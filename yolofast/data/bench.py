"""``yolofast bench data``: training samples per second per core of the data pipeline, against Ultralytics'
where it is importable, and the GPU step throughput that rate can feed.

One process, one thread (OpenCV and torch), ``dataset[i]`` in alternating blocks per engine (a busy
neighbour slows both alike), each engine's default training augmentation. The rate is samples per CPU
second of this process: with one thread that is samples per second per core, and it does not count the
time a neighbour held the core.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

__all__ = ["bench_data_main", "cpu_name", "loader_rates", "loader_rounds", "measure"]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _one_thread() -> None:
    import cv2
    import torch

    cv2.setNumThreads(1)
    torch.set_num_threads(1)


def _yolofast_dataset(train, imgsz, batch, cache, names_nc):
    from yolofast.data import build_dataset

    return build_dataset(train, imgsz=imgsz, augment=True, nc=names_nc, cache=cache, batch_size=batch,
                         prefix="yolofast: ")


def _ultralytics_dataset(train, imgsz, batch, cache, data):
    """Ultralytics' YOLODataset with its default training hyper-parameters, or None when not importable."""
    try:
        from ultralytics.cfg import get_cfg
        from ultralytics.data.dataset import YOLODataset as UDataset
        from ultralytics.utils import DEFAULT_CFG
        from ultralytics.utils import LOGGER as ULOGGER
    except ImportError:
        return None
    ULOGGER.setLevel("ERROR")
    try:
        import psutil  # noqa: F401  Ultralytics sizes cache=ram with it
    except ImportError:  # without it its memory check fails: the bench's sets are small, skip the check
        UDataset.check_cache_ram = lambda self, *a, **k: True
    hyp = get_cfg(DEFAULT_CFG, dict(imgsz=imgsz, cache=cache))
    return UDataset(img_path=train, imgsz=imgsz, batch_size=batch, augment=True, hyp=hyp, rect=False,
                    cache=cache or False, single_cls=False, stride=32, pad=0.0, prefix="ultralytics: ",
                    task="detect", classes=None, data=data, fraction=1.0)


def _block(ds, order, start, n):
    t0 = time.process_time()
    for k in range(n):
        ds[order[(start + k) % len(order)]]
    return n / max(time.process_time() - t0, 1e-9)


def measure(engines: dict, blocks: int, block_size: int, seed: int = 0) -> dict:
    """Alternate blocks of ``block_size`` samples over ``engines`` (name -> dataset); -> name -> list of
    samples per CPU second, one per block. One warm-up block each first (page cache, buffers)."""
    import numpy as np

    n = min(len(ds) for ds in engines.values())
    order = np.random.default_rng(seed).permutation(n).tolist()
    rates = {k: [] for k in engines}
    for ds in engines.values():
        _block(ds, order, 0, block_size)
    for b in range(blocks):
        names = list(engines) if b % 2 == 0 else list(engines)[::-1]
        for name in names:
            rates[name].append(_block(engines[name], order, (b + 1) * block_size, block_size))
    return rates


def loader_rates(make_dataset, batch: int, workers: tuple, n_batches: int, rounds: int) -> tuple:
    """DataLoader over a fresh dataset per workers value (persistent workers, warmed first by up to 4
    epochs or 40 batches: each worker fills its own mosaic buffer, and on a set as small as coco128 the
    buffer ends up holding every image), ``rounds`` alternating rounds of ``n_batches`` each.

    A round starts and ends with every worker idle (its prefetch queue full), so one loader's workers
    never run during the other's round, and its CPU seconds (main process + workers, /proc) are exactly
    the cost of the batches it handed out. A workers>0 round first takes the prefetched batches untimed
    (that restarts the workers) and times the next ``n_batches``: without this a round of 8 batches
    started with 4 already made, and the other loader's round paid for refilling them.

    -> (batches per wall second, CPU seconds per batch as {"main": [...], "workers": [...]}), per workers
    value, one entry per round."""
    from yolofast.data import build_dataloader

    loaders = {w: build_dataloader(make_dataset(), batch, w, shuffle=True, seed=0) for w in workers}
    return loader_rounds(loaders, n_batches, rounds)


def loader_rounds(loaders: dict, n_batches: int, rounds: int) -> tuple:
    """``loader_rates`` over given DataLoaders (name -> loader; each with an EpochSampler)."""
    names = list(loaders)
    its = {k: _endless(ld) for k, ld in loaders.items()}
    for k, it in its.items():
        for _ in range(min(4 * len(loaders[k]), 40) + 1):
            next(it)
    rates = {k: [] for k in names}
    cpu = {k: {"main": [], "workers": []} for k in names}
    for r in range(rounds):
        for k in (names if r % 2 == 0 else names[::-1]):
            for ld in loaders.values():
                _wait_idle(ld)
            queued = (loaders[k].prefetch_factor or 0) * loaders[k].num_workers
            m0, k0 = time.process_time(), _worker_seconds(loaders[k])
            for _ in range(queued):
                next(its[k])
            t0 = time.perf_counter()
            for _ in range(n_batches):
                next(its[k])
            rates[k].append(n_batches / (time.perf_counter() - t0))
            _wait_idle(loaders[k])
            cpu[k]["main"].append((time.process_time() - m0) / (n_batches + queued))
            cpu[k]["workers"].append((_worker_seconds(loaders[k]) - k0) / (n_batches + queued))
    return rates, cpu


def _worker_seconds(loader) -> float:
    """CPU seconds used so far by the loader's worker processes (Linux /proc; 0 without workers)."""
    import os

    total = 0.0
    it = getattr(loader, "_iterator", None)
    for p in getattr(it, "_workers", []) or []:
        try:
            fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return float("nan")
    return total


def _wait_idle(loader, step: float = 0.05, limit: float = 30.0) -> None:
    """Until the loader's workers have used no CPU for ``step`` seconds (their prefetch queue is full)."""
    if not getattr(loader, "num_workers", 0):
        return
    prev, t0 = _worker_seconds(loader), time.perf_counter()
    while time.perf_counter() - t0 < limit:
        time.sleep(step)
        cur = _worker_seconds(loader)
        if cur == prev:
            return
        prev = cur


def _endless(loader):
    epoch = 0
    while True:
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def device_table(train, nc, imgsz: int, batch: int, device: str, rounds: int = 5) -> list[str]:
    """augment_device on ``device``: agreement with the CPU path (same draws), plans per CPU second (the
    loader's share: file reads and draws), and the device's rendering rate (nvJPEG decode on CUDA)."""
    import torch

    from yolofast.data import build_dataset
    from yolofast.data.device_aug import apply_plans, plan_sample

    ds = build_dataset(train, imgsz=imgsz, augment=True, nc=nc, batch_size=batch, prefix="device: ")
    n = min(batch, len(ds))
    ds.reseed(0)
    cpu = [ds[i] for i in range(n)]
    ds.reseed(0)
    plans = [plan_sample(ds, i, "cpu") for i in range(n)]
    out = apply_plans(plans, device).cpu()
    diff = torch.stack([(out[k].float() - cpu[k]["img"].float()).abs().mean() for k in range(n)])
    box = max(float((p["bboxes"] - c["bboxes"]).abs().max()) if len(c["bboxes"]) else 0.0
              for p, c in zip(plans, cpu))
    dec = "device" if device.startswith("cuda") else "cpu"
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    t0 = time.process_time()
    plans = [plan_sample(ds, i % len(ds), dec) for i in range(4 * batch)]
    plan_rate = len(plans) / max(time.process_time() - t0, 1e-9)
    t0 = time.process_time()
    for i in range(2 * batch):
        ds[i % len(ds)]
    cpu_rate = 2 * batch / max(time.process_time() - t0, 1e-9)
    render = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for k in range(0, len(plans), batch):
            apply_plans(plans[k:k + batch], device)
        sync()
        render.append(len(plans) / (time.perf_counter() - t0))
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else cpu_name()
    return [f"| augment_device={device} ({name}), imgsz {imgsz}, batch {batch} | |",
            "| --- | --- |",
            f"| pixels vs the CPU path, mean abs diff per image (max over {n}) | {float(diff.max()):.3f} |",
            f"| boxes vs the CPU path, max abs diff | {box:.2e} |",
            f"| CPU path: samples per CPU second (1 thread) | {cpu_rate:.1f} |",
            f"| device path: plans per CPU second ({dec} decode) | {plan_rate:.1f} |",
            f"| device path: images rendered per second on the device (median of {rounds}) | "
            f"{statistics.median(render):.0f} |"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="yolofast bench data", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="data yaml (its train split is read)")
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--batch", type=int, default=16, help="batch size (sizes the mosaic buffer; default 16)")
    ap.add_argument("--cache", default="", choices=("", "ram", "disk"), help="image cache of both engines")
    ap.add_argument("--blocks", type=int, default=8, help="timed blocks per engine (median over them)")
    ap.add_argument("--block-size", type=int, default=64, help="samples per block")
    ap.add_argument("--no-ultralytics", action="store_true", help="time yolofast only")
    ap.add_argument("--workers", type=int, default=8,
                    help="loader workers of the GPU run the feed rate is quoted for (default 8)")
    ap.add_argument("--device", default="",
                    help="also time augment_device on this device (cuda:0: nvJPEG decode + batched ops)")
    ap.add_argument("--loader", type=int, default=0, metavar="W",
                    help="also time the DataLoader (batches/s, wall clock) at workers=0 against workers=W")
    ap.add_argument("--loader-rounds", type=int, default=8, help="alternating rounds per loader (default 8)")
    ap.add_argument("--loader-batches", type=int, default=24, help="timed batches per round (default 24)")
    return ap


def bench_data_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from yolofast.data import DataError, check_data

    try:
        data = check_data(args.data)
    except (DataError, FileNotFoundError) as e:
        print(f"yolofast bench data: error: {e}", file=sys.stderr)
        return 2
    _one_thread()
    train = data["train"]
    engines = {"yolofast": _yolofast_dataset(train, args.imgsz, args.batch, args.cache or False, data["nc"])}
    if not args.no_ultralytics:
        u = _ultralytics_dataset(train, args.imgsz, args.batch, args.cache or False, data)
        if u is None:
            print("Ultralytics is not importable here: timing yolofast only")
        else:
            engines["ultralytics"] = u
    _one_thread()  # a library may have changed the thread counts at import
    rates = measure(engines, args.blocks, args.block_size)
    _print_table(rates, args, data)
    if args.loader:
        _loader_table(args, train, data, engines["yolofast"])
    if args.device:
        print("\n" + "\n".join(device_table(train, data["nc"], args.imgsz, args.batch, args.device)))
    return 0


def _loader_table(args, train, data, ds):
    import os

    w, n, rounds = (0, args.loader), args.loader_batches, args.loader_rounds
    load0 = os.getloadavg()[0]
    lr, cpu = loader_rates(lambda: _yolofast_dataset(train, args.imgsz, args.batch, args.cache or False,
                                                data["nc"]), args.batch, w, n, rounds)
    med = {k: statistics.median(v) for k, v in lr.items()}
    ratios = [b / a for a, b in zip(lr[0], lr[args.loader])]
    print(f"\nDataLoader batches/s (batch {args.batch}, wall clock, {os.cpu_count()} cores, {rounds} "
          f"alternating rounds of {n} batches, each from idle workers): workers=0 {med[0]:.2f}, "
          f"workers={args.loader} {med[args.loader]:.2f}, {statistics.median(ratios):.2f}x (median of "
          f"per-round ratios; range {min(ratios):.2f}-{max(ratios):.2f}); load average {load0:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")
    tot = {k: [a + b for a, b in zip(v["main"], v["workers"])] for k, v in cpu.items()}
    c0, cw = statistics.median(tot[0]), statistics.median(tot[args.loader])
    print(f"CPU seconds per batch, all processes (median; range): workers=0 {c0:.4f} "
          f"({min(tot[0]):.4f}-{max(tot[0]):.4f}), workers={args.loader} {cw:.4f} "
          f"({min(tot[args.loader]):.4f}-{max(tot[args.loader]):.4f}; main process "
          f"{statistics.median(cpu[args.loader]['main']):.4f}): on {args.loader} free cores "
          f"workers={args.loader} would reach ~{args.loader * c0 / cw:.2f}x")
    if ds.ims is None and ds.max_buffer >= len(ds):
        print(f"(the mosaic buffer, min(8 x batch, 1000) images, holds all {len(ds)} of this split: after "
              f"the warm-up no worker decodes a JPEG, and the samples are copies and warps, which the cores' "
              f"shared memory bandwidth limits more than decodes; on a larger set each sample decodes one "
              f"image)")
    load = max(load0, os.getloadavg()[0])
    if load > 0.5:
        print(f"(other jobs ran meanwhile, load average up to {load:.1f}: the wall-clock ratio measures them "
              f"too; the CPU seconds per batch do not)")


def _print_table(rates: dict, args, data) -> None:
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\ntraining samples per second per core: {args.data} train ("
          f"imgsz {args.imgsz}, default training augmentation, cache={args.cache or 'none'}, 1 thread, "
          f"{args.blocks} alternating blocks of {args.block_size}; CPU: {cpu_name()})")
    print(f"{'engine':12s} {'median':>8s} {'min':>8s} {'max':>8s}")
    for k, v in rates.items():
        print(f"{k:12s} {med[k]:8.1f} {min(v):8.1f} {max(v):8.1f}")
    if "ultralytics" in med:
        ratios = [a / b for a, b in zip(rates["yolofast"], rates["ultralytics"])]
        print(f"yolofast / ultralytics: {statistics.median(ratios):.2f}x (median of per-block ratios; "
              f"range {min(ratios):.2f}-{max(ratios):.2f})")
    feed = med["yolofast"] * args.workers
    print(f"to keep a GPU fed: with workers={args.workers} (one core each) yolofast supplies ~{feed:.0f} "
          f"images/s; a batch-{args.batch} train step faster than {1000 * args.batch / feed:.1f} ms "
          f"({feed / args.batch:.1f} steps/s) waits for data")

"""Latency of several models on one input, measured side by side: what ``fedmed export-int8`` picks its engine by and
what ``benchmarks.qfedpolyp.int8_speed`` reports."""

from __future__ import annotations

import random
import time
from typing import Callable

import numpy as np
import torch


def latencies(paths: dict[str, Callable], x: torch.Tensor, warmup: int, repeats: int,
              seed: int = 0, blocks: int = 5) -> dict[str, float]:
    """Median seconds per call of each path. The ``repeats`` timed calls of a path are made in ``blocks`` runs of
    consecutive calls, the paths taking turns in a shuffled order every block (so that a machine that gets busier
    slows them alike), each run after one untimed call. Paths are not interleaved call by call: ONNX Runtime's
    threads spin for a while after each call, and on 2 cores whatever ran next was slowed (benchmarks.qfedpolyp.
    int8_speed before and after: PT2E 18.3 -> 7.7 ms at batch 1, FP32 ONNX Runtime itself 39.1 -> 21.9 ms)."""
    rng = random.Random(seed)
    times: dict[str, list[float]] = {name: [] for name in paths}
    per_block = [len(chunk) for chunk in np.array_split(np.arange(repeats), max(1, min(blocks, repeats)))]
    with torch.inference_mode():
        for name, run in paths.items():
            for _ in range(warmup):
                run(x)
        for count in per_block:
            order = list(paths)
            rng.shuffle(order)
            for name in order:
                paths[name](x)  # the previous path's threads settle
                for _ in range(count):
                    started = time.perf_counter()
                    paths[name](x)
                    times[name].append(time.perf_counter() - started)
    return {name: float(np.median(values)) for name, values in times.items()}

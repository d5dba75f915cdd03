"""Latency of several models on one input, measured side by side: what ``fedmed export-int8`` picks its engine by and
what ``benchmarks.qfedpolyp.int8_speed`` reports."""

from __future__ import annotations

import random
import time
from typing import Callable

import numpy as np
import torch


def latencies(paths: dict[str, Callable], x: torch.Tensor, warmup: int, repeats: int,
              seed: int = 0) -> dict[str, float]:
    """Median seconds per call of each path, the paths interleaved in a shuffled order every repetition (so that a
    busy machine slows them alike)."""
    rng = random.Random(seed)
    times: dict[str, list[float]] = {name: [] for name in paths}
    with torch.inference_mode():
        for name, run in paths.items():
            for _ in range(warmup):
                run(x)
        for _ in range(repeats):
            order = list(paths)
            rng.shuffle(order)
            for name in order:
                started = time.perf_counter()
                paths[name](x)
                times[name].append(time.perf_counter() - started)
    return {name: float(np.median(values)) for name, values in times.items()}

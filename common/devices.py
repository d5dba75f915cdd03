"""Which device a hospital and the server compute on, and in which precision.

The choice is ``device`` of the hospital's node config, else the run config's (``auto``, ``cpu``, ``cuda`` or
``cuda:N``); ``cpu`` always means the CPU. ``auto`` takes a GPU where the process can see one:

- in Flower's simulation, the GPU Ray gave the hospital's actor (``client-resources-num-gpus``: fractions share one
  GPU, Ray spreads whole ones); where Ray gave it none but GPUs are visible anyway, the hospitals are spread over
  them by partition, never piled onto GPU 0;
- in a deployment, the node's first GPU (``device='cuda:N'`` in the node config picks another);
- the server's evaluation and FedMEPD's server-side training run on the server's first GPU.

Each hospital's reply says which device it used (``device`` in its config), and each round records it.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import Iterator

import torch

DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def check_device(choice: str, key: str = "device") -> str:
    if not DEVICE_PATTERN.match(choice):
        raise ValueError(f"{key}={choice!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    return choice


def ray_gpu_ids() -> list[int] | None:
    """The GPUs Ray assigned to this process's actor (None outside a Ray actor)."""
    ray = sys.modules.get("ray")
    if ray is None:
        return None
    try:
        if not ray.is_initialized():
            return None
        return [int(i) for i in ray.get_gpu_ids()]
    except Exception:  # not inside a worker, or Ray without GPU support
        return None


def cuda_device(index: int, choice: str) -> torch.device:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"device={choice!r} but no CUDA GPU is visible to this process")
    if index >= count:
        raise ValueError(f"device={choice!r} but this process sees {count} GPU(s): cuda:0..cuda:{count - 1}")
    return torch.device(f"cuda:{index}")


def hospital_device(choice: str = "auto", partition_id: int | None = None,
                    assigned: list[int] | None = None) -> torch.device:
    """A hospital's device for ``choice`` (its node config's ``device``, else the run config's). ``assigned``: the
    GPUs Ray gave its actor (default: asked of Ray); ``partition_id`` spreads simulated hospitals Ray gave no GPU."""
    check_device(choice)
    if choice == "cpu":
        return torch.device("cpu")
    if choice.startswith("cuda"):
        return cuda_device(int(choice.partition(":")[2] or 0), choice)
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return torch.device("cpu")
    assigned = ray_gpu_ids() if assigned is None else assigned
    if assigned:  # Ray made its GPU(s) the only visible ones: the first is this actor's
        return torch.device("cuda:0")
    if partition_id is not None:  # simulated, no GPU of its own: spread, never all on GPU 0
        return torch.device(f"cuda:{partition_id % torch.cuda.device_count()}")
    return torch.device("cuda:0")


def server_device(choice: str = "auto") -> torch.device:
    """The server's device (its evaluation, FedMEPD's server-side training)."""
    check_device(choice)
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return cuda_device(int(choice.partition(":")[2] or 0), choice)


def autocast_dtype(device: torch.device, precision: str) -> torch.dtype | None:
    """The autocast dtype for ``precision`` on ``device`` (None: full float32). ``auto``: float32 on the CPU (bf16
    is slower there without AMX), bf16 on a GPU that has it, else fp16."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: use one of {', '.join(PRECISIONS)}")
    if precision == "fp32" or (precision == "auto" and device.type != "cuda"):
        return None
    if precision == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if precision == "bf16" else torch.float16


@contextlib.contextmanager
def autocast(device: torch.device, precision: str) -> Iterator[torch.dtype | None]:
    """``torch.autocast`` for ``precision`` on ``device`` (nothing for float32)."""
    dtype = autocast_dtype(device, precision)
    if dtype is None:
        yield None
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield dtype


def grad_scaler(device: torch.device, dtype: torch.dtype | None) -> torch.amp.GradScaler | None:
    """fp16 gradients need scaling (bf16 and float32 do not)."""
    return torch.amp.GradScaler(device.type) if dtype == torch.float16 else None


def describe(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H200)``, ``cpu``: what a round records for a hospital."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return f"{device} ({name}" + (f", CUDA_VISIBLE_DEVICES={visible})" if visible else ")")
    return str(device)

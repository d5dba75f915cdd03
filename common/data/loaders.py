"""Data sets by name or import path: ``dataset='ham10000'`` (a format we read) or ``dataset='package.module:loader'``
(a consortium's own), with ``dataset-args`` (a JSON object, from the run config and, over it, the hospital's node
config) handed to the loader.

A loader is called once per process with a :class:`DataRequest` and returns, for a hospital, its ``(train, validation)``
data sets and, for the server, its held-out test set (or ``None``: no test set, the server then scores nothing itself).
A data set is one of ours (``common.data.containers``) or any map-style torch ``Dataset`` of ``(image, target)`` items
(``common.data.torch_data``). The built-in formats are loaders of the same kind (``DATA_FORMATS`` of
``common/trust/code_gate.py``), so the server, the hospitals, ``fedmed partition`` and ``fedmed evaluate`` read them the
same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Mapping

from common.trust.code_gate import DATA_FORMATS, load_factory, parse_arguments

from .containers import DataError

if TYPE_CHECKING:
    from common.config import JobConfig

#: items of a torch Dataset of a consortium's own checked when its loader returns it (the rest batch by batch)
FIRST_ITEMS_CHECKED = 8


@dataclass(frozen=True)
class DataRequest:
    """What a loader is asked for: whose data, where it lives, and the run's settings."""

    role: Literal["hospital", "server"]
    job: "JobConfig"
    hospital: str = ""  #: the hospital's name ("" for the server)
    data_dir: str = ""  #: the hospital's own folder (deployment), or the run's whole data set (simulation)
    partition_id: int | None = None  #: simulation: which part of the whole data set is this hospital's
    num_partitions: int | None = None
    seed: int = 0  #: a seed for this hospital's own split (train/validation), the same on every rerun
    args: Mapping[str, Any] = field(default_factory=dict)  #: ``dataset-args`` (run config, then node config over it)


def is_custom(dataset: str) -> bool:
    return dataset not in DATA_FORMATS


def dataset_arguments(cfg: "JobConfig", node_arguments: str = "") -> dict[str, Any]:
    """``dataset-args`` of the run config with the node config's over them."""
    return {**parse_arguments(cfg.dataset_args, "dataset-args"), **parse_arguments(node_arguments, "dataset-args")}


def call_loader(request: DataRequest):
    """The user's loader's answer to ``request``; DataError naming the loader for anything it raises or returns
    that is not data."""
    name = request.job.dataset
    loader = load_factory(name, "dataset")
    try:
        answer = loader(request)
    except DataError:
        raise
    except Exception as error:
        who = request.hospital or "the server"
        raise DataError(f"dataset {name!r} failed for {who}: {type(error).__name__}: {error}") from error
    if request.role == "hospital":
        if not isinstance(answer, (tuple, list)) or len(answer) != 2:
            raise DataError(f"dataset {name!r} returned {type(answer).__name__} for {request.hospital}, not a "
                            "(train, validation) pair")
        train, validation = (wrap(part, f"dataset {name!r}, {request.hospital} {kind}", request.job)
                             for part, kind in zip(answer, ("train", "validation")))
        if len(train) == 0:
            raise DataError(f"dataset {name!r} returned no training samples for {request.hospital}: it does not "
                            "train on nothing")
        return train, validation
    return None if answer is None else wrap(answer, f"dataset {name!r}, server test set", request.job)


def wrap(data: Any, where: str, cfg: "JobConfig"):
    """Our containers as they are; a torch Dataset (or a DataLoader's) as :class:`~common.data.torch_data.TorchData`,
    its items ``(image, target)`` or dicts of them (``{"img": ..., "label": ...}``); DataError naming
    ``where`` for NaN or Inf images, or images of no image's shape (its first items here, the rest as it is read)."""
    import numpy as np
    import torch

    from .containers import LabelledImages, SegmentationImages
    from .torch_data import TorchData

    if isinstance(data, (LabelledImages, SegmentationImages)):
        if data.images.dtype.kind == "f":
            finite = np.isfinite(data.images.reshape(len(data.images), -1)).all(axis=1)
            if not finite.all():
                raise DataError(f"{where}: image {data.names[np.argmin(finite)]} holds NaN or Inf values")
        return data
    if isinstance(data, (TorchData, list)):
        return data
    if isinstance(data, torch.utils.data.DataLoader):  # a Flower app's loaders: what they read, in our batches
        data = data.dataset
    wrapped = TorchData(data, where, workers=cfg.data_workers)
    for index in range(min(len(wrapped), FIRST_ITEMS_CHECKED)):  # the rest is checked batch by batch
        image, _ = wrapped.item(index)
        if image.ndim not in (3, 4):
            raise DataError(f"{where}: item {index}'s image has shape {tuple(image.shape)}; an image is (channels, "
                            "height, width), a volume (channels, depth, height, width)")
        if image.is_floating_point() and not torch.isfinite(image).all():
            raise DataError(f"{where}: item {index}'s image holds NaN or Inf values")
    return wrapped

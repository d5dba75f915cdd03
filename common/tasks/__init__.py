"""Tasks: what a model is trained to do, independent of how hospitals federate.

A task knows its model, loss, batches, local training loop and evaluation. Methods combine a
task with a federated algorithm.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from common.config import JobConfig

    from .base import Task

#: task name -> "module:class"; imported lazily so a job loads only the task it runs.
TASKS = {
    "classification": "common.tasks.classification:ClassificationTask",
    "polyp-segmentation": "common.tasks.polyp:PolypSegmentationTask",
    "brain-tumour-segmentation": "common.tasks.brain:BrainTumourTask",
}


def task_class(name: str) -> type["Task"]:
    module, attribute = TASKS[name].split(":")
    return getattr(import_module(module), attribute)


def get_task(cfg: "JobConfig", spec: dict[str, Any] | None = None) -> "Task":
    return task_class(cfg.task)(cfg, spec)


from .base import Task  # noqa: E402  (re-exported for type hints)

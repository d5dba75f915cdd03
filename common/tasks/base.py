"""The task interface and the local training loop shared by the 2D tasks."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Iterator

import numpy as np
import torch

from common.config import JobConfig

#: ImageNet statistics, the usual normalisation for RGB medical photographs (and FedProIn's).
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)

ExtraLoss = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def normalisation(channels: int, device: torch.device) -> tuple[torch.Tensor | float, torch.Tensor | float]:
    """(mean, std) that map [0, 1] images to network inputs: ImageNet statistics for RGB, 0.5/0.5 otherwise."""
    if channels == 3:
        return (torch.from_numpy(IMAGENET_MEAN).to(device).view(1, 3, 1, 1),
                torch.from_numpy(IMAGENET_STD).to(device).view(1, 3, 1, 1))
    return 0.5, 0.5


def images_to_tensor(images: np.ndarray, device: torch.device) -> torch.Tensor:
    """uint8 (N, H, W, C) -> normalised float (N, C, H, W), contiguous (see :func:`normalisation`).

    Contiguous NCHW, not the channels-last strides the permute leaves: a tutorial network flattens with
    ``x.view(-1, 16 * 5 * 5)``, which only works on a contiguous tensor."""
    batch = torch.from_numpy(np.ascontiguousarray(images))
    if device.type == "cuda":  # uint8 through pinned memory, a quarter of float32's bytes, overlapping the GPU
        batch = batch.pin_memory().to(device, non_blocking=True)
    x = batch.to(device).permute(0, 3, 1, 2).to(torch.float32, memory_format=torch.contiguous_format).div_(255.0)
    mean, std = normalisation(x.shape[1], device)
    return (x - mean) / std


def random_flips(rng: np.random.Generator, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same random horizontal/vertical flip per sample on every tensor (image and mask alike)."""
    n = tensors[0].shape[0]
    flip_w = torch.from_numpy(rng.random(n) < 0.5).to(tensors[0].device)
    flip_h = torch.from_numpy(rng.random(n) < 0.5).to(tensors[0].device)
    out = []
    for t in tensors:
        shape = (n,) + (1,) * (t.ndim - 1)
        t = torch.where(flip_w.view(shape), t.flip(-1), t)
        t = torch.where(flip_h.view(shape), t.flip(-2), t)
        out.append(t)
    return tuple(out)


class Task(ABC):
    """A task: model, loss, batches, training loop and evaluation.

    ``spec`` is what a hospital needs to build the same model as the server (number of classes,
    input channels); the server derives it from its test data and sends it with every round.
    """

    name: str

    def __init__(self, cfg: JobConfig, spec: dict[str, Any] | None = None):
        self.cfg = cfg
        self.spec: dict[str, Any] = dict(spec or {})

    # --- model ------------------------------------------------------------------------------------
    @staticmethod
    @abstractmethod
    def describe(data) -> dict[str, Any]:
        """The model spec implied by a data set (the server's test set)."""

    def model_spec(self) -> dict[str, Any]:
        return {f"model.{k}": v for k, v in self.spec.items()}

    def adopt_spec(self, config: dict[str, Any]) -> None:
        """Take the model spec from a received round config (hospital side)."""
        self.spec.update({k.removeprefix("model."): v for k, v in config.items() if k.startswith("model.")})

    @property
    def network_name(self) -> str:
        """The job's network: its ``model``, or the task's built-in default."""
        from common.models.networks import TASK_DEFAULT

        return self.cfg.model or TASK_DEFAULT[self.name]

    def network_model_args(self) -> dict[str, Any]:
        from common.trust.code_gate import parse_arguments

        return parse_arguments(self.cfg.model_args, "model-args")

    @abstractmethod
    def build_model(self) -> torch.nn.Module:
        ...

    def initial_model(self) -> torch.nn.Module:
        """A freshly built model as a run starts from it (seed it first); classification may load a
        pretrained encoder (``encoder-weights``)."""
        return self.build_model()

    def model_from_payload(self, payload) -> torch.nn.Module:
        from common.arrays import load_model_arrays

        self.adopt_spec(payload.config)
        model = self.build_model()
        load_model_arrays(model, payload.arrays["model"])
        return model

    # --- data -------------------------------------------------------------------------------------
    @classmethod
    def load_test(cls, cfg: JobConfig):
        """The server's held-out test set: a loader of the job's own (``dataset='package.module:loader'``; it may
        give none), or the built-in format's."""
        from common.data.loaders import DataRequest, call_loader, dataset_arguments, is_custom

        if is_custom(cfg.dataset):
            return call_loader(DataRequest("server", cfg, data_dir=cfg.test_dir or cfg.data_dir,
                                           seed=cfg.seed, args=dataset_arguments(cfg)))
        return cls.builtin_test(cfg)

    @classmethod
    def builtin_test(cls, cfg: JobConfig):
        from common.data.sources import server_test_set

        return server_test_set(cfg)

    @classmethod
    def spec_without_test_set(cls, cfg: JobConfig) -> dict[str, Any]:
        """The model spec when the server holds no test set (a loader that gives it none): from the run config."""
        return {"in-channels": cfg.input_dims[0]} if cfg.input_dims else {}

    @classmethod
    def hospital_properties(cls, cfg: JobConfig, partition_id: int | None,
                            properties: dict[str, Any]) -> dict[str, Any]:
        """What a hospital tells the server about itself, from its node config (a simulated hospital's
        may come from the run config, e.g. its MRI modalities); checked before its data is loaded."""
        return properties

    @classmethod
    def load_hospital_data(cls, cfg: JobConfig, *, partition_id: int | None = None, num_partitions: int | None = None,
                           data_dir: str | None = None, properties: dict[str, Any] | None = None,
                           seed: int = 0, hospital: str = "", node_arguments: str = "") -> tuple[Any, Any]:
        """A hospital's (train, val): from a loader of the job's own, or in the built-in format from its own folder
        (deployment) or its partition of the whole data set (simulation)."""
        from common.data.loaders import DataRequest, call_loader, dataset_arguments, is_custom

        if is_custom(cfg.dataset):
            return call_loader(DataRequest("hospital", cfg, hospital=hospital, data_dir=data_dir or cfg.data_dir,
                                           partition_id=partition_id, num_partitions=num_partitions, seed=seed,
                                           args=dataset_arguments(cfg, node_arguments)))
        return cls.builtin_hospital_data(cfg, partition_id=partition_id, num_partitions=num_partitions,
                                         data_dir=data_dir, properties=properties, seed=seed)

    @classmethod
    def builtin_hospital_data(cls, cfg: JobConfig, *, partition_id: int | None = None,
                              num_partitions: int | None = None, data_dir: str | None = None,
                              properties: dict[str, Any] | None = None, seed: int = 0) -> tuple[Any, Any]:
        from common.data.sources import load_folder, simulated_hospital, train_val

        if data_dir:
            data = load_folder(cfg, data_dir)
        else:
            data = simulated_hospital(cfg, int(partition_id or 0), int(num_partitions or 1))
        return train_val(data, cfg.val_fraction, seed)

    @abstractmethod
    def batches(self, data, batch_size: int, device: torch.device, rng: np.random.Generator | None,
                train: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets) batches; shuffled and augmented when ``train``."""

    @abstractmethod
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        ...

    def check_data(self, data, where: str) -> None:
        """Raise a clear error when a hospital's data does not fit the model spec."""

    # --- training and evaluation -------------------------------------------------------------------
    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=self.cfg.learning_rate, weight_decay=self.cfg.weight_decay)

    def fit(self, model: torch.nn.Module, data, device: torch.device, seed: int, epochs: int | None = None,
            extra_loss: ExtraLoss | None = None, optimizer: torch.optim.Optimizer | None = None) -> dict[str, float]:
        """Local training: ``epochs`` passes over ``data`` with Adam; returns the mean training loss."""
        from common.devices import autocast, autocast_dtype, grad_scaler

        torch.manual_seed(seed)
        rng = np.random.default_rng(seed)
        model.to(device).train()
        optimizer = optimizer or self.make_optimizer(model)
        scaler = grad_scaler(device, autocast_dtype(device, self.cfg.precision))
        total, steps = 0.0, 0
        for _ in range(epochs or self.cfg.local_epochs):
            for x, y in self.batches(data, self.cfg.batch_size, device, rng, train=True):
                with autocast(device, self.cfg.precision):
                    output = model(x)
                    loss = self.loss(output, y)
                    if extra_loss is not None:
                        loss = loss + extra_loss(model, x, y, output)
                optimizer.zero_grad(set_to_none=True)
                if scaler is None:
                    loss.backward()
                    optimizer.step()
                else:  # fp16: scaled gradients, unscaled before the step
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()
                total += float(loss.detach())
                steps += 1
        return {"train-loss": total / max(steps, 1)}

    @abstractmethod
    def evaluate(self, model: torch.nn.Module, data, device: torch.device = torch.device("cpu")) -> dict[str, float]:
        ...

    def validate(self, model: torch.nn.Module, data, device: torch.device = torch.device("cpu")) -> dict[str, float]:
        """What a hospital reports about a model it received, on its validation data (default: evaluate)."""
        return self.evaluate(model, data, device)

    @property
    def headline_metric(self) -> str:
        """The metric a summary leads with."""
        return "accuracy"


def index_batches(n: int, batch_size: int, rng: np.random.Generator | None,
                  drop_last: bool = False) -> Iterator[np.ndarray]:
    order = rng.permutation(n) if rng is not None else np.arange(n)
    stop = n - n % batch_size if drop_last and n >= batch_size else n
    for start in range(0, stop, batch_size):
        yield order[start:start + batch_size]

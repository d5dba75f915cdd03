"""The two halves of a federated method, free of any transport.

``ServerMethod`` owns the global state between rounds: it says what each hospital receives,
checks and aggregates what comes back, and saves its state for checkpoints. ``HospitalMethod``
is a hospital's local step. Flower strategies and ClientApp handlers only move :class:`Payload`
objects between them; the in-process runner calls them directly (benchmarks, GPU machines
without Flower, tests).
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from common.arrays import ArraysMismatch, NamedArrays, check_like, is_exchanged
from common.config import JobConfig
from common.methods.site import Site
from common.payload import ConfigValue, Payload  # noqa: F401  (re-exported: the methods' message type)
from common.tasks import Task, get_task

#: Evaluate-message config key: score the final models for the run's cross-site table (``HospitalMethod.cross_site``).
CROSS_SITE_KEY = "cross-site"


#: A hospital property: it is a Flower ClientApp that trains the model itself, under Flower's FedAvg contract (one
#: ArrayRecord of its own tensor names, one MetricRecord with its sample count; no round echoed), not fedmed's step.
TRAINS_ITSELF = "trains-itself"
#: A hospital property: a Flower ClientApp with nothing of fedmed (no query handler): it is sent no fedmed query.
FLOWER_ONLY = "flower-only"


@dataclass(frozen=True)
class HospitalInfo:
    """What a hospital tells the server about itself when the run starts."""

    name: str
    num_examples: int
    properties: dict[str, Any] = field(default_factory=dict)


@dataclass
class HospitalUpdate:
    """A hospital's accepted reply to a training round."""

    hospital: HospitalInfo
    payload: Payload
    share: float | None = None  #: its share of the aggregate, set by the round engine after screening
    weight_key: str = "num-examples"  #: the metric holding its sample count (a strategy's weighted_by_key)

    @property
    def weight(self) -> float:
        """What the update weighs in sample-weighted averages: its share once the round engine has set it
        (``screening.max-hospital-weight`` caps it), else its sample count."""
        return self.share if self.share is not None else float(self.num_examples)

    @property
    def num_examples(self) -> int:
        """The reported sample count (0 when it is not a finite number); the round engine refuses a reply whose
        count is not positive or exceeds what the hospital declared (``common.engine.screening``) before ``check``."""
        value = self.payload.metrics.get(self.weight_key, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            return 0
        return int(value) if np.isfinite(value) else 0


@dataclass(frozen=True)
class SecureMean:
    """A secure round of the FedAvg family as the server may know it (``ServerMethod.aggregate_secure_mean``): the
    global model moved by the hospitals' sample-weighted mean update, the hospitals in the sum (each update holding
    only what it said in the clear: metrics and config, no arrays) and their samples as the protocol counts them
    (each capped by the round plan's common cap and its policy's)."""

    arrays: NamedArrays
    hospitals: list[HospitalUpdate]
    weight_total: float

    @property
    def count(self) -> int:
        """How many hospitals the sum holds."""
        return len(self.hospitals)


class RejectedUpdate(Exception):
    """A reply the server will not aggregate; ``str(error)`` is the logged reason."""


class ServerMethod(ABC):
    """Server side of a method. Subclasses set ``name`` and implement :meth:`aggregate`; the round engine
    (``common/engine/round_engine.py``) calls, per round, in this order:

    - :meth:`hospitals_available` (rnd, every connected hospital): before the round's hospitals are chosen, so a
      method that counts hospitals (FedDyn's |P|/m) knows m;
    - :meth:`downlink` (rnd, each chosen hospital), then per reply :meth:`check`, :meth:`screened_arrays`,
      :meth:`reply_arrays`;
    - :meth:`aggregate` (rnd, the accepted updates), or under secure aggregation its package's ``SecureMethod.apply``
      (the FedAvg family's: :meth:`aggregate_secure_mean`, given a :class:`SecureMean`);
    - :meth:`server_step` (rnd), then :meth:`evaluate`, and :meth:`state_dict` for the checkpoint.

    :meth:`check_hospital` runs once per hospital when it joins."""

    name: ClassVar[str]
    #: reply metrics this method reads as lists (every other metric must be a number: ``common.engine.screening``)
    list_metrics: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, cfg: JobConfig, task: Task | None = None):
        self.cfg = cfg
        self.task = task or get_task(cfg)
        self.global_arrays: NamedArrays = {}

    # --- lifecycle --------------------------------------------------------------------------------
    def initialize(self) -> None:
        """Create the initial global model, seeded by the job's seed."""
        torch.manual_seed(self.cfg.seed)
        from common.arrays import model_arrays

        self.global_arrays = model_arrays(self.task.initial_model())

    def adopt_own_network(self, arrays: NamedArrays) -> None:
        """Take ``arrays`` as the global model of a network the server does not build (a Flower user's own, given as
        ``initial_arrays``): every entry as given, counters included, so that it loads into that network as it is.
        Only the methods whose server averages named arrays (``MethodSpec.flower_contract``) are asked to."""
        self.global_arrays = {name: np.array(value, copy=True) for name, value in arrays.items()}

    def model_from_network(self, arrays: NamedArrays) -> NamedArrays | None:
        """The method's global model made from ``arrays``, the state of the network itself (a Flower user's
        ``ArrayRecord(Net().state_dict())``), where the method's model is built around the network (FedProIn: its
        encoder from them); None where it is not (default)."""
        return None

    def flower_reply_arrays(self, arrays: NamedArrays) -> dict[str, NamedArrays]:
        """The array groups of a reply from a Flower ClientApp that trained the model itself (its whole state dict in
        one ArrayRecord): the model, less the local-only counters (BatchNorm's ``num_batches_tracked``) where the
        global model holds none."""
        return {"model": {name: value for name, value in arrays.items()
                          if is_exchanged(name) or name in self.global_arrays}}

    def check_hospital(self, hospital: HospitalInfo) -> None:
        """Refuse (ValueError) a hospital whose declared properties the method cannot work with, when it
        joins, so that nothing it declared can fail a round later (default: any is fine)."""

    def hospitals_available(self, rnd: int, hospitals: list[HospitalInfo]) -> None:
        """Told, before round ``rnd``'s hospitals are chosen, which hospitals are connected (``len(hospitals)``: the
        m of a method that scales by the share of hospitals taking part; default: ignored)."""

    def downlink(self, rnd: int, hospital: HospitalInfo) -> Payload:
        """What ``hospital`` receives to train in round ``rnd``: by default the global model."""
        return Payload(arrays={"model": self.global_arrays}, config=self.round_config(rnd))

    def round_config(self, rnd: int) -> dict[str, ConfigValue]:
        return {"server-round": rnd, "run-name": self.cfg.run_name, **self.task.model_spec()}

    def check(self, update: HospitalUpdate) -> None:
        """Refuse a malformed reply (raise :class:`RejectedUpdate` with the reason); the sample count and metrics
        were screened already."""
        if "model" not in update.payload.arrays:
            raise RejectedUpdate("reply carries no 'model' arrays")
        try:
            check_like(update.payload.arrays["model"], self.expected_model(update), f"update of {update.hospital.name}",
                       exact_dtype=True)
        except (ArraysMismatch, ValueError) as error:
            raise RejectedUpdate(str(error)) from None

    def expected_model(self, update: HospitalUpdate) -> NamedArrays:
        """The names, shapes and dtypes a hospital's model arrays must have (default: the global model's)."""
        return self.global_arrays

    def screened_arrays(self, update: HospitalUpdate) -> tuple[NamedArrays, NamedArrays]:
        """The arrays of a checked reply that the round's screening compares across hospitals, and what the
        hospital received of them (``common.engine.screening``: BatchNorm variances, the update-norm rule).
        Default: the reply's model against the global model."""
        return update.payload.arrays.get("model", {}), self.expected_model(update)

    def reply_arrays(self, update: HospitalUpdate) -> dict[str, Mapping[str, np.ndarray]]:
        """The array groups of a screened reply that :meth:`aggregate` reads (default: all the reply's own), called
        once per reply right after its checks, refused or not. The round engine keeps them, on disk in a streamed
        round, and hands them to :meth:`aggregate` as ``update.payload.arrays``; everything else of the reply is
        released as soon as it is screened."""
        return update.payload.arrays

    @abstractmethod
    def aggregate(self, rnd: int, updates: list[HospitalUpdate]) -> dict[str, Any]:
        """Fold the accepted updates into the global state; return round metrics worth recording.

        Each update's arrays may be on disk (``common.engine.reply_store.StoredArrays``: each tensor read from its file
        when asked for): go tensor by tensor, or hospital by hospital, never holding every reply's whole arrays at
        once, and copy what is kept beyond the round (``common.engine.reply_store.materialized``)."""

    def aggregate_secure_mean(self, rnd: int, mean: SecureMean) -> dict[str, Any]:
        """Under secure aggregation, for a method that sums as FedAvg does (``MEAN_UPDATE``): fold the round's
        secure mean (the moved model, the hospitals in the sum and their samples: ``mean.count``,
        ``mean.weight_total``) into the global state, as :meth:`aggregate` folds the updates; return round metrics.
        A method that names ``MEAN_UPDATE`` must say what it does here (its config is refused before round 1
        otherwise)."""
        raise NotImplementedError(f"strategy {self.name!r} does not take a secure sum's mean update")

    def server_step(self, rnd: int) -> dict[str, Any]:
        """Work the server does on its own after aggregation (e.g. training on its data)."""
        return {}

    # --- evaluation -------------------------------------------------------------------------------
    def evaluation_model(self, hospital: str | None = None) -> torch.nn.Module:
        """The global model (``hospital``: that hospital's own model, for methods whose server keeps one)."""
        from common.arrays import load_model_arrays

        if hospital:
            raise ValueError(f"strategy {self.name!r} keeps no hospital's own model at the server (personal models "
                             "stay with the hospitals: see cross-site-evaluation)")
        model = self.task.build_model()
        load_model_arrays(model, self.global_arrays)
        return model

    def evaluate(self, test_data) -> dict[str, float]:
        """Metrics of the global model on the server's held-out test set (on the server's GPU where it has one)."""
        from common.devices import server_device

        return self.task.evaluate(self.evaluation_model(), test_data, server_device(self.cfg.device))

    # --- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> NamedArrays:
        """Everything needed to continue, as named arrays (see :func:`pack_json` for non-array state)."""
        return {f"global/{k}": v for k, v in self.global_arrays.items()}

    def load_state_dict(self, state: NamedArrays) -> None:
        self.global_arrays = {k.removeprefix("global/"): v for k, v in state.items() if k.startswith("global/")}


class HospitalMethod(ABC):
    """A hospital's side of a method: local training (and evaluation) on its own site."""

    #: Set by the hospital's policy under local DP (common/trust/enforcer.py): every statistic the reply carries besides
    #: the clipped, noised model must have the sensitivity the policy accounts for (FedProIn counts its influence with
    #: the received model, so one replaced sample moves two counts by one).
    privacy_bounded: bool = False
    #: Set by the hospital's policy under patient-dp: the DP-SGD its local training runs as (common/trust/patient_dp.py)
    dp_sgd = None

    def __init__(self, cfg: JobConfig, site: Site, task: Task | None = None):
        self.cfg = cfg
        self.site = site
        self.task = task or get_task(cfg)

    def info(self) -> HospitalInfo:
        return HospitalInfo(self.site.name, len(self.site.train), dict(self.site.properties))

    @abstractmethod
    def train(self, rnd: int, payload: Payload) -> Payload:
        """Train on the received payload and return the reply (``metrics['num-examples']`` set)."""

    def timed_train(self, rnd: int, payload: Payload) -> Payload:
        """``train``, with the hospital's own compute time in ``metrics['hospital-seconds']`` (what the
        overhead benchmark subtracts from a round's wall time) and, when it used its saved memory, the
        round that memory was saved in (``state-from-round``)."""
        started = time.perf_counter()
        self.site.state.loaded_round = None
        reply = self.train(rnd, payload)
        reply.metrics["hospital-seconds"] = time.perf_counter() - started
        reply.metrics["server-round"] = rnd  # the round this reply answers: the server refuses it in any other
        from common.devices import describe

        reply.config["device"] = describe(self.site.device)  # recorded with the round
        if self.site.state.loaded_round is not None:
            reply.metrics["state-from-round"] = self.site.state.loaded_round
        return reply

    def evaluate(self, rnd: int, payload: Payload) -> dict[str, float]:
        """Metrics of the received model on this hospital's validation data."""
        model = self.task.model_from_payload(payload)
        return self.task.evaluate(model, self.site.val, self.site.device)

    def cross_site(self, rnd: int, payload: Payload) -> dict[str, dict[str, float]]:
        """This hospital's scores, on its own validation data, of the models a consortium reports at the end of
        a run: the final global model, and (methods that personalise) the hospital's own final model."""
        return {"global": self.evaluate(rnd, payload)}


def pack_json(value: Any) -> np.ndarray:
    """JSON-able state as a uint8 array, so checkpoints hold arrays only (no pickle)."""
    return np.frombuffer(json.dumps(value, sort_keys=True).encode(), dtype=np.uint8).copy()


def unpack_json(array: np.ndarray) -> Any:
    return json.loads(array.tobytes().decode())

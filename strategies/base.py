"""``HospitalStrategy``: the base of our Flower strategies, one subclass per method (``strategies/<method>.py``).

A subclass names its method; the base builds that method's server half (``common.methods``, plain
PyTorch/NumPy) from the constructor's arguments, and adds to Flower's strategy interface what
hospitals need: identities (a query at the start, and for nodes that join later) so that sampling is
by hospital name, not node id; per-hospital byte counts measured on the serialised messages; a round
timeout after which missing hospitals are recorded and the round goes on; refused replies logged with
their reason; a callback after each round for checkpoints and results; and resuming from any round.

Hospitals evaluate the model they receive inside their training reply, so by default there is no
separate evaluation round trip (``fraction_evaluate=0``); a positive ``fraction_evaluate`` adds
Flower's evaluate phase. Everything works both under our :meth:`HospitalStrategy.start` (faster
polling, resume) and under Flower's own loop, e.g. inside Flower's DP wrappers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from common.config import ConfigError, JobConfig, fedmed_keys_of, hospital_keys, load_job_config
from common.engine.round_engine import RoundEngine, select_hospitals, weighted_mean_metrics
from common.engine.screening import cut
from common.engine.wire import (
    MalformedPayload,
    RecordKeys,
    to_recorddict,
)
from common.logs import fedmed_logger_prints
from common.methods.base import TRAINS_ITSELF, HospitalInfo
from common.methods.registry import method_spec, method_tasks
from common.payload import Payload
from common.trust.audit import SERVER_HEAD_KEY, AuditLog, message_digest

from .audit_trail import AuditTrail
from .hospitals import HospitalDirectory
from .legacy_api import ARGUMENTS as LEGACY_ARGUMENTS
from .legacy_api import METHODS as LEGACY_METHODS
from .legacy_api import legacy_argument, legacy_method
from .records import arrays_of, into_arrayrecord, numbers, round_metricrecord
from .replies import ReplyIntake, ReplyLimits
from .round_loop import EvaluateFn, OwnRoundLoop
from .round_workflow import PlainRounds
from .run_folder import RunFolder
from .wrappers import FlowerWrappers

if TYPE_CHECKING:
    from .secure_aggregation import SecureAggregation

log = logging.getLogger("fedmed")

RoundCallback = Callable[[RoundEngine, dict[str, Any]], None]
MetricsAggregation = Callable[[list[RecordDict], str], "MetricRecord | None"]


def job_config(method: str, run_config: Mapping[str, Any] | JobConfig | None, **settings: Any) -> JobConfig:
    """The job a strategy runs: ``run_config`` (a fedmed run config, flat or validated; default: every
    default) with the strategy's method and its arguments over it; ConfigError names a bad argument.

    ``run_config`` may be a whole Flower run config (``context.run_config``) holding the app's own keys too:
    those are left to the app (logged once); a key that looks like one of ours misspelt is refused."""
    base = run_config.to_flat() if isinstance(run_config, JobConfig) else fedmed_keys_of(run_config or {})
    flat = {**base, "strategy": method}
    if "task" not in flat:  # the method's first task: QFedPolypStrategy() is for polyp segmentation
        flat["task"] = method_tasks(method)[0]
    flat.update({key: value for key, value in settings.items() if value is not None})
    return load_job_config(flat)


class RunStopped(RuntimeError):
    """The SuperLink no longer serves this run (``flwr stop``): the round it cut short is not saved."""


class HospitalStrategy(FlowerWrappers, OwnRoundLoop, Strategy):
    """A Flower strategy that runs one federated method over hospitals (subclasses name the method).

    Flower's arguments mean what they mean in ``FedAvg`` and come in its order, so they may be given by position
    (``FedProInStrategy(0.5)`` as ``FedAvg(0.5)``); all after them are keyword-only. ``fraction_train`` of the
    connected hospitals train each round, at least ``min_train_nodes`` replies are needed to aggregate, and
    round 1 waits for ``min_available_nodes`` hospitals. ``run_config`` is a fedmed run config (the
    keys of ``[tool.flwr.app.config]``, e.g. ``context.run_config``) for everything else: the task,
    the server's test set, the model's size. The method's own arguments are the subclasses'.
    """

    method_name: ClassVar[str] = ""
    #: the method's settings table (``strategies/<method>/settings.py``): its fields are the strategy's own keyword
    #: arguments, with their defaults, and ``section`` is the run-config table they set
    settings_type: ClassVar[type | None] = None
    section: ClassVar[str | None] = None
    renamed: ClassVar[dict[str, str]] = {}  #: argument -> settings field, where Flower's name differs (proximal_mu)

    def __init__(self, fraction_train: float = 1.0, fraction_evaluate: float = 0.0, min_train_nodes: int = 2,
                 min_evaluate_nodes: int = 1, min_available_nodes: int = 2, weighted_by_key: str = "num-examples",
                 arrayrecord_key: str = "arrays", configrecord_key: str = "config",
                 train_metrics_aggr_fn: MetricsAggregation | None = None,
                 evaluate_metrics_aggr_fn: MetricsAggregation | None = None, *,
                 run_config: Mapping[str, Any] | JobConfig | None = None, settings: Mapping[str, Any] | None = None,
                 on_round_end: RoundCallback | None = None, wait_for_nodes: float = 600.0, **method_settings: Any):
        if not self.method_name:
            raise TypeError("HospitalStrategy is a base class: use one of the strategies in strategies/")
        fedmed_logger_prints()  # a user's own ServerApp: the round lines reach its stdout, as Flower's do
        if not 0.0 <= fraction_evaluate <= 1.0:
            raise ConfigError(f"fraction_evaluate={fraction_evaluate!r} must be between 0 and 1")
        own = self.own_arguments()
        unknown = sorted(set(method_settings) - set(own))
        legacy = [legacy_argument(type(self).__name__, name) for name in unknown if name in LEGACY_ARGUMENTS]
        if legacy:
            raise TypeError(legacy[0])
        if unknown:
            raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument {unknown[0]!r} "
                            f"(its method's own: {', '.join(own) or 'none'})")
        self.job = job_config(self.method_name, run_config, **{
            "fraction-train": fraction_train, "min-train-hospitals": min_train_nodes,
            "min-available-hospitals": min_available_nodes, **dict(settings or {}),
            **self.method_settings(**method_settings)})
        self.run_folder = RunFolder(chosen_for_it=not self.job.run_name)  # a timestamp moves on where it is held
        if not self.job.run_name:  # hospitals keep their memory in a folder named after the run
            self.job = self.job.model_copy(update={"run_name": f"{self.job.task}-{self.method_name}-"
                                                               f"{time.strftime('%Y%m%d-%H%M%S')}"})
        self.audit = AuditTrail.of(self.job)  # the server's audit log (strategies/audit_trail.py)
        self.fraction_evaluate = fraction_evaluate
        self.min_evaluate_nodes = min_evaluate_nodes
        self.weighted_by_key = weighted_by_key
        self.records = RecordKeys(arrayrecord_key, configrecord_key)
        self.train_metrics_aggr_fn = train_metrics_aggr_fn
        self.evaluate_metrics_aggr_fn = evaluate_metrics_aggr_fn
        self.on_round_end = on_round_end
        self.wait_for_nodes = wait_for_nodes
        self.directory = HospitalDirectory(self)  # which hospital each node is (strategies/hospitals.py); its dicts:
        self.hospitals = self.directory.hospitals  # node id -> identity
        self.contested = self.directory.contested  # hospital name -> the nodes claiming it (no hospital-keys)
        self._refusals = self.directory.refusals  # node id -> why it could not say which hospital it is
        self._engine: RoundEngine | None = None
        self._bytes_down: dict[str, int] = {}
        self._chosen: list[HospitalInfo] = []
        self._evaluated: list[HospitalInfo] = []
        self._round_started = 0.0
        self._identity_seconds = 0.0
        self._in_own_loop = False  # our start() calls on_round_end after the whole round
        self._grid: Grid | None = None  # the grid of the round in progress (configure_train's)
        self._warned_gpus = False
        self._wrappers_checked = False  # Flower wrappers found and checked (once)
        self._record: dict[str, Any] | None = None  # the round in progress, finished once its model is released
        self._state_before: dict[str, Any] | None = None  # the method's state before an override's aggregation
        self._given: ArrayRecord | None = None  # the model configure_train was given: kept if a round is declined
        self.cross_site: dict[str, Any] | None = None  # the end-of-run cross-site scores (cross_site_evaluation)
        self.nothing_aggregated: str | None = None  # why start()'s rounds aggregated nobody (strategies/outcome.py)
        from strategies.secure_aggregation import SecureAggregation

        #: how the training rounds travel, chosen once: secure aggregation where the job enables it, else plain
        self.workflow: PlainRounds | SecureAggregation = SecureAggregation.of(self) or PlainRounds(self)

    @property
    def secure_aggregation(self) -> SecureAggregation | None:
        """The strategy's secure aggregation (its workflow), None for plain rounds."""
        return None if isinstance(self.workflow, PlainRounds) else self.workflow

    @classmethod
    def own_arguments(cls) -> dict[str, str]:
        """The method's own keyword arguments -> the fields of its settings table they set (the table's fields,
        under Flower's name where it has one: FedProx's ``proximal_mu``)."""
        if cls.settings_type is None:
            return {}
        by_field = {field: argument for argument, field in cls.renamed.items()}
        return {by_field.get(field, field): field for field in cls.settings_type.model_fields}

    @classmethod
    def argument_defaults(cls) -> dict[str, Any]:
        """The method's own arguments with their defaults, from its settings table (their one source)."""
        fields = cls.settings_type.model_fields if cls.settings_type is not None else {}
        return {argument: fields[field].default for argument, field in cls.own_arguments().items()}

    @classmethod
    def method_settings(cls, **values: Any) -> dict[str, Any]:
        """The method's own arguments as dotted run-config keys (``fdl_weight`` -> ``fedproin.fdl-weight``)."""
        fields = cls.own_arguments()
        return {f"{cls.section}.{fields[name].replace('_', '-')}": value for name, value in values.items()}

    def __getattr__(self, name: str) -> Any:
        """The method's own settings as attributes, as Flower's FedProx has ``proximal_mu``."""
        if name.startswith("_") or "job" not in self.__dict__:
            raise AttributeError(name)
        field = type(self).own_arguments().get(name)
        if field is None and name in LEGACY_METHODS:
            raise AttributeError(legacy_method(type(self).__name__, name))
        if field is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(getattr(self.job, self.section), field)

    # Flower's attribute names for what the job holds
    @property
    def fraction_train(self) -> float:
        return self.job.fraction_train

    @property
    def min_train_nodes(self) -> int:
        return self.job.min_train_hospitals

    @property
    def min_available_nodes(self) -> int:
        return self.job.min_available_hospitals

    @property
    def arrayrecord_key(self) -> str:
        return self.records.arrays

    @property
    def configrecord_key(self) -> str:
        return self.records.config

    # --- the method's server half ----------------------------------------------------------------
    @property
    def engine(self) -> RoundEngine:
        """The method's round engine, built on first use (it loads the server's test set, and for
        FedMEPD its own training cases, from the run config)."""
        if self._engine is None:
            self._engine = self.workflow.round_engine()
        return self._engine

    def initial_arrays(self) -> ArrayRecord:
        """The method's initial global model (seeded by the run config's seed), for ``start``."""
        return into_arrayrecord(self.engine.method.global_arrays)

    def resume(self, checkpoint: Mapping[str, Any]) -> None:
        """Continue after the checkpoint's last round (``server_app.checkpoint.load_checkpoint``)."""
        self.engine.load_state_dict(dict(checkpoint))
        log.info("resuming %s after round %d", self.job.run_name, len(self.engine.history))

    def hospital_config(self, server_round: int) -> dict[str, Any]:
        """Round config every message carries: the job as this strategy holds it (so settings given in Python reach
        the hospitals; ``common.config.hospital_keys`` leaves out what is the server's alone), the round, and the
        record names and weighting key the replies must use."""
        audit = self.audit_log()  # the hospitals record the server's log as it stood: its operator cannot rewrite it
        return {**hospital_keys(self.job), "server-round": server_round, "run-name": self.job.run_name,
                **self.records.as_config(), "weighted-by-key": self.weighted_by_key,
                **({SERVER_HEAD_KEY: audit.head()} if audit is not None else {})}

    def claim_run_folder(self) -> None:
        """Hold the run folder for this run, before round 1 (:meth:`RunFolder.claim`); the name held is the run's."""
        name = self.run_folder.claim(self.job.results_dir, self.job.run_name)
        if name != self.job.run_name:
            self.change_job(run_name=name)

    def release_run_folder(self) -> None:
        self.run_folder.release()

    def audit_log(self) -> AuditLog | None:
        """The server's audit log (run config ``audit-log``), None for 'none': :meth:`AuditTrail.log`."""
        return self.audit.log()

    def audit_message(self, *line: Any, **fields: Any) -> None:
        """A line of the audit log for a message sent or received: :meth:`AuditTrail.message`."""
        self.audit.message(*line, **fields)

    def audit_messages(self, lines: list[tuple]) -> None:
        """Lines of :meth:`audit_message` under one lock and one ``fsync``: :meth:`AuditTrail.messages`."""
        self.audit.messages(lines)

    def reply_intake(self) -> ReplyIntake:
        """How replies are taken now: by the hospitals known, within the method's limits (strategies/replies.py)."""
        return ReplyIntake(self.hospitals, self.audit, self.records,
                           ReplyLimits.of(self.job.screening.max_reply_mb, self.engine.method.global_arrays),
                           self.engine.method.flower_reply_arrays, self.workflow.masks_own_training)

    def discover(self, grid: Grid) -> None:
        """Learn the identity of every connected node not seen before (:meth:`HospitalDirectory.discover`)."""
        self.directory.discover(grid)

    def hospital_messages(self, server_round: int, hospitals: list[HospitalInfo], config: ConfigRecord,
                          message_type: str, unlogged: list[tuple] | None = None) -> list[Message]:
        """The method's payload for each hospital, with the round config and ``config`` (Flower's
        train or evaluate config) in its ConfigRecord; each logged as sent, or its audit line added to ``unlogged``
        (the training messages: the round's workflow logs them as they leave)."""
        node_of = {info.name: node for node, info in self.hospitals.items()}
        layout = self.message_layout()
        messages = []
        shared: dict = {}  # one record of the global model for every hospital that receives it, not a copy each
        config = {**dict(config or {}), **(self.flower_train_config() if message_type == MessageType.TRAIN else {})}
        for info in hospitals:
            payload = self.engine.downlink(server_round, info)
            if info.properties.get(TRAINS_ITSELF) and not self.masks_own_training(message_type):
                content = self.flower_content(server_round, payload, config, shared)
            else:
                payload.config = {**payload.config, **self.hospital_config(server_round), **config,
                                  "message-arrays": layout}  # the hospital replies in the same layout
                content = to_recorddict(payload, layout, self.records, shared)
            message = Message(content, message_type=message_type, dst_node_id=node_of[info.name])
            digest = message_digest(message)
            self._bytes_down[info.name] = digest["bytes"]
            messages.append(message)
            line = ("sent", message, server_round, info.name, node_of[info.name], False, digest)
            if unlogged is None:
                self.audit_messages([line])
            else:
                unlogged.append(line)
        return messages

    def flower_content(self, server_round: int, payload: Payload, config: Mapping[str, Any],
                       shared: dict) -> RecordDict:
        """A message to a hospital that trains the model itself, as Flower's FedAvg builds it: the model as one
        ArrayRecord of one Array per tensor (``arrayrecord_key``; ``to_torch_state_dict()`` loads it) and the train
        or evaluate config with ``server-round`` (``configrecord_key``), nothing of fedmed's protocol."""
        arrays = payload.arrays.get("model", {})
        same = ("flower", tuple((name, id(value)) for name, value in arrays.items()))
        if same not in shared:  # one record for every such hospital of the round
            shared[same] = (tuple(arrays.values()), ArrayRecord({name: Array(np.require(value, requirements="C"))
                                                                 for name, value in arrays.items()}))
        return RecordDict({self.records.arrays: shared[same][1],
                           self.records.config: ConfigRecord({**config, "server-round": server_round})})

    def masks_own_training(self, message_type: str) -> bool:
        """Whether a hospital that trains the model itself gets fedmed's messages rather than Flower's: the training
        rounds of a secure run, whose stages its HospitalClientApp's mod answers, masking what the app's own train
        handler returns (``client_app/hospital_mod.py``); its evaluate phase stays Flower's."""
        return self.workflow.masks_own_training and message_type == MessageType.TRAIN

    def flower_train_config(self) -> dict[str, Any]:
        """What a train message's config carries for the method beside the user's train config, as Flower's strategy
        of the same name sends it (FedProx: ``proximal-mu``); none by default."""
        return {}

    def message_layout(self) -> str:
        """How this round's arrays travel: ``message-arrays``, where that is 'auto' flat in our own round loop
        (:meth:`start`) and per tensor under Flower's, where a wrapper (Flower's DP) may compare each reply with
        the model it was sent tensor by tensor."""
        if self.job.message_arrays != "auto":
            return self.job.message_arrays
        return "flat" if self._in_own_loop else "per-tensor"

    # --- Flower's strategy interface -------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Hospitals of this round and their messages; ``arrays`` (the current global model, as Flower's loop
        and ours pass it) become the method's global model first, so a wrapper's or a subclass's changes (e.g.
        DP noise) are what hospitals receive. A wrapper that cannot take this strategy's replies is refused first."""
        self.refuse_unfit_wrappers()
        self.claim_run_folder()  # under Flower's loop (a DP wrapper's start): held until the ServerApp process ends
        if len(arrays) and not self.engine.history and not self.engine.own_network:  # Flower's loop: initial_arrays
            self.adopt_initial_arrays(arrays, f"arrays given for round {server_round}")
        elif len(arrays):
            self.engine.adopt_global_arrays(arrays_of(arrays, copy=False), f"arrays given for round {server_round}")
        self._grid, self._given = grid, arrays
        asked_from = time.time()
        self.discover(grid)
        if not self.engine.history and len(self.hospitals) < self.job.min_train_hospitals and self._refusals:
            raise ConfigError(f"round {server_round} cannot start: {len(self.hospitals)} hospital(s) can train, "
                              f"min_train_nodes={self.job.min_train_hospitals}; nodes that refused the job: "
                              + "; ".join(f"node {node}: {reason}" for node, reason in sorted(self._refusals.items())))
        self._round_started = time.time()
        self._identity_seconds = self._round_started - asked_from
        self._chosen = self.engine.select(server_round, list(self.hospitals.values()))
        self._bytes_down = {}
        sent: list[tuple] = []
        messages = self.hospital_messages(server_round, self._chosen, config, MessageType.TRAIN, unlogged=sent)
        log.info("round %d: training on %s", server_round, ", ".join(h.name for h in self._chosen))
        return self.workflow.prepare(server_round, messages, grid, sent)  # secure: key stages first

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The next global model and the round's metrics, as Flower's: ``(None, None)`` when no reply was accepted,
        no arrays when too few were (``min_train_nodes``: the model stays as it was). The round is recorded, scored
        on the test set and saved once its model is released (:meth:`configure_evaluate`), so what a subclass or a
        DP wrapper makes of these arrays is the model that is scored, saved and sent next; a subclass's
        ``aggregate_train`` that returns no arrays keeps the previous model (:meth:`aggregation_returned`)."""
        if type(self).aggregate_train is not HospitalStrategy.aggregate_train:  # an override may still decline
            self._state_before = {k: np.array(v, copy=True) for k, v in self.engine.method.state_dict().items()}
        folder = self.reply_folder()
        intake = self.reply_intake()
        round_replies = intake.round_replies(server_round, replies, [h.name for h in self._chosen], folder is None)
        if folder is not None:  # each reply screened as it arrives, what the method aggregates kept on disk
            record = self.engine.complete_round(server_round, self._chosen, round_replies, self._round_started,
                                                self._bytes_down, evaluate=False, reply_folder=folder)
        else:
            record = self.engine.complete_round(server_round, self._chosen, list(round_replies), self._round_started,
                                                self._bytes_down, evaluate=False)
        record["identity-seconds"] = round(self._identity_seconds, 3)  # finding new hospitals, before the round
        if self._refusals:  # nodes that would not join (a hospital's gate or policy refused the job): metrics.jsonl
            record["not-joined"] = {f"node {node}": reason for node, reason in sorted(self._refusals.items())}
        self._record = record
        self.warn_of_idle_gpus(record)
        if not record["aggregated"]:
            return None, None
        metrics = round_metricrecord(record)
        if self.train_metrics_aggr_fn is not None:
            own = self.train_metrics_aggr_fn([intake.kept[name] for name in record["aggregated"]],
                                             self.weighted_by_key)
            metrics = MetricRecord({**metrics, **dict(own or {})})
        if "skipped" in record:
            return None, metrics
        return into_arrayrecord(self.engine.method.global_arrays), metrics

    def warn_of_idle_gpus(self, record: dict[str, Any]) -> None:
        """Once: the server sees GPUs but hospitals with ``device='auto'`` trained on the CPU (in Flower's simulation:
        no ``client-resources-num-gpus``, so Ray gave them none)."""
        import torch

        on_cpu = sorted(h for h, device in record.get("devices", {}).items() if device == "cpu")
        if self._warned_gpus or not on_cpu or self.job.device != "auto" or not torch.cuda.is_available():
            return
        self._warned_gpus = True
        log.warning("this machine has %d GPU(s) but %s trained on the CPU: in Flower's simulation give the hospitals "
                    "GPUs with --federation-config \"client-resources-num-gpus=0.25\" (fedmed simulate does), in a "
                    "deployment set device='cuda:N' in their node config", torch.cuda.device_count(),
                    ", ".join(on_cpu))

    def aggregation_returned(self, server_round: int, arrays: ArrayRecord | None) -> None:
        """The outermost ``aggregate_train`` of round ``server_round`` (a subclass's override, a wrapper's, ours)
        returned ``arrays``, as :meth:`release` learns from what it is handed. ``None`` is Flower's way to skip a
        round: the previous global model stays, in the method too (whatever ours aggregated before an override or a
        wrapper declined), and the round is recorded as skipped, with the reason. An override that aggregated without
        ours has its round recorded too (``aggregated-by``); its arrays are released as any."""
        record = self._record if self._record is not None and self._record["round"] == server_round else None
        before, self._state_before = self._state_before, None
        overridden = type(self).aggregate_train is not HospitalStrategy.aggregate_train
        name = f"{type(self).__name__}.aggregate_train" if overridden else "the aggregate_train wrapping ours"
        if record is None and arrays is None and overridden:  # an override that never called ours
            self.round_record(server_round, f"{name} returned no arrays without fedmed's aggregation")
        elif record is None and arrays is not None and server_round == self.engine.next_round:  # on its own
            self._record = self.engine.unscreened_round(server_round, self._chosen, self._round_started,
                                                        self._bytes_down, aggregated_by=f"{name}, on its own")
        elif record is not None and arrays is None and "skipped" not in record:
            if before is not None:
                self.engine.method.load_state_dict(before)
            elif self._given is not None and len(self._given):  # a wrapper declined: at least its model back
                self.engine.adopt_global_arrays(arrays_of(self._given, copy=False), "the kept model")
            record["discarded"], record["aggregated"] = record["aggregated"], []
            record.pop("method", None)
            record["skipped"] = (f"{name} returned no arrays: the aggregate of {', '.join(record['discarded'])} "
                                 f"was discarded; {kept(server_round)}")
            log.warning("round %d: %s", server_round, record["skipped"])

    def round_record(self, server_round: int, why: str = "") -> dict[str, Any] | None:
        """Round ``server_round``'s record while it is in progress; where no ``aggregate_train`` of ours made one (an
        override or a wrapper declined the round first: Flower's DP wrappers do when a reply is an error), one that
        records it skipped, ``why``. None once the round has ended."""
        if self._record is not None and self._record["round"] == server_round:
            return self._record
        if server_round != self.engine.next_round:
            return None
        why = why or "the replies never reached fedmed's aggregate_train (a wrapper declined the round)"
        self._record = self.engine.unscreened_round(server_round, self._chosen, self._round_started, self._bytes_down,
                                                    skipped=f"{why}; {kept(server_round)}")
        return self._record

    def release(self, server_round: int, arrays: ArrayRecord) -> None:
        """``arrays`` are round ``server_round``'s released global model (a wrapper's or a subclass's take on what
        :meth:`aggregate_train` returned): the method holds them, and the round is scored on the test set. Handed the
        very model ``configure_train`` was given, the round was declined: Flower's loop (and ours) keep the previous
        model when the outermost ``aggregate_train`` returns no arrays, and pass that one on."""
        declined = self._given is not None and arrays is self._given
        self.aggregation_returned(server_round, None if declined else arrays)
        self._given = None
        record = self.round_record(server_round)
        if record is None:
            return
        if len(arrays) and "skipped" not in record:
            self.engine.adopt_global_arrays(arrays_of(arrays, copy=False),
                                            f"global model released after round {server_round}")
        self.engine.evaluate_round(record)

    def test_metrics(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """The server's test-set metrics of round ``server_round``'s model, to pass as ``evaluate_fn`` to Flower's
        own loop (a DP wrapper's ``start``): the round's recorded scores (``arrays`` were released to the method in
        ``configure_evaluate``); round 0 scores ``arrays`` as given."""
        if server_round == 0:
            self.adopt_initial_arrays(arrays, "initial arrays")
            if self.engine.test_data is None:  # no test set, or a network the server does not build
                return None
            return MetricRecord(numbers(self.engine.method.evaluate(self.engine.test_data)))
        for record in reversed(self.engine.history):
            if record["round"] == server_round:
                return MetricRecord(numbers(record.get("test", {}))) if record.get("test") else None
        return None

    def adopt_initial_arrays(self, arrays: ArrayRecord, what: str) -> None:
        """``arrays`` as the model round 1 starts from. Where they are not the method's model of the run config's
        network: with no network named (``model`` unset) a method of Flower's contract (``MethodSpec.flower_contract``:
        FedAvg, FedProx, FedBN) takes the network's shape from them, as Flower's strategies do; otherwise a ConfigError
        says which network they were compared with and what to change."""
        named = arrays_of(arrays, copy=False)
        try:
            self.engine.adopt_global_arrays(named, what)
            return
        except ValueError as error:
            mismatch = str(error)
        method, network = self.job.strategy, self.engine.method.task.network_name
        built = self.engine.method.model_from_network(named)  # the network's own state: FedProIn's encoder
        if built is not None:
            self.engine.adopt_global_arrays(built, what)
            log.info("%s: %s are the network's own state; %s's model is built from them", method, what, method)
            return
        if not self.job.model and method_spec(method).flower_contract:
            self.engine.adopt_own_network(named, what)
            return
        if self.job.model:
            raise ConfigError(f"{mismatch}: {what} are not a {method} model of the network the run config names "
                              f"(model={network!r}); give {what} of that network, or leave model unset (FedAvg, "
                              f"FedProx and FedBN then take the network from {what})")
        raise ConfigError(f"{mismatch}: {what} are not a {method} model of the run config's network, which names none "
                          f"(model unset: the {self.job.task} task's default, {network!r}). {method} builds its model "
                          "around the network, so the server needs the network itself: name yours in the run config, "
                          "model='package.module:Net', and pass initial_arrays=strategy.initial_arrays() or none; "
                          f"its hospitals run fedmed's {method} step, so the ClientApp also becomes a "
                          "HospitalClientApp (from client_app.hospital_mod import HospitalClientApp) and the run "
                          "config names a loader of its data, dataset='package.module:load' (docs/own-serverapp.md "
                          "shows the whole change for each method)")

    def round_ended(self, record: dict[str, Any]) -> None:
        """Hand the finished round to ``on_round_end`` (checkpoint, result files), unless the run was stopped.

        ``flwr stop`` deletes the run's pending messages at the SuperLink before this ServerApp learns of the
        stop, so the round in flight can end with hospitals missing that were never going to be late. Saved, it
        would be the round a resume continues from. A round that lacks a chosen hospital is therefore saved only
        after one call to the SuperLink, which it refuses once the run is stopped, has succeeded."""
        if self.on_round_end is None:
            return
        lost = [*record["missing"], *record["refused"]]
        if lost and self._grid is not None:
            try:
                self._grid.get_node_ids()
            except Exception as error:  # the SuperLink's refusal (HTTP 401 on a stopped run) or no SuperLink
                raise RunStopped(f"round {record['round']} ended without {', '.join(lost)} and the "
                                 f"SuperLink no longer serves this run ({type(error).__name__}: {error}); the "
                                 "round is not saved, so a resume repeats it") from error
        self.on_round_end(self.engine, record)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """The round's released model (``arrays``, what Flower's loop and ours will send next) is scored on the
        test set; then Flower's evaluate phase, when ``fraction_evaluate > 0`` (hospitals already score the
        received model inside their training reply)."""
        self.release(server_round, arrays)
        if self.fraction_evaluate <= 0 or not self.hospitals:
            self._evaluated = []
            return []
        self._evaluated = select_hospitals(list(self.hospitals.values()), self.fraction_evaluate,  # a draw of
                                           self.min_evaluate_nodes, self.job.seed + 1, server_round)  # its own
        return self.hospital_messages(server_round, self._evaluated, config, MessageType.EVALUATE)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        scores: list[tuple[float, dict[str, Any], RecordDict]] = []
        intake = self.reply_intake() if self._evaluated else None
        for message in replies:
            hospital = self.hospitals.get(message.metadata.src_node_id)
            self.audit_message("received", message, server_round, hospital.name if hospital else None)
            if hospital is None or hospital not in self._evaluated:
                continue
            if message.has_error():
                log.warning("round %d: %s could not evaluate: %s", server_round, hospital.name,
                            cut(message.error.reason))
                continue
            try:
                metrics = intake.decode(hospital, message.content, training=False).metrics
            except MalformedPayload as error:
                log.warning("round %d: evaluation of %s refused: %s", server_round, hospital.name, error)
                continue
            scores.append((max(float(metrics.get(self.weighted_by_key, 0) or 0), 1.0), metrics, message.content))
        aggregated = weighted_mean_metrics([(weight, metrics) for weight, metrics, _ in scores]) if scores else None
        if scores and self.evaluate_metrics_aggr_fn is not None:
            aggregated = dict(self.evaluate_metrics_aggr_fn([content for *_, content in scores], self.weighted_by_key)
                              or {})
        record = self._record
        if record is not None and record["round"] == server_round:
            if aggregated:
                record["evaluate"] = aggregated
            self._record = None
            if not self._in_own_loop:
                self.round_ended(record)
        return MetricRecord(aggregated) if aggregated else None

    def change_job(self, **changes: Any) -> None:
        """The job with ``changes``, for the method's server half too where it is built already (initial_arrays())."""
        self.job = self.job.model_copy(update=changes)
        self.audit = AuditTrail.of(self.job)  # a new run name: the log in its folder
        if self._engine is not None:
            self._engine.cfg = self._engine.method.cfg = self._engine.method.task.cfg = self.job

    def summary(self) -> None:
        self.refuse_unfit_wrappers()  # Flower's loop begins with summary(): before evaluate_fn and round 1
        log.info("%s: %d rounds, fraction-train %.2f, min %d hospitals per round, timeout %.0fs",
                 type(self).__name__, self.job.num_server_rounds, self.job.fraction_train,
                 self.job.min_train_hospitals, self.job.round_timeout)
        log.info("%s: %s", type(self).__name__, self.who_trains())

    def who_trains(self) -> str:
        """Whose train loop trains this run's rounds, for its first lines: a ClientApp's own for the methods of
        Flower's contract (masked by fedmed's mod under secure aggregation), fedmed's hospital step for the others."""
        method = self.job.strategy
        if method_spec(method).flower_contract:
            return (f"a ClientApp that trains the model itself trains {method}'s rounds with its own train loop"
                    f"{self.workflow.who_trains_note()}")
        return (f"{method}'s hospitals run fedmed's {method} step (its own local training): a HospitalClientApp's own "
                f"train handler is not asked for {method}'s rounds (docs/own-clientapp.md)")

    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int | None = None,
              timeout: float | None = None, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None, evaluate_fn: EvaluateFn | None = None) -> Result:
        """Flower's round loop (``Strategy.start``), from the engine's next round (1, or the round after a resumed
        checkpoint) to ``num_rounds`` (default: the run config's), each round waiting at most ``timeout`` seconds
        (default: the run config's round timeout) for replies.

        As in Flower's loop, ``configure_train`` is given the current global model and what ``aggregate_train``
        returns (a subclass's change included) is the next one: scored on the test set (the round's
        ``evaluate_metrics_serverapp``, with ``evaluate_fn``'s metrics), checkpointed (``on_round_end``) and sent
        next. ``initial_arrays`` replace the method's initial model (same names and shapes; counters such as
        BatchNorm's ``num_batches_tracked`` may be included); ``train_config`` and ``evaluate_config`` travel in
        every train and evaluate message (their keys win over ours, e.g. ``local-epochs``); ``evaluate_fn(round,
        arrays)`` scores the global model before round 1 and after every round. What ours adds: hospitals by
        name, faster polling, messages a few at a time in simulation, and resume. A run in which no round
        aggregated any hospital returns its Result as Flower's loop does (``Result.arrays`` empty: it holds the last
        round's aggregate only), the reason logged, in the audit log and in ``nothing_aggregated``.
        """
        self.claim_run_folder()
        try:
            return self.run_rounds(grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config,
                                   evaluate_fn)
        finally:
            self.release_run_folder()


def kept(server_round: int) -> str:
    """Which model a skipped round keeps."""
    return ("the initial global model is kept" if server_round == 1 else
            f"the global model of round {server_round - 1} is kept")


class NoHospitalAggregated(RuntimeError):
    """A run none of whose rounds aggregated any hospital: what fedmed's own ServerApp makes of it (a failed run)."""


def strategy_arguments(strategy: type[HospitalStrategy], cfg: JobConfig) -> dict[str, Any]:
    """A validated job as the strategy's constructor arguments (how fedmed's own ServerApp builds one)."""
    section = getattr(cfg, strategy.section) if strategy.section else None
    own = {name: getattr(section, field) for name, field in strategy.own_arguments().items()}
    return {"fraction_train": cfg.fraction_train, "min_train_nodes": cfg.min_train_hospitals,
            "min_available_nodes": cfg.min_available_hospitals, "run_config": cfg, **own}

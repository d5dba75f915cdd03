"""The server's round engine, whatever carries the messages: choose hospitals, build what each one
receives, accept or refuse replies, aggregate, evaluate, and keep the round history.

The Flower strategies (``strategies``) and the in-process runner (``common.engine.inprocess``) both
drive a :class:`RoundEngine`; they differ only in how payloads reach hospitals. (Named so as not
to be read as a Flower "federation", which is a SuperLink connection.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common.arrays import ArraysMismatch, check_like, is_exchanged
from common.config import JobConfig
from common.engine.reply_store import ReplyStore
from common.engine.round_record import round_record, screened_shares, weighted_mean_metrics  # noqa: F401
from common.engine.run_imports import IMPORT_PATHS_KEY, import_roots
from common.engine.screening import (
    batchnorm_problem,
    brief,
    cut,
    metrics_problem,
    norm_outliers,
    sample_count_problem,
    update_distance,
)
from common.methods.base import (
    TRAINS_ITSELF,
    HospitalInfo,
    HospitalUpdate,
    Payload,
    RejectedUpdate,
    ServerMethod,
    pack_json,
    unpack_json,
)
from common.methods.registry import method_spec, server_class
from common.models.requirements import check_network
from common.tasks import get_task, task_class

log = logging.getLogger("fedmed")


@dataclass
class RoundReply:
    """What came back from one chosen hospital: a payload, or the error it reported."""

    hospital: HospitalInfo
    payload: Payload | None
    error: str | None = None
    bytes_up: int = 0


@dataclass
class RoundInbox:
    """One round's replies as they come in (:meth:`RoundEngine.receive`): the screened ones with what the method
    aggregates of each (on disk with a ``store``) and their update distance, the refused ones' reasons, and the
    bytes each hospital sent."""

    rnd: int
    store: ReplyStore | None = None
    screened: list[tuple[HospitalUpdate, float | None]] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    bytes_up: dict[str, int] = field(default_factory=dict)  #: every hospital that answered, errors included


def select_hospitals(hospitals: list[HospitalInfo], fraction: float, minimum: int, seed: int,
                     rnd: int) -> list[HospitalInfo]:
    """This round's hospitals: a seeded draw over hospitals sorted by name, so reruns and resumed
    runs choose the same ones whatever node ids the transport assigned. How many: as Flower's FedAvg,
    ``int(fraction * connected)`` and at least ``minimum``."""
    ordered = sorted(hospitals, key=lambda h: h.name)
    count = min(len(ordered), max(minimum, int(fraction * len(ordered))))
    picked = np.random.default_rng([seed, rnd]).choice(len(ordered), size=count, replace=False)
    return [ordered[i] for i in sorted(picked)]


class RoundEngine:
    """One run's server state: the method, the test set, the round history."""

    def __init__(self, cfg: JobConfig, method: ServerMethod | None = None, test_data: Any = None,
                 weight_key: str = "num-examples"):
        self.cfg = cfg
        self.weight_key = weight_key  #: the reply metric holding a hospital's sample count (Flower's weighted_by_key)
        if method is None:
            task_type = task_class(cfg.task)
            self.test_data = task_type.load_test(cfg) if test_data is None else test_data
            task = get_task(cfg, task_type.describe(self.test_data) if self.test_data is not None
                            else task_type.spec_without_test_set(cfg))
            method = server_class(cfg.strategy)(cfg, task)
            check_network(method.task, method_spec(cfg.strategy).model_needs, self.test_data)  # before round 1
            method.initialize()
        else:
            self.test_data = test_data
        self.method = method
        self.own_network = False  #: the global model is of a network the server does not build (adopt_own_network)
        self.history: list[dict[str, Any]] = []
        self.update_norms: dict[str, float] = {}
        self.weight_cuts: dict[str, str] = {}  # hospitals whose weight screening.sample-ratio-limit cut this round

    @property
    def next_round(self) -> int:
        return len(self.history) + 1

    # --- one round --------------------------------------------------------------------------------
    def select(self, rnd: int, hospitals: list[HospitalInfo]) -> list[HospitalInfo]:
        self.method.hospitals_available(rnd, hospitals)
        return select_hospitals(hospitals, self.cfg.fraction_train, self.cfg.min_train_hospitals, self.cfg.seed, rnd)

    def downlink(self, rnd: int, hospital: HospitalInfo) -> Payload:
        return self.method.downlink(rnd, hospital)

    def adopt_global_arrays(self, arrays: dict[str, np.ndarray], what: str = "global arrays") -> None:
        """Take ``arrays`` as the global model (e.g. a DP wrapper's noised aggregate, or a user's initial
        model): same names and shapes as the method's, each cast to the method's dtype."""
        current = self.method.global_arrays
        try:
            check_like({k: v for k, v in arrays.items() if is_exchanged(k)},
                       {k: v for k, v in current.items() if is_exchanged(k)}, what)
        except ArraysMismatch as error:
            raise ValueError(str(error)) from None  # a user's own network's counters are kept as the model holds them
        self.method.global_arrays = {k: np.asarray(arrays[k] if k in arrays else v, dtype=v.dtype)
                                     for k, v in current.items()}

    def adopt_own_network(self, arrays: dict[str, np.ndarray], what: str = "initial_arrays") -> None:
        """Take ``arrays`` as the global model of a network the server does not build (a Flower user's own): the
        method holds them as they are, and the server scores nothing itself (it has no such network to load them
        into): the user's ``evaluate_fn`` does, as in Flower."""
        self.method.adopt_own_network(arrays)
        self.test_data = None
        self.own_network = True
        log.info("the global model is the network of %s (%d tensors), which the server does not build: it scores "
                 "nothing on its test set (pass evaluate_fn to start(), or name the network in the run config, "
                 "model='package.module:Net')", what, len(arrays))

    def complete_round(self, rnd: int, chosen: list[HospitalInfo], replies: Iterable[RoundReply], started: float,
                       bytes_down: dict[str, int] | None = None, evaluate: bool = True,
                       reply_folder: Path | None = None) -> dict[str, Any]:
        """Check every reply, aggregate the accepted ones, let the server work, evaluate, record.

        ``replies`` are taken one at a time as they come (a generator's as they arrive): each is screened and
        released (:meth:`receive`), what the method aggregates kept in memory, or with ``reply_folder`` on disk in
        ``<reply_folder>/.round-<rnd>`` (removed when the round closes), so that the server holds one reply at a
        time whatever the number of hospitals; the result is the same bit for bit. ``bytes_down`` is what was sent
        to each chosen hospital (measured by the transport). ``evaluate=False`` leaves the test-set scores to
        :meth:`evaluate_round`, once the round's model is released (a Flower strategy's ``configure_evaluate``: a
        DP wrapper adds its noise in between).
        """
        inbox = RoundInbox(rnd, ReplyStore(reply_folder / f".round-{rnd}") if reply_folder is not None else None)
        try:
            for reply in replies:
                self.receive(inbox, reply)
                del reply  # not held while the next one is pulled and decoded
            return self.close_round(inbox, chosen, started, bytes_down, evaluate)
        finally:
            if inbox.store is not None:
                inbox.store.remove()

    def receive(self, inbox: RoundInbox, reply: RoundReply) -> None:
        """Take one reply of ``inbox``'s round as it arrives: screen it (:meth:`screen_one`), keep what the method
        aggregates of it (``ServerMethod.reply_arrays``; on disk when the round has a store) and release the rest,
        the reply's payload included. A refused reply leaves only its reason. Nothing a reply holds can raise here."""
        name, payload = reply.hospital.name, reply.payload
        inbox.bytes_up[name] = reply.bytes_up
        if payload is None:
            inbox.refused[name] = f"hospital reported an error: {cut(str(reply.error))}"
            return
        update = HospitalUpdate(reply.hospital, payload, weight_key=self.weight_key)
        try:
            reason, distance = self.screen_one(update, inbox.rnd)
            kept = self.method.reply_arrays(update)
        except Exception as error:  # a reply no check foresaw: refused, never the round's end
            log.exception("unexpected error while checking the update of %s", name)
            reason, distance = f"could not be checked ({type(error).__name__}: {error})", None
        if reason:
            inbox.refused[name] = cut(reason)
            return
        if inbox.store is not None:  # the server's disk, not the reply: a full disk ends the round, loudly
            kept = {group: inbox.store.keep(arrays) for group, arrays in kept.items()}
        update.payload = Payload(arrays=kept, config=payload.config, metrics=payload.metrics)
        inbox.screened.append((update, distance))

    def close_round(self, inbox: RoundInbox, chosen: list[HospitalInfo], started: float,
                    bytes_down: dict[str, int] | None = None, evaluate: bool = True) -> dict[str, Any]:
        """The round of ``inbox`` once its replies are in: the rules that weigh each reply against the others
        (:meth:`round_rules`, on the numbers screening kept), the method's aggregation and server step, the record."""
        rnd = inbox.rnd
        accepted = self.round_rules(inbox)
        refused = inbox.refused
        for name, reason in refused.items():
            log.warning("round %d: refused the update of %s: %s", rnd, name, reason)
        missing = [h.name for h in chosen if h.name not in inbox.bytes_up]
        if missing:
            log.warning("round %d: no reply from %s before the timeout", rnd, ", ".join(missing))

        method, skipped = None, None
        if len(accepted) >= self.cfg.min_train_hospitals:
            method = self.method.aggregate(rnd, accepted)
            method.update(self.method.server_step(rnd))
        else:
            skipped = (f"{len(accepted)} accepted update(s), fewer than min-train-hospitals="
                       f"{self.cfg.min_train_hospitals}; the global model is unchanged")
        bytes_down = bytes_down or {}
        traffic = {h.name: {"down": int(bytes_down.get(h.name, 0)), "up": int(inbox.bytes_up.get(h.name, 0))}
                   for h in chosen}
        record = round_record(rnd, chosen, accepted, started=started, traffic=traffic, missing=missing,
                              refused=refused, method=method, skipped=skipped, update_norms=self.update_norms,
                              weight_cuts=self.weight_cuts)
        self.history.append(record)
        if evaluate:
            self.evaluate_round(record)
        return record

    def unscreened_round(self, rnd: int, chosen: list[HospitalInfo], started: float,
                         bytes_down: dict[str, int] | None = None, skipped: str | None = None,
                         aggregated_by: str = "") -> dict[str, Any]:
        """Record round ``rnd``, whose replies fedmed's screening never saw (a user's or a wrapper's
        ``aggregate_train`` took them first): skipped for the reason ``skipped`` (the global model unchanged), or
        else aggregated by ``aggregated_by`` from the chosen hospitals' replies."""
        bytes_down = bytes_down or {}
        traffic = {h.name: {"down": int(bytes_down.get(h.name, 0)), "up": 0} for h in chosen}
        record = round_record(rnd, chosen, [], started=started, traffic=traffic, skipped=skipped or None,
                              aggregated=[] if skipped else [h.name for h in chosen])
        if not skipped:
            record["aggregated-by"] = aggregated_by
        self.history.append(record)
        return record

    def evaluate_round(self, record: dict[str, Any]) -> None:
        """Score the global model on the test set for ``record``'s round (every ``evaluate-every`` rounds, and the
        last) and log the round."""
        rnd = record["round"]
        due = rnd % self.cfg.evaluate_every == 0 or rnd == self.cfg.num_server_rounds
        if due and self.test_data is not None:  # a loader of the job's own may give the server no test set
            started = time.time()
            record["test"] = self.method.evaluate(self.test_data)
            record["seconds"] = round(record["seconds"] + time.time() - started, 3)
        log.info("round %d/%d: %s", rnd, self.cfg.num_server_rounds, describe(record))

    def round_rules(self, inbox: RoundInbox) -> list[HospitalUpdate]:
        """The screened replies of ``inbox`` that the rules weighing each against the others accept (the update-norm
        rule against the others' median, refuse-unchanged), each with its share of the aggregate (sample counts
        cut at sample-ratio-limit x the others' median, capped at max-hospital-weight), in hospital-name order: the
        same result whatever order the replies arrived in. The others go into ``inbox.refused``, after the replies
        refused on their own, each set in name order."""
        screened = sorted(inbox.screened, key=lambda item: item[0].hospital.name)
        refused = {name: inbox.refused[name] for name in sorted(inbox.refused)}
        distances = {u.hospital.name: d for u, d in screened if d is not None}
        self.update_norms = distances  # recorded with the round: what the norm rule judged by
        refused.update(norm_outliers(distances, self.cfg.screening.update_norm_limit))
        if self.cfg.screening.refuse_unchanged:
            refused.update({name: "its update is zero: it returned the model it received unchanged "
                                  "(screening.refuse-unchanged)" for name, d in distances.items() if d == 0.0})
        inbox.refused = refused
        accepted = [u for u, _ in screened if u.hospital.name not in refused]
        self.weight_cuts = screened_shares(accepted, self.cfg.screening)
        for name, why in self.weight_cuts.items():
            log.warning("%s %s", name, why)
        return accepted

    def screen_one(self, update: HospitalUpdate, rnd: int | None = None) -> tuple[str | None, float | None]:
        """One reply's reason to refuse (or None) and its update distance (for the round-wide norm rule)."""
        metrics = update.payload.metrics
        reason = metrics_problem(metrics, self.method.list_metrics)
        trains_itself = update.hospital.properties.get(TRAINS_ITSELF)  # Flower's contract: no round in its reply
        if reason is None and rnd is not None and not trains_itself and metrics.get("server-round") != rnd:
            reason = (f"the reply is for round {brief(metrics.get('server-round'))}, not this round {rnd} "
                      "(a reply replayed from another round, or one that does not say its round)")
        if reason is None:
            reason = sample_count_problem(metrics.get(self.weight_key), update.hospital.num_examples, self.weight_key)
        if reason:
            return reason, None
        try:
            self.method.check(update)
        except RejectedUpdate as error:
            return str(error), None
        arrays, received = self.method.screened_arrays(update)
        reason = batchnorm_problem(arrays)
        return reason, None if reason else update_distance(arrays, received)

    # --- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        state = {f"method/{k}": v for k, v in self.method.state_dict().items()}
        state["run/history"] = pack_json(self.history)
        state["run/config"] = pack_json(self.cfg.model_dump(mode="json", by_alias=True))
        state["run/model-spec"] = pack_json(self.method.task.spec)  # classes and channels the model was built for
        state[IMPORT_PATHS_KEY] = pack_json(import_roots(self.cfg))  # where its own network and loader came from
        return state

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Continue from a checkpoint's state; ValueError when its global model does not fit this run's (names,
        shapes, dtypes), before anything is changed."""
        method_state = {k.removeprefix("method/"): v for k, v in state.items() if k.startswith("method/")}
        current = {k: v for k, v in self.method.state_dict().items() if k.startswith("global/")}
        try:
            check_like({k: v for k, v in method_state.items() if k.startswith("global/")}, current,
                       "the checkpoint's global model")
        except ArraysMismatch as error:
            raise ValueError(f"{error} (the run config builds another model than the checkpoint's)") from None
        self.history = unpack_json(state["run/history"])
        self.method.load_state_dict(method_state)


def describe(record: dict[str, Any]) -> str:
    """A one-line progress summary of a round record."""
    parts = [f"{len(record['aggregated'])}/{len(record['chosen'])} hospitals"]
    if record.get("refused"):
        parts.append(f"refused {sorted(record['refused'])}")
    if record.get("missing"):
        parts.append(f"missing {record['missing']}")
    test = record.get("test", {})
    parts += [f"{k}={v:.4f}" for k, v in test.items() if "/" not in k and k != "num-examples" and isinstance(v, float)]
    parts.append(f"up={record['bytes_up'] / 1e6:.2f}MB down={record['bytes_down'] / 1e6:.2f}MB")
    parts.append(f"{record['seconds']:.1f}s")
    return ", ".join(parts)

"""Which hospital each node is: identity queries (signed with ``hospital-keys``), discovery of nodes that join,
contested names, and Flower ClientApps that train the model themselves."""

from __future__ import annotations

import logging
import time
from typing import Any

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.superlink.grid import InMemoryGrid

from common.config import SAFE_RUN_NAME
from common.engine.screening import brief, cut, declared_count_problem
from common.methods.base import FLOWER_ONLY, TRAINS_ITSELF, HospitalInfo
from common.methods.registry import method_spec
from common.trust.identity import IDENTITY_QUERY, NONCE_KEY, SIGNATURE_KEY, identity_problem, new_nonce

from .grid_messages import collect_replies, messages_in_flight

log = logging.getLogger("fedmed")


#: Flower's ClientApp error for a message type it has no handler for (``flwr/clientapp/client_app.py``): a node that
#: answers the identity query with it is a standard Flower ClientApp that trains the model itself.
NO_QUERY_HANDLER = "No query function registered"


class ExpectedNoQueryHandler(logging.Filter):
    """Drops Flower's log records of a ClientApp's "No query function registered". Flower's simulation engine
    (``vce_api``, in the process that runs this ServerApp) logs every exception a ClientApp raises twice, the error
    and its traceback, and a Flower ClientApp without a query handler raises that one at our identity query: it is
    how such an app says it trains the model itself, which :meth:`HospitalStrategy.learn_flower_clientapp` logs once
    per node in words. (A deployment's SuperNode logs it in its own process, once per node: the run's end is not
    announced to such nodes.)"""

    def filter(self, record: logging.LogRecord) -> bool:
        return NO_QUERY_HANDLER not in record.getMessage()


def quiet_expected_no_query_handler() -> None:
    """Install :class:`ExpectedNoQueryHandler` on Flower's logger, once per process."""
    flower = logging.getLogger("flwr")
    if not any(isinstance(existing, ExpectedNoQueryHandler) for existing in flower.filters):
        flower.addFilter(ExpectedNoQueryHandler())

#: What a hospital may declare about itself besides its name and size (modalities, bit-width...), and how long.
MAX_PROPERTIES = 32
MAX_PROPERTY_TEXT = 256



class HospitalDirectory:
    """The hospitals a strategy knows, by node: who each node is, which nodes could not say (and why), and the names
    more than one node claims. A part of ``HospitalStrategy`` (``strategy.directory``), which shares its dicts."""

    RETRY_FAILED_NODES_AFTER = 600.0  # seconds before a node whose identity query failed is asked again
    QUERY_PATIENCE = 45.0  # seconds before an identity query without reply is sent again

    def __init__(self, strategy: Any):
        self.strategy = strategy  # its job, record names, audit trail and method (check_hospital)
        self.hospitals: dict[int, HospitalInfo] = {}  # node id -> identity
        self.unusable: dict[int, float] = {}  # node id -> when its identity query failed (retried after a while)
        self.nonces: dict[int, list[str]] = {}  # node id -> identity nonces sent and not yet answered
        self.refusals: dict[int, str] = {}  # node id -> why it could not say which hospital it is
        self.contested: dict[str, set[int]] = {}  # hospital name -> the nodes claiming it (no hospital-keys)
        self._warned_names = False

    def discover(self, grid: Grid) -> None:
        """Learn the identity of every connected node not seen before (one query message each), once
        ``min-available-hospitals`` nodes are connected, as Flower's strategies wait for ``min_available_nodes``
        before each round: up to ``wait_for_nodes`` before the first, up to ``round-timeout`` before a later one (a
        hospital that left gets time to come back, instead of the rounds its peers' policies refuse without it
        running out meanwhile), then with whoever is connected."""
        job = self.strategy.job
        patience = job.round_timeout if self.hospitals else self.strategy.wait_for_nodes
        deadline, needed = time.time() + patience, job.min_available_hospitals
        while True:
            nodes = list(grid.get_node_ids())
            if len(nodes) >= needed or time.time() > deadline:
                break
            log.info("waiting for hospitals: %d connected, %d needed", len(nodes), needed)
            time.sleep(2.0)
        connected = set(nodes)
        for node in list(self.hospitals):
            if node not in connected:
                log.info("hospital %s (node %d) disconnected", self.hospitals.pop(node).name, node)
        for name, claimants in list(self.contested.items()):  # an operator stopped all claimants but one
            claimants &= connected
            if len(claimants) <= 1:
                del self.contested[name]
                for node in claimants:
                    self.unusable.pop(node, None)  # asked again below, and it holds the name alone
                log.warning("hospital name %s is no longer contested%s", name,
                            f": node {min(claimants)} alone claims it" if claimants else "")
        if not self.strategy.job.hospital_keys and not self._warned_names and not isinstance(grid, InMemoryGrid):
            self._warned_names = True
            log.warning("hospital names are not authenticated (no hospital-keys): any node can claim any hospital's "
                        "name and its place in the rounds; set hospital-keys to the folder of the hospitals' "
                        "registered <hospital>.pub keys")
        retry_after = time.time() - self.RETRY_FAILED_NODES_AFTER
        new = [node for node in nodes if node not in self.hospitals and self.unusable.get(node, 0.0) < retry_after]
        give_up = time.time() + self.strategy.job.round_timeout
        asked: set[str] = set()  # every query still unanswered: a late reply to an earlier one counts too
        in_flight = messages_in_flight(self.strategy.job, grid, queries=True)
        if new:
            quiet_expected_no_query_handler()
        while new and time.time() < give_up:
            windows = -(-len(new) // in_flight) if in_flight else 1  # a query's patience starts when it is sent
            patience = min(self.QUERY_PATIENCE * windows, give_up - time.time())
            for reply in collect_replies(grid, asked, patience, len(new), self.identity_queries(new), in_flight):
                node = reply.metadata.src_node_id
                if node in new:
                    new.remove(node)
                    self.learn_identity(node, reply)
            if new:  # a reply lost on the way (e.g. to a run stopped meanwhile) is not waited for forever
                log.info("asking node(s) %s again which hospital they are", ", ".join(map(str, new)))
        if new:  # slow, not broken (a first answer loads torch and the data): asked again next round
            log.warning("node(s) %s did not say which hospital they are within %.0f s; asked again next round",
                        ", ".join(map(str, new)), self.strategy.job.round_timeout)

    def identity_queries(self, nodes: list[int]) -> list[Message]:
        """One query per node, each with a fresh nonce the hospital signs when ``hospital-keys`` is set."""
        messages = []
        for node in nodes:
            nonce = new_nonce()
            self.nonces.setdefault(node, []).append(nonce)  # a late reply to an earlier query still verifies
            config = ConfigRecord({"query": IDENTITY_QUERY, **self.strategy.hospital_config(0), NONCE_KEY: nonce})
            messages.append(Message(RecordDict({self.strategy.records.config: config}), message_type=MessageType.QUERY,
                                    dst_node_id=node))
            self.strategy.audit.message("sent", messages[-1], 0, node=node)
        return messages

    def learn_identity(self, node: int, reply: Message) -> None:
        """Record which hospital ``node`` is; a reply without a usable identity, a claim the hospital cannot
        sign for (``hospital-keys``) or properties the method cannot use are logged and the node skipped."""
        claimed = None if reply.has_error() else reply.content.config_records.get("hospital", {}).get("name")
        self.strategy.audit.message("received", reply, 0, claimed if isinstance(claimed, str) else None, node)
        if reply.has_error() and NO_QUERY_HANDLER in str(reply.error.reason):
            self.learn_flower_clientapp(node)
            return
        if reply.has_error():
            log.warning("node %d did not say which hospital it is: %s", node, cut(reply.error.reason))
            self.unusable[node] = time.time()
            self.refusals[node] = cut(reply.error.reason)
            return
        try:
            hospital = self.identity_of(node, reply)
        except ValueError as error:
            log.warning("node %d gave no usable identity (%s); it is not asked to train", node, error)
            self.unusable[node] = time.time()
            self.refusals[node] = str(error)
            return
        self.refusals.pop(node, None)
        if hospital.name in self.contested:
            self.contested[hospital.name].add(node)
            log.warning("node %d claims to be %s too; the name is contested by nodes %s: none of them trains until "
                        "an operator stops all but one (or sets hospital-keys)", node, hospital.name,
                        sorted(self.contested[hospital.name]))
            self.unusable[node] = time.time()
            return
        for old_node, old in list(self.hospitals.items()):
            if old.name != hospital.name:
                continue
            if not self.strategy.job.hospital_keys:  # names are self-declared: two claimants are both refused
                del self.hospitals[old_node]
                self.contested[hospital.name] = {old_node, node}
                self.unusable.update({old_node: time.time(), node: time.time()})
                log.warning("node %d claims to be %s, which node %d (still connected) is: names are not authenticated "
                            "(no hospital-keys), so neither trains until an operator stops one of them (or sets "
                            "hospital-keys to bind names to the hospitals' keys)", node, hospital.name, old_node)
                return
            log.info("hospital %s is back as node %d (was %d)", hospital.name, node, old_node)  # signed: a restart
            del self.hospitals[old_node]
        self.hospitals[node] = hospital
        self.nonces.pop(node, None)
        log.info("hospital %s on node %d: %d training samples %s", hospital.name, node, hospital.num_examples,
                 hospital.properties or "")

    def learn_flower_clientapp(self, node: int) -> None:
        """``node`` answered the identity query with Flower's "No query function registered": a standard Flower
        ClientApp that trains the model itself. For a method whose hospital step is plain local training
        (``MethodSpec.flower_contract``) it is hospital ``node-<id>``, sent Flower's own messages, its sample count
        bounded by ``screening.max-samples``; for the others it is refused, saying what to add."""
        problem = self.trains_itself_problem("a Flower ClientApp that trains the model itself (it answered the "
                                             f"identity query with Flower's '{NO_QUERY_HANDLER}')", signs=False)
        if problem:
            log.warning("node %d is not asked to train: %s", node, problem)
            self.unusable[node] = time.time()
            self.refusals[node] = problem
            return
        self.refusals.pop(node, None)
        self.hospitals[node] = HospitalInfo(f"node-{node}", self.strategy.job.screening.max_samples,
                                            {TRAINS_ITSELF: True, FLOWER_ONLY: True})
        log.info("node %d is a Flower ClientApp that trains the model itself: hospital node-%d, sent Flower's own "
                 "messages", node, node)

    def trains_itself_problem(self, what: str, signs: bool = True) -> str | None:
        """Why a hospital that trains the model itself under Flower's contract cannot serve this job (None: it can);
        ``signs``: whether it can sign its name (HospitalClientApp can, a ClientApp with nothing of fedmed cannot)."""
        method = self.strategy.job.strategy
        if not method_spec(method).flower_contract:
            return (f"{what}, but {method}'s hospitals run fedmed's {method} step: make its ClientApp a "
                    "HospitalClientApp (from client_app.hospital_mod: Flower's ClientApp with fedmed's hospital mod "
                    "and query handler; docs/own-clientapp.md)")
        unsigned = None if signs else self.strategy.workflow.unsigned_problem(what)
        if unsigned:
            return unsigned
        if self.strategy.job.hospital_keys and not signs:
            return (f"{what}, but hospital-keys is set and it cannot sign its name: make its ClientApp a "
                    "HospitalClientApp (from client_app.hospital_mod), which signs with the node's identity-key")
        return None

    def identity_of(self, node: int, reply: Message) -> HospitalInfo:
        """The hospital an identity reply describes, every field checked (ValueError says which is wrong)."""
        try:
            info = reply.content.config_records["hospital"]
        except KeyError:
            raise ValueError("no 'hospital' ConfigRecord") from None
        name, count = info.get("name"), info.get("num-examples")
        if not isinstance(name, str) or not SAFE_RUN_NAME.match(name) or len(name) > 120:
            raise ValueError(f"name={brief(name)} is not a hospital name (letters, digits, '.', '_', '-')")
        if info.get(f"property.{TRAINS_ITSELF}") is True:  # fedmed's mod in a ClientApp that trains itself
            problem = self.trains_itself_problem(f"{name} trains the model itself (its ClientApp's own train)")
            if problem:
                raise ValueError(problem)
            if count is None:
                self.strategy.workflow.hospital_without_count(name)
            count = self.strategy.job.screening.max_samples if count is None else count
        problem = declared_count_problem(count, self.strategy.job.screening.max_samples)
        if problem:
            raise ValueError(f"{name}: {problem}")
        job = self.strategy.job
        if job.hospital_keys:
            signature = info.get(SIGNATURE_KEY)
            problems = [identity_problem(job.hospital_keys, job.run_name, nonce, name, signature)
                        for nonce in self.nonces.get(node, [])] or ["it was never asked who it is"]
            if all(problems):
                raise ValueError(problems[-1])
        properties = {k.removeprefix("property."): v for k, v in info.items() if k.startswith("property.")}
        if len(properties) > MAX_PROPERTIES or any(len(str(v)) > MAX_PROPERTY_TEXT or len(k) > MAX_PROPERTY_TEXT
                                                   for k, v in properties.items()):
            raise ValueError(f"{name}: {len(properties)} properties, or one longer than {MAX_PROPERTY_TEXT} characters "
                             f"({brief(properties)}); a hospital declares at most {MAX_PROPERTIES} short ones")
        hospital = HospitalInfo(name, count, properties)
        self.strategy.engine.method.check_hospital(hospital)
        return hospital

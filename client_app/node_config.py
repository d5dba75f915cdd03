"""A SuperNode's ``--node-config``: who the hospital is and where its data and state live.

Deployment: ``hospital``, ``data-dir`` and ``state-dir`` name the site's own folders. Simulation:
Flower sets ``partition-id``/``num-partitions`` and the hospital takes that partition of the
job's data set. Unknown keys and wrong types are refused with the key named.

Only a hospital of Flower's simulation engine is *virtual* (it takes the run config's import paths, since one
operator writes the run config and runs every hospital): its node config is exactly the one the engine sets and
its ClientApp runs inside the engine (:func:`inside_simulation_engine`). A SuperNode started by hand with the same
keys, or any node config with more, gets a deployed hospital's rules.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from pydantic import Field, ValidationError, field_validator, model_validator

from common.config import ConfigError, JobConfig, Section, describe_validation_error
from common.trust.argument_gate import DEFAULT_JOB_LIMITS
from common.trust.audit import AuditLog
from common.trust.code_gate import CodeGate, split_list

if TYPE_CHECKING:
    from common.trust.enforcer import Enforcer

#: A deployed hospital works in its warm worker unless its node config says ``warm-worker=false``.
WARM_WORKER_BY_DEFAULT = True

#: The node config Flower's simulation engine gives each virtual node (``flwr/server/superlink/fleet/vce/vce_api.py``).
SIMULATION_ENGINE_FIELDS = frozenset({"partition_id", "num_partitions"})

_EVERY_HOSPITAL_IN_THIS_PROCESS = contextvars.ContextVar("fedmed_every_hospital_in_this_process", default=False)


def inside_simulation_engine() -> bool:
    """Whether this ClientApp runs inside Flower's simulation engine: in one of the Ray actors of its ClientApp
    pool (``flwr.simulation.ray_transport.ray_actor``), or in a process that runs every hospital itself
    (:func:`every_hospital_in_this_process`). A SuperNode started by hand runs its ClientApps in no Ray actor."""
    if _EVERY_HOSPITAL_IN_THIS_PROCESS.get():
        return True
    ray = sys.modules.get("ray")
    if ray is None or "flwr.simulation.ray_transport.ray_actor" not in sys.modules:
        return False
    try:
        return bool(ray.is_initialized()) and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # an older or half-started Ray: not known to be the engine
        return False


@contextlib.contextmanager
def every_hospital_in_this_process():
    """While inside, hospitals answered here are the operator's own virtual hospitals (a test's or benchmark's
    in-process federation, as Flower's simulation engine runs them): nothing a message says can set this."""
    token = _EVERY_HOSPITAL_IN_THIS_PROCESS.set(True)
    try:
        yield
    finally:
        _EVERY_HOSPITAL_IN_THIS_PROCESS.reset(token)


class NodeConfig(Section):
    partition_id: int | None = Field(None, ge=0)
    num_partitions: int | None = Field(None, ge=1)
    hospital: str = ""
    data_dir: str = ""
    state_dir: str = ""
    device: str = Field("", description="This hospital's device: auto, cpu, cuda or cuda:N (empty: the run config's).")
    modalities: str = Field("", description="Brain task: the MRI modalities this hospital has, e.g. 'flair,t1ce'.")
    bit_width: int = Field(0, ge=0, le=32, description="QFedPolyp: this hospital's bit-width (0: from run config).")
    dataset_args: str = Field("", description=(
        "A loader of the job's own (dataset='package.module:loader'): keyword arguments of this hospital's, a JSON "
        "object over the run config's dataset-args (e.g. where its label file is)."))
    identity_key: str = Field("", description="Deployment: the hospital's private key (the one given to "
                                               "flower-supernode --auth-supernode-private-key); it signs the "
                                               "hospital's name for servers that check hospital-keys.")
    peer_keys: str = Field("", description=(
        "Deployment, secure aggregation: a folder of the consortium's registered keys, <hospital>.pub (the files of "
        "the server's hospital-keys, held here so that no server can substitute them). Every other hospital's "
        "public keys and survivor-set signature must verify with them; needs identity-key (it signs its own)."))
    warm_worker: bool = Field(WARM_WORKER_BY_DEFAULT, description=(
        "Deployment: keep torch and the data loaded in a worker process between messages (client_app/worker.py); "
        "false: do all the work in each message's own ClientApp process."))
    policy_file: str = Field("", description=(
        "The hospital's data-protection policy (TOML, or JSON ending in .json; common/trust/policy.py, "
        "docs/privacy.md): "
        "tasks and methods it allows, min-samples, max-rounds-per-run, local-dp. Read at the hospital for every "
        "message; nothing the server sends changes it."))
    models: str = Field("", description=(
        "Networks of the consortium's own this hospital runs, by import path, comma-separated; '*' matches any run "
        "of characters ('monai.networks.nets:DenseNet121, my_site.nets:*'). Built-in networks need no listing; "
        "anything else a message names is refused before it is imported (common/trust/code_gate.py)."))
    datasets: str = Field("", description=(
        "Data loaders of the consortium's own this hospital runs, by import path, comma-separated (as models)."))
    dataset: str = Field("", description=(
        "Pins this hospital's data loader (a format we read or an import path): it reads its data with this loader "
        "and its own dataset-args, whatever the server's run config or a message names."))
    approved_apps: str = Field("", description=(
        "SHA-256 hashes of the Flower app bundles (FABs) this hospital runs, comma-separated (`fedmed app-hash` "
        "prints an app's); fedmed-supernode refuses any other (deploy/fedmed_supernode.py). The policy's 'apps' "
        "adds to them."))
    audit_log: str = Field("", description=(
        "The hospital's audit log (common/trust/audit.py): every message received and sent and every policy decision, "
        "chained by SHA-256. Empty: audit.jsonl in its state folder; 'none': no log."))

    @field_validator("bit_width")
    @classmethod
    def _valid_bit_width(cls, value: int) -> int:
        from common.quantization.codec import check_bit_width

        return value and check_bit_width(value, "bit-width")

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        from common.devices import check_device

        return value and check_device(value)

    @field_validator("hospital")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        from common.config import SAFE_RUN_NAME

        if value and (not SAFE_RUN_NAME.match(value) or ".." in value or len(value) > 120):
            raise ValueError(f"{value[:120]!r} is not a hospital name: letters, digits, '.', '_', '-' (it names the "
                             "hospital's state folder, which must stay inside state-dir)")
        return value

    @model_validator(mode="after")
    def _has_data(self) -> "NodeConfig":
        if not self.data_dir and self.partition_id is None:
            raise ValueError("a hospital needs data-dir (deployment) or partition-id (simulation)")
        if self.partition_id is None and not self.hospital:
            raise ValueError("a deployed hospital (data-dir, no partition-id) needs its name: hospital='...'")
        if (self.partition_id is not None and self.num_partitions is not None
                and self.partition_id >= self.num_partitions):
            raise ValueError(f"partition-id {self.partition_id} is not below num-partitions {self.num_partitions}")
        return self

    @property
    def virtual(self) -> bool:
        """A virtual hospital of Flower's simulation engine: exactly the node config the engine sets (nothing of its
        own: no name, folders, lists or policy), answered inside the engine, so the run config's author (the
        operator of the one machine) decides its data and code."""
        return self.model_fields_set == SIMULATION_ENGINE_FIELDS and inside_simulation_engine()

    def pinned_keys(self) -> dict[str, str]:
        """Run-config keys this hospital sets itself, over whatever a message says: its data loader, when pinned
        (its dataset-args are then its own, given to the loader on their own)."""
        return {"dataset": self.dataset, "dataset-args": ""} if self.dataset else {}

    @property
    def name(self) -> str:
        return self.hospital or f"hospital-{self.partition_id:02d}"

    def state_root(self, run_state_dir: str) -> Path:
        """The hospital's own state folder (its runs' folders, its privacy ledger, its audit log, its secure-
        aggregation memory): ``state-dir``, or ``<run config state-dir>/<hospital>`` inside Flower's simulation
        engine. A hospital elsewhere without ``state-dir`` keeps it in ``state/<hospital>`` of its working folder:
        the run config is the server's, and a server that chose where a hospital keeps its ledger could start it
        afresh."""
        if self.state_dir:
            return Path(self.state_dir)
        return Path((run_state_dir or "state") if inside_simulation_engine() else "state") / self.name

    def state_folder(self, cfg: JobConfig, run_name: str) -> Path:
        return self.state_root(cfg.state_dir) / run_name

    def audit_path(self, run_state_dir: str) -> Path | None:
        """Where the hospital's audit log is (None: 'none')."""
        if self.audit_log.strip().lower() == "none":
            return None
        return Path(self.audit_log) if self.audit_log else self.state_root(run_state_dir) / "audit.jsonl"

    def properties(self) -> dict[str, Any]:
        """What the hospital tells the server about itself besides its name and size."""
        props: dict[str, Any] = {}
        if self.modalities:
            props["modalities"] = self.modalities
        if self.bit_width:
            props["bit-width"] = self.bit_width
        return props


#: node configs as validated: their (key, type, value)s -> the NodeConfig (a hospital has one; a process a few)
_VALIDATED: dict[tuple, NodeConfig] = {}
_VALIDATED_KEPT = 64


def load_node_config(raw: Mapping[str, Any]) -> NodeConfig:
    """The node config, validated once per distinct content (a hospital reads it at every message, a secure round
    at each of its stages); the folders and files it names are checked at every call. Callers must not change the
    NodeConfig returned."""
    try:
        key: tuple | None = tuple(sorted((str(k), type(v).__name__, v) for k, v in raw.items()))
        node = _VALIDATED.get(key)
    except TypeError:  # a value that is no Flower node-config scalar: validation names it
        key, node = None, None
    if node is None:
        try:
            node = NodeConfig.model_validate(dict(raw))
        except ValidationError as error:
            where = raw.get("hospital") or (f"hospital-{raw['partition-id']}" if "partition-id" in raw else "this node")
            raise ConfigError(describe_validation_error(error, what=f"node config of {where}")) from None
        if key is not None:
            while len(_VALIDATED) >= _VALIDATED_KEPT:
                del _VALIDATED[next(iter(_VALIDATED))]
            _VALIDATED[key] = node
    if node.identity_key and not Path(node.identity_key).is_file():
        raise ConfigError(f"node config of {node.name} key 'identity-key': {node.identity_key!r} is not a file")
    if node.peer_keys and (not Path(node.peer_keys).is_dir() or not node.identity_key):
        raise ConfigError(f"node config of {node.name} key 'peer-keys': {node.peer_keys!r} is not a folder of "
                          "<hospital>.pub files, or identity-key is unset (the others check this hospital's "
                          "signatures as it checks theirs)")
    if node.data_dir and not Path(node.data_dir).exists():
        raise ConfigError(f"node config of {node.name} key 'data-dir': {node.data_dir!r} does not exist")
    if node.policy_file and not Path(node.policy_file).is_file():
        raise ConfigError(f"node config of {node.name} key 'policy-file': {node.policy_file!r} is not a file (the "
                          "hospital answers nothing until its policy can be read)")
    return node


def hospital_audit(node: NodeConfig, run_state_dir: str) -> AuditLog | None:
    """The hospital's audit log (node config ``audit-log``; default: audit.jsonl in its state folder)."""
    path = node.audit_path(run_state_dir)
    return AuditLog(path, f"hospital:{node.name}") if path is not None else None


def code_gate(node: NodeConfig, enforcer: Enforcer | None) -> CodeGate:
    """The code this hospital runs by name: built in, and what its node config and policy list; the size of the
    networks it builds (its limits' model-parameters)."""
    policy = enforcer.policy if enforcer is not None else None
    models = split_list(node.models) + tuple(policy.models if policy else ())
    datasets = split_list(node.datasets) + tuple(policy.datasets if policy else ())
    limits = policy.limits if policy else DEFAULT_JOB_LIMITS
    return CodeGate(models, datasets, trust_run_config=node.virtual,
                    source="node config and policy" if policy else "node config",
                    max_parameters=0 if node.virtual else limits["model-parameters"])

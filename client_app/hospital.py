"""A hospital's answers to the server's messages (identity, training, evaluation) on its own data.

Runs wherever the hospital's work happens: in the ClientApp process itself (simulation, where
Flower keeps that process alive between messages) or in the hospital's warm worker (deployment,
``client_app/worker.py``). Loaded data sets are kept while the process lives.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Mapping

from common.config import JobConfig, hospital_job_config
from common.data.image_files import cache_dir
from common.methods.base import CROSS_SITE_KEY, HospitalMethod, Payload
from common.methods.registry import hospital_class
from common.methods.site import HospitalStateStore, Site, build_site
from common.trust.argument_gate import DEFAULT_JOB_LIMITS, argument_problems, inside
from common.trust.enforcer import Enforcer, enforcer_for
from common.trust.identity import NONCE_KEY, SIGNATURE_KEY, sign_identity
from common.trust.policy import PolicyRefusal
from common.trust.sandbox import closed

from .node_config import NodeConfig, code_gate, hospital_audit, load_node_config

_SITES: "OrderedDict[tuple, Site]" = OrderedDict()  # loaded data, reused while this process lives
_MAX_SITES = 32


def hospital_site(cfg: JobConfig, node: NodeConfig, run_name: str = "") -> Site:
    """This hospital's site; its data is loaded once per process, its state folder is the run's."""
    key = (cfg.model_dump_json(exclude={"run_name", "resume_from", "num_server_rounds"}), node.model_dump_json())
    if key not in _SITES:
        _SITES[key] = build_site(cfg, node.name, partition_id=node.partition_id, num_partitions=node.num_partitions,
                                 data_dir=node.data_dir or None, device=node.device or cfg.device,
                                 properties=node.properties(), node_arguments=node.dataset_args)
        while len(_SITES) > _MAX_SITES:
            _SITES.popitem(last=False)
    _SITES.move_to_end(key)
    site = _SITES[key]
    site.state = HospitalStateStore(node.state_folder(cfg, run_name) if run_name else None)
    return site


def hospital_method(cfg: JobConfig, node: NodeConfig, payload: Payload) -> HospitalMethod:
    """The hospital half of the method the message names, on this node's site (its state folder is the
    run's, named in the payload); how it trains comes from the message's server-set keys."""
    run_name = str(payload.config.get("run-name", ""))
    return hospital_class(cfg.strategy)(cfg, hospital_site(cfg, node, run_name))


def hospital_enforcer(node: NodeConfig, cfg: JobConfig) -> Enforcer | None:
    """The hospital's own policy (node config ``policy-file``), read afresh for every message; None without one.
    Its decisions, and its ledger's entries, go to the hospital's audit log."""
    if not node.policy_file:
        return None
    return enforcer_for(node.policy_file, node.state_root(cfg.state_dir), hospital_audit(node, cfg.state_dir),
                        peers_checked=bool(node.peer_keys))


def answer(kind: str, payload: Payload, run_config: Mapping[str, Any], node_config: Mapping[str, Any]) -> Payload:
    """The reply to one message: ``query`` (identity in config), ``train`` or ``evaluate`` (metrics), within the
    hospital's policy (``policy-file``) and the code it approved (``common/trust/code_gate.py``): a message it does not
    allow raises ``PolicyRefusal`` with the reason, before anything the message names is imported."""
    node = load_node_config(node_config)
    cfg = hospital_job_config(run_config, payload.config, node.pinned_keys())
    enforcer = hospital_enforcer(node, cfg)
    run, rnd = str(payload.config.get("run-name", "")), int(payload.config.get("server-round", 0))
    where = {"run": run, "round": rnd, "method": cfg.strategy, "kind": kind}
    gate = code_gate(node, enforcer)
    # a deployed hospital is closed (common/trust/sandbox.py) before the gate imports the first approved module
    audit = node.audit_path(cfg.state_dir)  # its folders, its audit log's and its decoded-image cache's
    writable = (*own_folders(node, cfg, enforcer), str(audit.parent) if audit else "", str(cache_dir()))
    with gate.enforced(), (contextlib.nullcontext() if node.virtual else closed(writable)):
        refused = gate.problems(cfg) + ([] if node.virtual else argument_problems_at(node, cfg, enforcer))
        if refused:
            if enforcer is not None:
                raise enforcer.refuse("; ".join(refused), **where)
            raise PolicyRefusal(f"refused: {'; '.join(refused)}")
        return answer_within(kind, payload, cfg, node, enforcer, where)


def own_folders(node: NodeConfig, cfg: JobConfig, enforcer: Enforcer | None) -> tuple[str, ...]:
    """A deployed hospital's own folders: its state folder (first), data-dir and its policy's argument-folders."""
    policy = enforcer.policy if enforcer is not None else None
    return (str(node.state_root(cfg.state_dir)), node.data_dir, *(policy.argument_folders if policy else ()))


def argument_problems_at(node: NodeConfig, cfg: JobConfig, enforcer: Enforcer | None) -> list[str]:
    """Why the server's arguments would reach outside this deployed hospital (common/trust/argument_gate.py): its own
    folders (:func:`own_folders`); its limits its policy's or the defaults."""
    policy = enforcer.policy if enforcer is not None else None
    folders = own_folders(node, cfg, enforcer)
    problems = argument_problems(cfg, folders, bool(policy and policy.allow_pretrained),
                                 policy.limits if policy else DEFAULT_JOB_LIMITS)
    if not node.data_dir and cfg.data_dir and not inside(cfg.data_dir, folders):  # its data: the node config's
        problems.append("data-dir names a folder outside this hospital's own folders, so it was not read")
    return problems


def answer_within(kind: str, payload: Payload, cfg: JobConfig, node: NodeConfig, enforcer: Enforcer | None,
                  where: dict[str, Any]) -> Payload:
    """:func:`answer` once the message passed the hospital's gate."""
    rnd = where["round"]
    if kind == "query":
        info = hospital_method(cfg, node, payload).info()
        identity = {"name": info.name, "num-examples": info.num_examples,
                    **{f"property.{k}": v for k, v in info.properties.items()}}
        if node.identity_key and NONCE_KEY in payload.config:  # the server checks who we are
            identity[SIGNATURE_KEY] = sign_identity(node.identity_key, str(payload.config.get("run-name", "")),
                                                    str(payload.config[NONCE_KEY]), info.name)
        return Payload(config=identity)
    method = hospital_method(cfg, node, payload)
    if kind == "train":
        rnd = int(payload.config["server-round"])
        reply = (method.timed_train(rnd, payload) if enforcer is None
                 else enforcer.train(method, rnd, payload, where["run"], where))
        weight_key = payload.config.get("weighted-by-key")
        if isinstance(weight_key, str) and weight_key and weight_key != "num-examples":  # a strategy's weighted_by_key
            reply.metrics[weight_key] = reply.metrics["num-examples"]
        return reply
    if kind == "evaluate":
        if enforcer is not None:
            enforcer.check_job(kind, method.cfg, where)
        if payload.config.get(CROSS_SITE_KEY):  # every model this hospital scores, as '<model>.<metric>'
            metrics = {f"{model}.{key}": value for model, scores in method.cross_site(rnd, payload).items()
                       for key, value in scores.items()}
        else:
            metrics = method.evaluate(rnd, payload)
        return Payload(metrics=metrics if enforcer is None else enforcer.evaluate_metrics(metrics, method.site, where))
    raise ValueError(f"unknown message kind {kind!r}")

"""A hospital's rules in words: what its node config and policy let the server make it do, read as the hospital
reads them for every message (``fedmed policy check`` prints them, ``fedmed console`` shows them)."""

from __future__ import annotations

from pathlib import Path

from client_app.node_config import SIMULATION_ENGINE_FIELDS, code_gate, hospital_audit, load_node_config
from common.config import ConfigError, server_settable_keys
from common.trust.argument_gate import DEFAULT_JOB_LIMITS
from common.trust.code_gate import wide_patterns
from common.trust.enforcer import enforcer_for


def policy_rules(node_config: str = "", policy_file: Path | str | None = None) -> list[tuple[str, str]]:
    """What a site's policy and node config allow, as (what, value) rows, read as the hospital reads them for every
    message: what ``fedmed policy check`` prints and ``fedmed console`` shows. The first row names the hospital and
    its policy file. ConfigError (or ValueError, OSError) when they cannot be read."""
    try:
        raw = {"hospital": "site", "data-dir": "."}
        if node_config:  # Flower's parser (its import is most of what reading a policy alone costs)
            from flwr.common.config import parse_config_args

            raw = parse_config_args([node_config])
    except Exception as error:  # Flower's parser raises click's exception, with its own message
        raise ConfigError(f"--node-config {node_config!r}: {getattr(error, 'message', error)}") from None
    if policy_file:
        raw = {**raw, "policy-file": str(policy_file)}
    node = load_node_config(raw)
    enforcer = None
    if node.policy_file:
        enforcer = enforcer_for(node.policy_file, None, hospital_audit(node, "state"))
    policy = enforcer.policy if enforcer is not None else None
    gate = code_gate(node, enforcer)
    rows = [("hospital", f"{node.name}" + (f", policy {node.policy_file} (sha256 {enforcer.policy_sha256})"
                                           if enforcer else ", no policy file"))]
    if policy is not None:
        rows += [("tasks", ", ".join(policy.tasks) or "any"), ("methods", ", ".join(policy.methods) or "any"),
                 ("min-samples", str(policy.min_samples)), ("release-metrics", policy.metrics_released),
                 ("max-rounds-per-run", str(policy.max_rounds_per_run or "no limit")),
                 ("max-trainings-per-day", str(policy.max_trainings_per_day or "no limit")),
                 ("local-dp", ", ".join(f"{k}={v:g}" for k, v in policy.local_dp.model_dump(by_alias=True).items())
                  if policy.local_dp else "none"),
                 ("secure aggregation", ("required" if policy.require_secure_aggregation else "not required")
                  + f", min-hospitals-per-sum {policy.min_hospitals_per_sum}, min-threshold-fraction "
                  f"{policy.min_threshold_fraction:g}, min-update-norm-bound {policy.min_update_norm_bound:g}"),
                 ("peers it accepts", ", ".join(f"{name} {fingerprint}" for name, fingerprint in
                                                sorted(policy.peers.items()))
                  or "none pinned (every key in its peer-keys folder)")]
    apps = sorted(set(filter(None, node.approved_apps.replace(",", " ").split())) | set(policy.apps if policy else []))
    engine_only = node.model_fields_set == SIMULATION_ENGINE_FIELDS
    limits = policy.limits if policy is not None else DEFAULT_JOB_LIMITS
    rows += [("apps it runs", ", ".join(apps) if apps else "none (fedmed-supernode refuses to start without "
              "approved-apps or the policy's apps)"),
             ("networks it runs", "built in" + (" (inside Flower's simulation engine, where one operator runs every "
                                                "hospital, also the run config's)" if engine_only else "")
              + "".join(f", {m}" for m in gate.models)),
             ("data loaders it runs", "built in" + "".join(f", {d}" for d in gate.datasets)),
             ("pretrained weights", "from its own cache (allow-pretrained)" if policy is not None
              and policy.allow_pretrained else "refused"),
             ("paths in model-args, dataset-args, encoder-weights", "only inside data-dir, state-dir"
              + "".join(f", {folder}" for folder in (policy.argument_folders if policy is not None else ()))),
             ("job limits", ", ".join(f"{key} <= {most}" for key, most in sorted(limits.items()))),
             ("set by the hospital only", f"state-dir{', ' + ', '.join(node.pinned_keys()) if node.dataset else ''}"),
             ("the server may set", ", ".join(k for k in server_settable_keys() if k not in node.pinned_keys()))]
    for pattern in wide_patterns(gate.models + gate.datasets):
        rows.append(("WARNING", f"{pattern!r} approves every module it matches, helpers included: list the modules "
                                "(or the networks and loaders) one by one"))
    return rows

"""Flower's legacy-API strategy names (``flwr.server.strategy``: ``fit``, ``Parameters``, ``client_manager``) and what
replaces each in Flower's Message API (``flwr.serverapp.strategy``), which our strategies are built on: a legacy
example's argument or call is refused naming its equivalent, not with a bare ``TypeError``/``AttributeError``."""

from __future__ import annotations

_CONFIG = "start(train_config=ConfigRecord({...})) (or a configure_train override for a per-round config)"

#: a legacy strategy's constructor argument -> its Message-API equivalent
ARGUMENTS = {
    "fraction_fit": "fraction_train",
    "min_fit_clients": "min_train_nodes",
    "min_evaluate_clients": "min_evaluate_nodes",
    "min_available_clients": "min_available_nodes",
    "fit_metrics_aggregation_fn": "train_metrics_aggr_fn(records, weighting_key) -> MetricRecord",
    "evaluate_metrics_aggregation_fn": "evaluate_metrics_aggr_fn(records, weighting_key) -> MetricRecord",
    "on_fit_config_fn": _CONFIG,
    "on_evaluate_config_fn": "start(evaluate_config=ConfigRecord({...})) (or a configure_evaluate override)",
    "initial_parameters": "start(initial_arrays=ArrayRecord(model.state_dict()))",
    "evaluate_fn": "start(evaluate_fn=fn(server_round, arrays) -> MetricRecord | None)",
    "accept_failures": "nothing: a failed or refused reply is logged with its reason and the round goes on",
    "inplace": "nothing: the aggregation is fedmed's (tensor by tensor, in place where it can)",
}

#: a legacy strategy's method (what Flower's legacy ServerApp and start_server call) -> its Message-API equivalent
METHODS = {
    "initialize_parameters": "start(initial_arrays=ArrayRecord(...))",
    "configure_fit": "configure_train(server_round, arrays, config, grid)",
    "aggregate_fit": "aggregate_train(server_round, replies)",
    "evaluate": "start(evaluate_fn=...)",
}


def legacy_argument(strategy: str, name: str) -> str | None:
    """The refusal of a legacy argument ``name`` (None: not one)."""
    if name not in ARGUMENTS:
        return None
    return (f"{strategy}() got Flower's legacy-API argument {name!r}: {strategy} is a Message-API strategy "
            f"(flwr.serverapp.strategy, driven by a ServerApp's @app.main() and strategy.start(grid, ...)); "
            f"use {ARGUMENTS[name]}")


def legacy_method(strategy: str, name: str) -> str | None:
    """The refusal of a legacy method ``name`` (None: not one)."""
    if name not in METHODS:
        return None
    return (f"{strategy} is a Message-API strategy and has no legacy {name}(): Flower's legacy ServerApp("
            f"config=..., strategy=...) and start_server drive flwr.server.strategy strategies; write @app.main() "
            f"with strategy.start(grid, ...) and use {METHODS[name]} (docs/own-serverapp.md)")

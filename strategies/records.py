"""Small helpers between our round records and Flower's records (the way ``FedAvg`` has ``strategy_utils``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, MetricRecord

from common.engine.wire import array_view
from common.payload import NamedArrays


def into_arrayrecord(arrays: NamedArrays) -> ArrayRecord:
    """``arrays`` as an ArrayRecord, each entry of ``arrays`` replaced, as soon as it is copied into the record, by a
    read-only view of that copy (the same values): a large model is never held twice over, and ``arrays`` (the
    method's global model) then shares the record's memory."""
    record = ArrayRecord()
    for name in list(arrays):
        record[name] = Array(np.require(arrays[name], requirements="C"))
        arrays[name] = array_view(record[name])
    return record


def arrays_of(record: ArrayRecord, copy: bool = True) -> NamedArrays:
    """The record's arrays, copies of their own, or without ``copy`` read-only views into the record's bytes (the
    method's global model then shares its memory with the ArrayRecord Flower's loop holds)."""
    return {name: array.numpy() if copy else array_view(array) for name, array in record.items()}


def flat_metrics(value: Any, prefix: str = "") -> dict[str, int | float | list]:
    """A round record's numbers and lists of numbers under dotted keys; text and empty lists are left out
    (they stay in ``metrics.jsonl``). A nested list (an influence matrix) becomes one flat list."""
    flat: dict[str, int | float | list] = {}
    if isinstance(value, dict):
        for key, item in value.items():
            flat.update(flat_metrics(item, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(value, bool):
        flat[prefix] = int(value)
    elif isinstance(value, (int, float, np.integer, np.floating)):
        flat[prefix] = value.item() if isinstance(value, np.generic) else value
    elif isinstance(value, (list, tuple, np.ndarray)):
        try:
            array = np.asarray(value)
        except ValueError:  # ragged
            return flat
        if array.size and array.dtype.kind in "iub":
            flat[prefix] = [int(v) for v in array.ravel()]
        elif array.size and array.dtype.kind == "f":
            flat[prefix] = [float(v) for v in array.ravel()]
    return flat


def round_metricrecord(record: dict[str, Any]) -> MetricRecord:
    """One round as a MetricRecord: the hospitals' weighted training metrics under the names their ClientApps sent
    (``train_loss``, as Flower's FedAvg aggregates them, the weighting key left out) and again as ``train.*``; beside
    them, fedmed's own, prefixed: the server's test metrics (``test.*``), the method's state (``method.*``, e.g.
    FedProIn's influence matrix per hospital), bytes each way in all and per hospital, each hospital's update norm
    (``update-norm.*``), and how many hospitals were aggregated, refused or missing (where a hospital's metric has
    the name of one of these, ours is the one kept)."""
    flat = {name: value for name, value in record.get("train", {}).items() if isinstance(value, (int, float))}
    flat.update(flat_metrics({key: record[key] for key in ("train", "test", "evaluate", "method", "update-norm")
                              if key in record}))
    flat.update({"bytes-up": int(record["bytes_up"]), "bytes-down": int(record["bytes_down"]),
                 "hospitals-aggregated": len(record["aggregated"]), "hospitals-refused": len(record["refused"]),
                 "hospitals-missing": len(record["missing"])})
    for hospital, traffic in record["traffic"].items():
        flat[f"bytes-up.{hospital}"] = int(traffic["up"])
        flat[f"bytes-down.{hospital}"] = int(traffic["down"])
    return MetricRecord(flat)


def numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics dict, as a MetricRecord takes them."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and v == v and abs(v) != float("inf")}

"""A round's record, built in one place for every round (plain, secure, or one fedmed's screening never saw), and
the one rule that weighs a hospital's accepted reply: its screened share, what the aggregate uses."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from common.engine.screening import brief, capped_shares, ratio_capped_weights, relative_norms
from common.methods.base import HospitalInfo, HospitalUpdate

log = logging.getLogger("fedmed")


def screened_shares(updates: list[HospitalUpdate], screening: Any) -> dict[str, str]:
    """Set each accepted update's share of the aggregate (``update.share``, so ``update.weight``): its sample count
    cut at ``screening.sample-ratio-limit`` x the others' median, the shares capped at ``max-hospital-weight``.
    Returns the hospitals whose count was cut, with why."""
    if not updates:
        return {}
    counts = [float(u.num_examples) for u in updates]
    weights, cut_index = ratio_capped_weights(counts, screening.sample_ratio_limit)
    cuts = {updates[i].hospital.name: f"weighs {weights[i]:.6g} samples, not the {counts[i]:.6g} it reported: "
                                      f"screening.sample-ratio-limit={screening.sample_ratio_limit:g} x the others' "
                                      "median" for i in cut_index}
    for update, share in zip(updates, capped_shares(weights, screening.max_hospital_weight)):
        update.share = float(share)
    return cuts


def weighted_mean_metrics(items: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Per-key mean weighted by the first element (sample counts); keys missing somewhere are skipped."""
    if not items:
        return {}
    keys = set.intersection(*(set(m) for _, m in items))
    total = sum(w for w, _ in items) or 1.0
    return {k: float(sum(w * m[k] for w, m in items) / total) for k in sorted(keys)
            if all(isinstance(m[k], (int, float)) and math.isfinite(m[k]) for _, m in items)}


def round_record(rnd: int, chosen: list[HospitalInfo], accepted: list[HospitalUpdate], *, started: float,
                 traffic: dict[str, dict[str, int]], missing: list[str] | None = None,
                 refused: dict[str, str] | None = None, method: dict[str, Any] | None = None,
                 skipped: str | None = None, update_norms: dict[str, float] | None = None,
                 weight_cuts: dict[str, str] | None = None, aggregated: list[str] | None = None,
                 **extra: Any) -> dict[str, Any]:
    """Round ``rnd``'s record: who was chosen, aggregated, missing and refused (why), the method's record or why
    the round was skipped, each hospital's bytes, its numbers and device, and the train metrics weighted by each
    accepted update's ``weight`` (its screened share: :func:`screened_shares`); ``extra`` adds entries (a secure
    round's protocol summary). ``aggregated`` names hospitals aggregated without an update fedmed saw."""
    update_norms = update_norms or {}
    record: dict[str, Any] = {"round": rnd, "chosen": [h.name for h in chosen],
                              "aggregated": aggregated if aggregated is not None else [u.hospital.name
                                                                                        for u in accepted],
                              "missing": list(missing or []), "refused": dict(refused or {}),
                              "update-norm": dict(update_norms), "update-norm-vs-median": relative_norms(update_norms)}
    if weight_cuts:
        record["weight-cut"] = dict(weight_cuts)
    if skipped is not None:
        record["skipped"] = skipped
        log.warning("round %d: %s", rnd, skipped)
    elif method is not None:
        record["method"] = method
    record["traffic"] = traffic
    record["bytes_down"] = int(sum(t["down"] for t in traffic.values()))
    record["bytes_up"] = int(sum(t["up"] for t in traffic.values()))
    record["hospital_metrics"] = {u.hospital.name: {k: v for k, v in u.payload.metrics.items()  # numbers only:
                                                    if not isinstance(v, (list, tuple))}  # lists go to "method"
                                  for u in accepted}
    record["devices"] = {u.hospital.name: brief(u.payload.config.get("device", "?"), 80).strip("'") for u in accepted}
    record["train"] = weighted_mean_metrics([(u.weight, dict(u.payload.metrics)) for u in accepted])
    record["train"].pop("num-examples", None)
    record.update(extra)
    record["seconds"] = round(time.time() - started, 3) if started else 0.0
    return record

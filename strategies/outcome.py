"""Why a run aggregated nobody, from its rounds' records: each round's reason (refusals, hospitals lost in the
secure-aggregation protocol, missing ones, a skip), and what to change where the cause is known.

Flower's ``Strategy.start`` returns a Result whatever the rounds did; ours does too, and says why (logged, on the
strategy as ``nothing_aggregated``, and in the server's audit log), so a user's own ServerApp decides what a run that
trained nobody means. fedmed's ServerApp fails such a run (``NoHospitalAggregated``).
"""

from __future__ import annotations

from typing import Any

#: what the hospitals' replay memory says when a secure-aggregation round is run again (common/trust/secure_aggregation)
REPLAY_REFUSALS = ("already took part in secure aggregation", "already helped unmask a sum")
REPLAY_ADVICE = ("the hospitals' replay memory refused a secure-aggregation round they took part in before (their "
                 "secure-aggregation.jsonl in their state folder): each hospital takes part in one protocol run per "
                 "run name and round, and helps unmask one sum per model it trained from. To run it again, change "
                 "run-name and seed (the same seed starts from the same model), or give the hospitals fresh state "
                 "folders (state-dir) if the earlier run is to be forgotten")


def round_reason(record: dict[str, Any]) -> str:
    """Why round ``record`` aggregated nobody, from its record."""
    parts = [f"{name} refused ({why})" for name, why in record.get("refused", {}).items()]
    lost = record.get("secure-aggregation", {}).get("lost", {})
    parts += [f"{name} lost in secure aggregation ({why})" for name, why in lost.items()
              if name not in record.get("refused", {})]
    if record.get("missing"):
        parts.append(f"missing {record['missing']}")
    if record.get("skipped"):
        parts.append(record["skipped"])
    return ", ".join(parts) or "no hospital chosen"


def why_nothing_aggregated(records: list[dict[str, Any]], first: int, last: int) -> str:
    """The reason a run whose rounds ``first..last`` (``records``) aggregated nobody gives: the last three rounds'
    reasons, and what to change where the cause is a known one."""
    reasons = [f"round {record['round']}: {round_reason(record)}" for record in records[-3:]]
    text = f"no round of {first}..{last} aggregated any hospital: " + "; ".join(reasons)
    if any(sign in text for sign in REPLAY_REFUSALS):
        text += f". {REPLAY_ADVICE}"
    return text

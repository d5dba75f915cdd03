"""Federated runs in one process, without Flower: for benchmarks, GPU machines without Flower, and tests.

The same :class:`~common.engine.round_engine.RoundEngine` and the same hospital halves as a Flower run; a
hospital's method object is created afresh for every round, as in a Flower deployment, so all
state a hospital keeps must go through its state store.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

from common.config import JobConfig
from common.engine.round_engine import RoundEngine, RoundReply
from common.methods.base import Payload
from common.methods.registry import hospital_class
from common.methods.site import Site, build_site

log = logging.getLogger("fedmed")


def simulated_hospital_name(partition_id: int) -> str:
    return f"hospital-{partition_id:02d}"


def simulated_sites(cfg: JobConfig, num_hospitals: int, state_root: str | Path | None = None,
                    device: str = "", properties: list[dict[str, Any]] | None = None) -> list[Site]:
    """Partitions 0..num_hospitals-1 of the job's data set, as in a Flower simulation."""
    sites = []
    for pid in range(num_hospitals):
        name = simulated_hospital_name(pid)
        state_dir = Path(state_root) / name if state_root else None
        sites.append(build_site(cfg, name, partition_id=pid, num_partitions=num_hospitals, state_dir=state_dir,
                                device=device or cfg.device, properties=(properties or [{}] * num_hospitals)[pid]))
    return sites


def run_rounds(cfg: JobConfig, sites: list[Site], engine: RoundEngine | None = None,
               on_round_end: Callable[[RoundEngine, dict], None] | None = None,
               last_round: int | None = None,
               on_reply: Callable[[int, str, Payload, Payload], None] | None = None) -> RoundEngine:
    """Run rounds ``engine.next_round .. last_round`` (default: the config's last). ``on_reply(round, hospital,
    downlink, reply)`` sees every hospital's reply before the server does (benchmarks study what hospitals send)."""
    engine = engine or RoundEngine(cfg)
    by_name = {site.name: site for site in sites}
    infos = [hospital_class(cfg.strategy)(cfg, site).info() for site in sites]
    for rnd in range(engine.next_round, (last_round or cfg.num_server_rounds) + 1):
        started = time.time()
        chosen = engine.select(rnd, infos)
        replies, bytes_down = [], {}
        for info in chosen:
            payload = engine.downlink(rnd, info)
            bytes_down[info.name] = payload.nbytes()
            try:
                reply = hospital_class(cfg.strategy)(cfg, by_name[info.name]).timed_train(rnd, payload)
            except Exception as error:  # a failing hospital is reported, the round goes on
                log.exception("hospital %s failed in round %d", info.name, rnd)
                replies.append(RoundReply(info, None, f"{type(error).__name__}: {error}"))
                continue
            if on_reply is not None:
                on_reply(rnd, info.name, payload, reply)
            replies.append(RoundReply(info, reply, None, reply.nbytes()))
        record = engine.complete_round(rnd, chosen, replies, started, bytes_down)
        if on_round_end is not None:
            on_round_end(engine, record)
    return engine


def evaluate_hospitals(cfg: JobConfig, engine: RoundEngine, sites: list[Site]) -> dict[str, dict[str, float]]:
    """Each hospital's metrics for the model it holds after the last round (what it would receive
    next, combined with what it keeps), on its validation data: the final scores of personalised methods."""
    rnd = engine.next_round
    scores = {}
    for site in sites:
        method = hospital_class(cfg.strategy)(cfg, site)
        scores[site.name] = method.evaluate(rnd, engine.downlink(rnd, method.info()))
    return scores

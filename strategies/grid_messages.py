"""Messages to and from the hospitals over Flower's grid: pushed a window at a time, replies handed out as they
arrive, and how many may be pending at once in a deployment and in Flower's simulation engine."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

from flwr.app import Message
from flwr.serverapp import Grid
from flwr.superlink.grid import InMemoryGrid

from common.config import JobConfig

log = logging.getLogger("fedmed")


def replies_as_they_arrive(grid: Grid, pending: set[str], timeout: float, enough: int | None = None,
                           queued: list[Message] | None = None, in_flight: int = 0,
                           pull_at_once: int = 0) -> Iterator[Message]:
    """Replies to the ``pending`` message ids, each handed out as soon as it is pulled, until all (or ``enough``)
    are in or ``timeout`` passes.

    Flower's ``Grid.send_and_receive`` sleeps 3 s between polls, which adds 1.5 s on average to
    every round trip; here the first polls come every 0.25 s, slowing to 2 s for long trainings.
    ``queued`` messages are pushed as room frees up, at most ``in_flight`` pending at once (0: all
    at once), see :func:`messages_in_flight`. ``pending`` loses the ids that were answered and
    ``queued`` the messages that were pushed. ``pull_at_once`` (0: all): most replies asked of the SuperLink in
    one pull, each of which Flower holds whole in memory until the pull returns.
    """
    queued = queued if queued is not None else []
    handed_out = 0
    started = time.time()
    while (pending or queued) and time.time() - started < timeout and (enough is None or handed_out < enough):
        room = len(queued) if in_flight <= 0 else in_flight - len(pending)
        if queued and room > 0:
            pending |= {mid for mid in grid.push_messages(queued[:room]) if mid}
            del queued[:room]
        if pull_at_once > 0:
            asked = sorted(pending)
            pulls = [asked[first:first + pull_at_once] for first in range(0, len(asked), pull_at_once)]
        else:
            pulls = [set(pending)] if pending else []
        for ids in pulls:
            arrived = list(grid.pull_messages(ids))
            pending -= {m.metadata.reply_to_message_id for m in arrived}
            while arrived:
                message = arrived.pop(0)
                handed_out += 1
                yield message
                del message  # not held while the next one is pulled
        if queued and len(pending) < in_flight:
            continue  # room for more at once
        if pending:
            time.sleep(0.1 if queued else min(2.0, 0.25 + (time.time() - started) / 60))


def collect_replies(grid: Grid, pending: set[str], timeout: float, enough: int | None = None,
                    queued: list[Message] | None = None, in_flight: int = 0) -> list[Message]:
    """:func:`replies_as_they_arrive`, all of them at once."""
    return list(replies_as_they_arrive(grid, pending, timeout, enough, queued, in_flight))


def retry_unavailable_objects_sooner() -> None:
    """Ask again after 0.05 s (at most 0.5 s between tries) for an object of a reply that the SuperLink does not
    hold yet, instead of Flower's 1 s, 2 s, 4 s...: a reply is listed as soon as the hospital starts pushing it,
    so the first pull of each round's replies usually finds some of its objects still on their way."""
    from flwr.supercore.inflatable import inflatable_utils

    inflatable_utils.pull_objects.__kwdefaults__.update(initial_backoff=0.05, backoff_cap=0.5)


def send_and_receive(grid: Grid, messages: list[Message], timeout: float, in_flight: int = 0) -> list[Message]:
    """Push messages (at most ``in_flight`` pending at once; 0: all) and collect replies until all are in or
    ``timeout`` passes. ``messages`` is emptied as they are sent, so that a large model's copies in them are
    freed while the replies come in."""
    replies = collect_replies(grid, set(), timeout, queued=messages, in_flight=in_flight)
    warn_unsent(messages, timeout, in_flight)
    return replies


def warn_unsent(messages: list[Message], timeout: float, in_flight: int) -> None:
    """Say so when ``messages`` (what a round could not push) is not empty."""
    if messages:
        log.warning("%d message(s) were not sent within %.0f s (messages-in-flight=%d)", len(messages), timeout,
                    in_flight)


#: Messages pending at once in Flower's simulation engine. Its in-memory SuperLink state looks through every
#: pending message for each virtual node ten times a second (``vce_api.add_messages_to_queue``), holding the
#: GIL: with all of 1000 hospitals' messages pending a round took 908 s, with 32 at once 267 s, with 8 115 s,
#: with 4 (this default on two cores) 103 s (benchmarks/results/overhead.md). Ray runs one virtual hospital per
#: two CPUs by default, so two pending per actor keep every actor busy.
SIMULATION_IN_FLIGHT = max(4, os.cpu_count() or 1)
#: Identity queries pending at once there: a query is answered in milliseconds, so what limits them is the
#: sweep's period (0.1 s plus the sweep itself, which checks every pending message for every virtual node),
#: and a wider window shares each period among more queries: 1000 identities took 48.7 s with 4 pending and
#: 21 s with 32 (2-core AMD EPYC, benchmarks/results/overhead.md). A wider window lengthens every sweep as
#: much as it adds queries to it, so it gains little more.
SIMULATION_QUERIES_IN_FLIGHT = 32
def messages_in_flight(job: JobConfig, grid: Grid, queries: bool = False) -> int:
    """How many messages may be pending at once: ``messages-in-flight``, or where that is 0, all of them in a
    deployment (every hospital works in parallel on its own machine) and :data:`SIMULATION_IN_FLIGHT` in
    Flower's simulation engine (its ``InMemoryGrid``), :data:`SIMULATION_QUERIES_IN_FLIGHT` for ``queries``."""
    if job.messages_in_flight > 0:
        return job.messages_in_flight
    if isinstance(grid, InMemoryGrid):
        return SIMULATION_QUERIES_IN_FLIGHT if queries else SIMULATION_IN_FLIGHT
    return 0

"""fedmed's log lines where nothing else prints them: a Flower user's own ServerApp.

fedmed logs to the ``fedmed`` logger. fedmed's own ServerApp gives it a handler (server_app/app.py); a ServerApp of a
user's own, with one of our strategies in it, gives it none, and Python then drops every INFO line, so the round
lines Flower's own strategies print (and ``flwr run --stream`` / ``flwr log`` show, as they mirror the ServerApp's
stdout) never appeared. A logger that someone configured (a handler on it or on the root) is left as it is."""

from __future__ import annotations

import logging
import sys

FORMAT = "%(levelname)s : fedmed: %(message)s"  # beside Flower's own "INFO :      [ROUND 1/3]" lines


def fedmed_logger_prints() -> logging.Logger:
    """The ``fedmed`` logger, printing INFO and above to stdout unless it or the root logger has a handler already."""
    log = logging.getLogger("fedmed")
    if log.handlers or logging.getLogger().handlers:
        return log
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(FORMAT))
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    log.propagate = False  # a root handler added later would print every line twice
    return log

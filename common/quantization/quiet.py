"""The quantisers' own chatter kept off the terminal during an INT8 export.

Building and timing five INT8 models makes torch.ao/torchao, PyTorch's ONNX exporter and ONNX Runtime's quantiser
print well over a hundred lines (libraries not found, ops they skip, tensors they leave in float), none of which the
user can act on and which bury the one line that says what was written. They are kept and counted here; the caller
says how many were held back."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

#: loggers the quantisers write to (ONNX Runtime's quantiser writes to the root logger, which its first
#: ``logging.warning`` would otherwise set up to print)
QUANTISER_LOGGERS = ("torch", "torchao", "onnxruntime", "onnxscript", "onnx", "onnx_ir", "openvino", "nncf")


class _Keep(logging.Handler):
    def __init__(self, kept: list[str]):
        super().__init__(logging.WARNING)
        self.kept = kept

    def emit(self, record: logging.LogRecord) -> None:
        self.kept.append(f"{record.name}: {record.getMessage()}")


@contextlib.contextmanager
def quiet_quantisers() -> Iterator[list[str]]:
    """Inside, the quantisers' warnings (Python warnings and their loggers') are kept in the list it yields, not
    printed; fedmed's own logger is left alone."""
    kept: list[str] = []
    keep = _Keep(kept)
    named = {name for name in logging.root.manager.loggerDict  # with their children that have handlers of their
             if name.split(".")[0] in QUANTISER_LOGGERS}  # own (torch's logging gives torch.onnx one)
    loggers = [logging.getLogger(name) for name in sorted(named | set(QUANTISER_LOGGERS))]
    saved = [(logger, logger.handlers[:], logger.propagate) for logger in loggers]
    root = logging.getLogger()
    root_was_bare = not root.handlers
    try:
        for logger in loggers:
            logger.handlers, logger.propagate = [keep], False
        if root_was_bare:  # a bare root would be given a printing handler by the first logging.warning
            root.addHandler(keep)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield kept
        kept.extend(f"{w.category.__name__}: {w.message}" for w in caught)
    finally:
        for logger, handlers, propagate in saved:
            logger.handlers, logger.propagate = handlers, propagate
        if root_was_bare:
            root.removeHandler(keep)

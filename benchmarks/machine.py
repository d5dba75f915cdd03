"""The machine a benchmark ran on (``common.machine``: ``fedmed export-int8`` names it too)."""

from common.machine import cpu_name  # noqa: F401

"""The machine a benchmark or an INT8 export ran on, named in every results file (speeds and even scores differ by
CPU)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name(cpuinfo: str | None = None) -> str:
    """The CPU's model name from /proc/cpuinfo with its family and model numbers (e.g. 'AMD EPYC (family 23,
    model 1)': a virtual machine's bare 'AMD EPYC' covers generations whose int8 and AVX2 speeds differ several
    times over), else what Python knows."""
    try:
        text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if "model name" in fields:
        numbers = [f"{label} {fields[key]}" for key, label in (("cpu family", "family"), ("model", "model"))
                   if fields.get(key)]
        return fields["model name"] + (f" ({', '.join(numbers)})" if numbers else "")
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_flags(cpuinfo: str | None = None) -> str:
    """The CPU's vector and int8 dot-product flags that decide its int8 speed (empty where none can be read)."""
    try:
        text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    flags = next((line.partition(":")[2].split() for line in text.splitlines() if line.startswith("flags")), [])
    return " ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags)

"""The install this suite runs in: CPU torch 2.13.0 and no CUDA packages pulled in by accident."""

from __future__ import annotations

from importlib import metadata

import torch


def test_no_nvidia_packages_installed():
    nvidia = sorted(d.metadata["Name"] for d in metadata.distributions()
                    if d.metadata["Name"].lower().startswith("nvidia"))
    assert nvidia == [], f"CUDA packages were installed (an unpinned torch?): {nvidia}"


def test_torch_is_the_pinned_release():
    assert torch.__version__.split("+")[0] == "2.13.0"

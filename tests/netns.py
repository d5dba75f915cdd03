"""Hosts with their own network addresses on this machine: Linux network namespaces joined by a bridge.

Each host is a namespace with a veth link into a bridge in the test's own namespace, which also
gets an address so that ``flwr`` (run from the test) reaches the SuperLink. Everything is torn
down when the context exits; tests skip when not root or without iproute2.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from dataclasses import dataclass, field

import pytest


def require_netns() -> None:
    if shutil.which("ip") is None:
        pytest.skip("iproute2 ('ip') is not installed: multi-host tests need network namespaces")
    if os.geteuid() != 0:
        pytest.skip("multi-host tests need root to create network namespaces")
    probe = f"fmprobe{os.getpid() % 10000}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot create network namespaces here: {done.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", "netns", "exec", netns, "ip", *args] if netns else ["ip", *args]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")


@dataclass
class VirtualNetwork:
    """A /24 with a bridge at .254 and one namespace per host (.1, .2, ...)."""

    hosts: list[str]
    tag: str = field(default_factory=lambda: f"{random.randrange(16**4):04x}")
    addresses: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.subnet = f"10.{random.randrange(200, 250)}.{random.randrange(1, 250)}"
        self.bridge = f"fmb{self.tag}"
        self.gateway = f"{self.subnet}.254"

    def netns(self, host: str) -> str:
        return f"fm{self.tag}-{host}"

    def link(self, host: str) -> str:
        """The bridge-side end of the host's cable: set it down to cut the host off."""
        return f"fm{self.tag}{self.hosts.index(host)}"

    def __enter__(self) -> "VirtualNetwork":
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for number, host in enumerate(self.hosts, start=1):
            ns, outside, inside = self.netns(host), self.link(host), f"fm{self.tag}{number - 1}p"
            ip("netns", "add", ns)
            ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            ip("link", "set", inside, "netns", ns)
            ip("link", "set", outside, "master", self.bridge)
            ip("link", "set", outside, "up")
            ip("link", "set", "lo", "up", netns=ns)
            ip("link", "set", inside, "name", "eth0", netns=ns)
            ip("addr", "add", f"{self.subnet}.{number}/24", "dev", "eth0", netns=ns)
            ip("link", "set", "eth0", "up", netns=ns)
            self.addresses[host] = f"{self.subnet}.{number}"
        return self

    def cut(self, host: str) -> None:
        ip("link", "set", self.link(host), "down")

    def restore(self, host: str) -> None:
        ip("link", "set", self.link(host), "up")

    def __exit__(self, *exc) -> None:
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", self.netns(host)], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

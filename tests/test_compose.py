"""docker-compose.yml: valid for docker-compose, TLS and authentication on, each hospital sees only its own data,
and each hospital's ClientApp runs in a container of its own whose only network reaches its SuperNode alone."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml

from .conftest import ROOT

COMPOSE = ROOT / "docker-compose.yml"


def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def hospitals() -> dict:
    """The hospitals' SuperNode services (fedmed-supernode with its ClientApp in another container)."""
    return {name: s for name, s in services().items()
            if str(s.get("command", "")).startswith("fedmed-supernode ") and EXECUTOR not in str(s["command"])}


EXECUTOR = "--fedmed-executor"


def clientapps() -> dict:
    """Each hospital's ClientApp service, by the hospital's name (fedmed-supernode --fedmed-executor)."""
    return {name.removesuffix("-clientapp"): s for name, s in services().items() if EXECUTOR in str(s.get("command"))}


def node_config_text(service: dict) -> str:
    command = " ".join(str(service["command"]).split())
    return command[command.index("--node-config"):]


def mounts(service: dict) -> list[tuple[str, str, str]]:
    """(source, target, mode) of every volume entry."""
    out = []
    for entry in service.get("volumes", []):
        parts = entry.split(":")
        out.append((parts[0], parts[1], parts[2] if len(parts) > 2 else "rw"))
    return out


def test_compose_file_is_valid_for_docker_compose():
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose); .ci/run installs it")
    environment = {k: v for k, v in os.environ.items() if k != "FEDMED_APPROVED_APPS"}
    done = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True,
                          cwd=ROOT, env={**environment, "FEDMED_APPROVED_APPS": "a" * 64})
    assert done.returncode == 0, done.stderr
    # no approved app, no consortium: the hospitals would otherwise run whatever app the SuperLink sends
    done = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True,
                          cwd=ROOT, env=environment)
    assert done.returncode != 0 and "compose_env.sh" in done.stderr, done.stderr


def test_three_hospitals_each_mount_only_their_own_data_state_and_key():
    found = clientapps()  # the ClientApp reads the data and signs with the key; its SuperNode holds neither data
    assert set(found) == set(hospitals()) and len(found) == 3
    for name, service in hospitals().items():
        assert {m[1] for m in mounts(service)} == {"/certs/ca.crt", f"/keys/{name}", "/state",
                                                   f"/policy/{name}.toml"}, name
        assert f"policy-file='/policy/{name}.toml'" in service["command"], name  # the apps it approves, too
        assert (f"{name}-state", "/state", "rw") in mounts(service)
    data_sources, state_sources = set(), set()
    for name, service in found.items():
        volume_list = mounts(service)
        data = [m for m in volume_list if m[1] == "/data"]
        assert len(data) == 1 and data[0][2] == "ro", f"{name}: one read-only data mount, got {data}"
        state = [m for m in volume_list if m[1] == "/state"]
        assert len(state) == 1 and state[0][0] == f"{name}-state", f"{name}: its own state volume"
        keys = [m for m in volume_list if m[1].startswith("/keys/")]
        assert keys == [(f"./deploy/keys/{name}", f"/keys/{name}", "ro")], f"{name}: only its own private key"
        peers = {(f"./deploy/keys/{other}.pub", f"/peer-keys/{other}.pub", "ro") for other in found}
        assert {m for m in volume_list if m[1].startswith("/peer-keys/")} == peers, f"{name}: every public key"
        policy = [m for m in volume_list if m[1].startswith("/policy/")]
        assert policy == [(f"./deploy/policies/{name}.toml", f"/policy/{name}.toml", "ro")], f"{name}: its own policy"
        assert f"policy-file='/policy/{name}.toml'" in service["command"], name
        assert {m[1] for m in volume_list} == {"/data", "/state", f"/keys/{name}", f"/policy/{name}.toml",
                                               *(m[1] for m in peers)}, name
        data_sources.add(data[0][0])
        state_sources.add(state[0][0])
    assert len(data_sources) == 3 and len(state_sources) == 3  # nobody shares a folder
    assert not any("test" in source or "results" in source for source in data_sources)


def test_tls_and_hospital_authentication_are_on_everywhere():
    all_services = services()
    link = " ".join(all_services["superlink"]["command"].split())
    assert "--ssl-certfile" in link and "--enable-supernode-auth" in link
    assert "--disable-runtime-dependency-installation" in link
    for name, service in hospitals().items():
        command = " ".join(service["command"].split())
        assert ("--root-certificates /certs/ca.crt" in command
                and f"--auth-supernode-private-key /keys/{name}" in command)
        assert f"hospital='{name}'" in command
    assert "--insecure" not in COMPOSE.read_text()


def test_each_clientapp_reaches_only_its_supernode():
    """Its one network is internal (no route out of it) and holds two members: the ClientApp and its SuperNode,
    whose Runtime API listens on that network's address alone; the SuperNode is also on the SuperLink's network."""
    compose = yaml.safe_load(COMPOSE.read_text())
    networks, all_services = compose["networks"], compose["services"]
    for name, clientapp in clientapps().items():
        (own,) = clientapp["networks"]
        assert networks[own].get("internal") is True, own
        members = {service for service, body in all_services.items() if own in (body.get("networks") or {})}
        assert members == {name, f"{name}-clientapp"}, (own, members)
        supernode = all_services[name]
        address = supernode["networks"][own]["ipv4_address"]
        assert set(supernode["networks"]) == {"default", own}
        assert f"--host {address} --port 9094" in " ".join(supernode["command"].split())
        assert "--clientapp-network container" in supernode["command"]
        assert f"--runtime-api-address {address}:9094" in " ".join(clientapp["command"].split())
        assert node_config_text(clientapp) == node_config_text(supernode)  # the apps it approved, the same keys
        assert clientapp["environment"]["FEDMED_WAIT_FOR"] == f"{address}:9094"


def test_the_gpu_overlay_starts_each_hospital_as_the_base_file_does_plus_its_gpu():
    overlay = yaml.safe_load((ROOT / "deploy" / "docker-compose.gpu.yml").read_text())["services"]
    for name, service in clientapps().items():  # the ClientApp trains: it gets the GPU
        base = " ".join(str(service["command"]).split())
        on_gpu = " ".join(str(overlay[f"{name}-clientapp"]["command"]).split())
        assert base.endswith("'\"") and on_gpu == base[:-1] + " device='cuda'\"", name
        assert "command" not in overlay[name] and "deploy" in overlay[f"{name}-clientapp"]


def test_the_image_copies_what_its_build_context_holds_and_every_package_the_fedmed_command_needs():
    """deploy/Dockerfile's COPY sources are let through by .dockerignore (an allowlist: ``*`` then ``!path``), and the
    image holds every package the installed ``fedmed`` command imports on its way to a hospital's commands."""
    import tomllib

    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text().splitlines()
    sources = [part for line in dockerfile if line.startswith("COPY ") and "--from" not in line
               for part in line.split()[1:-1]]
    allowed = {line[1:].strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    assert sources and [source for source in sources if source not in allowed] == []
    script = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["fedmed"]
    command_package = script.split(".")[0]
    assert {command_package, "common", "strategies", "server_app", "client_app"} <= set(sources)

"""A ClientApp process with no route out (issue 65): fedmed-supernode starts it in a network namespace of its own,
where the code a job names cannot open a connection even with Python's own modules bypassed (a subprocess, libc
through ctypes), and reaches its SuperNode's Runtime API only through the Unix socket the supervisor relays."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from cli.launch import SUPERNODE_WITH_EXECUTOR

from .test_secure_by_default import listener  # noqa: F401 (a fixture)


def supernode_script():
    spec = importlib.util.spec_from_file_location("fedmed_supernode", SUPERNODE_WITH_EXECUTOR)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


#: what approved code tries from inside the ClientApp process; each prints whether it went through
PROBE = r"""
import ctypes, json, socket, struct, subprocess, sys
port, api_socket = int(sys.argv[1]), sys.argv[2]
def attempt(action):
    try:
        action()
        return "went through"
    except Exception as error:
        return f"refused ({type(error).__name__})"
def libc_connect():
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
    address = struct.pack("=H", socket.AF_INET) + struct.pack("!H4s8x", port, bytes([127, 0, 0, 1]))
    if libc.connect(fd, address, len(address)) != 0:
        raise OSError(ctypes.get_errno(), "libc connect failed")
def shell_connect():
    subprocess.run(["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"], check=True, capture_output=True, timeout=10)
def supernode():
    import httpx
    reply = httpx.Client(transport=httpx.HTTPTransport(uds=api_socket)).get("http://127.0.0.1:9094/health")
    assert reply.text == "runtime api", reply.text
print(json.dumps({
    "python": attempt(lambda: socket.create_connection(("127.0.0.1", port), 2).close()),
    "ctypes": attempt(libc_connect),
    "subprocess": attempt(shell_connect),
    "internet": attempt(lambda: socket.create_connection(("1.1.1.1", 53), 2).close()),
    "supernode": attempt(supernode) if api_socket else "no socket",
}))
"""


class RuntimeApi(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        body = b"runtime api"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_approved_code_in_the_clientapp_namespace_reaches_only_its_supernode(tmp_path, listener):  # noqa: F811
    script = supernode_script()
    prefix = script.namespace_prefix()
    if prefix is None:
        pytest.skip("this machine allows no network namespace (unshare as root, or unprivileged user namespaces): "
                    "fedmed-supernode runs the ClientApp in the host's network there, with a warning")
    port, accepted = listener
    api = HTTPServer(("127.0.0.1", 0), RuntimeApi)
    threading.Thread(target=api.serve_forever, daemon=True).start()
    relay = script.RuntimeRelay(tmp_path / "runtime.sock", f"127.0.0.1:{api.server_address[1]}")
    try:
        inside = subprocess.run([*prefix, sys.executable, "-c", PROBE, str(port), str(relay.path)],
                                capture_output=True, text=True, timeout=120)
        outside = subprocess.run([sys.executable, "-c", PROBE, str(port), ""], capture_output=True, text=True,
                                 timeout=120)
    finally:
        relay.close()
        api.shutdown()
    assert inside.returncode == 0, inside.stderr[-2000:]
    closed = json.loads(inside.stdout)
    assert closed["supernode"] == "went through"  # its one way out
    for way in ("python", "ctypes", "subprocess", "internet"):
        assert closed[way].startswith("refused"), (way, closed)
    opened = json.loads(outside.stdout)  # the same code in the host's network: the listener is reached
    assert opened["python"] == opened["ctypes"] == "went through", opened
    assert len(accepted) >= 2 - (opened["subprocess"] != "went through")


def test_an_unknown_clientapp_network_is_refused_in_one_line():
    done = subprocess.run([sys.executable, str(SUPERNODE_WITH_EXECUTOR), "--clientapp-network", "everywhere",
                           "--insecure", "--superlink", "127.0.0.1:9", "--any-app"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "--clientapp-network everywhere" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_the_executor_sends_over_the_socket_through_flowers_client():
    """use_unix_socket replaces the httpx client a Flower Runtime API client holds: that attribute must still be it."""
    import httpx
    from flwr.supercore.runtime import RuntimeHttpClient

    client = RuntimeHttpClient.from_server_address(server_address="127.0.0.1:9094", insecure=True,
                                                   root_certificates=None, interceptors=[])
    assert isinstance(client._client, httpx.Client)
    supernode_script().use_unix_socket(client, "/nonexistent/runtime.sock")
    with pytest.raises(httpx.TransportError):  # it tries the socket, not 127.0.0.1:9094
        client._client.get("http://127.0.0.1:9094/")

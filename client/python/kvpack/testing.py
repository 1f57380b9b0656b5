"""Starts a real kvpackd for tests: `with LocalDaemon() as d: ... d.target, d.metrics_url`.

Standard library only, so the deploy tests can use it before the gRPC stubs exist. The daemon runs
on the CPU backend (no GPU needed) on free loopback ports and is stopped with SIGTERM (it drains,
then exits) when the block ends.

Which binary: $KVPACKD if set, else kvpackd under $KVPACK_BUILD_DIR, else under <repo>/build (the
CMake target lives in server/service/; server/ is looked at too).
Which flags: the daemon's own `--help` is read to pick the name of the listen-address flag;
$KVPACKD_TEST_ARGS (a shell-quoted string) replaces the generated flags entirely, with {port} and
{metrics_port} substituted.
Which transport: loopback TCP, or with unix_socket=True (or $KVPACK_TEST_UNIX_SOCKET=1) a unix socket
in a temporary directory — what docs/deploy.md recommends for a daemon on the caller's host.
"""

import os
import pathlib
import re
import shlex
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

REPO = pathlib.Path(__file__).resolve().parents[3]

# Candidate spellings of the gRPC listen flag, in order of preference; the first one the daemon's
# --help mentions is used, else the first.
_ADDRESS_FLAGS = ("listen", "address", "listen_address", "grpc_address")


def find_kvpackd():
    """Path of a kvpackd binary, or None."""
    candidates = []
    if os.environ.get("KVPACKD"):
        candidates.append(pathlib.Path(os.environ["KVPACKD"]))
    builds = [pathlib.Path(os.environ["KVPACK_BUILD_DIR"])] if os.environ.get("KVPACK_BUILD_DIR") else []
    for build in builds + [REPO / "build"]:
        candidates += [build / "server" / "service" / "kvpackd", build / "server" / "kvpackd"]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    return None


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _known_flags(binary):
    try:
        out = subprocess.run([str(binary), "--help"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return set(re.findall(r"--([a-z][a-z0-9_]*)", out.stdout + out.stderr))


class LocalDaemon:
    """A kvpackd child process on loopback ports. Not thread-safe; one `with` block per object."""

    def __init__(self, binary=None, budget_bytes=1 << 30, extra_args=(), start_timeout_s=30.0,
                 unix_socket=None):
        self.binary = pathlib.Path(binary) if binary else find_kvpackd()
        if self.binary is None:
            raise FileNotFoundError("no kvpackd binary (build it, or set KVPACK_BUILD_DIR or KVPACKD)")
        if unix_socket is None:
            unix_socket = os.environ.get("KVPACK_TEST_UNIX_SOCKET", "") not in ("", "0")
        self._socket_dir = tempfile.TemporaryDirectory(prefix="kvpackd-") if unix_socket else None
        self.socket_path = (os.path.join(self._socket_dir.name, "kvpackd.sock")
                            if unix_socket else None)
        self.port = free_port()
        self.metrics_port = free_port()
        self.budget_bytes = budget_bytes
        self.extra_args = list(extra_args)
        self.start_timeout_s = start_timeout_s
        self.proc = None
        self._log_file = None

    @property
    def target(self):
        """What a client dials: unix:///path or 127.0.0.1:port."""
        if self.socket_path:
            return f"unix://{self.socket_path}"
        return f"127.0.0.1:{self.port}"

    @property
    def listen(self):
        """The daemon's --listen address."""
        return f"unix:{self.socket_path}" if self.socket_path else f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self):
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def args(self):
        override = os.environ.get("KVPACKD_TEST_ARGS")
        if override:
            return [a.format(port=self.port, metrics_port=self.metrics_port)
                    for a in shlex.split(override)]
        known = _known_flags(self.binary)
        address = next((f for f in _ADDRESS_FLAGS if f in known), _ADDRESS_FLAGS[0])
        return [f"--{address}={self.listen}",
                f"--metrics_address=127.0.0.1:{self.metrics_port}",
                "--backend=cpu",
                f"--vram_budget={self.budget_bytes}"] + self.extra_args

    def __enter__(self):
        # A file, not a pipe: a chatty daemon must never block on a full pipe.
        self._log_file = tempfile.TemporaryFile(mode="a+b")  # O_APPEND: reads never move writes
        self.proc = subprocess.Popen([str(self.binary)] + self.args(), stdout=self._log_file,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvpackd exited with {self.proc.returncode}:\n" + self.log())
            try:
                self.scrape()
                self._wait_grpc_port(deadline)
                return self
            except (OSError, urllib.error.URLError):
                time.sleep(0.1)
        self.__exit__(None, None, None)
        raise TimeoutError(f"kvpackd did not serve {self.metrics_url} within "
                           f"{self.start_timeout_s} s:\n" + self.log())

    def _wait_grpc_port(self, deadline):
        while True:
            try:
                if self.socket_path:
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                        s.settimeout(1)
                        s.connect(self.socket_path)
                else:
                    socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def scrape(self):
        """The text of one /metrics scrape."""
        with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
            return r.read().decode()

    def __exit__(self, *exc):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._socket_dir is not None:
            self._socket_dir.cleanup()
            self._socket_dir = None
        return False

    def log(self):
        """Everything the daemon printed so far."""
        if self._log_file is None:
            return ""
        self._log_file.seek(0)
        return self._log_file.read().decode(errors="replace")

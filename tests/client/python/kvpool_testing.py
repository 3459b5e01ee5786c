"""Test harness for the Python tests: real kvpoold processes in private runtime directories, and
helper processes whose output the tests read (the Python side of tests/integration/harness.h).

The programs come from the environment ctest sets (kvpool_py_test in cmake/KvpoolHelpers.cmake):
KVPOOLD, KVPOOLCTL, KVPOOL_INTEGRATION_CLIENT, KVPOOL_LOADGEN.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))


def program(variable: str) -> str:
    path = os.environ.get(variable)
    if not path:
        raise RuntimeError(f"{variable} is not set: run the Python tests through ctest")
    return path


KVPOOLD = lambda: program("KVPOOLD")  # noqa: E731
KVPOOLCTL = lambda: program("KVPOOLCTL")  # noqa: E731
INTEGRATION_CLIENT = lambda: program("KVPOOL_INTEGRATION_CLIENT")  # noqa: E731
LOADGEN = lambda: program("KVPOOL_LOADGEN")  # noqa: E731

# A small pool: 256 blocks of 16 tokens of the tiny model's shape.
SMALL_CONFIG = "pool_bytes: 16777216 max_blocks_per_seq: 64"


def _accepts(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


class Daemon:
    """kvpoold with `config` (textproto; runtime_dir is added) in a fresh private directory.
    Stopped (SIGTERM) by stop() or at the end of a `with` block."""

    def __init__(self, config: str = SMALL_CONFIG, directory: Optional[str] = None,
                 args: Tuple[str, ...] = ()):
        self.dir = directory or tempfile.mkdtemp(prefix="kvpool-pytest-")
        self._owns_dir = directory is None
        self.config_path = self.dir + ".textproto"
        with open(self.config_path, "w") as f:
            f.write(f'{config}\nruntime_dir: "{self.dir}"\n')
        self.process = subprocess.Popen(
            [KVPOOLD(), f"--config={self.config_path}", "--log_level=warn", *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not (_accepts(f"{self.dir}/attach.sock") and _accepts(f"{self.dir}/kvpoold.sock")):
            if self.process.poll() is not None:
                raise RuntimeError(f"kvpoold exited with {self.process.returncode}")
            if time.monotonic() > deadline:
                self.process.kill()
                self.process.wait()
                raise RuntimeError("kvpoold did not come up in 10 s")
            time.sleep(0.01)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        rc = self.process.wait(timeout=30)
        return rc

    def close(self) -> None:
        self.stop()
        os.unlink(self.config_path) if os.path.exists(self.config_path) else None
        if self._owns_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Daemon":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Polls `predicate` until it holds or `timeout` passes (the daemon's reclaim is asynchronous
    to the client's death; there is nothing to wait on but its stats)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)


def run(argv: List[str], timeout: float = 60, env=None) -> Tuple[int, str]:
    """Runs `argv` to completion; (exit code, stdout). stderr passes through to the test log."""
    done = subprocess.run(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, timeout=timeout,
                          text=True, env=env)
    return done.returncode, done.stdout


def spawn(argv: List[str], env=None) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            env=env)


def read_line(process: subprocess.Popen, timeout: float = 30) -> str:
    """The next line `process` prints, without the newline. Raises TimeoutError."""
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError(f"no line from {process.args[0]} in {timeout} s")
    return process.stdout.readline().rstrip("\n")


def python_child(script: str, *args: str) -> List[str]:
    """argv running tests/client/python/<script> with this interpreter."""
    return [sys.executable, os.path.join(HERE, script), *map(str, args)]


class Frontend:
    """A kvpool-frontend process (python3 -m kvpool_frontend) on a free port of 127.0.0.1,
    attached to `daemon_dir`. Stopped (SIGTERM: it drains) by stop() or a `with` block."""

    def __init__(self, daemon_dir: str, *args: str):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvpool_frontend", f"--socket_dir={daemon_dir}", "--port=0",
             *args], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        line = read_line(self.process, 30)
        if not line.startswith("kvpool-frontend: serving "):
            self.process.kill()
            raise RuntimeError(f"kvpool-frontend did not start: {line!r}")
        self.url = line.split(" at ")[1].split(" ")[0]
        self.port = int(self.url.rsplit(":", 1)[1])

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        rc = self.process.wait(timeout=60)
        self.process.stdout.close()
        return rc

    def __enter__(self) -> "Frontend":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def http(url: str, body=None, raw: Optional[bytes] = None, method: Optional[str] = None,
         timeout: float = 60):
    """(status, headers, parsed JSON body) of one request; `body` is sent as JSON."""
    import json
    import urllib.error
    import urllib.request

    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def stream(url: str, body, timeout: float = 60):
    """The server-sent events of one streaming request: (status, [event JSON or "[DONE]"])."""
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            events = []
            for line in response:
                line = line.decode().strip()
                if line.startswith("data: "):
                    payload = line[len("data: "):]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
            return response.status, events
    except urllib.error.HTTPError as e:
        return e.code, [json.loads(e.read())]

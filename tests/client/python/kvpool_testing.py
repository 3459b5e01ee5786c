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
import urllib.request
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


def free_port() -> int:
    """A port of 127.0.0.1 nothing listens on now (the daemon and Prometheus take an address, not
    a descriptor; the gap between this close and their bind is the only race)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fetch(url: str, timeout: float = 5) -> str:
    """The body of an HTTP GET (a daemon's /metrics, Prometheus's API)."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


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
         timeout: float = 60, key: Optional[str] = None, headers: Optional[dict] = None):
    """(status, headers, parsed JSON body) of one request; `body` is sent as JSON, with
    `Authorization: Bearer <key>` when `key` is given, and `headers`."""
    import json
    import urllib.error
    import urllib.request

    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              **_auth(key), **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def _auth(key: Optional[str]) -> dict:
    return {"Authorization": f"Bearer {key}"} if key is not None else {}


def stream(url: str, body, timeout: float = 60, key: Optional[str] = None):
    """The server-sent events of one streaming request: (status, [event JSON or "[DONE]"])."""
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **_auth(key)})
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


def train_sentencepiece(directory: str, vocab_size: int = 400) -> str:
    """Trains a small SentencePiece BPE model (byte fallback, BOS 1, EOS 2) into
    <directory>/tokenizer.model, as a Llama checkpoint ships one; returns its path."""
    import io

    import sentencepiece

    text = ["the pool keeps every block of every sequence", "a frontend streams tokens",
            "kvpool shares prefixes between processes", "naive cafe unicode text"] * 50
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(text), model_writer=model, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, bos_id=1, eos_id=2,
        unk_id=0, pad_id=-1, minloglevel=2)
    path = os.path.join(directory, "tokenizer.model")
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return path


def write_checkpoint(directory: str, vocab_size: int, seed: int = 3) -> None:
    """A small Llama checkpoint in f32 as transformers writes one: config.json and
    model.safetensors (tied embeddings), random weights."""
    import json

    import numpy as np

    hidden, inter, layers, heads, kv_heads, head_dim = 64, 128, 2, 4, 2, 16
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": inter,
              "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": True,
              "max_position_embeddings": 1024, "torch_dtype": "float32"}
    rng = np.random.default_rng(seed)
    tensors = {"model.embed_tokens.weight": (vocab_size, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter)})
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, shape in tensors.items():
        values = (np.ones(shape) if len(shape) == 1
                  else rng.normal(0, 1 / np.sqrt(shape[-1]), shape)).astype("<f4")
        blobs.append(values.tobytes())
        header[name] = {"dtype": "F32", "shape": list(shape),
                        "data_offsets": [offset, offset + len(blobs[-1])]}
        offset += len(blobs[-1])
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)

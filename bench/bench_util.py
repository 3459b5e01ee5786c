"""Helpers shared by the Python benchmarks: a kvpoold from a build directory in a private runtime
directory, and summaries of interleaved rounds (median and spread of per-round ratios)."""

import os
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def use_tree(build_dir):
    """Imports kvpool and kvpool_frontend from this tree, with the stubs `build_dir` generated,
    here and in the processes started from here."""
    paths = [os.path.join(REPO, "client", "python"), os.path.join(REPO, "client", "frontend"),
             os.path.join(os.path.abspath(build_dir), "python")]
    sys.path[:0] = paths
    os.environ["PYTHONPATH"] = ":".join(paths + [os.environ.get("PYTHONPATH", "")]).rstrip(":")


def accepts(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


class Daemon:
    def __init__(self, build_dir, config):
        self.dir = tempfile.mkdtemp(prefix="kvpool-bench-")
        self.config = self.dir + ".textproto"
        with open(self.config, "w") as f:
            f.write(f'{config}\nruntime_dir: "{self.dir}"\n')
        self.process = subprocess.Popen(
            [os.path.join(build_dir, "daemon", "kvpoold"), f"--config={self.config}",
             "--log_level=warn"], stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not (accepts(f"{self.dir}/attach.sock") and accepts(f"{self.dir}/kvpoold.sock")):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("kvpoold did not come up")
            time.sleep(0.01)

    def close(self):
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=30)
        os.unlink(self.config)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def spread(ratios):
    """'median (min-max over N rounds)' of per-round ratios."""
    return (f"{statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f}, "
            f"{len(ratios)} rounds)")


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]

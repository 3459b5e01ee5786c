"""kvpoold's /metrics (daemon/metrics, docs/metrics.md) against the real tools: promtool accepts
the exposition, a real Prometheus scrapes a daemon under load and its PromQL hit ratio equals the
one GetStats reports, every GetStats figure is exported, and every query of the Grafana dashboard
(deploy/grafana/kvpool.json) names a family the daemon exports."""

import json
import math
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import unittest
import urllib.parse

import kvpool
from kvpool._proto import kvpool_pb2
from kvpool_testing import (REPO, SMALL_CONFIG, Daemon, KVPOOLCTL, fetch, free_port, run,
                            wait_until)

DASHBOARD = os.path.join(REPO, "deploy", "grafana", "kvpool.json")


def tokens(n, seed=1):
    x, out = seed * 7919 + 1, []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(x % 8192)
    return out


def families(text: str):
    """{family name: type} of a Prometheus text exposition."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.M)}


def samples(text: str):
    """{'name{labels}': value} of a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


class MetricsTest(unittest.TestCase):
    def setUp(self):
        self.port = free_port()
        self.daemon = Daemon(SMALL_CONFIG + f'\ntiers {{ host_blocks: 32 }}\n'
                             f'metrics {{ listen: "{self.port}" max_tenants: 2'
                             f' block_residency_sample: 1 }}\n')
        self.addCleanup(self.daemon.close)
        self.url = f"http://127.0.0.1:{self.port}/metrics"

    def connect(self, tenant="default"):
        c = kvpool.Client.connect(self.daemon.dir, tenant=tenant, kv_access=True)
        self.addCleanup(c.close)
        return c

    def load(self, client, rounds, stop=None):
        """Allocate-and-free of prompts that share prefixes: hits and misses both."""
        for i in range(rounds):
            if stop is not None and stop.is_set():
                return
            prompt = tokens(32, seed=i % 3) + tokens(16, seed=100 + i)
            seq = client.allocate_one(prompt)
            client.free([seq.id], commit=True)

    def test_promtool_accepts_the_exposition(self):
        self.load(self.connect(), 6)
        text = fetch(self.url)
        done = subprocess.run(["promtool", "check", "metrics"], input=text, text=True,
                              capture_output=True)
        problems = (done.stdout + done.stderr).strip().splitlines()
        # vLLM's own names carry ':' (the recording-rule convention), which promtool's linter
        # flags; dashboards query them by those names, so they stay. Nothing else may be flagged.
        others = [p for p in problems
                  if not re.fullmatch(r"vllm:\S+ metric names should not contain ':'", p)]
        self.assertEqual(others, [])
        self.assertIn(done.returncode, (0, 3))  # 3: lint findings only; 1 would be a parse error
        self.assertTrue(problems, "the vllm: families are missing")

    def test_every_getstats_figure_is_exported_and_printed(self):
        c = self.connect()
        self.load(c, 6)

        def figures():
            r = c.get_stats()
            return r, [(s.name, tuple(s.label_values), s.value, s.count) for s in r.stats
                       if s.name not in ("uptime_seconds", "rpcs")]
        # The host tier copies blocks down on its own schedule: wait until the figures settle.
        last = [figures()[1]]

        def settled():
            now = figures()[1]
            same, last[0] = now == last[0], now
            time.sleep(0.05)
            return same
        self.assertTrue(wait_until(settled, 10))
        stats = c.get_stats()
        text = fetch(self.url)
        values = samples(text)
        _, ctl = run([KVPOOLCTL(), f"--socket_dir={self.daemon.dir}", "stats"])
        kind_suffix = {kvpool_pb2.Stat.KIND_COUNTER: "_total"}
        self.assertGreater(len(stats.stats), 50)
        for s in stats.stats:
            name = s.name if s.name.startswith("vllm:") else "kvpool_" + s.name
            name += kind_suffix.get(s.kind, "")
            self.assertIn(s.name, ctl)
            if s.kind == kvpool_pb2.Stat.KIND_HISTOGRAM:
                self.assertIn(f"# TYPE {name} histogram", text)
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in zip(s.label_names, s.label_values))
            key = f"{name}{{{labels}}}" if labels else name
            self.assertIn(key, values)
            if s.name in ("uptime_seconds", "rpcs"):  # move by themselves (GetStats is an rpc)
                self.assertGreaterEqual(values[key], s.value, key)
            else:  # the text format prints 10 significant digits or so: exact for counts
                self.assertTrue(math.isclose(values[key], s.value, rel_tol=1e-9),
                                f"{key}: {values[key]} exported, {s.value} in GetStats")
        self.assertGreater(values['kvpool_rpcs_total{method="Allocate",code="OK"}'], 0)

    def test_tenants_past_max_tenants_fold_into_other(self):
        for tenant in ("t1", "t2", "t3", "t4"):
            self.load(self.connect(tenant), 1)
        text = fetch(self.url)
        tenants = set(re.findall(r'kvpool_tenant_prompt_tokens_total\{[^}]*tenant="([^"]+)"',
                                 text))
        self.assertEqual(tenants, {"t1", "t2", "other"})

    def test_prometheus_sees_the_hit_ratio_getstats_reports(self):
        prometheus = shutil.which("prometheus")
        self.assertIsNotNone(prometheus, "prometheus is missing: run deploy/install-deps.sh")
        work = tempfile.mkdtemp(prefix="kvpool-prometheus-")
        self.addCleanup(shutil.rmtree, work, True)
        with open(os.path.join(work, "prometheus.yml"), "w") as f:
            f.write("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                    "scrape_configs:\n"
                    "  - job_name: kvpool\n"
                    f"    static_configs: [{{targets: ['127.0.0.1:{self.port}']}}]\n")
        api = f"127.0.0.1:{free_port()}"
        server = subprocess.Popen(
            [prometheus, f"--config.file={work}/prometheus.yml", f"--storage.tsdb.path={work}/db",
             f"--web.listen-address={api}", "--log.level=warn"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def stop_prometheus():
            server.terminate()
            server.wait(timeout=30)
        self.addCleanup(stop_prometheus)

        def query(expr):
            try:
                body = json.loads(fetch(f"http://{api}/api/v1/query?" +
                                        urllib.parse.urlencode({"query": expr}), timeout=2))
            except OSError:
                return None
            result = body.get("data", {}).get("result", [])
            return float(result[0]["value"][1]) if result else None

        c = self.connect()
        stop = threading.Event()
        loader = threading.Thread(target=self.load, args=(c, 10_000, stop))
        loader.start()
        try:
            self.assertTrue(wait_until(lambda: query('up{job="kvpool"}') == 1.0, 30),
                            "Prometheus never scraped the daemon")
        finally:
            stop.set()
            loader.join()
        stats = c.get_stats()
        self.assertGreater(stats.hit_tokens, 0)
        want = stats.hit_tokens / stats.prompt_tokens
        ratio = ("sum(vllm:prefix_cache_hits_total{job='kvpool'}) / "
                 "sum(vllm:prefix_cache_queries_total{job='kvpool'})")
        self.assertTrue(wait_until(lambda: (query(ratio) or -1) == want, 15),
                        f"PromQL says {query(ratio)}, GetStats {want}")

    def test_every_dashboard_query_names_an_exported_family(self):
        with open(DASHBOARD) as f:
            dashboard = json.load(f)
        exprs = []

        def walk(node):
            if isinstance(node, dict):
                if isinstance(node.get("expr"), str):
                    exprs.append(node["expr"])
                for value in node.values():
                    walk(value)
            elif isinstance(node, list):
                for value in node:
                    walk(value)
        walk(dashboard)
        self.assertGreater(len(exprs), 5)
        self.load(self.connect("t1"), 4)
        exported = families(fetch(self.url))
        names = set()
        for e in exprs:
            found = re.findall(r"\b(vllm:[a-z_]+|kvpool_[a-z_]+)", e)
            self.assertTrue(found, f"a query naming no kvpool family: {e}")
            names.update(found)
        # Each query parses as PromQL (Grafana's variables given values first): as recording
        # rules, which promtool checks offline.
        rules = os.path.join(tempfile.mkdtemp(prefix="kvpool-rules-"), "dashboard.yml")
        self.addCleanup(shutil.rmtree, os.path.dirname(rules), True)
        with open(rules, "w") as f:
            f.write("groups:\n  - name: dashboard\n    rules:\n")
            for i, e in enumerate(exprs):
                e = e.replace("$__rate_interval", "1m").replace("$pool", ".*")
                f.write(f"      - record: kvpool:dashboard_{i}\n        expr: {json.dumps(e)}\n")
        done = subprocess.run(["promtool", "check", "rules", rules], capture_output=True, text=True)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        for name in sorted(names):
            family = re.sub(r"_(bucket|sum|count)$", "", name)
            self.assertIn(family, exported, f"the dashboard queries {name}, never exported")
            if family != name:
                self.assertEqual(exported[family], "histogram", name)


if __name__ == "__main__":
    unittest.main()

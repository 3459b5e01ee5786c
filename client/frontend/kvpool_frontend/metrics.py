"""The frontend's Prometheus metrics (GET /metrics), through Debian's python3-prometheus-client.

Request-level figures under vLLM's names, so dashboards and autoscalers written for a vLLM server
read a kvpool-frontend unchanged (label model_name, the served name):

  vllm:request_success_total{finished_reason}   requests answered whole (stop, length)
  vllm:prompt_tokens_total, vllm:generation_tokens_total
  vllm:time_to_first_token_seconds              arrival to the first token (histogram)
  vllm:inter_token_latency_seconds              between tokens of one request (histogram)
  vllm:e2e_request_latency_seconds              arrival to the last token (histogram)
  vllm:num_requests_running                     requests holding a run slot now

and what only this frontend knows:

  kvpool_frontend_cached_prompt_tokens_total    prompt tokens the daemon's prefix cache supplied
                                                (in whole blocks, as usage reports them)
  kvpool_frontend_http_requests_total{endpoint,code}
                                                every answer, refusals included (400, 401, 413,
                                                429, 503...)

The numbers carry no tenant's data (no prompt, no key name), so the endpoint takes no API key,
as vLLM's does. Each Frontend has its own registry (several may live in one process: the tests).
Not thread-safe beyond what prometheus_client gives: used on the frontend's event loop.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's buckets for the same families (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class FrontendMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self._model = model_name
        r, m = self.registry, ("model_name",)
        self.success = Counter("vllm:request_success", "Requests answered whole, by why they "
                               "ended.", m + ("finished_reason",), registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of answered requests.",
                                     m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", m,
                                         registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to the first token.",
                              m, buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Between two tokens of one "
                             "request.", m, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to the last token.", m,
                             buckets=_E2E_BUCKETS, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests holding a run slot.", m,
                             registry=r)
        self.cached = Counter("kvpool_frontend_cached_prompt_tokens", "Prompt tokens the daemon's "
                              "prefix cache supplied (whole blocks).", m, registry=r)
        self.http = Counter("kvpool_frontend_http_requests", "HTTP answers by endpoint and "
                            "status code.", m + ("endpoint", "code"), registry=r)

    def answered(self, endpoint: str, code: int) -> None:
        self.http.labels(self._model, endpoint, str(code)).inc()

    def token(self, arrival: float, previous: float, now: float) -> None:
        """One generated token at `now`; `previous` is the last one's time (or 0 for the first)."""
        if previous:
            self.itl.labels(self._model).observe(now - previous)
        else:
            self.ttft.labels(self._model).observe(now - arrival)

    def finished(self, arrival: float, now: float, prompt_tokens: int, generated: int,
                 cached: int, finish_reason: str) -> None:
        m = self._model
        self.success.labels(m, finish_reason or "abort").inc()
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(generated)
        self.cached.labels(m).inc(cached)
        self.e2e.labels(m).observe(now - arrival)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

"""Frontend metrics with Dynamo's names (`dynamo_frontend_*`, labelled by model); updated from the event loop
only, so without prometheus_client's locks."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from tandem.runtime.loop_metrics import Counter, Gauge, Histogram

PREFIX = "dynamo_frontend"
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKENS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry, instance_id: int | None = None) -> None:
        def counter(name: str, doc: str, labels: tuple[str, ...]) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, labels, registry)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ("model",)) -> Gauge:
            return Gauge(f"{PREFIX}_{name}", doc, labels, registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, ("model",), registry, buckets)

        self.requests = counter("requests", "Requests handled", ("model", "endpoint", "request_type", "status"))
        self.inflight = gauge("inflight_requests", "Requests being handled now")
        self.queued = gauge("queued_requests", "Requests waiting for their first token")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", _LATENCY)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens", _LATENCY)
        self.isl = histogram("input_sequence_tokens", "Prompt tokens per request", _TOKENS)
        self.osl = histogram("output_sequence_tokens", "Generated tokens per request", _TOKENS)
        self.duration = histogram("request_duration_seconds", "Time from request to last token", _LATENCY)
        self.migrations = counter("model_migration", "Requests moved to another worker", ("model", "migration_type"))
        self.migration_too_long = counter(
            "model_migration_max_seq_len_exceeded", "Streams not migrated: longer than --migration-max-seq-len",
            ("model",),
        )
        self.rejections = counter("model_rejection", "Requests refused because all workers were busy",
                                  ("model", "endpoint"))
        self.cancellations = counter("model_cancellation", "Requests whose client went away",
                                     ("model", "endpoint", "request_type"))
        # Disaggregated serving (tandem.frontend.disagg has the outcomes).
        self.remote_prefills = counter(
            "remote_prefills", "Requests of models with prefill workers, by outcome: ok, fallback (decoded with "
            "local prefill), error (503 under --enforce-disagg), skipped_conditional, cancelled", ("model", "outcome"))
        self.prefill_seconds = histogram("remote_prefill_duration_seconds",
                                         "Prefill leg on a prefill worker, until its KV transfer parameters", _LATENCY)
        self.kv_transfer_seconds = histogram("kv_transfer_seconds",
                                             "KV transfer to the decode worker, as it reports (kv_transfer_ms)", _LATENCY)
        if instance_id is not None:
            # Which process wrote the page: one address may be served by several (--num-processes, a Service).
            Gauge("tandem_frontend_instance_info", "This frontend process: its discovery instance id", ("instance",),
                  registry).labels(f"{instance_id:x}").set(1)
        self.model_gauges = {
            name: gauge(f"model_{name}", f"Model configuration: {name}")
            for name in ("total_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "context_length",
                         "kv_cache_block_size", "migration_limit", "workers", "prefill_workers")
        }

    def migration(self, model: str, kind: str) -> None:
        self.migrations.labels(model, kind).inc()

    def migration_max_seq_len_exceeded(self, model: str) -> None:
        self.migration_too_long.labels(model).inc()

    def remote_prefill(self, model: str, outcome: str) -> None:
        self.remote_prefills.labels(model, outcome).inc()

    def set_model(self, model: str, values: dict[str, int | float | None]) -> None:
        for name, value in values.items():
            if value is not None and name in self.model_gauges:
                self.model_gauges[name].labels(model).set(value)


"""The planner: sizes the worker pools to meet TTFT and ITL targets, from predicted traffic (throughput-based,
the SLA planner) and from the engines' load (load-based), alone or together.

- `config.py`: the settings (Dynamo's planner fields and defaults), checked field by field;
- `predictors.py`: the next interval's load from the past ones (constant, moving average, ARIMA, Kalman,
  Prophet);
- `perf.py`: a worker's profiled prefill and decode performance, in Dynamo's profile layout;
- `sla.py`: one interval's metrics in, the replicas each pool needs out;
- `load.py`: the engines' forward-pass metrics in, one worker more or fewer per pool out;
- `limits.py`: the min and max endpoints and GPU budgets every decision ends in;
- `trace.py`: load history from a Mooncake-format trace, to warm the predictors up;
- `observe.py`, `prometheus.py`: one interval of traffic, from the frontends' metrics or from Prometheus;
- `engines.py`: the engines' forward-pass metrics, followed on the event plane;
- `loop.py`: every interval observe, decide and hand the decision to a connector;
- `kubernetes.py`, `virtual.py`: connectors to a Helm release's Deployments and to an external orchestrator;
- `control.py`: the control API (`/v1/min-endpoints`);
- `main.py`: `tandem planner`, beside a deployment it did not start.
"""

"""The planner: sizes the worker pools for the load it predicts, to meet TTFT and ITL targets.

- `config.py`: the settings (Dynamo's SLA-planner fields and defaults), checked field by field;
- `predictors.py`: the next interval's load from the past ones (constant, moving average, ARIMA, Kalman,
  Prophet);
- `perf.py`: a worker's profiled prefill and decode performance, in Dynamo's profile layout;
- `sla.py`: one interval's metrics in, the replicas each pool needs out;
- `trace.py`: load history from a Mooncake-format trace, to warm the predictors up;
- `observe.py`: one interval of traffic from the frontends' metrics;
- `loop.py`: every interval observe, decide and hand the decision to a connector;
- `main.py`: `tandem planner`, observing a deployment it did not start.
"""

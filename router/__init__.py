"""Router: the front door only. The gRPC server, each request's job (placement on a prefill and
a decode worker, streaming, re-runs), the worker pools, autoscaling, config and /metrics; no
model code, no benchmark (``bench/``), no command line (``cli/``)."""

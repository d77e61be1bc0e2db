"""Router: the front door only. The gRPC server, each request's job (placement on a prefill and
a decode worker, streaming, re-runs), the worker pools, autoscaling, config and /metrics, and
the gRPC client of the front door (client.py: the CLI, benchmarks and tests use it); no model
code, no benchmark (``bench/``), no command line (``cli/``)."""

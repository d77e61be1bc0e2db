"""The worker runtime both worker kinds share: the step loop (a thread that steps the worker
core and runs actor calls between steps), the typed protocol to the router, the Ray actor
base and the per-worker /metrics server. ``engine/`` knows no network; this package does."""

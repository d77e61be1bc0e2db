"""Prefill worker: runs prompt prefill and pushes the KV cache, then the first token as the
transfer's trailer, to a decode worker. The core (``worker.py``) knows no Ray; the actor
(``actor.py``) is a thin role on the shared runtime (``worker/``)."""

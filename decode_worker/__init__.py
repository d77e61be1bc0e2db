"""Decode worker: reserves KV blocks, receives prefilled KV and the first token, and streams
generated tokens. The core (``worker.py``) knows no Ray; the actor (``actor.py``) is a thin
role on the shared runtime (``worker/``)."""

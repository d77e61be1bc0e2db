"""The ``pdserve`` command line (main.py; ``quantize`` and ``eval-ppl`` in quant.py) and what
goes with it: the gRPC client helpers (client.py) and the `ray up` cluster-file checks
(deploy.py). A client of the router: nothing in router/ imports it."""

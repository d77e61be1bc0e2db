"""The ``pdserve`` command line (main.py: the parser and the commands; local.py runs the engine in
this process, remote.py asks a server through router.client; ``quantize`` and ``eval-ppl`` in
quant.py, ``pull`` and ``models`` in pull.py, ``plan`` in plan.py) and the `ray up` cluster-file
checks (deploy.py, which reads commands with shell.py). A client of the router: nothing in router/
imports it."""

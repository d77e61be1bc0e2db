"""A discrete-event cluster simulator that runs the router's real placement, prefix-index,
local-prefill and role-switch functions over simulated workers (bench/simulate.py)."""

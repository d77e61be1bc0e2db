"""The chaos run, short (bench/chaos.py has the full one): a real cluster under streaming load
while every kind of fault lands once, at seeded random times. Nothing wrong, hung or leaked."""

from __future__ import annotations

import json

from bench.chaos import CLUSTER, FAULT_KINDS, parse, run_chaos, table


def test_every_fault_kind_under_load_nothing_wrong_hung_or_leaked(make_cluster, capsys):
    args = parse(["--requests", "16", "--faults-per-kind", "1", "--fault-gap-s", "1", "--concurrency", "4",
                  "--specs", "6", "--max-tokens", "12", "--long-words", "120", "--stall-s", "6", "--lease-s", "10",
                  "--hang-s", "240", "--seed", "1"])
    overrides = {**CLUSTER, "router.stall_s": args.stall_s, "kv_transfer.lease_s": args.lease_s}
    cluster = make_cluster(**{k.replace(".", "__"): v for k, v in overrides.items()})
    out = run_chaos(cluster, args)
    print(table(out), json.dumps(out))  # shown on failure
    assert out["faults_by_kind"] == {k: 1 for k in FAULT_KINDS}, out
    assert out["requests"] >= 16 and out["completed_identical"] >= 1, out
    assert out["wrong"] == 0 and out["hung"] == 0, out
    assert out["leaked_blocks"] == 0 and out["stranded_blocks"] == 0 and out["swept_blocks"] == 0, out
    assert out["leaked_processes"] == 0 and out["leaked_ports"] == 0, out
    assert out["recovered"] == out["faults"], out  # every fault's victim served again

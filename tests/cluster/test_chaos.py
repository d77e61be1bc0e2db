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


def test_router_faults_under_streams_nothing_wrong_hung_or_leaked(ray_session, capsys):
    """bench/chaos_router.py, small: an HA pair of ``pdserve serve`` processes; the leader
    stopped past its lease (it wakes fenced and stands by), then the new leader killed, while 6
    greedy streams run over both routers' addresses: 4 through the threaded gRPC client (the
    CLI's: gRPC's own retries of its streams once left some waiting until their deadline after a
    kill; this test failed 1 run in 2 then), 2 through the OpenAI API, retried with their
    Idempotency-Key. (The asyncio client, bench/loadgen's, has the gRPC client's resume logic:
    tests/router/test_resume.py.)"""
    from bench.chaos_router import run_router_chaos
    from bench.chaos_router import table as router_table
    # (seed 1: the stop comes first, so the woken router is the kill's standby and no router
    # has to be started again: the restart is the full run's, each kill but the last. A stop of
    # 4 s ends about when the standby leads: the woken router and the clients' connection
    # attempts to it meet the new leader, the case router.client's connect timeout is for)
    args = parse(["--kinds", "kill_router,stop_router", "--faults-per-kind", "1", "--fault-gap-s", "1",
                  "--concurrency", "6", "--clients", "threads,threads,openai", "--max-tokens", "24",
                  "--long-words", "120", "--router-lease-s", "2", "--router-stop-s", "4", "--router-resume-s", "10", "--hang-s", "120", "--seed", "1"])
    assert args.kinds == [] and args.router_kinds == ["kill_router", "stop_router"]
    out = run_router_chaos(args, ray_session.get_runtime_context().gcs_address)
    print(router_table(out), json.dumps(out))  # shown on failure
    assert out["faults_by_kind"] == {"kill_router": 1, "stop_router": 1} and out["router_kills"] == 1, out
    assert {k: c["streams"] for k, c in out["by_client"].items()} == {"threads": 4, "openai": 2}, out
    assert out["completed_identical"] >= 6 and out["wrong"] == 0 and out["hung"] == 0 and out["errored"] == 0, out
    assert out["leaked_blocks"] == 0 and out["stranded_blocks"] == 0, out
    assert out["workers_replaced"] == 0 and out["workers_left"] == 0, out  # the same workers throughout, then none

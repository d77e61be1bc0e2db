"""cli/deploy.py reads start commands as a shell would: every way of writing an open listener or
a Ray without token auth and TLS is refused, the way the shipped files write them passes."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from cli.deploy import _excluded, check_cluster_file
from cli.shell import invocations

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
AWS = DEPLOY / "cluster-aws.yaml"
ENV = ("export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=t RAY_USE_TLS=1 RAY_TLS_SERVER_CERT=c RAY_TLS_SERVER_KEY=k "
       "RAY_TLS_CA_CERT=a")
SERVE = "cd ~/pdserve && .venv/bin/pdserve serve --address auto --config deploy/cluster.yaml"
RAY = "~/pdserve/.venv/bin/ray start --head --port=6379"


def _with_head(tmp_path, *commands: str) -> Path:
    """deploy/cluster-aws.yaml with these head start commands."""
    cfg = copy.deepcopy(yaml.safe_load(AWS.read_text()))
    cfg["head_start_ray_commands"] = list(commands)
    out = tmp_path / "c.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


def test_the_shipped_form_passes(tmp_path):
    check_cluster_file(_with_head(tmp_path, f"{ENV}; {RAY} --dashboard-host=127.0.0.1", f"{ENV}; {SERVE}"))
    check_cluster_file(_with_head(tmp_path, f"{ENV} && {RAY} --dashboard-host localhost", f"{ENV}\n{SERVE} &"))
    check_cluster_file(_with_head(tmp_path, f"{ENV}; {RAY} --include-dashboard=false --dashboard-host 0.0.0.0",
                                  f"{ENV}; {SERVE}"))


@pytest.mark.parametrize("ray", [
    f"{ENV}; {RAY} --dashboard-host 0.0.0.0",
    f"{ENV}; {RAY} --dashboard-host=0.0.0.0",
    f"{ENV}; {RAY} --dashboard-host ::",
    f"{ENV}; {RAY} --dashboard-host=[::]",
    f"{ENV}; {RAY} --dashboard-host=0",
    f"{ENV}; {RAY} '--dashboard-host=0.0.0.0'",
    f"{ENV}; {RAY} --dashboard-host=\"0.0.0.0\"",
    f"{ENV}; {RAY} --dashboard-host head.internal",
    f"{ENV}; h=0.0.0.0; {RAY} --dashboard-host $h",
    f"{ENV}; true && {RAY} --dashboard-host=127.0.0.1 && ray start --head --dashboard-host=0.0.0.0",
    f"{ENV}; {RAY} --include-dashboard=false --include-dashboard=true --dashboard-host=0.0.0.0",
    f"{ENV}; sh -c 'ray start --head --dashboard-host=0.0.0.0'",
    f"{ENV}; nohup env ray start --head --dashboard-host=0.0.0.0 &",
    f"{ENV}; python -m ray.scripts.scripts start --head --dashboard-host=::",
], ids=["space", "equals", "ipv6-any", "ipv6-brackets", "zero", "quoted", "dquoted", "a-name", "variable",
        "second-of-chain", "dashboard-back-on", "sh-c", "nohup-env", "python-m"])
def test_an_open_dashboard_is_refused_however_written(tmp_path, ray):
    with pytest.raises(ValueError, match="dashboard on"):
        check_cluster_file(_with_head(tmp_path, ray, f"{ENV}; {SERVE}"))


@pytest.mark.parametrize("ray", [
    RAY,
    f"RAY_AUTH_MODE=token; {RAY}",                                   # a shell variable, not exported
    f"{ENV}; unset RAY_USE_TLS; {RAY}",
    f"{ENV}; export RAY_USE_TLS=0; {RAY}",
    f"(export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=t); {RAY}",    # a subshell's export stays there
    f"false && {ENV}; {RAY}",                                        # may not have run
    f"if false; then {ENV}; fi; {RAY}",
    f"{ENV} | cat; {RAY}",
    f"{ENV}; env -i {RAY}",
    f"{ENV}; sudo {RAY}",
    f"{ENV}; RAY_TLS_CA_CERT= {RAY}",
    f"{ENV}; $(which ray) start --head",                             # cannot tell what runs
], ids=["bare", "not-exported", "unset", "tls-off", "subshell", "after-false", "if-body", "pipeline", "env-i",
        "sudo", "empty-ca", "unknown-program"])
def test_ray_without_token_auth_and_tls_is_refused(tmp_path, ray):
    with pytest.raises(ValueError, match="RAY_AUTH_MODE=token|RAY_USE_TLS=1|cannot tell which program"):
        check_cluster_file(_with_head(tmp_path, ray, f"{ENV}; {SERVE}"))


@pytest.mark.parametrize("serve,needle", [
    (f"{SERVE} --set 'security.tls_cert=\"\"'", "without TLS"),
    (f"{SERVE} --tls-key=", "without TLS"),
    (f"{SERVE} --tokens-file ''", "without tokens"),
    (f"{SERVE} --set metrics.host=0.0.0.0", "metrics.host 0.0.0.0"),
    (f"{SERVE} --set \"metrics.host='::'\"", "metrics.host ::"),
    (f"{SERVE} --set metrics.worker_port=0", "worker_port"),
    ("cd ~/pdserve && .venv/bin/pdserve serve --address auto --host 0.0.0.0", "serves 0.0.0.0"),  # default config
    ("cd ~/pdserve && .venv/bin/pdserve serve --address auto --host=:: --config deploy/local.yaml", "serves ::"),
    ("cd ~/pdserve && sh -c 'exec .venv/bin/pdserve serve --address auto --config deploy/local.yaml "
     "--set router.host=0.0.0.0'", "serves 0.0.0.0"),
    ("cd ~/pdserve && python -m cli.main serve --address auto --config deploy/local.yaml --host 0.0.0.0",
     "serves 0.0.0.0"),
    (f"{SERVE} --set security.tokens_file=deploy/secrets/nodes/tokens", "reaches every worker"),
    (f"{SERVE} --no-such-flag", "unrecognized arguments"),
    ("cd ~/pdserve && .venv/bin/pdserve serve --address auto --config deploy/missing.yaml", "cannot read config"),
], ids=["no-tls", "no-tls-key-flag", "no-tokens-flag", "metrics-any", "metrics-ipv6", "worker-metrics", "host-flag",
        "host-equals-ipv6", "sh-c-set", "python-m", "tokens-on-workers", "bad-flag", "missing-config"])
def test_pdserve_listeners_beyond_loopback_need_tls_and_tokens(tmp_path, serve, needle):
    ray = f"{ENV}; {RAY} --dashboard-host=127.0.0.1"
    with pytest.raises(ValueError, match=needle):
        check_cluster_file(_with_head(tmp_path, ray, f"{ENV}; {serve}"))


def test_pdserve_serve_needs_ray_tls_too(tmp_path):
    with pytest.raises(ValueError, match="RAY_USE_TLS=1"):
        check_cluster_file(_with_head(tmp_path, f"{ENV}; {RAY}",
                                      f"export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=x; {SERVE}"))


def test_invocations_follow_the_shell():
    """What runs, with which environment and folder (the words as the program gets them)."""
    inv = invocations("a=1; export B=$a C='x y'; cd /w && X=2 nohup sh -c 'exec p --k=\"v w\"' > log 2>&1 & echo $!")
    assert [(i.argv, i.env, i.cwd) for i in inv] == [
        (("p", "--k=v w"), {"B": "1", "C": "x y", "X": "2"}, "/w"), (("echo", "$!"), {"B": "1", "C": "x y"}, "/w")]
    # case arms and tests are read as commands too; only ray start / pdserve serve matter
    assert [i.argv for i in invocations("case $ip in 1) r=a;; *) r=b;; esac; if [ -n x ]; then f; fi")] == [
        ("*)", "r=b"), ("[", "-n", "x", "]"), ("f",)]
    with pytest.raises(ValueError, match="unbalanced"):
        invocations("echo 'open")


@pytest.mark.parametrize("rel,patterns,want", [
    ("deploy/secrets/ca.key", ["/deploy/secrets"], True),
    ("x/deploy/secrets/ca.key", ["/deploy/secrets"], False),     # anchored at the transfer's root
    ("ca.key", ["/deploy/secrets"], False),                      # the nodes/ mount's own root
    ("x/deploy/secrets/ca.key", ["deploy/secrets"], True),       # unanchored with a /: the end of the path
    ("a/__pycache__/m.pyc", ["**/__pycache__"], True),
    (".venv/bin/ray", [".venv"], True),
    ("deploy/secrets", ["secrets/"], False),                     # a trailing /: folders only (this is a file)
    ("deploy/secrets/x", ["secrets/"], True),
    ("deploy/secrets/ca.key", ["*.key"], True),
    ("deploy/secrets/ca.key", ["deploy/*.key"], False),          # * stops at /
])
def test_rsync_exclude_rules(rel, patterns, want):
    assert _excluded(rel, patterns) is want

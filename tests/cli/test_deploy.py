"""Every `ray up` file in deploy/ passes Ray's cluster-config validation and pdserve's checks;
broken copies fail them; the pdserve configs in deploy/ load."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cli.deploy import check_cluster_file, check_security
from router.config import load_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CLUSTER_FILES = sorted(DEPLOY.glob("cluster-*.yaml"))


def test_there_is_a_cloud_cluster_file():
    assert [p.name for p in CLUSTER_FILES] == ["cluster-aws.yaml"]


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_cluster_files_validate(path):
    cfg = check_cluster_file(path)
    types = cfg["available_node_types"]
    assert types["prefill_gpu"]["resources"]["prefill"] >= 1 and types["decode_gpu"]["resources"]["decode"] >= 1


def _broken(tmp_path, path, edit):
    cfg = yaml.safe_load(path.read_text())
    edit(cfg)
    out = tmp_path / "broken.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


@pytest.mark.parametrize("edit,needle", [
    (lambda c: c.update(max_worker=3), "max_worker"),
    (lambda c: c["available_node_types"]["decode_gpu"].update(min_worker=1), "min_worker"),
    (lambda c: c["available_node_types"]["decode_gpu"].update(min_workers=9, max_workers=8), "min_workers 9 > max_workers 8"),
    (lambda c: c.update(max_workers=1), "max_workers"),
    (lambda c: c["available_node_types"]["prefill_gpu"].update(resources={}), "'prefill' resource"),
    (lambda c: c.update(head_start_ray_commands=["ray start --head"]), "pdserve serve --address auto"),
    (lambda c: c.update(worker_start_ray_commands=["ray start --address=$RAY_HEAD_IP:6379"]), "RAY_AUTH_MODE=token"),
    (lambda c: c.update(head_start_ray_commands=[x.replace("127.0.0.1", "0.0.0.0") for x in c["head_start_ray_commands"]]),
     "dashboard on 0.0.0.0"),
    (lambda c: c.update(worker_start_ray_commands=[x.replace("RAY_USE_TLS=1", "RAY_USE_TLS=0")
                                                   for x in c["worker_start_ray_commands"]]), "without Ray's TLS"),
    (lambda c: c.update(rsync_exclude=[".venv"]), "to every worker|reaches every worker"),
    (lambda c: c.update(setup_commands=["cd ~/pdserve && make install"]), "pdserve pull"),
], ids=["typo-top", "typo-node", "min-over-max", "sum-min-over-global-max", "no-prefill", "no-serve", "ray-no-auth",
        "open-dashboard", "ray-no-tls", "secrets-to-workers", "no-model-pull"])
def test_broken_copies_fail(tmp_path, edit, needle):
    for path in CLUSTER_FILES:
        with pytest.raises(Exception, match=needle.replace("(", r"\(")):
            check_cluster_file(_broken(tmp_path, path, edit))


@pytest.mark.parametrize("name", ["local.yaml", "cluster.yaml"])
def test_pdserve_configs_load(name):
    cfg = load_config(DEPLOY / name)
    if name == "cluster.yaml":
        aws = yaml.safe_load((DEPLOY / "cluster-aws.yaml").read_text())["available_node_types"]
        # The pool controller never asks for more workers than the node types can host.
        assert cfg.autoscale.prefill.max_replicas <= aws["prefill_gpu"]["max_workers"] * aws["prefill_gpu"]["resources"]["prefill"]
        assert cfg.autoscale.decode.max_replicas <= aws["decode_gpu"]["max_workers"] * aws["decode_gpu"]["resources"]["decode"]
        assert cfg.device == "cuda" and cfg.autoscale.enabled
        # gRPC open to other machines: TLS and tokens, never an open door
        assert cfg.router.host == "0.0.0.0" and cfg.security.tls_cert and cfg.security.tokens_file
        assert not cfg.security.insecure


def test_make_secrets_writes_what_the_cluster_config_names(tmp_path):
    """deploy/make-secrets.sh (run on a copy of deploy/) writes every file deploy/cluster.yaml
    names, and the router accepts them: TLS loads, the tokens parse, the door opens on 0.0.0.0."""
    import shutil
    import subprocess

    from router.auth import front_door
    shutil.copytree(DEPLOY, tmp_path / "deploy", ignore=shutil.ignore_patterns("secrets"))
    r = subprocess.run(["bash", str(tmp_path / "deploy" / "make-secrets.sh"), "head.example", "10.0.0.5"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    sec = load_config(DEPLOY / "cluster.yaml").security
    sec = type(sec)(**{k: str(tmp_path / v) if k in ("tls_cert", "tls_key", "tokens_file") else v
                       for k, v in vars(sec).items()})
    door = front_door(sec, "0.0.0.0", env={})
    assert door.tls is not None and len(door.auth.tokens) == 1
    assert len((tmp_path / "deploy" / "secrets" / "nodes" / "ray_auth_token").read_text().strip()) == 64
    text = subprocess.run(["openssl", "x509", "-in", sec.tls_cert, "-noout", "-text"], capture_output=True,
                          text=True, check=True).stdout
    assert "DNS:head.example" in text and "IP Address:10.0.0.5" in text


def test_the_onprem_loopback_file_validates_with_token_auth_on_every_node():
    """deploy/onprem-loopback.yaml: `ray up` with the local provider on 127.0.0.1-3 (run by hand:
    it needs an SSH server; deploy/README.md). Ray's own validation, and Ray's token auth in
    every start command (Ray resolves a 127.0.0.1 head to the machine's address)."""
    import copy

    from ray.autoscaler._private.util import prepare_config, validate_config
    raw = yaml.safe_load((DEPLOY / "onprem-loopback.yaml").read_text())
    cfg = prepare_config(copy.deepcopy(raw))
    validate_config(cfg)
    assert cfg["provider"]["type"] == "local" and cfg["provider"]["worker_ips"] == ["127.0.0.2", "127.0.0.3"]
    for c in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]:
        assert "RAY_AUTH_MODE=token" in c and "ray_auth_token" in c and "RAY_USE_TLS=1" in c, c
    check_security(cfg, "onprem-loopback.yaml")  # the listeners and the secrets as in the cloud file


def test_node_setup_pulls_the_catalogue_model_the_config_names(tmp_path):
    """`python -m cli.deploy model CONFIG` (what the setup commands pull) follows `model:`."""
    from cli.deploy import catalogue_model, main
    assert catalogue_model(DEPLOY / "cluster.yaml") is None  # null: the bundled model, installed with pdserve
    for model, want in (("gemma3-270m", "gemma3-270m"), ("smollm2-135m", None), ("/models/x.gguf", None)):
        f = tmp_path / "c.yaml"
        f.write_text(f"model: {model}\n")
        assert catalogue_model(f) == want
    assert main(["model", str(tmp_path / "missing.yaml")]) == 2

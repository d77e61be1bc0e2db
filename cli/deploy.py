"""Checks for `ray up` cluster files (deploy/*.yaml) before they reach a cloud.

``check_cluster_file`` runs Ray's own validation (the JSON schema and checks ``ray up`` runs,
offline), then what pdserve needs on top: per node type ``min_workers <= max_workers`` (Ray
checks only the global sum), a node type advertising each of the ``prefill`` and ``decode``
resources, a head node without them, a head start command that runs
``pdserve serve --address auto``, node setup that pulls the model the pdserve config names, and
``check_security``:

- every command is read as a shell would (``;``, ``&&``, ``|``, ``&``, subshells, ``sh -c``,
  ``export``, ``VAR=x cmd``, ``env``, ``nohup``/``exec``; ``--opt value`` and ``--opt=value``): each
  ``ray start`` and ``pdserve serve`` must run with Ray's token auth and mutual TLS in its
  environment (``RAY_AUTH_MODE=token`` + a token, ``RAY_USE_TLS=1`` + cert, key and CA); Ray's
  dashboard only on loopback (it serves Ray's job API without TLS); ``pdserve serve``'s listeners,
  from its ``--config`` plus flags and ``--set``, beyond loopback only with TLS and tokens, its
  ``/metrics`` (no authentication) on loopback, and no per-worker ``/metrics`` (workers bind it on
  every interface);
- the file mounts carry no part of ``deploy/secrets/`` to the nodes but ``deploy/secrets/nodes/``
  (Ray's token and CA certificates, the node issuer): rsync's exclude rules are applied as Ray's
  rsync applies them, to the sync to the head and to the head's sync to each worker. Nor may the
  router's key or tokens lie in a mount that reaches workers.

``python -m cli.deploy model CONFIG`` prints the catalogue model a pdserve config serves
(nothing when there is none to pull): a ``ray up`` file's setup commands pull it on every node
with ``pdserve pull "$(...)"``, so the node setup follows the config's ``model:``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import posixpath
import re
import sys
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from cli.main import build_parser
from cli.shell import Invocation, invocations

ROOT = Path(__file__).resolve().parents[1]  # `ray up` runs from the repository root: mounts' "." is here
SECRETS = "deploy/secrets"
EVERY_NODE = "deploy/secrets/nodes"  # what a node needs to join Ray; the rest of deploy/secrets/ stays off the nodes
# what deploy/make-secrets.sh writes, relative to the root (probes for the file mounts)
SECRET_FILES = ("deploy/secrets/ca.key", "deploy/secrets/ca.pem", "deploy/secrets/ray-ca.key",
                "deploy/secrets/head/server.pem", "deploy/secrets/head/server.key", "deploy/secrets/head/tokens",
                "deploy/secrets/nodes/ray_auth_token", "deploy/secrets/nodes/ray-ca.pem",
                "deploy/secrets/nodes/ray-issuer.pem", "deploy/secrets/nodes/ray-issuer.key")
HOME_ONLY = ("deploy/secrets/ca.key", "deploy/secrets/ray-ca.key")  # the CAs' keys: on no node
RAY_TLS_FILES = ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")
COMMAND_KEYS = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
                "head_start_ray_commands", "worker_start_ray_commands")


def check_cluster_file(path: str | Path, root: str | Path = ROOT) -> dict:
    """Validate a `ray up` config; returns it as Ray prepares it.

    Args:
        path: the cluster file.
        root: where `ray up` runs (the file mounts' local paths are relative to it).

    Raises:
        ValueError: (or Ray's jsonschema ValidationError, a ValueError subclass is not
            guaranteed) with a message naming the problem.
    """
    cfg = _prepared(path)
    types = cfg["available_node_types"]
    for name, t in types.items():
        lo, hi = t.get("min_workers", 0), t.get("max_workers", cfg["max_workers"])
        if lo > hi:
            raise ValueError(f"{path}: node type {name}: min_workers {lo} > max_workers {hi}")
    for res in ("prefill", "decode"):
        if not any(t.get("resources", {}).get(res, 0) > 0 for t in types.values()):
            raise ValueError(f"{path}: no node type advertises the {res!r} resource: the {res} pool cannot be placed")
    head = types[cfg["head_node_type"]]
    if set(head.get("resources", {})) & {"prefill", "decode"}:
        raise ValueError(f"{path}: the head node type advertises prefill/decode: workers would land on the router")
    serves = [inv for c in cfg.get("head_start_ray_commands", []) for inv in invocations(c)
              if _program(inv) == "pdserve-serve"]
    if not any(_serve_args(inv, path).address == "auto" for inv in serves):
        raise ValueError(f"{path}: head_start_ray_commands must start `pdserve serve --address auto`")
    # every node resolves the model from its own cache (router.nodes), the head too (its tokenizer)
    if not any("pdserve pull" in c for c in cfg.get("setup_commands", [])):
        raise ValueError(f"{path}: setup_commands must run `pdserve pull` for the model the pdserve config names "
                         "(`pdserve pull \"$(python -m cli.deploy model CONFIG)\"`): every node needs it")
    check_security(cfg, path, root)
    return cfg


def _prepared(path: str | Path) -> dict:
    # (heavy: Ray's autoscaler, loaded only to check a cluster file)
    import yaml
    from ray.autoscaler._private.util import prepare_config, validate_config
    raw = yaml.safe_load(Path(path).read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a mapping")
    cfg = prepare_config(copy.deepcopy(raw))
    validate_config(cfg)
    return cfg


def check_security(cfg: dict, path: str | Path, root: str | Path = ROOT) -> None:
    """What every `ray up` file must hold to (module docstring): Ray's listeners behind token auth
    and TLS, pdserve's beyond loopback only with TLS and tokens, secrets only where needed.

    Raises:
        ValueError: naming the file, the command and what is wrong.
    """
    mounts = Mounts(cfg, Path(root))
    lists = [(key, cfg.get(key, [])) for key in COMMAND_KEYS]
    lists += [(f"available_node_types.{n}.{k}", t.get(k, [])) for n, t in cfg["available_node_types"].items()
              for k in ("initialization_commands", "worker_setup_commands")]
    for key, commands in lists:
        for c in commands:
            for inv in invocations(c):
                for problem in _listener_problems(inv, mounts, path):
                    raise ValueError(f"{path}: {key}: `{c.strip()[:70]}...`: {problem}")
    for p in SECRET_FILES:
        if not p.startswith(EVERY_NODE + "/") and mounts.reaches_workers(p):
            raise ValueError(f"{path}: the file mounts carry {p} to every worker node; only {EVERY_NODE}/ may go "
                             "there (exclude /deploy/secrets from the checkout's mount: rsync_exclude)")
        if p in HOME_ONLY and mounts.reaches_head(p):
            raise ValueError(f"{path}: the file mounts carry {p}, a CA's key, to the head; it stays where "
                             "make-secrets.sh ran")


_MODULES = {"cli.main": "pdserve", "ray.scripts.scripts": "ray"}  # `python -m X` that runs them


def _program(inv: Invocation) -> str | None:
    """"ray-start", "pdserve-serve", "unknown" (a program the check cannot name that is given
    start/serve), or None (anything else)."""
    argv = list(inv.argv)
    if re.fullmatch(r"python[\d.]*", posixpath.basename(argv[0])) and "-m" in argv[:-1]:
        i = argv.index("-m")
        argv = [_MODULES.get(argv[i + 1], argv[i + 1])] + argv[i + 2:]
    name = posixpath.basename(argv[0])
    words = [a for a in argv[1:] if not a.startswith("-")]
    if name == "ray" and words[:1] == ["start"]:
        return "ray-start"
    if name == "pdserve" and words[:1] == ["serve"]:
        return "pdserve-serve"
    if re.search(r"[$`]", argv[0]) and {"start", "serve"} & set(argv[1:]):
        return "unknown"
    return None


def _option(argv: Sequence[str], name: str) -> list[str]:
    """Every value of ``name`` in ``argv``, given as ``name value`` or ``name=value``."""
    vals = []
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            vals.append(argv[i + 1])
        elif a.startswith(name + "="):
            vals.append(a[len(name) + 1:])
    return vals


def _ray_env_problems(env: dict[str, str]) -> list[str]:
    out = []
    if env.get("RAY_AUTH_MODE") != "token" or not (env.get("RAY_AUTH_TOKEN_PATH") or env.get("RAY_AUTH_TOKEN")):
        out.append("runs without Ray's token auth (RAY_AUTH_MODE=token with RAY_AUTH_TOKEN_PATH): anyone who "
                   "reaches Ray's ports could run code on the cluster")
    if env.get("RAY_USE_TLS", "").lower() not in ("1", "true") or not all(env.get(k) for k in RAY_TLS_FILES):
        out.append("runs without Ray's TLS (RAY_USE_TLS=1 with " + ", ".join(RAY_TLS_FILES) + "): the Ray token, "
                   "the cluster key and prompts would cross the network in clear")
    return out


def _listener_problems(inv: Invocation, mounts: Mounts, path: str | Path) -> list[str]:
    from router.auth import is_loopback  # (heavy: the router's gRPC and TLS, only to check a cluster file)
    prog = _program(inv)
    if prog == "unknown":
        return [f"cannot tell which program `{inv.argv[0]}` is: name ray or pdserve by its path"]
    if prog == "ray-start":
        out = _ray_env_problems(inv.env)
        on = [v.lower() not in ("false", "0", "no", "off") for v in _option(inv.argv, "--include-dashboard")]
        for host in _option(inv.argv, "--dashboard-host"):
            if (not on or on[-1]) and not is_loopback(host):
                out.append(f"the dashboard on {host} serves Ray's job API, without TLS, beyond loopback (on "
                           "0.0.0.0 or :: to anyone): --dashboard-host=127.0.0.1")
        return out
    if prog != "pdserve-serve":
        return []
    out = _ray_env_problems(inv.env)
    cfg, local = _serve_config(inv, mounts, path)
    sec = cfg.security
    if not is_loopback(cfg.router.host):
        missing = [w for w, ok in (("TLS (security.tls_cert and tls_key)", sec.tls_cert and sec.tls_key),
                                   ("tokens (security.tokens_file, PDSERVE_TOKENS or tls_client_ca)",
                                    sec.tokens_file or inv.env.get("PDSERVE_TOKENS") or sec.tls_client_ca))
                   if not ok]
        if missing:
            out.append(f"serves {cfg.router.host} (beyond loopback) without {' and '.join(missing)}")
    if cfg.metrics.port is not None and not is_loopback(cfg.metrics.host):
        out.append(f"metrics.host {cfg.metrics.host}: /metrics has no authentication; keep it on 127.0.0.1")
    if cfg.metrics.worker_port is not None:
        out.append("metrics.worker_port is set: each worker would serve /metrics on every interface of its node "
                   "without authentication (the router's /metrics repeats every worker's): set it to null")
    for f in (sec.tls_key, sec.tokens_file):
        if f and mounts.reaches_workers(local(f)):
            out.append(f"{f} (the router's key or tokens) lies in a file mount that reaches every worker")
    return out


def _serve_args(inv: Invocation, path: str | Path) -> argparse.Namespace:
    argv = list(inv.argv)
    i = argv.index("serve")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(argv[i:])
    except SystemExit:
        raise ValueError(f"{path}: `pdserve {' '.join(argv[i:])[:60]}`: {err.getvalue().strip()[-200:]}") from None


def _serve_config(inv: Invocation, mounts: Mounts, path: str | Path):
    """The config ``pdserve serve`` would run with (as cli.main.cmd_serve_cluster builds it), and a
    function from a path it names to that path in this checkout."""
    # (heavy: the router's config and what it imports, loaded only to check a cluster file)
    import yaml

    from router.config import ConfigError, load_config  # (heavy: as above)
    args = _serve_args(inv, path)
    overrides = {k: v for k, v in (("router.host", args.host), ("security.tls_cert", args.tls_cert),
                                   ("security.tls_key", args.tls_key), ("security.tls_client_ca", args.tls_client_ca),
                                   ("security.tokens_file", args.tokens_file), ("security.insecure", args.insecure),
                                   ("metrics.port", args.metrics_port))
                 if v is not None}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key.strip()] = yaml.safe_load(value)

    def local(p: str) -> str:
        return mounts.local(p if p.startswith(("/", "~")) else posixpath.join(inv.cwd or ".", p))
    try:
        cfg_path = None if args.config is None else mounts.root / local(args.config)
        return load_config(cfg_path, overrides), local
    except ConfigError as e:
        raise ValueError(f"{path}: `pdserve serve`: {e}") from None


# ---- file mounts: what reaches the head, and each worker ------------------------------------------------

class Mounts:
    """The file mounts as Ray syncs them: ``ray up`` rsyncs each local path to the head (with
    ``rsync_exclude``), then the head's autoscaler rsyncs the head's copy of each to every worker
    (same excludes); ``cluster_synced_files`` go from the head to every worker as they are."""

    def __init__(self, cfg: dict, root: Path):
        user = cfg.get("auth", {}).get("ssh_user", "root")
        self.home = "/root" if user == "root" else f"/home/{user}"
        self.root = root
        self.mounts = [(self._remote(r), posixpath.normpath(str(l))) for r, l in cfg.get("file_mounts", {}).items()]
        self.excludes = list(cfg.get("rsync_exclude") or [])
        self.synced = [self._remote(p) for p in cfg.get("cluster_synced_files") or []]

    def _remote(self, p: str) -> str:
        return posixpath.normpath(self.home + p[1:] if p.startswith("~") else p)

    def local(self, remote_or_relative: str) -> str:
        """A path a node command names (``~/pdserve/x``, or relative to the root), in this checkout."""
        p = remote_or_relative
        if p.startswith(("/", "~")):
            p = self._remote(p)
            for r, l in sorted(self.mounts, key=lambda m: -len(m[0])):
                if _under(p, r):
                    return posixpath.normpath(posixpath.join(l, posixpath.relpath(p, r)))
        return posixpath.normpath(p)

    def _on_head(self, p: str, excludes: bool) -> list[str]:
        """Where the local file ``p`` lies on the head: through each mount whose local path holds it."""
        return [posixpath.normpath(posixpath.join(r, posixpath.relpath(p, l))) for r, l in self.mounts
                if _under(p, l) and not (excludes and _excluded(posixpath.relpath(p, l), self.excludes))]

    def reaches_head(self, p: str) -> bool:
        return bool(self._on_head(p, excludes=True))

    def reaches_workers(self, p: str) -> bool:
        """Whether the local file ``p`` reaches the workers, wherever the head holds it (a file
        pushed to the head by hand lies where a mount would have put it)."""
        for h in self._on_head(p, excludes=False):
            if any(_under(h, s) for s in self.synced):
                return True
            if any(_under(h, r) and not _excluded(posixpath.relpath(h, r), self.excludes) for r, _ in self.mounts):
                return True
        return False


def _under(p: str, d: str) -> bool:
    return d in (".", "") or p == d or p.startswith(d.rstrip("/") + "/")


def _excluded(rel: str, patterns: Sequence[str]) -> bool:
    """Whether rsync skips ``rel`` (relative to the transfer's root) for these ``--exclude`` patterns:
    a pattern matches a path or one of its folders (rsync does not descend into an excluded one).
    Rules: a leading / anchors at the root; a trailing / matches folders only; a pattern with a /
    or ** inside matches the end of the path, otherwise the last name; * stops at /, ** does not."""
    parts = PurePosixPath(rel).parts
    for i in range(1, len(parts) + 1):
        sub, is_dir = "/".join(parts[:i]), i < len(parts)
        for pat in patterns:
            if pat.endswith("/") and not is_dir:
                continue
            anchored, body = pat.startswith("/"), pat.strip("/")
            rx = "".join(".*" if t == "**" else "[^/]*" if t == "*" else "[^/]" if t == "?" else re.escape(t)
                         for t in re.split(r"(\*\*|\*|\?)", body) if t)
            if anchored:
                hit = re.fullmatch(rx, sub)
            elif "/" in body or "**" in body:
                hit = re.fullmatch(f"(?:.*/)?{rx}", sub)
            else:
                hit = re.fullmatch(rx, parts[i - 1])
            if hit:
                return True
    return False


def catalogue_model(config: str | Path) -> str | None:
    """The catalogue model the pdserve config at ``config`` serves, which every node must pull;
    None when its ``model:`` is null or the bundled one (installed with pdserve), a file or a folder.

    Raises:
        router.config.ConfigError: the config does not load.
    """
    # (heavy: the engine's catalogue and the router's config, loaded only for `model`)
    from engine.models import catalog
    from router.config import load_config
    model = load_config(config).model
    entry = catalog.lookup(model) if model is not None else None
    return entry.name if entry is not None and not entry.bundled else None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cli.deploy", description="Helpers for `ray up` node setup.")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("model", help="print the catalogue model a pdserve config serves (nothing if none to pull)")
    m.add_argument("config", help="the pdserve cluster config, e.g. deploy/cluster.yaml")
    args = p.parse_args(argv)
    try:
        name = catalogue_model(args.config)
    except ValueError as e:
        print(f"cli.deploy: error: {e}", file=sys.stderr)
        return 2
    if name:
        print(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())

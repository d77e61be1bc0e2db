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
from collections.abc import Collection
from typing import Any

from engine.errors import InvalidRequestError
from engine.request import Guided

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
_FENCE = re.compile(r"^```[A-Za-z]*\s*\n?(.*?)\n?```$", re.S)  # a Markdown code block, the whole answer


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


def _call(name: str, args: Any) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def bare_calls(text: str, names: Collection[str]) -> list[dict[str, Any]] | None:
    """Calls written without the ``<tool_call>`` tags: the whole answer one JSON object
    ``{"name": <an offered function>, "arguments": {...}}``, or a list of them, bare or in a
    Markdown code fence. Small Qwen2.5 models answer a ``tool_choice: auto`` request so as often
    as with the tags (the 0.5B on bench/agents.py's asks did so every time it called). Only the
    whole answer and only offered names count, so prose or JSON that is not a call stays
    content. None when the answer is anything else."""
    s = text.strip()
    m = _FENCE.match(s)
    if m:
        s = m.group(1).strip()
    if not names or not s or s[0] not in "{[":
        return None
    try:
        obj = json.loads(s)
    except json.JSONDecodeError:
        return None
    calls = []
    for o in obj if isinstance(obj, list) else [obj]:
        if not isinstance(o, dict) or o.get("name") not in names or set(o) - {"name", "arguments", "parameters"}:
            return None
        args = o.get("arguments", o.get("parameters", {}))
        if not isinstance(args, dict):
            return None
        calls.append(_call(o["name"], args))
    return calls or None


def parse_calls(text: str, names: Collection[str] = ()) -> tuple[str | None, list[dict[str, Any]]]:
    """(content outside the calls or None, OpenAI ``tool_calls``) from a model's output. A block
    whose JSON does not parse as ``{"name", "arguments"}`` stays in the content. ``names``: the
    offered functions; with them, an answer that is only a call without the tags is one too
    (``bare_calls``)."""
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
        calls.append(_call(obj["name"], args))
    if not calls and (bare := bare_calls(text, names)):
        return None, bare
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


# ---- streaming -------------------------------------------------------------------------------
# A block's start once the call's name is known: what the Hermes form puts before the arguments.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_HEAD_CHARS = 256  # a block whose start does not read as a call by then is parsed whole at its close


class CallStream:
    """One choice's text, as it streams, split into content and tool calls (OpenAI's streamed
    ``delta.tool_calls``): ``feed`` each new piece of text, ``finish`` at the end; each returns
    events, in order: ``("content", text)``, ``("call", k, id, name)`` (call ``k`` starts),
    ``("args", k, fragment)`` (its arguments' JSON, as generated).

    States: ``text`` (content; a tail that may begin ``<tool_call>`` is held, and so is trailing
    whitespace, dropped before a call as ``parse_calls`` strips it) -> ``head`` (after
    ``<tool_call>``: until ``{"name": "f", "arguments":`` reads whole, the call is announced) ->
    ``args`` (the arguments value passed on as it comes, its end found by bracket depth outside
    strings) -> ``tail`` (until ``</tool_call>``) -> ``text``. A block whose start is not that
    shape (other key order, not JSON) is held in ``block`` to its close and parsed whole, as
    ``parse_calls`` does: a call, or content again, so text that is no call still reaches the
    client. Once announced a call stays one: cut short (max_tokens), its arguments end where
    the output did.

    With the offered function ``names``, an answer whose first non-blank character opens JSON
    or a code fence may be a call without the tags (``bare_calls``): it is held whole (``bare``)
    and at ``finish`` becomes that call, or, if it is not one, the content (and tagged calls)
    it holds, at once. So such an answer streams in one piece at its end.
    """

    def __init__(self, names: Collection[str] = ()) -> None:
        self.calls = 0  # calls announced
        self.names = tuple(names)
        self._fresh = bool(self.names)  # nothing but blanks seen yet: a bare call may be coming
        self._mode = "text"
        self._buf = ""  # text not yet passed on
        self._ws = ""  # trailing whitespace held in text mode
        self._pre = ""  # the whitespace held before the open block (content again if it is no call)
        self._depth, self._in_str, self._esc, self._started, self._scalar = 0, False, False, False, False

    def feed(self, text: str) -> list[tuple]:
        out: list[tuple] = []
        self._buf += text
        if self._fresh:
            start = self._buf.lstrip()[:1]
            if not start:
                return out
            self._fresh = False
            if start in "{[`":
                self._mode = "bare"
        while getattr(self, "_" + self._mode)(out):
            pass
        return out

    def _bare(self, out: list[tuple]) -> bool:
        return False  # held to the end (``finish``)

    def finish(self) -> list[tuple]:
        """The events for what is still held, at the choice's end."""
        out: list[tuple] = []
        if self._mode == "bare":
            calls = bare_calls(self._buf, self.names)
            if calls:
                for c in calls:
                    out += [("call", self.calls, c["id"], c["function"]["name"]),
                            ("args", self.calls, c["function"]["arguments"])]
                    self.calls += 1
                self._buf = ""
                return out
            held, self._buf, self._mode = self._buf, "", "text"  # not a bare call: as any other text
            out = self.feed(held)
        if self._mode == "text":
            rest = self._ws + self._buf
            if self.calls:
                rest = rest.rstrip()
            if rest:
                out.append(("content", rest))
        elif self._mode in ("head", "block"):  # a block never closed: no call, content as written
            out.append(("content", self._pre + OPEN + self._buf))
        self._buf = self._ws = ""
        return out

    def _content(self, text: str, out: list[tuple]) -> None:
        text = self._ws + text
        kept = text.rstrip()
        self._ws = text[len(kept):]
        if kept:
            out.append(("content", kept))

    def _text(self, out: list[tuple]) -> bool:
        k = self._buf.find(OPEN)
        if k >= 0:
            self._content(self._buf[:k], out)
            self._pre, self._ws = self._ws, ""
            self._buf, self._mode = self._buf[k + len(OPEN):], "head"
            return True
        hold = next((n for n in range(min(len(OPEN) - 1, len(self._buf)), 0, -1)
                     if OPEN.startswith(self._buf[-n:])), 0)
        self._content(self._buf[:len(self._buf) - hold], out)
        self._buf = self._buf[len(self._buf) - hold:]
        return False

    def _head(self, out: list[tuple]) -> bool:
        m = _HEAD.match(self._buf)
        if m and _NAME.match(m.group(1)):
            out.append(("call", self.calls, f"call_{uuid.uuid4().hex[:24]}", m.group(1)))
            self.calls += 1
            self._buf, self._mode = self._buf[m.end():], "args"
            self._depth, self._in_str, self._esc, self._started, self._scalar = 0, False, False, False, False
            return True
        if CLOSE in self._buf or len(self._buf) > _HEAD_CHARS:
            self._mode = "block"
            return True
        return False

    def _block(self, out: list[tuple]) -> bool:
        k = self._buf.find(CLOSE)
        if k < 0:
            return False
        block = OPEN + self._buf[:k + len(CLOSE)]
        self._buf, self._mode = self._buf[k + len(CLOSE):], "text"
        _, calls = parse_calls(block)
        if not calls:
            self._content(self._pre + block, out)
            return True
        f = calls[0]["function"]
        out.append(("call", self.calls, calls[0]["id"], f["name"]))
        out.append(("args", self.calls, f["arguments"]))
        self.calls += 1
        return True

    def _args(self, out: list[tuple]) -> bool:
        buf, start, end = self._buf, None, None
        for i, c in enumerate(buf):
            if not self._started:
                if c.isspace():
                    continue
                self._started, start = True, i
                if c in "{[":
                    self._depth = 1
                elif c == '"':
                    self._in_str = True
                else:
                    self._scalar = True  # a number or literal: ends at the first character past it
                continue
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
                    if self._depth == 0:
                        end = i + 1
                        break
            elif self._scalar:
                if c in ",}]<" or c.isspace():
                    end = i
                    break
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
            elif c == "<":  # no JSON: the block closes early; the arguments end here
                end = i
                break
        if start is None and self._started:
            start = 0
        frag = buf[start:end] if start is not None else ""
        if frag:
            out.append(("args", self.calls - 1, frag))
        if end is None:
            self._buf = ""
            return False
        self._buf, self._mode = buf[end:], "tail"
        return True

    def _tail(self, out: list[tuple]) -> bool:
        k = self._buf.find(CLOSE)
        if k < 0:
            self._buf = self._buf[-(len(CLOSE) - 1):]
            return False
        self._buf, self._mode = self._buf[k + len(CLOSE):], "text"
        return True


def call_deltas(events: list[tuple]) -> list[dict[str, Any]]:
    """``CallStream`` events as OpenAI's chunk deltas: runs of content one ``{"content"}``, runs
    of call events one ``{"tool_calls": [...]}`` (a call's start and its arguments in one entry)."""
    deltas: list[dict[str, Any]] = []
    for ev in events:
        last = deltas[-1] if deltas else None
        if ev[0] == "content":
            if last is not None and "content" in last:
                last["content"] += ev[1]
            else:
                deltas.append({"content": ev[1]})
            continue
        if last is None or "tool_calls" not in last:
            last = {"tool_calls": []}
            deltas.append(last)
        entries = last["tool_calls"]
        if ev[0] == "call":
            entries.append({"index": ev[1], "id": ev[2], "type": "function",
                            "function": {"name": ev[3], "arguments": ""}})
        elif entries and entries[-1]["index"] == ev[1]:
            entries[-1]["function"]["arguments"] += ev[2]
        else:
            entries.append({"index": ev[1], "function": {"arguments": ev[2]}})
    return deltas

"""The OpenAI API's responses: pdserve's ``GenerateResponse`` stream onto OpenAI's objects.

Pure (no server: router.openai_http serves it; the requests are router.openai_api's). One
:class:`Shaper` per request builds a chunk per response while streaming, or the whole answer;
``usage`` counts each prompt once over its ``n`` choices.

Chat with ``tools`` offered (router/tools.py): calls parsed into ``tool_calls`` with
``finish_reason: "tool_calls"``; streamed as OpenAI streams them (router.tools.CallStream): what
comes before a call is ``content``, then per call a ``delta.tool_calls`` entry with its
``index``, ``id``, ``type`` and ``function.name``, then its ``function.arguments`` in fragments
as they are generated; the finish comes last, in a chunk of its own.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pdserve.v1 import pdserve_pb2 as pb
from router.tools import CallStream, call_deltas, parse_calls

FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


def usage(finals: list[pb.Usage], n: int) -> dict[str, Any]:
    """OpenAI's usage over every choice (prompt-major): each prompt counted once, not once per
    each of its ``n`` choices."""
    finals_ = [u or pb.Usage() for u in finals]  # (None: a choice without its last response yet)
    prompt = sum(u.prompt_tokens for u in finals_[::n])
    cached = sum(u.cached_prompt_tokens for u in finals_[::n])
    completion = sum(u.completion_tokens for u in finals_)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _entries(lps) -> list[tuple[int, float | None, list[tuple[int, float]] | None]]:
    return [(x.token_id, x.logprob, [(t.token_id, t.logprob) for t in x.top]) for x in lps]


class Shaper:
    """Builds one endpoint's response objects from each choice's pdserve responses: a chunk
    per response while streaming (``chunk``), or the whole answer (``add`` each, then
    ``whole``). ``token_text``: a token id's text (logprobs name tokens by their text).
    ``echo``: per choice, the prompt's text to put before its completion (a completion's
    ``echo``; its logprobs then start with the prompt's, the first token's being null)."""

    def __init__(self, chat: bool, rid: str, model: str, choices: int, token_text=None,
                 echo: list[str] | None = None, tools: Sequence[str] = ()) -> None:
        self.chat, self.rid, self.model, self.echo = chat, rid, model, echo
        # chat with tools offered, their names: parse calls out of the text (router.tools)
        self.tools = tuple(tools) if chat else ()
        self._calls = [CallStream(self.tools) for _ in range(choices)] if self.tools else None  # (streaming)
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.token_text = token_text or str
        self._started: set[int] = set()  # choices whose first chunk is out (role, echo)
        self.texts = [""] * choices
        self.finishes = [0] * choices
        self.usages: list[Any] = [None] * choices
        self.logprobs: list[list[Any]] = [[] for _ in range(choices)]
        self._offset = [0] * choices  # a completion's text_offset: characters of the choice so far

    def _head(self, chunk: bool) -> dict[str, Any]:
        obj = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def _take(self, index: int, r: pb.GenerateResponse) -> tuple[str, list, bool]:
        """(text, logprob entries, first of its choice) of one response; echo goes first."""
        first = index not in self._started
        self._started.add(index)
        text, entries = r.text, _entries(r.logprobs)
        if first and self.echo is not None:
            text = self.echo[index] + text
            if r.prompt_token_ids:
                entries = [(r.prompt_token_ids[0], None, None), *_entries(r.prompt_logprobs), *entries]
        if r.finish_reason:
            self.usages[index] = r.usage
        return text, entries, first

    def _logprobs(self, index: int, entries: list) -> dict[str, Any] | None:
        if not entries:
            return None
        text = self.token_text
        if self.chat:
            def entry(token_id: int, logprob: float) -> dict[str, Any]:
                t = text(token_id)
                return {"token": t, "logprob": logprob, "bytes": list(t.encode())}
            return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]}
                                for t, lp, top in entries], "refusal": None}
        tokens = [text(t) for t, _, _ in entries]
        offsets = []
        for t in tokens:
            offsets.append(self._offset[index])
            self._offset[index] += len(t)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [None if top is None else {text(a): b for a, b in top} for _, _, top in entries],
                "text_offset": offsets}

    def chunks(self, index: int, r: pb.GenerateResponse) -> list[dict[str, Any]]:
        """The streamed chunks for one response of choice ``index`` (none: its text is held)."""
        if self._calls is None:
            return [self.chunk(index, r)]
        reason = FINISH.get(r.finish_reason)
        text, entries, first = self._take(index, r)
        calls = self._calls[index]
        deltas = call_deltas(calls.feed(text) + (calls.finish() if reason else []))
        if first:  # the first chunk names the role
            deltas[:1] = [{"role": "assistant", **(deltas[0] if deltas else {"content": ""})}]
        lps = self._logprobs(index, entries)
        if lps is not None and not deltas:
            deltas = [{}]
        if reason:
            deltas.append({})
        out = [{**self._head(True), "choices": [{"index": index, "delta": d, "logprobs": None,
                                                 "finish_reason": None}]} for d in deltas]
        if out:
            out[0]["choices"][0]["logprobs"] = lps
        if reason:
            out[-1]["choices"][0]["finish_reason"] = _tool_finish(reason) if calls.calls else reason
        return out

    def chunk(self, index: int, r: pb.GenerateResponse) -> dict[str, Any]:
        """The streamed chunk for one response of choice ``index`` (without tools: ``chunks``)."""
        reason = FINISH.get(r.finish_reason)
        text, entries, first = self._take(index, r)
        lps = self._logprobs(index, entries)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}  # the first chunk names the role
            if text or not reason:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": reason}
        return {**self._head(True), "choices": [choice]}

    def usage(self, n: int) -> dict[str, Any]:
        return usage(self.usages, n)

    def usage_chunk(self, n: int) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": self.usage(n)}

    def add(self, index: int, r: pb.GenerateResponse) -> None:
        """Take one response of choice ``index`` into the whole answer."""
        text, entries, _ = self._take(index, r)
        self.texts[index] += text
        self.logprobs[index].extend(entries)
        if r.finish_reason:
            self.finishes[index] = r.finish_reason

    def whole(self, n: int) -> dict[str, Any]:
        choices = []
        for i, (t, f) in enumerate(zip(self.texts, self.finishes)):
            lps = self._logprobs(i, self.logprobs[i])
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": t}
                reason = FINISH.get(f)
                if self.tools:
                    content, calls = parse_calls(t, self.tools)
                    if calls:
                        message = {"role": "assistant", "content": content, "tool_calls": calls}
                        reason = _tool_finish(reason)
                choices.append({"index": i, "message": message, "logprobs": lps, "finish_reason": reason})
            else:
                choices.append({"index": i, "text": t, "logprobs": lps, "finish_reason": FINISH.get(f)})
        return {**self._head(False), "choices": choices, "usage": self.usage(n)}


def _tool_finish(reason: str | None) -> str | None:
    """OpenAI's finish for an answer that made calls: tool_calls, unless it was cut short."""
    return "tool_calls" if reason == "stop" else reason


def models_list(name: str, context_length: int, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "pdserve",
                                        "max_model_len": context_length}]}


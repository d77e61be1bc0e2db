"""One client request as the router tracks it across workers and attempts.

A job owns its state: the prompt, what it has streamed so far, where it runs now and the
events for it. Workers know it by a ``worker.protocol.Key`` (request id, attempt): a re-run
after a lost worker is a new attempt, so late records of the old one are told apart and
dropped.

Lifecycle (``Job.state``; the router's ``Generate`` drives it, router.server)::

    PLACING ──reserved on decode, submitted to prefill (or one colocated worker)──► RUNNING
    RUNNING ──a record with a final finish, Abort, a stop string across a re-run──► DONE
    RUNNING ──worker lost, transfer failed──► PLACING again (attempt + 1; the prompt is now
              prompt + every token already streamed) ... after MAX_ATTEMPTS: DONE (UNAVAILABLE)

Events (``Job.events``), each ``(attempt, worker or None, event)``: a worker's record
(``Tokens``/``Failed``), :class:`Lost` when a worker the job runs on was lost, :class:`Aborted`
from Abort or shutdown. A decode worker's records may overtake the prefill's first token (two
sockets): :meth:`Job.in_order` puts an attempt's records in output order by their ``start``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import Any

from engine.detokenizer import TextStream, tokens_through_stop
from engine.request import SamplingParams
from pdserve.v1 import pdserve_pb2 as pb
from worker.protocol import Failed, Key, Tokens

FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


class JobState(enum.Enum):
    PLACING = "placing"
    RUNNING = "running"
    DONE = "done"


@dataclass(frozen=True)
class Lost:
    """A worker the job runs on was lost (router.pools)."""


@dataclass(frozen=True)
class Aborted:
    """Abort, or the router stops."""


Event = Tokens | Failed | Lost | Aborted


@dataclass
class Job:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    owner: str = ""  # the token's name that sent it (router.auth); "" with auth off
    arrival: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # monotonic time the client stops waiting (its gRPC deadline)
    prefer: tuple[str, str] | None = None  # (prefill, decode) worker ids placement prefers
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    attempt: int = 0
    prefill: Any = None  # pools.Worker, while placed
    decode: Any = None
    prefill_id: str = ""  # the workers of the latest attempt (kept after it ends)
    decode_id: str = ""
    placement: str = ""  # where its prompt was prefilled and why (proto Usage.prefill_placement)
    generated: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    uncached: int = 0  # prompt tokens this attempt's prefill computes, as placement estimated them
    prefix_hashes: list[int] = field(default_factory=list)  # its prompt's block hashes (router.prefix_index)
    first_token_time: float | None = None
    last_token_time: float | None = None
    gaps: list[float] = field(default_factory=list)  # seconds between streamed token batches
    text: str = ""  # text streamed so far
    # After a re-run the new worker sees the streamed tokens as prompt: the router then makes
    # the text itself (an engine.detokenizer.TextStream over every output token), so characters
    # and stop strings straddling the boundary come out right.
    stream: Any = None
    stopped: bool = False  # the router's stream found a stop string: finish with "stop"
    state: JobState = JobState.PLACING
    base: int = 0  # tokens streamed before this attempt
    pending: dict[int, Tokens] = field(default_factory=dict)  # this attempt's records ahead of their turn

    @property
    def key(self) -> Key:
        """What workers know this attempt by."""
        return Key(self.request_id, self.attempt)

    def inputs(self) -> tuple[list[int], SamplingParams]:
        """What the next attempt runs: the prompt plus every token already streamed, for what
        is left of ``max_tokens`` (so the client never sees a token twice), ``resumed`` after
        them (a seeded request then goes on as it would have)."""
        if not self.generated:
            return self.prompt_ids, self.params
        left = self.params.max_tokens - len(self.generated)
        # (the prompt's logprobs went out with the first token)
        return self.prompt_ids + self.generated, dataclasses.replace(self.params, max_tokens=left,
                                                                     resumed=len(self.generated),
                                                                     prompt_logprobs=None)

    def rerun(self, tokenizer: Any) -> None:
        """A new attempt follows: from now on the text is made here, continuing from the
        tokens and text already streamed (a held-back character or stop-string tail included)."""
        self.attempt += 1
        self.state, self.base, self.pending = JobState.PLACING, len(self.generated), {}
        if self.stream is None and self.generated:
            self.stream = TextStream(tokenizer, self.params.stop)
            self.stream.step(self.generated)
            self.stream.mark_sent(len(self.text))

    def placed(self, prefill: Any, decode: Any, placement: str = "") -> None:
        self.prefill, self.decode = prefill, decode
        self.prefill_id, self.decode_id = prefill.worker_id, decode.worker_id
        self.placement = placement
        self.state = JobState.RUNNING

    @property
    def prefilling(self) -> bool:
        """Placed, and no token of this attempt yet: its prompt is in its prefill worker's queue."""
        return self.state == JobState.RUNNING and len(self.generated) == self.base

    def heard_from(self, worker: Any) -> None:
        """A record of this attempt came from ``worker``. Decode runs only once the KV and the
        first token are in: its first record ends the prefill's part, so losing that worker
        from now on must not re-run this request."""
        if worker is self.decode and self.prefill is not self.decode:
            self.prefill = None

    def depends_on(self, worker: Any) -> bool:
        """Whether this attempt still needs ``worker``: its loss or failure re-runs the job only
        then. The prefill's part ends once decode streams (``prefill`` is cleared), so a lost or
        failed prefill found in the queue after that point is someone else's concern."""
        return worker is not None and (worker is self.prefill or worker is self.decode)

    def time_left(self) -> float | None:
        """Seconds until the client's deadline (None: it set none); workers get it with the
        request and drop it then, even if no abort reaches them."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def put(self, worker: Any, event: Event) -> None:
        self.events.put_nowait((self.attempt, worker, event))

    @property
    def finished(self) -> bool:
        """Its last response is out (a rejected job never gets there)."""
        return self.state is JobState.DONE

    def in_order(self, record: Tokens) -> list[Tokens]:
        """This attempt's records that are next in output order, ``record`` included once its
        turn comes; a record already streamed (the same token from another worker) is dropped."""
        at = len(self.generated) - self.base
        if record.start < at:
            return []
        self.pending[record.start] = record
        out = []
        while at in self.pending:
            r = self.pending.pop(at)
            out.append(r)
            at += len(r.tokens)
        return out

    def tokens(self, record: Tokens) -> pb.GenerateResponse | None:
        """The response for a record's new tokens and text (None when it has neither)."""
        ids = record.tokens
        text = record.text
        lps = record.logprobs or []
        if self.stream is not None:  # after a re-run: the router's own text (see ``stream``)
            # "prefilled" ends only the prefill side's part: decode goes on with this text
            done = record.finish not in (None, "prefilled")
            if self.stream.step(self.generated + ids, final=done):
                if ids:
                    ids = ids[:tokens_through_stop(self.stream.tokenizer, self.generated + ids, len(ids),
                                                   self.stream.stop)]
                self.stopped = True
            text = self.stream.delta(done or self.stopped)
        if not ids and not text:
            return None
        now = time.monotonic()
        if ids and self.first_token_time is None:
            self.first_token_time = now
            self.cached_tokens = record.cached_tokens
        if ids:
            if self.last_token_time is not None:
                self.gaps.append(now - self.last_token_time)
            self.last_token_time = now
        self.generated += ids
        self.text += text
        out = pb.GenerateResponse(request_id=self.request_id, token_ids=ids, text=text,
                                  logprobs=_logprobs(lps[:len(ids)]))
        if record.prompt_logprobs is not None:
            out.prompt_logprobs.extend(_logprobs(record.prompt_logprobs))
            out.prompt_token_ids.extend(self.prompt_ids)
        return out

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def tpot(self) -> float | None:
        n = len(self.generated)
        return (self.last_token_time - self.first_token_time) / (n - 1) if n > 1 else None

    def final(self, finish: str) -> pb.GenerateResponse:
        """The last response: finish reason and usage."""
        self.state = JobState.DONE
        n = len(self.generated)
        ttft, tpot = self.ttft or 0.0, self.tpot or 0.0
        usage = pb.Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=n,
                         cached_prompt_tokens=self.cached_tokens, ttft_s=ttft, mean_tpot_s=tpot,
                         prefill_worker=self.prefill_id, decode_worker=self.decode_id,
                         prefill_placement=self.placement)
        return pb.GenerateResponse(request_id=self.request_id, finish_reason=FINISH[finish], usage=usage)


def _logprobs(entries) -> list[pb.TokenLogprob]:
    """engine.sampler.TokenLogprob tuples (through worker.protocol.Tokens) as proto messages."""
    return [pb.TokenLogprob(token_id=t, logprob=lp, top=[pb.TopLogprob(token_id=a, logprob=b) for a, b in top])
            for t, lp, top in entries]

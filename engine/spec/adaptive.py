"""Adaptive K: each request's draft length from its recent acceptance and measured step costs.

Expected tokens from one verify of K drafts when each draft is accepted with probability a
(independently, the standard model): E(a, K) = 1 + a + ... + a^K = (1 - a^(K+1)) / (1 - a).
A verify step costs the target's forward over B(1+K) tokens instead of B, plus K draft
forwards. With T(n) the measured step time for n tokens and d the measured time of one draft
forward, the gain of speculating with K over plain decoding is

    gain(K) = E(a, K) * T(B) / (T(B * (1 + K)) + K * d)

(B: the requests decoding in the batch, all assumed to speculate: pessimistic for a mixed
batch). Each request takes the K in 1..K_max with the best gain, or K = 0 (off) when no K
gains more than ``MIN_GAIN``; an off request probes again with a short draft after
``PROBE_EVERY`` steps (the wait doubling after each probe that does not turn it back on, up to
``PROBE_MAX``), so a text that turns repetitive gets speculation back at little cost. a is a
decayed estimate: accepted drafts / (accepted drafts + rejections), starting from the worker's
recent acceptance (a prior worth two drafts), so once a draft has proved useless here new
requests do not pay to find that out again.
T(n) is a decayed least-squares line fitted to decode-only steps; until the steps seen differ
in size, its slope comes from a deliberately pessimistic prior.

A draft with a cache of its own must first catch up on the tokens it has not seen (a new
request's whole prompt, or what passed while the request was off): c per token, measured.
Starting (or probing) is worth it only when the time the request may still save, about
remaining_tokens * T(B)/B * (1 - 1/gain), exceeds that one-time stale_tokens * c.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.7  # per verify step, for a request's acceptance counts
TIME_DECAY = 0.97  # per step, for the step-time fit and the draft time
PRIOR_ALPHA, PRIOR_WEIGHT = 0.6, 2.0
PRIOR_SLOPE = 0.3  # marginal cost of one more token, as a share of the mean per-token cost
MIN_GAIN = 1.02
PROBE_EVERY = 16
PROBE_MAX = 256
PROBE_K = 1
WORKER_DECAY = 0.95  # per verify, for the worker's acceptance (the prior of new requests)


def expected_tokens(alpha: float, k: int) -> float:
    """E(a, K) = (1 - a^(K+1)) / (1 - a): tokens one verify of K drafts yields on average."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class _Acceptance:
    accepted: float = PRIOR_ALPHA * PRIOR_WEIGHT
    rejected: float = (1 - PRIOR_ALPHA) * PRIOR_WEIGHT
    off_steps: int = 0
    probe_wait: int = PROBE_EVERY

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


class StepTimeModel:
    """Step time T(n) for n tokens, from decode-only steps.

    Steps of 2+ tokens fit a decayed least-squares line a + b n, its slope shrunk towards a
    pessimistic prior (a share of the mean per-token cost). One-token steps keep a decayed mean
    of their own: a lone token may take a faster path than the batched forward
    (engine/models/single_token.py), a fixed jump between T(1) and T(2) that a line through
    both would mistake for a steep per-token cost. Where the line would dip below T(1) it is
    moved up to start from T(1) (more tokens never cost less than one).
    """

    def __init__(self) -> None:
        self.w = self.sn = self.st = self.snn = self.snt = 0.0
        self.one_w = self.one_t = 0.0

    def observe(self, n: int, seconds: float) -> None:
        d = TIME_DECAY
        if n <= 1:
            self.one_w = self.one_w * d + 1
            self.one_t = self.one_t * d + seconds
            return
        self.w = self.w * d + 1
        self.sn = self.sn * d + n
        self.st = self.st * d + seconds
        self.snn = self.snn * d + n * n
        self.snt = self.snt * d + n * seconds

    def predict(self, n: float) -> float | None:
        one = self.one_t / self.one_w if self.one_w > 1e-9 else None
        if n <= 1 and one is not None:
            return one
        if self.w < 1e-9:  # only one-token steps seen so far
            return None if one is None else one * (1 + PRIOR_SLOPE * (n - 1))
        mn, mt = self.sn / self.w, self.st / self.w
        var = self.snn / self.w - mn * mn
        cov = self.snt / self.w - mn * mt
        prior = PRIOR_SLOPE * mt / max(mn, 1.0)
        slope = max(0.0, (cov + prior) / (var + 1.0))  # shrunk towards the prior by one token^2
        t = mt + slope * (n - mn)
        if one is not None and t < one + slope * (n - 1):
            t = one + slope * (n - 1)
        return max(1e-6, t)


class AdaptiveK:
    """Chooses ``spec_k`` per request; ``k_max`` from the config, ``adaptive=False`` fixes it."""

    def __init__(self, k_max: int, adaptive: bool = True) -> None:
        self.k_max = k_max
        self.adaptive = adaptive
        self.times = StepTimeModel()
        self.draft_step_s = 0.0  # decayed mean time of one draft forward
        self._draft_w = 0.0
        self.catchup_token_s = 0.0  # decayed mean time per catch-up token
        self._catchup_w = 0.0
        self._req: dict[str, _Acceptance] = {}
        self._worker = _Acceptance()  # every request's verifies, decayed: the prior of new ones

    def forget(self, request_id: str) -> None:
        self._req.pop(request_id, None)

    def alpha(self, request_id: str) -> float:
        return self._state(request_id).alpha

    def _state(self, request_id: str) -> _Acceptance:
        st = self._req.get(request_id)
        if st is None:
            a = self._worker.alpha
            st = self._req[request_id] = _Acceptance(a * PRIOR_WEIGHT, (1 - a) * PRIOR_WEIGHT)
        return st

    def observe_verify(self, request_id: str, proposed: int, accepted: int) -> None:
        """A verify of ``proposed`` drafts kept ``accepted`` of them."""
        if proposed <= 0:
            return
        st = self._state(request_id)
        st.accepted = st.accepted * DECAY + accepted
        st.rejected = st.rejected * DECAY + (1 if accepted < proposed else 0)
        w = self._worker
        w.accepted = w.accepted * WORKER_DECAY + accepted
        w.rejected = w.rejected * WORKER_DECAY + (1 if accepted < proposed else 0)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.times.observe(num_tokens, seconds)

    def observe_draft(self, forwards: int, seconds: float) -> None:
        if forwards <= 0:
            return
        self._draft_w = self._draft_w * TIME_DECAY + forwards
        self.draft_step_s += (seconds - forwards * self.draft_step_s) / self._draft_w

    def observe_catchup(self, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        self._catchup_w = self._catchup_w * TIME_DECAY + tokens
        self.catchup_token_s += (seconds - tokens * self.catchup_token_s) / self._catchup_w

    def worth_catching_up(self, stale: int, remaining: int, gain: float, batch: int) -> bool:
        """Is the one-time catch-up of ``stale`` tokens paid back over ``remaining`` tokens?"""
        if stale <= 0 or self.catchup_token_s <= 0.0:
            return True
        step = self.times.predict(batch)
        if step is None:
            return True
        saved = remaining * step / batch * (1.0 - 1.0 / gain)
        return saved > stale * self.catchup_token_s

    def gain(self, alpha: float, k: int, batch: int) -> float:
        """Modelled speedup of verifying k drafts per request over plain decoding."""
        base = self.times.predict(batch)
        spec = self.times.predict(batch * (1 + k))
        if base is None or spec is None:
            return expected_tokens(alpha, k) / (1 + 0.1 * k)  # no timings yet: assume a cheap verify
        return expected_tokens(alpha, k) * base / (spec + k * self.draft_step_s)

    def choose(self, request_id: str, batch: int, stale: int = 0, remaining: int = 1 << 30) -> int:
        """K for this request's next step (0: plain decode).

        Args:
            request_id: the request.
            batch: requests decoding in the batch.
            stale: tokens the draft must catch up on first (0 for drafts without a cache).
            remaining: tokens the request may still generate.
        """
        if not self.adaptive:
            return self.k_max
        st = self._state(request_id)
        a = st.alpha
        best_k, best = 0, MIN_GAIN
        for k in range(1, self.k_max + 1):
            g = self.gain(a, k, batch)
            if g > best:
                best_k, best = k, g
        if best_k and not self.worth_catching_up(stale, remaining, best, batch):
            return 0  # not now: the catch-up would cost more than it can save (no probe either)
        if best_k == 0:
            st.off_steps += 1
            step = self.times.predict(batch) or 0.0
            if st.off_steps >= st.probe_wait and stale * self.catchup_token_s <= step:
                # probe: one short draft refreshes a (unless catching up costs more than a step)
                st.off_steps = 0
                st.probe_wait = min(st.probe_wait * 2, PROBE_MAX)
                return min(PROBE_K, self.k_max)
        else:
            st.off_steps, st.probe_wait = 0, PROBE_EVERY
        return best_k

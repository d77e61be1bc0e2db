"""What each token may take: concurrency, tokens per minute, priority and weight (``security.policy_file``).

The policy sits beside the tokens file, not in it: the tokens file is secret (``token`` or
``token name`` per line, unchanged), the policy names no secret and may be committed. It is
YAML keyed by the token's NAME (the second word of its line in the tokens file; a token
without a name is ``token-`` and 8 hex digits of its hash)::

    default:                # every token not named below (and every caller with auth off)
      priority: normal
    tokens:
      alice:  {max_concurrent: 16, tokens_per_minute: 200000, priority: high, weight: 3}
      batch:  {priority: low}
      ci:     {max_concurrent: 2, tokens_per_minute: 20000}

Fields, each optional (absent = today's behaviour, no limit):

- ``max_concurrent``: requests of this token in progress at once (an OpenAI request with
  ``n`` choices or several prompts counts one per choice); beyond: refused (429 /
  RESOURCE_EXHAUSTED). Default: no cap.
- ``tokens_per_minute``: prompt + generated tokens. Both cost the cluster (a prompt's prefill
  and its KV blocks as much as decoding), so a limit on generated tokens alone would let long
  prompts with ``max_tokens: 1`` through for free. A token bucket of this size refilled at
  this rate per minute: a request is admitted while the bucket is above zero, its prompt is
  charged then and its tokens as they stream, so one request may take the bucket below zero,
  and the next waits until it is paid back (``Retry-After`` says how long). Default: no limit.
- ``priority``: ``high``, ``normal`` (the default) or ``low``: strict between classes (a
  waiting request of a higher class is placed before any of a lower one).
- ``weight``: share against other tokens of the same class while they wait (default 1): two
  tokens at weights 3 and 1 that both wait get placements in the ratio 3:1 of their requests'
  tokens (router.admission).

A name in the policy that no token has is allowed (a token added later); an unknown field, a
bad value or a non-mapping is refused with the file and the field named.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

PRIORITIES = ("high", "normal", "low")  # strict, first first
FIELDS = ("max_concurrent", "tokens_per_minute", "priority", "weight")


class PolicyError(ValueError):
    """A policy file the router cannot use; the message names the file and the field."""


@dataclass(frozen=True)
class TokenPolicy:
    """One token's limits (None: no limit)."""

    max_concurrent: int | None = None
    tokens_per_minute: int | None = None
    priority: str = "normal"
    weight: float = 1.0

    @property
    def rank(self) -> int:
        """0 for the highest class."""
        return PRIORITIES.index(self.priority)


@dataclass(frozen=True)
class Policy:
    """Every token's policy by name, and the default for the rest."""

    tokens: Mapping[str, TokenPolicy] = field(default_factory=dict)
    default: TokenPolicy = TokenPolicy()

    def of(self, name: str) -> TokenPolicy:
        return self.tokens.get(name, self.default)


def _token_policy(raw: Any, where: str) -> TokenPolicy:
    if raw is None:
        return TokenPolicy()
    if not isinstance(raw, dict):
        raise PolicyError(f"{where}: a mapping of {', '.join(FIELDS)}")
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise PolicyError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(FIELDS)})")
    for key in ("max_concurrent", "tokens_per_minute"):
        v = raw.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise PolicyError(f"{where}.{key}: a positive integer, or absent for no limit")
    prio = raw.get("priority", "normal")
    if prio not in PRIORITIES:
        raise PolicyError(f"{where}.priority: one of {', '.join(PRIORITIES)}")
    weight = raw.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= 1e6:
        raise PolicyError(f"{where}.weight: a number > 0")
    return TokenPolicy(raw.get("max_concurrent"), raw.get("tokens_per_minute"), prio, float(weight))


def parse_policy(data: Any, source: str) -> Policy:
    """A Policy from the YAML document ``data`` (module doc).

    Raises:
        PolicyError: naming ``source`` and the field.
    """
    if data is None:
        return Policy()
    if not isinstance(data, dict) or set(data) - {"default", "tokens"}:
        raise PolicyError(f"{source}: a mapping with `default` and `tokens` (by token name)")
    tokens = data.get("tokens") or {}
    if not isinstance(tokens, dict):
        raise PolicyError(f"{source}: tokens: a mapping of token name to its policy")
    return Policy({str(name): _token_policy(p, f"{source}: tokens.{name}") for name, p in tokens.items()},
                  _token_policy(data.get("default"), f"{source}: default"))


def load_policy(path: str) -> Policy:
    """The policy in ``path`` (empty: no file, no limits).

    Raises:
        PolicyError: unreadable, not YAML, or a bad field.
    """
    if not path:
        return Policy()
    try:
        data = yaml.safe_load(Path(path).expanduser().read_text())
    except OSError as e:
        raise PolicyError(f"cannot read policy file {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise PolicyError(f"policy file {path} is not valid YAML: {e}") from e
    return parse_policy(data, f"policy file {path}")

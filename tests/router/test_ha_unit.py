"""router.ha without Ray: the fenced handle's calls, actor options, and the ``ha`` config."""

from __future__ import annotations

import pytest

from router import ha
from router.config import ConfigError, HAConfig, load_config


class FakeMethod:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def remote(self, *args, **kwargs):
        self.log.append((self.name, args, kwargs))
        return "ref"


class FakeHandle:
    def __init__(self) -> None:
        self.log: list = []

    def __getattr__(self, name: str) -> FakeMethod:
        return FakeMethod(name, self.log)


def test_every_call_through_a_fenced_actor_carries_the_epoch():
    h = FakeHandle()
    a = ha.FencedActor(h, 7)
    assert a.reserve.remote("key", [1, 2], timeout_s=3) == "ref"
    a.adopt("link", 5.0)
    assert h.log == [("call", (7, "reserve", "key", [1, 2]), {"timeout_s": 3}), ("adopt", (7, "link", 5.0), {})]
    assert ha.ray_handle(a) is h and ha.ray_handle(h) is h


def test_ha_off_is_today_plain_actors_no_options():
    cfg = load_config()
    assert not cfg.ha.enabled
    assert ha.actor_options(cfg.ha, "decode-0") == {}
    h = FakeHandle()
    assert ha.fenced(h, None) is h


def test_ha_on_detached_named_actors():
    opts = ha.actor_options(HAConfig(enabled=True, cluster_name="blue"), "prefill-2")
    assert opts == {"name": "blue/prefill-2", "namespace": "pdserve", "lifetime": "detached"}


@pytest.mark.parametrize("key, value, msg", [
    ("ha.cluster_name", "a/b", "ha.cluster_name"),
    ("ha.cluster_name", "", "ha.cluster_name"),
    ("ha.grace_s", 0, "ha.grace_s"),
    ("ha.enabled", "yes", "ha.enabled"),
])
def test_bad_ha_values_name_the_key(key, value, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, {key: value})

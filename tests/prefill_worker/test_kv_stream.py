"""The transfer thread's logic (prefill_worker/kv_stream.py) with a recording sender: order,
one request's failure isolated, flush reporting it once, and no silent hang if the thread is
gone. The real sender and transports run it in tests/worker/test_prefill_decode.py."""

from __future__ import annotations

import threading

import pytest
import torch

from prefill_worker.kv_stream import LayerJob, LayerStreamer


class RecordingSender:
    def __init__(self, fail: str = "") -> None:
        self.sent: list[tuple[str, int, int]] = []
        self.fail = fail

    def send_layer(self, rid, layer, k, v, token_start=None):
        if rid == self.fail:
            raise ValueError("header cannot hold this id")
        self.sent.append((rid, layer, k.shape[0]))
        return True

    def progress(self):
        pass


def kv_caches(layers=3, blocks=4, bs=4):
    return [(torch.arange(blocks * bs * 2 * 2, dtype=torch.float32).view(blocks * bs, 2, 2),) * 2
            for _ in range(layers)]


def test_layers_go_in_order_and_a_failed_request_stops_alone():
    sender = RecordingSender(fail="bad")
    st = LayerStreamer(sender, kv_caches(), 4)
    try:
        for layer in range(3):
            for rid in ("ok", "bad"):
                st.put(LayerJob(rid, layer, (0, 1), 0, 6))
        errors = st.flush()
        assert list(errors) == ["bad"] and isinstance(errors["bad"], ValueError)
        assert sender.sent == [("ok", 0, 6), ("ok", 1, 6), ("ok", 2, 6)]
        assert st.flush() == {}  # reported once
    finally:
        st.close()


def test_flush_raises_when_the_thread_is_gone():
    st = LayerStreamer(RecordingSender(), kv_caches(), 4)
    st.close()
    st.close()  # twice: safe
    st.put(LayerJob("r", 0, (0,), 0, 1))
    with pytest.raises(RuntimeError, match="transfer thread is gone"):
        st.flush()


def test_the_thread_keeps_its_parallel_work_to_itself(monkeypatch):
    # (engine/openmp.one_thread: no second OpenMP pool beside the forward's; tests/engine/test_openmp.py)
    import prefill_worker.kv_stream as kv_stream
    threads = []
    monkeypatch.setattr(kv_stream, "one_thread", lambda: threads.append(threading.current_thread().name))
    st = LayerStreamer(RecordingSender(), kv_caches(), 4)
    try:
        st.put(LayerJob("a", 0, (0, 1), 0, 6))
        assert st.flush() == {}
    finally:
        st.close()
    assert threads == ["kv-stream"]

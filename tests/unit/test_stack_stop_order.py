"""`epd up` stops the gateway (the last child) and waits for it before it signals any
worker; a child that outlives its stage's time is killed."""

from __future__ import annotations

import signal
import subprocess

from launch.stack import _stop_children


class FakeChild:
    """Records what happens to it in a shared log; exits on SIGTERM unless ``stuck``."""

    def __init__(self, name: str, log: list[str], stuck: bool = False):
        self.name, self.log, self.stuck = name, log, stuck
        self.pid, self.returncode = 0, None

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.log.append(f"term {self.name}")
        assert sig == signal.SIGTERM

    def wait(self, timeout: float | None = None) -> int:
        if self.stuck and self.returncode is None:
            self.log.append(f"timeout {self.name}")
            raise subprocess.TimeoutExpired(self.name, timeout)
        if self.returncode is None:
            self.log.append(f"exited {self.name}")
            self.returncode = 0
        return self.returncode

    def kill(self) -> None:
        self.log.append(f"kill {self.name}")
        self.returncode = -signal.SIGKILL


def test_gateway_stops_and_exits_before_any_worker_is_signalled():
    log: list[str] = []
    children = [FakeChild(n, log) for n in ("encoder", "prefill", "decode", "gateway")]
    _stop_children(children, grace_s=1.0)
    assert log[:2] == ["term gateway", "exited gateway"]
    assert log[2:5] == ["term encoder", "term prefill", "term decode"]  # together
    assert sorted(log[5:]) == ["exited decode", "exited encoder", "exited prefill"]


def test_a_child_that_does_not_stop_is_killed_and_the_rest_still_stop():
    log: list[str] = []
    children = [FakeChild("decode", log, stuck=True), FakeChild("gateway", log)]
    _stop_children(children, grace_s=0.01)
    assert log == ["term gateway", "exited gateway", "term decode", "timeout decode", "kill decode"]


def test_sigterm_asks_to_stop_without_taking_a_lock():
    """`epd up`'s SIGTERM handler only sets an attribute (a threading.Event's set, run
    inside the main thread's Event.wait, could deadlock on the Event's own lock); a
    SIGTERM from another thread cuts a sleep like `up`'s loop short and is seen."""
    import os
    import threading
    import time

    from launch.stack import _Stop

    stop = _Stop()
    old = signal.signal(signal.SIGTERM, stop.handler)
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        t0 = time.monotonic()
        while not stop.asked and time.monotonic() - t0 < 10:
            time.sleep(0.5)
        assert stop.asked and time.monotonic() - t0 < 2
    finally:
        signal.signal(signal.SIGTERM, old)

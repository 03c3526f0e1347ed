"""Link shaper: paces the bytes a rank sends over an emulated slow link (token bucket with
no burst), so a cross-datacenter run can be emulated on loopback or one fast network.

``acquire(n)`` books ``n`` bytes on the link and sleeps until the moment a real link of
``rate`` bytes/s would have finished carrying them (after all bytes booked before); the
caller posts the send then, so the receiver sees the data no earlier than the real link
would deliver it. Thread-safe: several children behind one link share its rate."""
from __future__ import annotations

import threading
import time


class LinkShaper:
    def __init__(self, rate_bytes_per_s: float, clock=time.monotonic, sleep=time.sleep) -> None:
        if not rate_bytes_per_s > 0:
            raise ValueError(f"LinkShaper: rate must be > 0 bytes/s, got {rate_bytes_per_s!r}")
        self.rate = float(rate_bytes_per_s)
        self._clock = clock
        self._sleep = sleep
        self._free_at = 0.0          # when the link finishes carrying everything booked
        self._lock = threading.Lock()
        self.bytes_booked = 0

    def acquire(self, nbytes: int) -> float:
        """Book nbytes; sleep until they would have arrived. Returns the arrival time."""
        with self._lock:
            start = max(self._clock(), self._free_at)
            self._free_at = start + nbytes / self.rate
            self.bytes_booked += nbytes
            done = self._free_at
        delay = done - self._clock()
        if delay > 0:
            self._sleep(delay)
        return done

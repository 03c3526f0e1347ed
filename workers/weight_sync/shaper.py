"""Link shaper: paces the bytes a rank sends over an emulated slow link (a token bucket),
so a cross-datacenter run can be emulated on loopback or one fast network.

``acquire(n)`` books ``n`` bytes on the link and sleeps until the moment a real link of
``rate`` bytes/s would have finished carrying them (after all bytes booked before); the
caller posts the send then, so the receiver sees the data when the real link would deliver
it. ``burst_s``: up to that much idle link time is credited (token-bucket capacity
rate * burst_s), so a sender thread that wakes up late (busy CPU) does not lose link time;
the price is that after an idle spell data may arrive up to burst_s early (never on the
first use: the executor makes fresh shapers per sync).
Thread-safe: several children behind one link share its rate."""
from __future__ import annotations

import threading
import time


class LinkShaper:
    def __init__(self, rate_bytes_per_s: float, burst_s: float = 0.05, clock=time.monotonic,
                 sleep=time.sleep) -> None:
        if not rate_bytes_per_s > 0:
            raise ValueError(f"LinkShaper: rate must be > 0 bytes/s, got {rate_bytes_per_s!r}")
        if burst_s < 0:
            raise ValueError(f"LinkShaper: burst_s must be >= 0, got {burst_s!r}")
        self.rate = float(rate_bytes_per_s)
        self.burst_s = float(burst_s)
        self._clock = clock
        self._sleep = sleep
        self._free_at = float("-inf")  # when the link finishes carrying everything booked
        self._lock = threading.Lock()
        self.bytes_booked = 0

    def acquire(self, nbytes: int) -> float:
        """Book nbytes; sleep until they would have arrived. Returns the arrival time."""
        with self._lock:
            now = self._clock()
            # A fresh link gets no credit (the first bytes are never early).
            start = now if self._free_at == float("-inf") else max(now - self.burst_s, self._free_at)
            self._free_at = start + nbytes / self.rate
            self.bytes_booked += nbytes
            done = self._free_at
        delay = done - self._clock()
        if delay > 0:
            self._sleep(delay)
        return done

"""``StatsTap``: the vLLM stat logger behind ``VLLMEngine.stats()``."""
from __future__ import annotations


class StatsTap:
    """A vLLM stat logger that keeps the latest scheduler numbers for ``stats()``."""

    def __init__(self):
        self.running = self.waiting = 0
        self.kv_usage = 0.0
        self.kv_peak = 0.0  # the highest kv_usage since the engine last became busy
        self.generated = 0  # output tokens since start
        self.prefix_hits = 0  # prompt (and preempted) tokens vLLM found in its prefix cache, since start

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        if scheduler_stats is not None:
            self.running, self.waiting = scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs
            self.kv_usage = scheduler_stats.kv_cache_usage
            self.kv_peak = max(self.kv_peak, self.kv_usage)
            pc = getattr(scheduler_stats, "prefix_cache_stats", None)
            if pc is not None:
                self.prefix_hits += pc.hits + pc.preempted_hits
        if iteration_stats is not None:
            self.generated += iteration_stats.num_generation_tokens

    def log_engine_initialized(self):
        pass

    def log(self):
        pass

    def record_sleep_state(self, *args, **kwargs):
        pass

    def record_admission_rejection(self, reason: str) -> None:
        pass

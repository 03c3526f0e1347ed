"""workers/generation/prepacked.available (mutation review, s59): the probe checks the GEMM's numbers."""
import torch


def test_the_prepacked_probe_says_no_when_the_gemm_gives_wrong_numbers(monkeypatch):
    """prepacked.available() checks the probe GEMM's numbers, not only that it runs. The wrong
    numbers are a fake (``linear`` returning zeros): no CPU here computes a wrong GEMM."""
    from workers.generation import prepacked

    monkeypatch.setattr(prepacked, "linear", lambda x, packed, bias: torch.zeros(x.shape[0], 32, dtype=x.dtype))
    prepacked.available.cache_clear()
    try:
        assert prepacked.available(torch.float32) is False
    finally:
        prepacked.available.cache_clear()

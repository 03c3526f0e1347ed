"""Functions a test runs inside vLLM's worker (``collective_rpc``). The engine-core child
imports this module to unpickle them, so it must not change the child's state when imported
(the test modules set ``torch.set_num_threads(1)`` at import)."""
import torch


def torch_threads(worker) -> int:
    """The worker process's torch intra-op thread count."""
    return torch.get_num_threads()

"""``engine.admission``: your own admission key (workers/generation/admission.py) on the native
engine: the smallest key first, ties in arrival order; a request the key fails for is admitted
last, said once. Both backends: test_engine_conformance.py; load-time checks: test_config.py."""
import numpy as np
import pytest
import torch

from test_engine import GREEDY, engine
from workers.generation.generate_all import generate_all
from workers.types import Request

torch.set_num_threads(1)


ADMISSION_KEYS = '''
def shortest_prompt(request):
    return request.prompt_ids.numel()

def picky(request):
    if request.sample_id == 2:
        raise KeyError("no key for 2")
    return "late" if request.sample_id == 3 else -request.sample_id
'''


def test_your_own_admission_key(tmp_path, caplog):
    # engine.admission: file.py:fn (as task.name): the smallest key first, ties in arrival order;
    # a request the key raises for or gives no number is admitted last (said once), not lost
    (tmp_path / "keys.py").write_text(ADMISSION_KEYS)
    lens = [9, 3, 6, 3, 12]
    reqs = [Request(sample_id=i, prompt_ids=torch.arange(1, n + 1), max_tokens=2, sampling=GREEDY)
            for i, n in enumerate(lens)]
    order = []
    generate_all(engine(max_batch_size=1, admission=f"{tmp_path}/keys.py:shortest_prompt"), reqs,
                 on_sample=lambda s: order.append(s.sample_id))
    assert order == [1, 3, 2, 0, 4]
    eng = engine(max_batch_size=1, admission=f"{tmp_path}/keys.py:picky")
    with caplog.at_level("WARNING", logger="streamrl.engine"):
        assert eng.add(reqs) == []
        served = []
        while eng.has_work():
            served += [s.sample_id for s in eng.step()]
    assert served == [4, 1, 0, 2, 3]
    said = [r.getMessage() for r in caplog.records if "engine.admission" in r.getMessage()]
    assert len(said) == 1 and "raised KeyError: 'no key for 2' for sample 2; it and any other request the key " \
        "fails for are admitted last (said once)" in said[0]
    with pytest.raises(ValueError, match=r"engine.admission: must be one of \('fcfs', 'lpt'\), or module:fn"):
        engine(admission="sjf")


@pytest.mark.parametrize("out, said", [(np.int64(7), None), (np.float32(2.5), None), (7, None),
                                       (10 ** 400, r"returned 10{56}\.\.\."),
                                       (10 ** 5000, "returned an int too long to print"),
                                       (float("nan"), "returned nan"), (True, "returned True"),
                                       ("3", "returned '3'"), (torch.tensor(1.5), None)],
                         ids=["int64", "float32", "int", "1e400", "1e5000", "nan", "bool", "str", "tensor"])
def test_an_admission_key_is_any_finite_real_number(out, said):
    # numpy's scalars were refused as "not a finite number"; an int past float's range raised
    # an OverflowError that escaped the lenient key (it admits only a ValueError's request last)
    from workers.generation.admission import _Checked, _Lenient

    req = Request(sample_id=5, prompt_ids=torch.tensor([1, 2]), max_tokens=2)
    key = _Checked(lambda r: out, "mine")
    if said is None:
        assert key(req) == float(out) and type(key(req)) is float
        return
    with pytest.raises(ValueError, match=rf"engine.admission 'mine' {said}, not a finite number"):
        key(req)
    assert _Lenient(key)(req) == float("inf")  # admitted last, not an error out of the engine


@pytest.mark.parametrize("admission, long_first", [("lpt", False), ("fcfs", True)])
def test_a_groups_samples_keep_their_slots_while_its_prompt_is_computed(admission, long_first):
    # prefix sharing admits a group's first sample, its siblings at the next step (they read the
    # prompt it computes): the short requests behind them took their slots, and LPT admitted the
    # long group's other samples only once those finished (flows review, s59)
    groups = [(5, 5), (5, 5), (5, 5), (40, 40)]  # (est_len, forced length): the long group arrives last
    reqs, sid = [], 0
    for g, (est, n) in enumerate(groups[::-1] if long_first else groups):
        for _ in range(4):
            reqs.append(Request(sid, torch.tensor([5 + g, 6, 7, 8]), n, n, float(est), group_id=g, sampling=GREEDY))
            sid += 1
    eng = engine(max_batch_size=4, admission=admission)
    eng.add(reqs)
    admitted, step = {}, 0
    while eng.has_work():
        eng.step()
        step += 1
        for s in eng.scheduler.running:
            admitted.setdefault(s.request.sample_id, step)
    long_ids = [r.sample_id for r in reqs if r.est_len == 40]
    assert max(admitted[i] for i in long_ids) == 2  # the long group's samples, all in the first two steps
    assert min(v for k, v in admitted.items() if k not in long_ids) > 40  # every short one after them

"""The run's length bounds reach the plans: Program gives the SGS (train.min_tokens,
train.max_tokens) for dispatch and balance_batch bounds the ranker's estimates by them (never a
request's own, its forced length under train.length_trace; mutation review, s60)."""
from types import SimpleNamespace

import torch

from controller.config import DispatchSection, MultiTurnSection
from controller.outbox import balance
from controller.program import Program
from controller.scheduling import make_dispatcher
from controller.sgs import SGS, InstanceSlot, default_profile, dispatch_estimates
from workers.types import Request, TaskPrompt


def _program(balance_batch: bool, ranker_est):
    sgs = SGS(make_dispatcher("skew_paper"), received=lambda it: set())
    world = SimpleNamespace(sgs=sgs, trainers=[object(), object()])
    train = SimpleNamespace(seed=0, batch_prompts=4, group_size=2, max_tokens=256, min_tokens=4, temperature=1.0,
                            top_k=-1, top_p=1.0, overlong_prompts="error", max_prompt_tokens=0)
    cfg = SimpleNamespace(train=train, trainer=SimpleNamespace(), multi_turn=MultiTurnSection(),
                          dispatch=DispatchSection(),
                          pipeline=SimpleNamespace(mode="stream", minibatch_size=0, stream_window_s=0.02,
                                                   balance_batch=balance_batch))
    prompts = [TaskPrompt(f"p{i}", "1", "t") for i in range(4)]
    task = SimpleNamespace(prompts=lambda split: prompts)
    tok = SimpleNamespace(encode_prompt=lambda text, messages=None: [1])
    p = Program(cfg, world, tok, task, ranker=SimpleNamespace(predict=lambda texts: list(ranker_est)))
    return p, prompts


def test_program_gives_dispatch_the_runs_bounds_for_the_rankers_estimates():
    """Program.__init__ hands SGS (train.min_tokens, train.max_tokens): a ranker's 900-token
    estimate is planned as 256, its 1-token one as 4 (real Program, SGS and skew dispatcher;
    the instance handle only records what it was asked)."""
    p, prompts = _program(False, [900.0, 30.0, 1.0, 100.0])
    asked = []

    class Handle:
        rank, role, name, alive = 1, "generation", "worker1", True

        def call(self, method, iteration, chunk, version, cap, window):
            asked.append(len(chunk))

    seen = []
    inner = p.world.sgs.dispatcher.plan
    p.world.sgs.dispatcher.plan = lambda est, *a, **kw: (seen.append(list(est)), inner(est, *a, **kw))[1]
    p.world.sgs.slots = [InstanceSlot(Handle(), default_profile())]
    p.world.sgs.launch(0, p._requests(0, prompts, 0), 0)
    assert seen == [[256.0, 256.0, 30.0, 30.0, 4.0, 4.0, 100.0, 100.0]] and asked == [8]


def test_balance_batch_places_groups_by_estimates_within_the_runs_bounds():
    """Estimates 900, 200, 200, 200 under train.max_tokens 256: the groups weigh 512+2, 402, 402,
    402, so the 900 group shares its rank (unbounded it trained alone, 1800 vs 1200)."""
    p, prompts = _program(True, [900.0, 200.0, 200.0, 200.0])
    reqs = p._requests(0, prompts, 0)
    ranks = [r.trainer_rank for r in reqs[::2]]
    assert ranks.count(ranks[0]) == 2, ranks
    # the function itself, with the run's bounds
    reqs = [Request(g * 2 + k, torch.ones(1, dtype=torch.long), 256, 4, est, group_id=g)
            for g, est in enumerate([900.0, 200.0, 200.0, 200.0]) for k in range(2)]
    balance(reqs, 2, 0, bounds=(4, 256))
    ranks = [r.trainer_rank for r in reqs[::2]]
    assert ranks.count(ranks[0]) == 2, ranks


def test_requests_carry_the_rankers_estimates_within_the_runs_bounds_not_the_forced_lengths():
    """Under train.length_trace a request's min_tokens == max_tokens == its true length; the
    dispatch clamped the ranker's estimates into them, so skew planned on the truth (the ranker
    bypassed, review s60). The requests carry the ranker's estimates; dispatch bounds them by the
    run's (train.min_tokens, train.max_tokens), which Program gives the SGS."""
    prog = Program.__new__(Program)
    prog.cfg = SimpleNamespace(train=SimpleNamespace(group_size=2, max_tokens=256, min_tokens=4, temperature=1.0,
                                                     seed=0, top_k=0, top_p=1.0, overlong_prompts="error",
                                                     max_prompt_tokens=0),
                               multi_turn=MultiTurnSection(), pipeline=SimpleNamespace(balance_batch=False))
    prog.tok = SimpleNamespace(encode_prompt=lambda prompt, messages=None: [1, 2, 3])
    prog.per_prompt = 2
    prog.ranker = SimpleNamespace(predict=lambda texts: [900.0, 30.0, 1.0])  # a ranker at its trace's scale
    lens = {"p1": 40, "p2": 100, "p3": 7}
    prog.length_of = lambda item: lens[item.prompt]
    reqs = prog._requests(0, [TaskPrompt(p, "1", "t") for p in lens], 0)
    assert [(r.max_tokens, r.min_tokens) for r in reqs[::2]] == [(40, 40), (100, 100), (7, 7)]  # forced
    assert [r.est_len for r in reqs] == [900.0, 900.0, 30.0, 30.0, 1.0, 1.0]  # the ranker's own (lpt, ranker/*)
    assert dispatch_estimates(reqs, (4, 256)) == [256.0, 256.0, 30.0, 30.0, 4.0, 4.0]  # not 40, 100, 7

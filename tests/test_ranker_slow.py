"""Real-trace quality check (slow tier): train on llama33_70b_rg_easy.train, judge on .val.

The issue's goal is recall@20 >= 0.80; this ranker reaches ~0.71 (0.69 in cross-validation), and
the answers' own sampling noise caps an oracle of each prompt's expected length at ~0.79-0.84
(`python -m ranker ceiling`; docs/ranker.md). The test pins what is achieved and that it beats
both baselines, so a regression is caught."""
from __future__ import annotations

from pathlib import Path

import pytest

import ranker
from ranker.baselines import TfidfRidge, prompt_length
from ranker.data import read_traces

DATA = Path(__file__).resolve().parents[1] / "data" / "length_traces"


@pytest.mark.slow
def test_real_trace_recall_beats_baselines():
    tr = read_traces(DATA / "llama33_70b_rg_easy.train.jsonl.gz")
    va = read_traces(DATA / "llama33_70b_rg_easy.val.jsonl.gz")
    prompts, true = [x.prompt for x in va], [x.target for x in va]
    r = ranker.build("lgbm").fit([x.prompt for x in tr], [x.target for x in tr])
    rep = ranker.ranking_report(r.predict(prompts), true)
    ridge = TfidfRidge().fit([x.prompt for x in tr], [x.target for x in tr])
    base = ranker.ranking_report(ridge.predict(prompts), true)
    plen = ranker.ranking_report(prompt_length(prompts), true)
    assert rep["recall@20"] >= 0.68, rep
    assert rep["recall@20"] > base["recall@20"] > plen["recall@20"], (rep, base, plen)
    assert rep["spearman"] >= 0.85 and rep["kendall_tau"] >= 0.70, rep

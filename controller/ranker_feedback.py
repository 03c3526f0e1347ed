"""What an iteration tells the length ranker: how its estimates ranked the samples' true
lengths (``ranker/*`` in iterations.jsonl and TensorBoard) and the rows of its online update."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from workers.types import id_parts, prompt_text

if TYPE_CHECKING:
    from controller.batch import Batch


def ranking_quality(b: "Batch", lengths: dict[int, int]) -> dict[str, float | None]:
    """Rank correlations and recall of the batch's estimates (``Request.est_len``) against
    ``lengths`` (sample id -> tokens, as the trainers took them); None where undefined
    (constant lengths); {} below two samples."""
    from ranker.metrics import ranking_report

    reqs = {r.sample_id: r for r in b.requests}
    pairs = [(reqs[sid].est_len, lengths[sid]) for sid in sorted(lengths)]
    if len(pairs) < 2:
        return {}
    pred, true = zip(*pairs)
    out = {**ranking_report(pred, true), "est_mean": sum(pred) / len(pred), "true_mean": sum(true) / len(true)}
    return {k: (round(v, 4) if math.isfinite(v) else None) for k, v in out.items()}


def update_rows(b: "Batch", lengths: dict[int, int], per_prompt: int) -> list[tuple[str, float]]:
    """(prompt text, the mean length of its samples) of each prompt of the iteration: the
    ranker's online-update rows, with the target its bootstrap fits (``measure_lengths``: a
    prompt's mean over its samples; rows per sample made an l1 ranker learn their median
    instead), on the text it predicts from (``prompt_text``: a chat item's last user turn).
    ``per_prompt``: requests per prompt (a sample's index in its iteration, ``id_parts``, is
    ``prompt * per_prompt + j``)."""
    per: dict[int, list[int]] = {}
    for sid, n in lengths.items():
        per.setdefault(id_parts(sid)[1] // per_prompt, []).append(n)
    return [(prompt_text(b.items[i]), sum(ns) / len(ns)) for i, ns in sorted(per.items())]

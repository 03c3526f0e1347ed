"""``python -m ranker train|predict|eval`` (see docs/ranker.md).

  python -m ranker train --train data/length_traces/llama33_70b_rg_easy.train.jsonl.gz \\
      --val data/length_traces/llama33_70b_rg_easy.val.jsonl.gz --out runs/ranker
  python -m ranker predict --model runs/ranker --input FILE --output preds.jsonl
  python -m ranker eval --model runs/ranker --data data/length_traces/llama33_70b_rg_easy.val.jsonl.gz
  python -m ranker ceiling --data data/length_traces/llama33_70b_rg_easy.val.jsonl.gz
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from ranker import progress
from ranker.data import LENGTHS_KEY, TraceError, read_traces

# --quick: a smaller model for smoke runs (seconds, not minutes); --config goes on top of it.
QUICK = {"lgbm": {"rounds": 60}, "lm": {"epochs": 1, "max_tokens": 128},
         "ensemble": {"lgbm": {"rounds": 60}, "lm": {"epochs": 1, "max_tokens": 128}}}


def _report_line(name: str, rep: dict) -> str:
    return f"{name:14s} " + "  ".join(f"{k} {v:.3f}" for k, v in rep.items())


def _json_out(obj) -> str:
    """JSON for stdout: NaN/inf (e.g. a rank correlation of constant predictions) become null."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v
    return json.dumps(clean(obj), allow_nan=False)


def _merge(base: dict, over: dict) -> dict:
    """``over`` on top of ``base``; objects nested in both are merged key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _config(a) -> dict:
    """``--config`` as keyword arguments (merged into ``--quick``'s), checked by building the model."""
    kw = QUICK[a.kind] if a.quick else {}
    if a.config:
        try:
            over = json.loads(a.config)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"--config: not valid JSON ({getattr(e, 'msg', 'nested too deeply')})") from e
        if not isinstance(over, dict):
            raise ValueError(f"--config: expected a JSON object of config keys, got {type(over).__name__}")
        kw = _merge(kw, over)
    return kw


def _output_file(path: str, flag: str) -> Path:
    """``path`` as a file to write later (nothing is created yet); refused, naming ``flag``, when it
    is a folder, ends in .gz, or its folder cannot be created or written."""
    from ranker.store import check_writable_parent

    out = Path(path)
    if out.suffix.lower() == ".gz":
        raise ValueError(f"{flag} {out}: predictions are written as plain JSON lines, not gzip; use a name "
                         f"without .gz (and compress the file afterwards if needed)")
    if out.is_dir():
        raise ValueError(f"{flag} {out}: is a folder, expected a file name")
    try:
        check_writable_parent(out)
    except ValueError as e:
        raise ValueError(f"{flag} {e}") from e
    return out


def cmd_train(a) -> int:
    import ranker
    from ranker.metrics import ranking_report
    from ranker.store import check_target

    kw = _config(a)
    try:
        r = ranker.build(a.kind, **kw)
    except ValueError as e:
        raise ValueError(f"--config: {e}") from e
    try:
        check_target(Path(a.out))
    except ValueError as e:
        raise ValueError(f"--out {e}") from e
    rows = read_traces(a.train)
    if len(rows) < r.min_rows:  # said before --val is read, naming the file
        raise ValueError(f"--train {a.train}: {len(rows)} rows; the {a.kind} ranker needs at least {r.min_rows} "
                         f"(prompt, length) pairs to fit")
    val = read_traces(a.val) if a.val else None  # a bad --val line stops us before training
    t0, c0 = time.time(), time.process_time()
    r.fit([x.prompt for x in rows], [x.target for x in rows])
    wall, cpu = time.time() - t0, time.process_time() - c0
    r.save(a.out)
    summary = {"kind": a.kind, "train_rows": len(rows), "train_wall_s": round(wall, 1),
               "train_cpu_s": round(cpu, 1), "load_avg_1m": round(os.getloadavg()[0], 2), "out": a.out}
    if val:
        summary["val"] = ranking_report(r.predict([x.prompt for x in val]), [x.target for x in val])
        summary["val_rows_in_train"] = _in_train(rows, val, f"--val {a.val}", f"--train {a.train}")
    print(_json_out(summary))
    return 0


def cmd_predict(a) -> int:
    import ranker

    from workers.atomic import write_text

    out = _output_file(a.output, "--output")
    if out.exists() and Path(a.input).exists() and os.path.samefile(out, a.input):
        raise ValueError(f"--output {out}: is the --input file; refusing to overwrite the trace with predictions")
    if out.resolve().is_relative_to(Path(a.model).resolve()):
        raise ValueError(f"--output {out}: is inside the --model folder {a.model}; refusing to overwrite the "
                         "saved ranker with predictions")
    rows = read_traces(a.input, need_lengths=False)
    preds = ranker.load(a.model).predict([x.prompt for x in rows])
    text = "".join(json.dumps({"idx": row.line, "pred_len": float(p)}) + "\n" for row, p in zip(rows, preds))
    try:  # temp file + rename: a failed write leaves the earlier output as it was
        write_text(out, text)
    except OSError as e:
        raise ValueError(f"--output {out}: cannot write ({e.strerror or e})") from e
    progress.log(f"wrote {len(rows)} predictions to {out}")
    return 0


def cmd_eval(a) -> int:
    import ranker
    from ranker.baselines import TfidfRidge, prompt_length
    from ranker.metrics import ranking_report

    rows = read_traces(a.data)
    prompts, true = [x.prompt for x in rows], [x.target for x in rows]
    results = {"model": ranking_report(ranker.load(a.model).predict(prompts), true),
               "prompt_length": ranking_report(prompt_length(prompts), true)}
    train_path = a.baseline_train or _default_train(a.data)
    overlap = {}  # held-out rows whose prompt is in the baseline's training file (counted when there is one)
    if train_path:
        tr = read_traces(train_path)
        try:
            ridge = TfidfRidge().fit([x.prompt for x in tr], [x.target for x in tr])
        except ValueError as e:
            what = "--baseline-train" if a.baseline_train else "the *.train.* sibling of --data,"
            raise ValueError(f"{what} {train_path}: cannot fit the TF-IDF baseline on it ({e})") from e
        results["tfidf_ridge"] = ranking_report(ridge.predict(prompts), true)
        overlap = {"rows_in_baseline_train": _in_train(tr, rows, f"--data {a.data}", train_path)}
    else:
        print(f"note: no TF-IDF ridge baseline: {a.data} has no *.train.* sibling (a file named like it with "
              f"'.val.' -> '.train.'); pass --baseline-train FILE to get it", file=sys.stderr)
    for name, rep in results.items():
        print(_report_line(name, rep), file=sys.stderr)
    print(_json_out({"data": a.data, "rows": len(rows), "tfidf_ridge_train": train_path, **results, **overlap}))
    return 0


def _in_train(train, held, held_name: str, train_name: str) -> int:
    """How many ``held`` rows have a prompt that is also in ``train`` (said on stderr when any:
    their scores flatter a ranker that saw them, its neighbour features find the row itself)."""
    seen = {x.prompt for x in train}
    n = sum(x.prompt in seen for x in held)
    if n:
        print(f"note: {n} of the {len(held)} rows of {held_name} have a prompt that is also in {train_name}: "
              f"their scores flatter a ranker trained on it", file=sys.stderr)
    return n


def cmd_ceiling(a) -> int:
    """Estimated recall ceiling set by the answers' sampling noise (ranker/ceiling.py)."""
    from ranker.ceiling import noise_ceiling

    if a.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {a.repeats}")
    rows = read_traces(a.data)
    first, n = rows[0], len(rows[0].lengths)
    if n < 2:
        raise ValueError(f"{a.data}:{first.line}: 1 answer in '{LENGTHS_KEY}'; ceiling needs >= 2 answers per line")
    bad = next((x for x in rows if len(x.lengths) != n), None)
    if bad is not None:
        k = len(bad.lengths)
        raise ValueError(f"{a.data}:{bad.line}: {k} answer{'s' * (k != 1)} in '{LENGTHS_KEY}', but line {first.line} "
                         f"has {n}; ceiling needs the same number of answers on every line")
    untasked = sum(not x.task for x in rows)
    if untasked:
        print(f"note: {untasked} of {len(rows)} lines have no 'task' field; they are pooled as one task (the "
              f"estimate models the answers' noise per task)", file=sys.stderr)
    out = {"data": a.data, "rows": len(rows)}
    for frac in (0.1, 0.2, 0.3):
        rep = noise_ceiling([x.lengths for x in rows], [x.task for x in rows], frac=frac, repeats=a.repeats)
        out[f"recall@{int(round(frac * 100))}"] = rep
        print(f"recall@{int(round(frac * 100))}: split-half {rep['observed_split_half']:.3f}, "
              f"oracle ceiling {rep['ceiling']:.3f} +- {rep['ceiling_std']:.3f} (q {rep['matched_q']:.3f})",
              file=sys.stderr)
    print(_json_out(out))
    return 0


def _default_train(data: str) -> str | None:
    """The TF-IDF baseline trains on the sibling ``*.train.*`` file of a ``*.val.*`` file."""
    p = Path(data)
    if ".val." in p.name:
        cand = p.with_name(p.name.replace(".val.", ".train."))
        if cand.exists():
            return str(cand)
    return None


def _os_error(e: OSError) -> str:
    return f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ranker", description="output-length ranker (docs/ranker.md)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="fit a ranker on a trace file and save it")
    t.add_argument("--train", required=True, help="trace file to fit on (JSON lines, .gz or plain)")
    t.add_argument("--val", help="trace file to report ranking metrics on after training (read first)")
    t.add_argument("--out", required=True, help="model folder to write: new, empty, or a ranker folder to replace")
    t.add_argument("--quick", action="store_true",
                   help=f"small model for smoke tests: {QUICK['lgbm']} (lgbm), {QUICK['lm']} (lm), both "
                        "(ensemble); --config goes on top")
    t.add_argument("--kind", default="lgbm", choices=["lgbm", "lm", "ensemble"], help="model kind (default lgbm)")
    t.add_argument("--config", help="JSON object of config overrides for the kind, e.g. '{\"rounds\": 100}'")
    p = sub.add_parser("predict", help="predict lengths for each line of a trace file")
    p.add_argument("--model", required=True, help="trained model folder")
    p.add_argument("--input", required=True, help="trace file; only 'question' is needed")
    p.add_argument("--output", required=True,
                   help="JSON lines file to write, one {idx, pred_len} per input line (not .gz, not --input)")
    e = sub.add_parser("eval", help="ranking quality vs two baselines")
    e.add_argument("--model", required=True, help="trained model folder")
    e.add_argument("--data", required=True, help="trace file to judge on (needs 'resp_words')")
    e.add_argument("--baseline-train", help="training file for the TF-IDF ridge baseline "
                   "(default: the *.train.* sibling of --data)")
    c = sub.add_parser("ceiling", help="recall an oracle of each prompt's expected length would get, "
                       "given the answers' sampling noise (uses the trace's task field)")
    c.add_argument("--data", required=True, help="trace file with >= 2 answers per line (and a 'task' field)")
    c.add_argument("--repeats", type=int, default=40, help="simulation repeats per q (default 40)")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    progress.set_enabled(True)
    try:
        return {"train": cmd_train, "predict": cmd_predict, "eval": cmd_eval,
                "ceiling": cmd_ceiling}[a.cmd](a)
    except (TraceError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # FileNotFoundError from load, or an I/O error while saving (full disk, ...)
        print(f"error: {_os_error(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

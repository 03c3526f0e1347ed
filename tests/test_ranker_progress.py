"""ranker/progress.py: the CLI's progress off a terminal is one log line per tenth of the work
(mutation review, s59: no test imported the module)."""
from ranker import progress


def test_off_a_terminal_a_line_per_tenth_and_nothing_when_disabled(capsys, monkeypatch):
    monkeypatch.setattr(progress, "_enabled", True)
    with progress.bar("lgbm", 20) as b:
        for i in range(20):
            b.advance(info=f"loss {i}")
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "lgbm:" in ln]
    assert [ln.split("lgbm: ")[1].split(" ")[0] for ln in lines] == [f"{2 * k}/20" for k in range(1, 11)]
    assert "loss 19" in lines[-1]
    monkeypatch.setattr(progress, "_enabled", False)
    with progress.bar("lgbm", 20) as b:
        b.advance(20)
    progress.log("said")
    assert capsys.readouterr().err == "" and b.done == 0

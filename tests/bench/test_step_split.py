"""``yolofast bench step`` reports where the train step's time goes: the phases of the trainer's
``profile=True`` (forward, loss, backward, optimizer + EMA), measured over a few auto-backend steps."""

import json

from yolofast.bench import bench_main
from yolofast.bench.cases import build_cases


def test_step_case_splits_its_time_into_the_trainers_phases():
    (case,) = build_cases("tiny-step")
    split = case.split(2)
    assert set(split) == {"forward", "loss", "backward", "optimizer"}
    assert all(v > 0 for v in split.values())


def test_bench_step_prints_and_writes_the_split(tmp_path, capsys):
    out = tmp_path / "step.json"
    rc = bench_main(["step", "--preset", "tiny-step", "--rounds", "3", "--no-memory", "--quiet", "--threads",
                     "1", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    line = next(line for line in text.splitlines() if "time split" in line)
    assert line.startswith("tiny-step/train_step time split over 3 auto-backend steps: forward ")
    assert "optimizer+EMA" in line and "%" in line
    split = json.loads(out.read_text())["splits"]["tiny-step/train_step"]
    assert split["steps"] == 3 and set(split["seconds"]) == {"forward", "loss", "backward", "optimizer"}

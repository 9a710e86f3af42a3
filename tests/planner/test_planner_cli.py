"""``fxpipe plan`` / ``fxpipe calibrate`` through their argument functions."""
import argparse
import json

from fxpipe.base.hardware import Hardware
from fxpipe.cli.calibrate import add_calibrate_arguments, run_calibrate
from fxpipe.cli.plan import add_plan_arguments, run_plan


def _parse(add, argv):
    p = argparse.ArgumentParser()
    add(p)
    return p.parse_args(argv)


def test_plan_prints_table_and_explanation(capsys, tmp_path):
    out = tmp_path / "plan.json"
    args = _parse(add_plan_arguments, ["--model", "gpt-1.7b", "--gpus", "32", "--global-batch", "512",
                                       "--top", "3", "--explain", "--json", str(out)])
    assert run_plan(args) == 0
    text = capsys.readouterr().out
    assert "gpt-1.7b" in text and "TFLOP/s" in text and "Why #1 beats #2" in text
    rows = json.loads(out.read_text())
    assert len(rows) == 3 and rows[0]["iteration_s"] <= rows[1]["iteration_s"]
    assert {"tp", "pp", "dp", "micro_batch", "breakdown"} <= set(rows[0])


def test_plan_restricts_schedules_and_recompute(capsys):
    args = _parse(add_plan_arguments, ["--model", "gpt-18b", "--gpus", "256", "--global-batch", "1024",
                                       "--schedules", "1f1b", "--recompute", "full", "--max-tp", "8"])
    assert run_plan(args) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if l[:2].strip().isdigit()]
    assert lines and all(" 1f1b " in l and " full " in l for l in lines)


def test_calibrate_without_processes_writes_a_loadable_profile(tmp_path, capsys):
    out = tmp_path / "hw.json"
    args = _parse(add_calibrate_arguments, ["--output", str(out), "--no-distributed"])
    assert run_calibrate(args) == 0
    hw = Hardware.load(str(out))
    assert hw.peak_flops > 1e9 and hw.memory_bw > 1e8 and 0 < hw.matmul_efficiency <= 1
    plan_args = _parse(add_plan_arguments, ["--model", "gpt-tiny", "--gpus", "2", "--global-batch", "8",
                                            "--hardware", str(out)])
    assert run_plan(plan_args) == 0
    assert "cpu-measured" in capsys.readouterr().out

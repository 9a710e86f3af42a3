"""Renderers: ASCII grid, Gantt PNG/SVG, Perfetto trace with flows."""
import json

import pytest

from fxpipe.schedules import Action, ActionKind, Timeline, generate, lower, simulate
from fxpipe.schedules.render import render_ascii, render_gantt, render_trace, trace_events


def test_ascii_grid_1f1b():
    out = render_ascii(simulate(generate("1f1b", 2, 2)).timeline)
    lines = out.splitlines()
    assert lines[0] == "1f1b p=2 m=2"
    assert "bubble 33.3% of step (50.0% of compute)" in lines[1]  # (p-1)/(m+p-1), (p-1)/m
    # F=1, B=2 units; one column per unit; '.' is a bubble.
    assert lines[4] == "rank 0| 0F0 0F1 .   .   0B0~~~~ .   0B1~~~~"
    assert lines[5] == "rank 1| .   1F0 1B0~~~~ 1F1 1B1~~~~ .   ."


def test_ascii_skips_comm_and_handles_latency():
    out = render_ascii(simulate(lower(generate("interleaved", 2, 4, 2)), p2p_latency=0.5).timeline)
    assert "SEND" not in out and "RECV" not in out
    assert "2F0" in out and "rank 1|" in out


@pytest.mark.parametrize("ext, magic", [("png", b"\x89PNG"), ("svg", b"<?xml")])
def test_gantt_files(tmp_path, ext, magic):
    path = tmp_path / f"chart.{ext}"
    render_gantt(simulate(generate("interleaved", 4, 8, 2)).timeline, path)
    data = path.read_bytes()
    assert data.startswith(magic) and len(data) > 5000
    if ext == "svg":
        text = data.decode()
        assert "bubble 15.8% of step" in text.replace("&#37;", "%")  # title carries the bubble
        assert "5.5 stage-microbatches" in text  # ... and the peak memory


def test_trace_has_durations_and_send_to_recv_flows(tmp_path):
    sched = lower(generate("1f1b", 3, 4))
    r = simulate(sched, p2p_latency=0.25)
    path = tmp_path / "trace.json"
    render_trace(r.timeline, path)
    trace = json.loads(path.read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == sum(map(len, sched.actions))
    by_name = {(e["pid"], e["name"]): e for e in slices}
    assert by_name[(1, "1B0")]["dur"] == pytest.approx(2000.0)  # 2 units, a unit shows as 1 ms
    assert by_name[(0, "0SEND_F0")]["dur"] == pytest.approx(250.0)
    starts = [e for e in trace["traceEvents"] if e["ph"] == "s"]
    ends = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "f"}
    n_sends = sum(a.kind in (ActionKind.SEND_F, ActionKind.SEND_B) for rank in sched.actions for a in rank)
    assert len(starts) == len(ends) == n_sends
    for s in starts:
        f = ends[s["id"]]
        assert f["pid"] != s["pid"]
        # each end of the arrow lies in a SEND / RECV slice of its rank
        src = [e for e in slices if e["pid"] == s["pid"] and e["ts"] == s["ts"] and "SEND" in e["name"]]
        dst = [e for e in slices if e["pid"] == f["pid"] and e["ts"] == f["ts"] and "RECV" in e["name"]]
        assert src and dst


def test_trace_threads_never_hold_overlapping_slices():
    # Viewers need the slices of one thread to nest; concurrent transfers get their own threads.
    events = trace_events(simulate(lower(generate("interleaved", 4, 8, 2)), p2p_latency=1.5).timeline)
    threads = {}
    for e in events:
        if e["ph"] == "X":
            threads.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    assert max(tid for _, tid in threads) >= 2  # some transfers did overlap
    for spans in threads.values():
        spans.sort()
        assert all(b[0] >= a[1] - 1e-6 for a, b in zip(spans, spans[1:]))


def test_trace_of_compute_only_timeline_links_producers_to_consumers():
    events = trace_events(simulate(generate("1f1b", 2, 1)).timeline)
    flows = [e for e in events if e["ph"] in ("s", "f")]
    assert len(flows) == 4  # 0F0 -> 1F0 and 1B0 -> 0B0


def test_renderers_take_a_measured_timeline(tmp_path):
    a = lambda t: Action.parse(t)  # noqa: E731
    measured = Timeline.from_events(
        [[(a("0F0"), 0.0, 1.1), (a("0B0"), 4.0, 6.2)], [(a("1F0"), 1.3, 2.2), (a("1B0"), 2.2, 3.9)]],
        unit="ms", title="measured",
    )
    assert "measured" in render_ascii(measured)
    render_gantt(measured, tmp_path / "m.png")
    render_trace(measured, tmp_path / "m.json")
    trace = json.loads((tmp_path / "m.json").read_text())
    assert {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"} == {"0F0", "0B0", "1F0", "1B0"}
    assert max(e["ts"] for e in trace["traceEvents"] if e["ph"] == "X") == pytest.approx(4000.0)

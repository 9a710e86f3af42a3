"""Renderers of a Timeline (simulated or measured): ASCII, Gantt, Perfetto."""
from fxpipe.schedules.render.ascii import render_ascii
from fxpipe.schedules.render.gantt import render_gantt
from fxpipe.schedules.render.trace import render_trace, trace_events

__all__ = ["render_ascii", "render_gantt", "render_trace", "trace_events"]

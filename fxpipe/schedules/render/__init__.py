"""Renderers of a Timeline (simulated or measured): ASCII, Gantt, Perfetto."""
from .ascii import render_ascii
from .gantt import render_gantt
from .trace import render_trace, trace_events

__all__ = ["render_ascii", "render_gantt", "render_trace", "trace_events"]

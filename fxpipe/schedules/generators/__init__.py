"""One file per schedule generator; each returns a compute-only Schedule.

Pick them by name through ``fxpipe.schedules.registry.generate``. Every
generator's docstring states its constraints, bubble and peak memory.
"""
from fxpipe.schedules.generators.gpipe import gpipe
from fxpipe.schedules.generators.interleaved import interleaved
from fxpipe.schedules.generators.one_f_one_b import one_f_one_b
from fxpipe.schedules.generators.v_shape import zb_v
from fxpipe.schedules.generators.zero_bubble import zb_h1

__all__ = ["gpipe", "interleaved", "one_f_one_b", "zb_h1", "zb_v"]

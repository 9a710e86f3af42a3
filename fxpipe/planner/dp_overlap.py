"""The exposed part of a bucketed data-parallel reduction, as the runtime overlaps it.

``runtime/grad_buckets.py`` reduces the gradients in buckets of ``bucket_mb`` MB, each
started as soon as the last microbatch's backward has finished every gradient in it,
one after another on the data-parallel group; the step waits only for what is still
running when that backward ends. The model here: the rank's last backward lasts
``backward_s`` and finishes its gradients evenly (bucket k of n is final at
(k+1)/n·backward_s); bucket k's collective starts when it is final and the previous one
is done. What outlasts the backward is exposed:

    exposed = max(0, finish of the last bucket − backward_s)

So at least the last bucket (final only when the backward ends) is always exposed, and
all of the reduction beyond the backward when it is the longer. The layout search
(``layout_price.py``) and ``fxpipe plan`` (``predict.py``, ``DPOverlap.BACKWARD``) both
price the reduction with this one function, through ``step_price.dp_sync_s``: the dense
buckets, and expert stacks' on their replica group. A tied table is not in it: the runtime
reduces it with its pipeline sum in one all-reduce that ends when the first rank's
backward does (``predict._sync_s``, ``layout_price.gradient_sync_s``).
"""
from __future__ import annotations

import math
from typing import Callable

DEFAULT_BUCKET_MB = 25.0
"""``ParallelConfig.bucket_mb``'s default (torch DDP's ``bucket_cap_mb``)."""


def exposed_reduction_s(grad_bytes: float, backward_s: float, collective_s: Callable[[float], float],
                        bucket_mb: float = DEFAULT_BUCKET_MB) -> float:
    """Seconds of the reduction of ``grad_bytes`` the step waits for after its last
    backward of ``backward_s``; ``collective_s(nbytes)``: one bucket's collective.
    ``bucket_mb`` 0: no overlap (the whole reduction after the backward)."""
    if grad_bytes <= 0:
        return 0.0
    if bucket_mb <= 0:
        return collective_s(grad_bytes)
    n = max(1, math.ceil(grad_bytes / (bucket_mb * 2**20)))
    each = collective_s(grad_bytes / n)
    done = 0.0
    for k in range(n):
        done = max(done, (k + 1) / n * backward_s) + each
    return max(0.0, done - backward_s)

"""Workers for test_overlap_tied.py: when the reductions over tied, row-shared and
expert-replica groups are issued, against the step's last backward (importable by the
children)."""
from __future__ import annotations

import time

import torch.distributed as dist

from tests.runtime._cases import MICROBATCHES, workload
from tests.runtime._reuse_capture import captures_reused


def issued_times(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Per case: the perf_counter of every all-reduce issued on one of the rank's tied,
    row-shared or expert-replica groups in the second step, and the end of the rank's last
    backward action (B, I, W or the head's T) in it."""
    from fxpipe.parallel import parallelize

    out = []
    with captures_reused():
        for case in cases:
            w = workload(case["model"])
            pm = parallelize(w.model, pp=case["pp"], microbatches=MICROBATCHES, schedule=case["schedule"],
                             example_inputs=w.example_inputs, loss_fn=w.loss_fn, costs="model",
                             ep=case.get("ep", 1), zero=case.get("zero", 0), precision=case.get("precision", "fp32"),
                             vocab_passes=case.get("vocab_passes", False), bucket_mb=0.01)
            sync = pm.grad_sync
            tracked = [g for _, g in sync.tied] + [g for _, _, g in sync.rows]
            if pm.experts is not None and pm.experts.replicas is not None:
                tracked.append(pm.experts.replicas)
            pm.train_step(w.example_inputs)  # warm-up
            issued: list[float] = []
            real = dist.all_reduce

            def recording(tensor, *args, group=None, **kwargs):
                if any(group is g for g in tracked):
                    issued.append(time.perf_counter())
                return real(tensor, *args, group=group, **kwargs)

            dist.all_reduce = recording
            try:
                pm.train_step(w.example_inputs)
            finally:
                dist.all_reduce = real
            backward = [e for e in pm.last_stats.events if e[0].kind.name in ("B", "I", "W", "T")]
            out.append(dict(groups=len(tracked), issued=issued, last_backward_end=max(e[2] for e in backward),
                            bucketed=sorted(sync.overlap.names) if sync.overlap is not None else []))
            pm.close()
    return out

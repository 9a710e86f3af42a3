"""The two main paths stay short and single: ``fxpipe run`` builds its workload once per
process and compiles once per rank; ``parallelize`` hands off to the runtime in a few calls."""
from __future__ import annotations

import collections
import dataclasses
import sys

import pytest

from fxpipe.compiler.pipeline import compile_pipeline
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.job.config import TrainConfig
from fxpipe.models.registry import build_workload
from tests.runtime._dist import run_world

CONFIG = TrainConfig(model="gpt-tiny", seq=32, micro_batch_size=2, steps=1, log_interval=1,
                     parallel=ParallelConfig(tp=1, pp=2, dp=1, microbatches=2, costs="model", partition="uniform"))


@dataclasses.dataclass
class _Counted:
    """Every fxpipe module's binding of ``build_workload`` and ``compile_pipeline`` wrapped
    in a counter (whatever name imported it, so no call goes uncounted)."""
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def __enter__(self):
        self._undo = []
        for fn, key in ((build_workload, "workload"), (compile_pipeline, "compile")):
            def counted(*a, _fn=fn, _key=key, **k):
                self.counts[_key] += 1
                return _fn(*a, **k)
            for mod in [m for name, m in list(sys.modules.items()) if name.startswith("fxpipe") and m]:
                for attr, value in list(vars(mod).items()):
                    if value is fn:
                        self._undo.append((mod, attr, value))
                        setattr(mod, attr, counted)
        assert self._undo, "nothing to count"
        return self.counts

    def __exit__(self, *exc):
        for mod, attr, value in self._undo:
            setattr(mod, attr, value)


def _worker_counts(rank, world, config):
    import fxpipe.job.train  # noqa: F401  (its imports bound before counting starts)
    import fxpipe.parallel  # noqa: F401
    from fxpipe.job.train import worker

    with _Counted() as counts:
        worker(config)
    return dict(counts)


@pytest.mark.slow
def test_a_run_builds_the_workload_once_and_compiles_once_per_rank(tmp_path):
    from fxpipe.job.preflight import check_run

    config = dataclasses.replace(CONFIG, timeline=str(tmp_path / "timeline"))  # not fxpipe-timeline.* in the cwd
    with _Counted() as launcher:
        check_run(dataclasses.replace(config, metrics_file=None))
    assert dict(launcher) == {"workload": 1, "compile": 1}
    ranks = run_world(2, _worker_counts, config)
    assert ranks == [{"workload": 1, "compile": 1}] * 2


def _parallelize_path(rank, world):
    import traceback

    import fxpipe
    from fxpipe import parallel
    from fxpipe.runtime import stage_runner

    w = build_workload("gpt-tiny", batch=4, seq=32)
    direct, first_action = [], []
    code = parallel.parallelize.__code__

    def profile(frame, event, arg):
        if event == "call" and frame.f_back is not None and frame.f_back.f_code is code \
                and "/fxpipe/" in frame.f_code.co_filename:
            direct.append(frame.f_code.co_name)

    forward = stage_runner.StageRunner.forward

    def first(self, *a, **k):
        if not first_action:
            first_action.append([f.name for f in traceback.extract_stack()[:-1] if "/fxpipe/" in f.filename])
        return forward(self, *a, **k)

    stage_runner.StageRunner.forward = first
    sys.setprofile(profile)
    try:
        pm = fxpipe.parallelize(w.model, tp=1, pp=2, microbatches=2, costs="model",
                                example_inputs=w.example_inputs, loss_fn=w.loss_fn)
    finally:
        sys.setprofile(None)
    pm.train_step(w.example_inputs)
    pm.close()
    return direct, first_action[0]


@pytest.mark.slow
def test_parallelize_reaches_the_first_action_in_few_calls():
    """The handoff is short: ``parallelize`` makes at most 8 calls into fxpipe (the mesh,
    the compile, the runtime), and the first stage forward runs 3 calls below
    ``train_step`` (the executor's run, then its forward action)."""
    direct, stack = run_world(2, _parallelize_path)[0]
    assert "compile_pipeline" in direct and "build_runtime" in direct
    assert len(direct) <= 8, direct
    assert stack[stack.index("train_step"):] == ["train_step", "run", "_forward"], stack

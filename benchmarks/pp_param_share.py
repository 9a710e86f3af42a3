"""Each pipeline rank's parameter share and peak memory at pp=2, by the partition alone
(cost model, no processes): the ILP without and with its memory tie-break, and the
parameter-balanced cut (``partition="params"``) with the bottleneck it would cost.

    PYTHONPATH=. .venv/bin/python benchmarks/pp_param_share.py

Zoo models, gpt-tiny, hf:llama and hf:gpt2 at batch 8 × 32, 4 microbatches, 1F1B.
Writes benchmarks/results/pp_param_share.txt. About a minute on 2 cores.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fxpipe  # noqa: E402
from benchmarks.results_log import recorded  # noqa: E402
from fxpipe.models import build_workload  # noqa: E402
from fxpipe.models.zoo import ZOO  # noqa: E402
from fxpipe.partition import registry  # noqa: E402
from fxpipe.partition.ilp import solve_ilp  # noqa: E402
from fxpipe.partition.result import Method  # noqa: E402


def compile_cut(w, partition: str, tiebreak: float):
    registry.SOLVERS[Method.ILP] = lambda problem, **kw: solve_ilp(problem, **{**kw, "memory_tiebreak": tiebreak})
    try:
        c = fxpipe.compile_pipeline(w.model, w.example_inputs,
                                    fxpipe.ParallelConfig(pp=2, num_microbatches=4, costs="model", partition=partition),
                                    loss_fn=w.loss_fn)
    finally:
        registry.SOLVERS[Method.ILP] = solve_ilp
    return c.program.partition


def main() -> None:
    with recorded("pp_param_share"):
        print(f"{'model':<20}{'cut':<18}{'largest share':>14}{'bottleneck ms':>15}{'fullest rank MiB':>18}")
        for name in [f"zoo:{n}" for n in ZOO] + ["gpt-tiny", "hf:llama", "hf:gpt2"]:
            try:
                w = build_workload(name, batch=8, seq=32)
            except ImportError:  # zoo:torchtune-llama without its extra
                continue
            for label, partition, tiebreak in (("ilp", "ilp", 0.0), ("ilp + tie-break", "ilp", 0.03),
                                               ("params", "params", 0.0)):
                r = compile_cut(w, partition, tiebreak)
                print(f"{name:<20}{label:<18}{max(r.rank_param_share):>14.3f}{r.bottleneck_s * 1e3:>15.3f}"
                      f"{max(r.rank_memory_bytes) / 2**20:>18.2f}")


if __name__ == "__main__":
    main()

"""The planner: one price (``step_price.py``) for the layouts of tensor, pipeline, data and
expert parallelism, with two entries that differ only in where a layout's stage times come from.

- On the captured graph, for a world of ranks (``parallelize``, ``fxpipe run``, ``fxpipe compile
  --world``): ``resolve.resolve_layout`` gives the layout or searches it with
  ``auto_layout.search_layout``, which compiles each layout and prices its stages from timings on
  this machine (``layout_price.py``; docs/layout_search.md).
- At cluster scale (``fxpipe plan``): ``plan`` prices the captured layer's matrices against a
  hardware profile and extrapolates over the layers (``predict.py``; docs/planner.md)::

    from fxpipe.planner import PlannerOptions, plan, shape_from_registry
    result = plan(shape_from_registry("gpt-1t"), gpus=3072, global_batch=3072,
                  options=PlannerOptions())
    best = result.predictions[0]     # .config, .iteration_s, .tflops_per_gpu, .memory_gb

Both compose the step, the data-parallel sync, the optimizer step and the training state the
same way; the SC21 closed forms (``sc21.py``) are a test reference, not a planner.
"""
from fxpipe.planner.options import CandidateLayout, DPOverlap, LayerBalance, PlannerOptions, ScheduleKind, VocabPasses
from fxpipe.planner.predict import Prediction, predict
from fxpipe.planner.search import PlanResult, enumerate_layouts, plan
from fxpipe.planner.shapes import TransformerShape, model_flops, shape_from_registry
from fxpipe.planner.work import Component

__all__ = ["Component", "DPOverlap", "LayerBalance", "CandidateLayout", "PlanResult", "PlannerOptions",
           "Prediction", "ScheduleKind", "TransformerShape", "VocabPasses", "enumerate_layouts", "model_flops", "plan",
           "predict", "shape_from_registry"]

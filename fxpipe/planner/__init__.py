"""The planner: search tensor/pipeline/data-parallel layouts with fxpipe's simulator.

    from fxpipe.planner import PlannerOptions, plan, shape_from_registry
    result = plan(shape_from_registry("gpt-1t"), gpus=3072, global_batch=3072,
                  options=PlannerOptions())
    best = result.predictions[0]     # .config, .iteration_s, .tflops_per_gpu, .memory_gb

See docs/planner.md for the cost model and its assumptions.
"""
from fxpipe.planner.options import CandidateLayout, DPOverlap, LayerBalance, PlannerOptions, ScheduleKind, VocabPasses
from fxpipe.planner.predict import Prediction, predict
from fxpipe.planner.search import PlanResult, enumerate_layouts, plan
from fxpipe.planner.shapes import TransformerShape, model_flops, shape_from_registry
from fxpipe.planner.work import Component

__all__ = ["Component", "DPOverlap", "LayerBalance", "CandidateLayout", "PlanResult", "PlannerOptions",
           "Prediction", "ScheduleKind", "TransformerShape", "VocabPasses", "enumerate_layouts", "model_flops", "plan",
           "predict", "shape_from_registry"]

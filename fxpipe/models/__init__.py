from fxpipe.models.gpt import GPT, GPTConfig
from fxpipe.models.registry import GPT_CONFIGS, Workload, build_workload, model_names

__all__ = ["GPT", "GPTConfig", "GPT_CONFIGS", "Workload", "build_workload", "model_names"]

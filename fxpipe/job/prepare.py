"""What ``fxpipe run`` builds before it trains, the same in the launcher's checks, the
layout search and every rank: the workload (``job_workload``: on the device
``models.registry.build_device`` chooses, the meta device for Hugging Face directories
and large registry GPTs), the data, the tokenizer and the weights a run takes by default."""
from __future__ import annotations

from fxpipe.data import CorpusOptions, open_data
from fxpipe.job.config import TrainConfig
from fxpipe.models.registry import build_device, build_workload
from fxpipe.models.workload import Workload
from fxpipe.models.hf_dir import check_weights_readable, has_weights, is_model_dir


def job_workload(config: "TrainConfig", batch: int | None = None) -> Workload:
    """The run's workload with an example batch of ``batch`` rows (default: the global
    batch), as every process of the run builds it. On the meta device (``build_device``)
    each rank takes only its shards (``weights_dir``) or initialises them itself."""
    return build_workload(config.model, batch=config.batch if batch is None else batch, seq=config.seq,
                          seed=config.parallel.seed, device=build_device(config.model))


def build_job(config: "TrainConfig"):
    """(workload, data source) of the run, as the layout search and every rank build them."""
    w = job_workload(config)
    source = open_data(config.data, seq=config.seq, val_data=config.val_data, val_fraction=config.val_fraction,
                       tokenizer=tokenizer_path(config), dtype=config.data_dtype.value, options=corpus_options(config))
    return w, source


def corpus_options(config: "TrainConfig", workers: int = 1, progress=None) -> CorpusOptions:
    """How the run reads text and datasets; ``workers`` tokenize a corpus found uncached
    (the preflight's: all cores, once, reporting ``progress``; a rank then finds the cache)."""
    return CorpusOptions(column=config.text_column, cache_dir=config.data_cache, workers=workers, progress=progress)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def tokenizer_path(config: "TrainConfig") -> str | None:
    """--tokenizer, else the --model directory's own tokenizer when it has one."""
    from pathlib import Path

    if config.tokenizer is not None:
        return config.tokenizer
    # tokenizer.json (fast), or a tokenizer_config.json / SentencePiece model that the Hugging
    # Face directory loader reads: never bytes for a model that brought its own tokenizer.
    if is_model_dir(config.model) and any((Path(config.model) / f).is_file() for f in TOKENIZER_FILES):
        return config.model
    return None


def weights_dir(config: "TrainConfig") -> str | None:
    """--init-from, else the --model directory when it holds safetensors (one holding its
    weights only as pickles is refused: it would otherwise train from random weights)."""

    if config.init_from is not None:
        return config.init_from
    if not is_model_dir(config.model):
        return None
    check_weights_readable(config.model)
    return config.model if has_weights(config.model) else None

"""`fxpipe run` on your model and your data: a tiny Llama saved
with save_pretrained, a BPE tokenizer trained here with `tokenizers`, text written
here and saved as a Hugging Face dataset (`Dataset.save_to_disk`); tp=2 × pp=2,
cosine LR, gradient clipping, validation, a metrics file and TensorBoard events with
MFU against a given peak — one job, its first two losses against one process reading
the same text as .txt files. The job is
docs/training.md's two-node launch: two torchrun invocations (--nnodes 2, c10d
rendezvous on 127.0.0.1) of 2 processes each; it checkpoints, balances stages on
measured costs and prints the run report (the elastic launcher's own path is run
by tests/checkpoint/test_checkpoint_cli.py's fxpipe run cases)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxpipe.checkpoint.dcp import list_checkpoints
from tests.data._corpus import train_bpe, write_corpus
from tests.runtime._dist import _free_port

ROOT = Path(__file__).resolve().parents[2]
SEQ, MBS, M, STEPS = 32, 2, 2, 20


def _llama_dir(path: Path, vocab: int) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=160, vocab_size=vocab, max_position_embeddings=SEQ,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("yours")
    texts = write_corpus(root / "texts", docs=40, words=150)
    (root / "txt").mkdir()  # the same documents, one .txt file each, in the rows' order
    for i, text in enumerate(texts):
        (root / "txt" / f"{i:03d}.txt").write_text(text)
    import datasets

    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(root / "dataset"))
    train_bpe(root / "tok", texts, vocab_size=320)
    _llama_dir(root / "llama", vocab=320)
    argv = ["--model", str(root / "llama"), "--data", str(root / "dataset"), "--tokenizer", str(root / "tok"),
            "--tp", "2", "--pp", "2", "--steps", str(STEPS), "--eval-interval", "10", "--lr-schedule", "cosine",
            "--grad-clip", "1.0", "--metrics-file", str(root / "m.jsonl"), "--seq", str(SEQ),
            "--micro-batch-size", str(MBS), "--microbatches", str(M), "--lr", "3e-3", "--log-interval", "1",
            "--timeline", str(root / "tl"), "--tensorboard-dir", str(root / "tb"), "--peak-tflops", "0.5"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "yours"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    nodes = [subprocess.Popen([*torchrun, "-m", "fxpipe", "run", *argv, "--checkpoint-dir", str(root / "ckpt"),
                               "--save-interval", "10"], cwd=root, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        outputs = [node.communicate(timeout=600) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    return root, argv, [(node.returncode, out, err) for node, (out, err) in zip(nodes, outputs)]


def _reference(root: Path, argv: list[str], steps: int) -> tuple[list[float], list[float]]:
    """One process: the directory's weights, the same windows, AdamW groups, schedule, clip."""
    import transformers

    from fxpipe.cli import build_parser
    from fxpipe.cli.run import resolve
    from fxpipe.data import DataStream
    from fxpipe.models.losses import next_token_loss
    from fxpipe.job.prepare import build_job
    from fxpipe.job.optimizer import lr_scheduler, param_groups

    config = resolve(build_parser().parse_args(["run", *argv]))
    _, source = build_job(config)
    stream = DataStream(source.train, config.batch, seed=config.parallel.seed)
    model = transformers.LlamaForCausalLM.from_pretrained(root / "llama")
    opt = torch.optim.AdamW(param_groups(model.named_parameters(), config.weight_decay), lr=config.lr,
                            betas=(0.9, 0.95))
    sched = lr_scheduler(opt, config)
    losses, norms = [], []
    for _ in range(steps):
        tokens = stream.next_batch()
        loss = next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)))
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, norms


@pytest.mark.slow
def test_your_model_on_your_data(job):
    root, argv, nodes = job
    for code, _, err in nodes:
        assert code == 0, err[-3000:]
    stdout = "".join(out for _, out, _ in nodes)  # rank 0 prints on whichever node it landed
    assert "tp=2 pp=2 dp=1" in stdout
    losses = [float(x) for x in re.findall(r"iter\s+\d+ \| loss ([0-9.]+) \|", stdout)]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.5, stdout
    evals = re.findall(r"eval\s+(\d+) \| val loss ([0-9.]+) \| perplexity ([0-9.]+)", stdout)
    assert [int(s) for s, _, _ in evals] == [10, 20], stdout
    assert [s for s, _ in list_checkpoints(root / "ckpt")] == [10, 20]
    # The report every run prints: throughput, the measured costs the partition balanced,
    # per-stage predicted vs measured times (tp=2 × pp=2: two stages), the timeline.
    assert "tokens/s" in stdout and "TFLOP/s/process" in stdout and "bubble" in stdout
    assert any("costs: timing" in err or "costs: reusing" in err for _, _, err in nodes)
    table = re.search(r"stage balance.*?\n(?:.*\n){1}((?:\s+\d+\s+\d+(?:\s+[0-9.]+){5}\n){2})"
                      r"measured imbalance .*: ([0-9.]+)", stdout)
    assert table and float(table.group(2)) >= 1.0, stdout
    assert (root / "tl.json").exists() and (root / "tl.png").exists()
    assert float(evals[1][1]) < float(evals[0][1])
    assert all(abs(float(p) - torch.tensor(float(v)).exp().item()) < 0.01 * float(p) for _, v, p in evals)
    records = [json.loads(line) for line in (root / "m.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert {"lr", "grad_norm", "tokens_per_s", "tflops_per_process", "bubble", "memory_gib"} <= set(steps[0])
    assert [r["loss"] for r in steps] == pytest.approx(losses, abs=1e-4)
    assert steps[-1]["lr"] < steps[5]["lr"], "cosine decay"
    assert [r["step"] for r in records if "val_loss" in r] == [10, 20]
    assert [r["mfu"] for r in steps] == pytest.approx([r["tflops_per_process"] / 0.5 for r in steps], rel=1e-6)
    assert re.search(r"\| MFU [0-9.]+% \|", stdout) and "MFU" in stdout.split("done:")[1]
    # Each rank's time blocked in waits (pipeline transfers, the gradient reduction) per step.
    waits = re.search(r"exposed communication ([0-9.]+) ms/iter \(per rank: ([0-9., ]+)\)", stdout.split("done:")[1])
    assert waits and len(waits.group(2).split(",")) == 4 and float(waits.group(1)) > 0, stdout
    # TensorBoard's own reader finds every scalar of every logged step, and the validations.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / "tb")).Reload()
    for tag in ("loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_process", "mfu", "memory_gib"):
        assert [e.step for e in events.Scalars(tag)] == list(range(1, STEPS + 1)), tag
    assert [e.value for e in events.Scalars("loss")] == pytest.approx(losses, abs=1e-4)
    assert [e.step for e in events.Scalars("val_loss")] == [10, 20]
    # The reference reads the same documents as .txt files: the dataset gave the same tokens.
    at = argv.index("--data") + 1
    ref_losses, ref_norms = _reference(root, argv[:at] + [str(root / "txt")] + argv[at + 1:], 2)
    assert losses[:2] == pytest.approx(ref_losses, rel=1e-4)
    assert min(ref_norms) > 1.0, "the clip acts on both steps"
    assert [r["grad_norm"] for r in steps[:2]] == pytest.approx(ref_norms, rel=1e-4)

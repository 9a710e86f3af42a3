"""Text and a BPE tokenizer written by a test (the tokenizers library, no download)."""
from __future__ import annotations

import json
from pathlib import Path

WORDS = ("the pipeline sends activations forward and gradients back while each stage "
         "computes its layers and the optimizer steps every shard of the model").split()


def write_corpus(root: Path, docs: int = 6, words: int = 120) -> list[str]:
    """a.txt (one document) and b.jsonl (``docs - 1`` documents); returns them in order."""
    root.mkdir(parents=True, exist_ok=True)
    texts = [" ".join(WORDS[(i * 7 + j * j) % len(WORDS)] for j in range(words)) for i in range(docs)]
    (root / "a.txt").write_text(texts[0])
    (root / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[1:]))
    return texts


def train_bpe(directory: Path, texts: list[str], vocab_size: int) -> Path:
    """A byte-level BPE trained on ``texts``, saved as tokenizer.json with its EOS named."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return directory

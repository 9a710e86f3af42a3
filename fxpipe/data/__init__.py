"""The data path of ``fxpipe run``: token files, text + tokenizer, packed windows.

::

    token file (.bin uint16/uint32, .npy) ───────────────────────────────────┐
    text (.txt, .jsonl, a directory) ──┬─ tokenizer, N processes ─> token cache ─┤
    Hugging Face dataset (save_to_disk,│  (.bin + manifest; keyed by stat and     │
      Parquet, Arrow: text/input_ids) ─┘   samples; blocks verified as read)     │
    the built-in default (stdlib source, bytes) ─────────────────────────────┘
        │ TokenStream: 1-D ids, documents separated by EOS   (tokens.py, corpus.py)
        ▼
    PackedWindows: seq+1 tokens each; a validation split          (windows.py)
        ▼
    DataStream: a shuffled order per epoch; replica r of dp reads its rows of each
                global batch; ``position`` (windows consumed) saved in checkpoints
"""
from fxpipe.data.builtin import stdlib_documents, stdlib_stream
from fxpipe.data.corpus import Corpus, cached_tokens, open_corpus, tokenized
from fxpipe.data.source import CorpusOptions, DataSource, open_data
from fxpipe.data.tokenizer import ByteTokenizer, load_tokenizer
from fxpipe.data.tokens import TokenDtype, TokenStream, max_token, open_token_file
from fxpipe.data.windows import DataStream, PackedWindows

__all__ = ["ByteTokenizer", "Corpus", "CorpusOptions", "DataSource", "DataStream", "PackedWindows", "TokenDtype", "TokenStream",
           "cached_tokens", "load_tokenizer", "max_token", "open_corpus", "open_data", "tokenized", "open_token_file", "stdlib_documents",
           "stdlib_stream"]

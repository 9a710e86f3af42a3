"""The data path of ``fxpipe run``: token files, text + tokenizer, packed windows.

::

    token file (.bin uint16/uint32, .npy)  ─┐
    text (.txt, .jsonl, a directory) ──tokenizer──> cached token file ─┤
    the built-in default (stdlib source, bytes) ──────────────────────┘
        │ TokenStream: 1-D ids, documents separated by EOS      (tokens.py, text.py)
        ▼
    PackedWindows: seq+1 tokens each; a validation split          (windows.py)
        ▼
    DataStream: a shuffled order per epoch; replica r of dp reads its rows of each
                global batch; ``position`` (windows consumed) saved in checkpoints
"""
from fxpipe.data.builtin import stdlib_documents, stdlib_stream
from fxpipe.data.source import DataSource, open_data
from fxpipe.data.tokenizer import ByteTokenizer, load_tokenizer
from fxpipe.data.tokens import TokenDtype, TokenStream, max_token, open_token_file
from fxpipe.data.windows import DataStream, PackedWindows

__all__ = ["ByteTokenizer", "DataSource", "DataStream", "PackedWindows", "TokenDtype", "TokenStream",
           "load_tokenizer", "max_token", "open_data", "open_token_file", "stdlib_documents",
           "stdlib_stream"]

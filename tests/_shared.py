"""Constants shared by test modules."""

# The five models the Foundation issue names: fxpipe's GPT and four HF families.
FIVE_MODELS = ["gpt-tiny", "hf:gpt2", "hf:llama", "hf:gpt_neox", "hf:opt"]

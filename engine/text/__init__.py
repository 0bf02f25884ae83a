"""Text in and out of the model: tokenizer, chat template, streaming detokenizer."""

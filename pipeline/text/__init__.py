"""Raw text in: sources, readers, encoders, the tokenizer."""

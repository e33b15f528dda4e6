"""The client side of the engine: core process handling, tokenizer, detokenizer, outputs."""

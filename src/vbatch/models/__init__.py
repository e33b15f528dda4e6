"""Model loading (HF directories, GGUF conversion) and the Llama-family decoder."""

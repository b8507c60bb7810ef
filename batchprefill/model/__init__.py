"""Model loading (GGUF conversion, HF folders), the tokenizer, and the Llama-family forward pass."""

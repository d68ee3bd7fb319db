"""Model families: dense targets (qwen3, llama) and the DSpark drafter."""

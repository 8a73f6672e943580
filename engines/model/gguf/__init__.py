"""GGUF files (llama.cpp, Ollama, LM Studio) imported into mlx-lm model directories."""

"""The OpenAI dialect: POST /v1/chat/completions and /v1/completions."""

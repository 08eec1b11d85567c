"""The HTTP dialects (OpenAI, Ollama, Anthropic) and the request path they share."""

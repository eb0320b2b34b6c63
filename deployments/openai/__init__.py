"""OpenAI's `/v1/completions`, `/v1/chat/completions` and `/v1/models`: request models, serving, routes."""

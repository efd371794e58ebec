"""The completions flow behind /v1/chat/completions and /v1/completions: prompts, admission against the
tenant's limits, the engine stream, and shaping choices, logprobs and tool calls as OpenAI responses."""

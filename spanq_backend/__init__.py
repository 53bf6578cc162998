"""spanq server side: lowering, span-aware hashing, ReRoPE, CIDRA, the vLLM plugin, the server, the default model."""

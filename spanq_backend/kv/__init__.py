"""The KV machinery, free of vLLM: span tables and span-aware block hashing, ReRoPE, key relocation
(with its compiled CPU op), and CIDRA's planning.
"""

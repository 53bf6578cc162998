"""spanq server side: lowering, span-aware hashing, ReRoPE, CIDRA, the vLLM plugin, the server, the default model."""

from spanq_backend.serving.logs import quiet_import

quiet_import()  # before any module of spanq's imports vLLM (its import-time notes; `serving/logs.py`)

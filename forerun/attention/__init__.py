from .base import AttentionBackend, ReferenceBackend
from .metadata import AttnMetadata

__all__ = ["AttentionBackend", "ReferenceBackend", "AttnMetadata"]

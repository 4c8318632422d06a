"""The client library: ``Client`` (blocking, thread-safe) and ``AsyncClient``."""

from .aio import AsyncClient
from .codec import Grant
from .sync import Client

__all__ = ["AsyncClient", "Client", "Grant"]

"""Settings of the serving API: environment variables ``DLRM_*`` (or ``dlrm serve`` flags)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DLRM_", use_attribute_docstrings=True, extra="ignore")

    store: str = "file://build/store"
    """Serving store URL: file://DIR or redis://[:password@]host:port/db."""
    model_name: str = "dlrm"
    """Name under which the model is served: /v1/models/{model_name}."""
    cache_mb: float = Field(default=256.0, ge=0)
    """Per-process hot-row cache in front of a remote store (0: no cache)."""
    max_instances: int = Field(default=4096, ge=1)
    """Largest batch one request may carry."""
    max_body_bytes: int = Field(default=16 << 20, ge=1024)
    """Largest request body; larger bodies get 413."""
    poll_interval_s: float = Field(default=0.5, gt=0)
    """How often the current version and live updates are polled."""
    store_timeout_s: float = Field(default=1.0, gt=0)
    """Socket timeout of every store call: a dead store costs at most this per request."""
    retry_after_s: int = Field(default=2, ge=1)
    """Retry-After of 503 answers while the store is unavailable."""
    api_key: SecretStr | None = None
    """Bearer key required on the model endpoints (unset: no authentication)."""
    api_key_file: Path | None = None
    """File holding the bearer key (first line), as an alternative to api_key."""
    threads: int = Field(default=1, ge=1)
    """Intra-op threads of the dense model per process (1 serves small batches fastest)."""

    def resolved_api_key(self) -> str | None:
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if self.api_key_file is not None:
            return self.api_key_file.read_text().splitlines()[0].strip()
        return None


@lru_cache
def get_settings() -> Settings:
    return Settings()

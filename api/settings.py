"""Settings of the serving API: environment variables ``DLRM_*`` (or ``dlrm serve`` flags)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="DLRM_", use_attribute_docstrings=True, extra="ignore"
    )

    store: str = "file://build/store"
    """Serving store URL: file://DIR, redis://[user@]host:port/db or rediss://... (TLS; CA and
    client certificates as ?ssl_ca_certs=&ssl_certfile=&ssl_keyfile=). Never logged unredacted."""
    store_password_file: Path | None = None
    """File holding the store's password (a Docker / Kubernetes secret), instead of the URL."""
    model_name: str = Field(default="dlrm", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    """Name under which the model is served: /v1/models/{model_name}, /v2/models/{model_name}."""
    cache_mb: float = Field(default=256.0, ge=0)
    """Per-process hot-row cache in front of a remote store, per loaded version (0: no cache)."""
    max_instances: int = Field(default=4096, ge=1)
    """Largest batch one request may carry."""
    max_ids_per_request: int = Field(default=1 << 18, ge=1)
    """Largest number of categorical ids one request may carry (every value of every feature,
    bags counted value by value); more get 413 naming this cap. 4096 one-hot Criteo instances
    carry 106,496; the cap bounds a request's lookup and pooling work whatever its bags hold."""
    batching: bool = True
    """Dynamic batching: concurrent requests of one version are coalesced into one model call
    (``api/batching.py``). A lone request is scored at once, never delayed."""
    batch_max_size: int = Field(default=256, ge=1)
    """Most examples in one coalesced model call; a request with more is scored alone."""
    batch_max_delay_us: int = Field(default=1000, ge=0)
    """Longest the batcher waits, once a request is queued, for requests already being decoded
    (Triton's ``max_queue_delay_microseconds``); it waits only while some are, so at low load no
    request waits at all."""
    fast_path: bool = True
    """Scoring routes (V1 predict and predict_tsv, V2 infer) answered by a lean ASGI layer
    (``api/fastpath.py``) instead of FastAPI's router and dependency machinery: the same
    handlers, errors, metrics, authentication and body cap, less CPU per request. False: through
    FastAPI (identical answers; for comparison)."""
    inline_max_bytes: int = Field(default=4096, ge=0)
    """A scoring request whose body is at most this many bytes (a dozen single instances),
    arriving while no other is in flight, on a local store (file: memory-mapped rows) or with
    every row it reads in a remote store's row cache, is scored on the event loop itself instead
    of a pool thread (``api/fastpath.py``): its work is bounded by its size, and it saves the
    thread hop. A body this small that arrives while others are in flight is decoded and
    featurised on the loop and its model call queued for the batcher thread (dynamic batching
    on). Larger bodies and lone requests that read a remote store go to a pool thread. 0: never
    on the loop."""
    pool_concurrency: int = Field(default=4, ge=1, le=40)
    """Threads doing a request's CPU work at once (``api/slots.py``: pool threads decoding or
    scoring large bodies and the batcher's thread; a request waiting for its batch gives its
    slot back); 4 requests per slot are let into the pool, the others wait on the event loop,
    holding no thread. Each busy thread contends for the GIL:
    with 40 at once, a health probe waited over 100 ms for the loop's turn; with 4 the loop
    gets the GIL within a switch interval or two, and two cores stay as busy
    (bench/results/probes.md)."""
    max_body_bytes: int = Field(default=16 << 20, ge=1024)
    """Largest request body; larger bodies get 413."""
    max_pinned_versions: int = Field(default=2, ge=0)
    """Versions other than the current one that requests may pin (/versions/{v}) and that stay
    loaded at once (least recently loaded first out)."""
    poll_interval_s: float = Field(default=0.5, gt=0)
    """How often the current version and live updates are polled."""
    store_timeout_s: float = Field(default=1.0, gt=0)
    """Socket timeout of every store call: a dead store costs at most this per request."""
    retry_after_s: int = Field(default=2, ge=1)
    """Retry-After of 503 answers while the store is unavailable."""
    api_key: SecretStr | None = None
    """Bearer key(s) required on every route but the health probes; several separated by commas
    (rotation), each at least 16 characters. Set but holding no key (empty, only commas) is an
    error, never "no authentication"."""
    api_key_file: Path | None = None
    """File of bearer keys, one per line (# comments), re-read when it changes."""
    no_auth: bool = False
    """Serve without authentication, explicitly (a warning at start). Without it and without
    keys, ``dlrm serve`` binds only to a loopback address."""
    header_timeout_s: float = Field(default=10.0, gt=0)
    """A request's line and headers must arrive within this long of its first byte (or of the
    connection), else 408 and the connection closes (slowloris; ``api/http_protocol.py``)."""
    body_idle_s: float = Field(default=30.0, gt=0)
    """Longest pause between two chunks of a request's body before the connection closes."""
    max_header_bytes: int = Field(default=65536, ge=1024)
    """Largest request line and headers together; more get 431 and the connection closes."""
    keep_alive_s: int = Field(default=5, ge=1)
    """An idle kept-alive connection closes after this many seconds (uvicorn's
    ``timeout_keep_alive``)."""
    dense_max_abs: float = Field(default=3.4028234663852886e38, gt=0)
    """Largest magnitude of a dense value (default: the finite float32 range, which the model
    computes in); larger values are a 422 naming the field, in every protocol."""
    threads: int = Field(default=1, ge=1)
    """Intra-op threads of the dense model per process (1 serves small batches fastest)."""
    gil_switch_interval_us: int = Field(default=1000, ge=100, le=100_000)
    """How long a thread may hold the GIL before the interpreter hands it to another
    (``sys.setswitchinterval``), set at start-up. A thread scoring a maximum-size request holds it
    in long pure-Python stretches; with Python's default (5000 µs) each hand-back to the event loop
    can wait that long several times in a row, so ``/healthz`` took 50-70 ms under such requests;
    at 1000 µs it answers in 20-35 ms."""
    access_log: bool = True
    """One log line per request (method, path, route, status, ms, request id), written in batches
    (``dlrm_core.logs.BufferedStreamHandler``: within 0.2 s, all of them at a graceful stop). On
    by default: in process it costs about 8 µs of CPU per request as text, 13 µs as JSON; a
    served request about 40-50 / 60-75 µs (bench/results/access_log.md); a saturated worker answers
    about 10% fewer requests with it. Turn it off where every microsecond counts."""
    log_format: Literal["text", "json"] = "text"
    """Log lines as text or as one JSON object per line."""

    def api_keys(self) -> list[str] | None:
        """The keys given directly (api_key), split at commas; None where api_key is unset (an
        empty list where it is set but holds none: an error for :class:`api.auth.KeyRing`)."""
        if self.api_key is None:
            return None
        return [k.strip() for k in self.api_key.get_secret_value().split(",") if k.strip()]

    def key_ring(self):
        """The bearer keys these settings give (:class:`api.auth.KeyRing`).

        Raises:
            ConfigError: a key source yields no key or a short one (see ``api/auth.py``).
        """
        from api.auth import KeyRing

        return KeyRing(self.api_keys(), self.api_key_file, no_auth=self.no_auth)


@lru_cache
def get_settings() -> Settings:
    return Settings()

"""Settings: the ingress process's configuration, from LORAPLEX_* environment variables, with its
sections beside it (ResponsesConfig), so a feature reads its section from here and settings import no feature.

Built by the caller (a deployment's constructor, the CLI), never at import time.
"""

import secrets
from pathlib import Path

from pydantic import BaseModel, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from adapters.store import store_location
from app.private_files import publish_secret
from app.schemas.openai import MAX_INPUT_ITEMS, MAX_MESSAGES, MAX_PROMPTS
from billing.db import PoolConfig
from deployments.engine.interface import MAX_N

MIN_ADMIN_KEY_BYTES = 32


class ResponsesConfig(BaseModel):
    """Settings.responses, as JSON in LORAPLEX_RESPONSES: {"retention_days": 30, ...}."""

    retention_days: float = Field(
        default=30.0,
        gt=0,
        description=(
            "A stored response (store: true) can be retrieved and continued this long after it was made; "
            "then it is gone as if deleted."
        ),
    )
    max_stored_kb: int = Field(
        default=4096,
        ge=1,
        description=(
            "Largest conversation one stored response may hold (its chain of earlier turns, its input and "
            "its output, as JSON). A continuation past it drops its oldest turns with truncation 'auto' "
            "and is refused (400) with 'disabled'."
        ),
    )
    max_input_items: int = Field(
        default=1024, ge=1, le=MAX_INPUT_ITEMS, description="Most items in one request's `input` list."
    )
    sweep_interval_s: float = Field(
        default=300.0,
        gt=0,
        description=(
            "How often each ingress deletes expired stored responses of every tenant (in batches); until "
            "then they read as missing but take space."
        ),
    )


class FilesConfig(BaseModel):
    """Settings.files, as JSON in LORAPLEX_FILES: {"max_bytes": 104857600, ...} (issue 37)."""

    max_bytes: int = Field(
        default=100 * 2**20,
        ge=1,
        description=(
            "Largest file one upload to POST /v1/files may hold, in bytes; past it the upload is refused "
            "(413 file_too_large) as it streams, the rest never read."
        ),
    )
    max_lines: int = Field(
        default=50_000,
        ge=1,
        description="Most JSONL lines (requests) one file may hold; more is refused (400 too_many_lines).",
    )
    retention_days: float = Field(
        default=30.0,
        gt=0,
        description=(
            "A file expires this long after its upload unless the upload asks for less (expires_after); "
            "then it reads as missing and the sweep removes it and its bytes."
        ),
    )
    output_retention_days: float = Field(
        default=30.0, gt=0, description="How long a batch's output and error files are kept."
    )
    sweep_interval_s: float = Field(
        default=300.0, gt=0, description="How often each ingress deletes every tenant's expired files."
    )


class BatchesConfig(BaseModel):
    """Settings.batches, as JSON in LORAPLEX_BATCHES: {"max_active": 10, ...} (issue 37)."""

    max_active: int = Field(
        default=10,
        ge=1,
        description=(
            "Batches one tenant may have that are not finished (validating, in progress, finalizing or "
            "cancelling); one more is refused (429 batch_limit_exceeded) until one ends."
        ),
    )
    max_models: int = Field(
        default=64,
        ge=1,
        description="Distinct models (base models or adapters) the lines of one batch may name.",
    )
    max_errors: int = Field(
        default=1000,
        ge=1,
        description="Most line errors a failed batch lists (its first, by line); validation stops there.",
    )
    run_lines: bool = Field(
        default=True,
        description="Whether this ingress replica runs batch lines (app/batches/runner.py); every one does.",
    )
    max_in_flight_per_tenant: int = Field(
        default=64,
        ge=1,
        description=(
            "Lines of one tenant's batches running at once, across replicas: its money is held only for "
            "these, so a batch never starves the tenant's interactive requests of credit. Above an "
            "engine's rows (max_num_seqs), so its queue never runs dry between a line's end and the next."
        ),
    )
    max_in_flight: int = Field(
        default=64, ge=1, description="Batch lines one ingress replica runs at once, of every tenant."
    )
    lease_s: float = Field(
        default=60.0,
        gt=0,
        description=(
            "How long a claimed line is its runner's without renewal (renewed every third of it while it "
            "runs); a line whose lease lapsed (its replica died) is claimed again. Also how long a batch "
            "left finalizing waits before another replica finalizes it."
        ),
    )
    poll_interval_s: float = Field(
        default=1.0, gt=0, description="How often an idle runner looks for queued lines and finished batches."
    )
    max_attempts: int = Field(
        default=8,
        ge=1,
        description=(
            "Claims of one line (the platform failed it, 5xx, or its runner died) before it fails; with "
            "the retry waits, about three minutes of an engine that is down or restarting."
        ),
    )
    max_lost: int = Field(
        default=3,
        ge=1,
        description=(
            "Runs of one line whose runner stopped before it ended (its replica died, its lease lapsed) "
            "before it fails: a line that takes down its replica does so this many times, not max_attempts."
        ),
    )
    retry_base_s: float = Field(
        default=2.0,
        gt=0,
        description=(
            "Wait before a line the platform failed runs again (its engine restarting, say), doubled at "
            "each try up to retry_max_s: a line does not spend its attempts while an engine is down."
        ),
    )
    retry_max_s: float = Field(default=60.0, gt=0, description="Longest wait before a line runs again.")


class Settings(BaseSettings):
    # hide_input_in_errors: a refused value (a short admin key, a database URL) never reaches a log.
    model_config = SettingsConfigDict(env_prefix="LORAPLEX_", extra="ignore", hide_input_in_errors=True)

    data_dir: Path = Field(default=Path("var"), description="Where the embedded defaults keep their files.")
    database_url: str = Field(
        default="",
        description="SQLAlchemy URL of the billing database; empty: a SQLite file in data_dir.",
    )
    admin_key: SecretStr = Field(
        default=SecretStr(""),
        description=(
            f"Bearer token for /admin, at least {MIN_ADMIN_KEY_BYTES} bytes (a shorter one is refused at "
            "start); empty disables the admin API. Only the nodes running ingress replicas need it."
        ),
    )
    key_secret: SecretStr = Field(
        default=SecretStr(""),
        description="Server secret that API-key hashes are keyed with; empty: a file in data_dir, made once.",
    )
    auth_cache_ttl_s: float = Field(
        default=2.0, ge=0, description="How long a key lookup is cached; revocations apply within this."
    )
    adapter_store: str | Path | None = Field(
        default=None,
        description=(
            "Adapter store: a directory or file:///dir (one machine), s3://bucket/prefix (endpoint, region "
            "and credentials from the AWS environment: AWS_ENDPOINT_URL, ...) or another fsspec URL; "
            "default data_dir/adapters."
        ),
    )
    adapter_cache_dir: Path | None = Field(
        default=None,
        description="Each node's cache of adapters read from an object store; default data_dir/adapter-cache",
    )
    adapter_cache_mb: int = Field(
        default=10240, ge=1, description="Size bound of each node's adapter cache (least recently used go)."
    )
    leftover_max_age_s: float = Field(
        default=3600.0,
        gt=0,
        description=(
            "At ingress startup, upload and store staging left untouched this long (by a process killed "
            "mid-upload) is removed; anything written to more recently is an upload still in progress."
        ),
    )
    auto_migrate: bool = Field(
        default=False,
        description=(
            "Upgrade the billing database to this version's schema when an ingress replica starts. For "
            "single-node setups; elsewhere run `loraplex db upgrade` once per release instead."
        ),
    )
    database_pool: PoolConfig = Field(
        default_factory=PoolConfig,
        description='The database connection pool of each ingress replica, as JSON: {"size": 5, ...}.',
    )
    auth_failure_limit: int = Field(
        default=100,
        ge=1,
        description=(
            "Failed key lookups one client address may cause per auth_failure_window_s (per ingress "
            "replica); past it, keys that need a lookup get 429 until the window ends, except keys whose "
            "prefix has authenticated on this replica (a tenant beside the culprit behind one address)."
        ),
    )
    auth_failure_limit_per_key: int = Field(
        default=10,
        ge=1,
        description=(
            "Failed lookups one client address may cause per auth_failure_window_s with one key prefix; "
            "past it, that prefix gets 429 from there until the window ends."
        ),
    )
    admin_auth_failure_limit: int = Field(
        default=10,
        ge=1,
        description=(
            "Failed admin-key checks one client address may make per auth_failure_window_s (per ingress "
            "replica); past it, every admin call from there gets 429 until the window ends."
        ),
    )
    auth_failure_window_s: float = Field(default=60.0, gt=0, description="Window of auth_failure_limit.")
    client_ip_header: str = Field(
        default="",
        description=(
            "Header a trusted proxy in front puts the client address in (its last entry is used), e.g. "
            "x-forwarded-for; empty: the connection's peer address. Set it behind a load balancer, else "
            "the failed-auth throttles count every client as the balancer. The admin listener "
            "(admin_listen) always uses the peer address."
        ),
    )
    read_rpm: int = Field(
        default=120, ge=1, description="Reads (/v1/models, /v1/usage, /v1/limits) per tenant per minute."
    )
    read_burst: int = Field(default=60, ge=1, description="Reads a tenant may make at once before read_rpm.")
    key_last_used_interval_s: float = Field(
        default=60.0,
        gt=0,
        description="An API key's last_used_at is written at most once per this many seconds per replica.",
    )

    budget_max_gpu_seconds: float = Field(
        default=300.0,
        gt=0,
        description=(
            "GPU seconds one request of a budgeted tenant (credit or a spend limit) may use where its prices "
            "charge GPU time: its hold includes this much GPU time, and the engine ends it there with "
            "finish_reason length (gpu_time_limited), so its cost never exceeds its hold."
        ),
    )

    adapter_cache_ttl_s: float = Field(
        default=1.0,
        ge=0,
        description="How long a name -> adapter version lookup is cached per ingress replica.",
    )
    max_upload_mb: int = Field(default=1024, ge=1, description="Largest adapter upload accepted.")
    max_body_kb: int = Field(
        default=2048,
        ge=1,
        description="Largest request body on every route but adapter uploads; larger gets 413 unread.",
    )
    admin_listen: str = Field(
        default="",
        description=(
            "host:port of a separate listener for /admin (each ingress replica opens it); when set, the "
            "tenant port no longer serves /admin, so operators can firewall the admin API."
        ),
    )
    public_docs: bool = Field(
        default=True,
        description=(
            "Serve /docs, /redoc and /openapi.json on the tenant port (with the admin API there too, they "
            "describe it). The admin listener serves them regardless."
        ),
    )
    public_readiness_checks: bool = Field(
        default=True,
        description=(
            "/readyz on the tenant port names each check (every base model among them); off, it answers "
            "ready or not only. The admin listener always names them."
        ),
    )
    max_messages: int = Field(
        default=1024, ge=1, le=MAX_MESSAGES, description="Most chat messages in one request."
    )
    max_prompt_chars: int = Field(
        default=1_000_000,
        ge=1,
        description=(
            "Most characters of prompt text (all messages, or all prompts, together) one request may send; "
            "a prompt sent as token ids counts each id as one character."
        ),
    )
    max_n: int = Field(
        default=8,
        ge=1,
        le=MAX_N,
        description="Most choices per prompt (`n`) one request may ask for; more gets 400 naming n.",
    )
    max_prompts: int = Field(
        default=64,
        ge=1,
        le=MAX_PROMPTS,
        description=(
            "Most prompts in one /v1/completions request (`prompt` as a list); each runs n choices, all "
            "in one engine request."
        ),
    )

    responses: ResponsesConfig = Field(
        default_factory=ResponsesConfig,
        description='The Responses API\'s stored responses, as JSON: {"retention_days": 30, ...}.',
    )

    files: FilesConfig = Field(
        default_factory=FilesConfig,
        description='The Files API, as JSON: {"max_bytes": 104857600, "max_lines": 50000, ...}.',
    )
    batches: BatchesConfig = Field(
        default_factory=BatchesConfig, description='The Batch API, as JSON: {"max_active": 10, ...}.'
    )

    @field_validator("admin_key")
    @classmethod
    def _long_admin_key(cls, key: SecretStr) -> SecretStr:
        value = key.get_secret_value()
        if value and len(value.encode()) < MIN_ADMIN_KEY_BYTES:
            raise ValueError(
                f"admin_key (LORAPLEX_ADMIN_KEY) must be at least {MIN_ADMIN_KEY_BYTES} bytes; make one with "
                "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
            )
        return key

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'loraplex.db').resolve()}"

    def resolved_adapter_store(self) -> Path | str:
        """A local store as a Path, an object store as its URL."""
        return store_location(self.adapter_store or self.data_dir / "adapters")

    def resolved_adapter_cache_dir(self) -> Path:
        return self.adapter_cache_dir or self.data_dir / "adapter-cache"

    def resolved_key_secret(self) -> bytes:
        """The configured secret, or one generated once per data_dir (0600) so restarts keep keys valid."""
        if self.key_secret.get_secret_value():
            return self.key_secret.get_secret_value().encode()
        path = self.data_dir / "key_secret"
        if not path.exists():  # 0600 from creation, linked into place whole; a concurrent winner's is kept
            publish_secret(path, secrets.token_urlsafe(32))
        return path.read_text().strip().encode()

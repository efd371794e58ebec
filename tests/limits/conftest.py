"""The `backend` fixture: every LimiterBackend in turn, each on fresh, isolated state.

Redis runs against the local server (LORAPLEX_TEST_REDIS_URL overrides it): skipped when unreachable,
a failure instead when CI=true, so CI can never go green without it. Ray runs a small local cluster for
this module, or reuses the session's if one is up already.
"""

import os
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterator

import pytest
import ray
import redis

from app.budgets.local_backend import LocalBudgets
from app.budgets.protocol import BudgetBackend
from app.budgets.ray_backend import ACTOR_NAME as BUDGET_ACTOR
from app.budgets.ray_backend import RayBudgets
from app.budgets.redis_backend import RedisBudgets
from app.limits import LimiterBackend
from app.limits.local_backend import LocalLimiter
from app.limits.ray_backend import ACTOR_NAME, RayLimiter
from app.limits.redis_backend import RedisLimiter
from tests.ci import missing

REDIS_URL = os.environ.get("LORAPLEX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
BACKENDS = ["local", "ray", "redis"]


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The test server's URL, once it has answered a PING."""
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2, socket_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        missing(f"Redis unreachable at {REDIS_URL}: {exc}")
    finally:
        client.close()
    return REDIS_URL


class RayActors:
    """Hands each test a namespace of its own with a fresh limiter actor in it. An actor's worker takes
    ~0.5 s to start, so the next few are always starting in the background while tests run."""

    AHEAD = 2

    def __init__(self) -> None:
        self._spares = deque(self._start() for _ in range(self.AHEAD))

    @staticmethod
    def _start() -> str:
        namespace = f"loraplex-test-{uuid.uuid4().hex}"
        RayLimiter(namespace=namespace)  # creates the named actor; does not wait for it
        return namespace

    def take(self) -> str:
        self._spares.append(self._start())
        return self._spares.popleft()

    def close(self) -> None:
        for namespace in self._spares:
            ray.kill(ray.get_actor(ACTOR_NAME, namespace=namespace))


@pytest.fixture(scope="module")
def ray_actors() -> Iterator[RayActors]:
    """A local Ray cluster, module-scoped so that it is gone before another module (tests/e2e) starts its
    own. A cluster that is already up is reused and left running."""
    if ray.is_initialized():
        actors = RayActors()
        yield actors
        actors.close()
        return
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # Ray 2.60 turns token auth on for new local clusters
    ray.init(address="local", include_dashboard=False, num_cpus=2, log_to_driver=False)
    try:
        yield RayActors()  # its spares die with the cluster
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


@pytest.fixture
async def redis_limiter(redis_url: str) -> AsyncIterator[RedisLimiter]:
    """A RedisLimiter under a key prefix of its own; its keys are deleted afterwards."""
    prefix = f"loraplex-test:{uuid.uuid4().hex}"
    limiter = RedisLimiter(redis_url, key_prefix=prefix)
    try:
        yield limiter
    finally:
        await limiter.aclose()
        _delete_keys(redis_url, prefix)


def _delete_keys(redis_url: str, prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        stale = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if stale:
            client.delete(*stale)
    finally:
        client.close()


@pytest.fixture
async def ray_limiter(ray_actors: RayActors) -> AsyncIterator[RayLimiter]:
    """A RayLimiter whose actor lives in a namespace of its own, killed afterwards."""
    namespace = ray_actors.take()
    # get_if_exists: the actor started for this namespace. 20 s, as the budgets' actor below: production's
    # 2 s bound is for a live platform, while here 300 concurrent calls beside the other xdist worker's
    # benches have taken longer; no test here checks the actor's timeout.
    limiter = RayLimiter(namespace=namespace, timeout_s=20)
    actor = ray.get_actor(ACTOR_NAME, namespace=namespace)
    await actor.__ray_ready__.remote()  # a worker may start slower than the limiter's call timeout
    try:
        yield limiter
    finally:
        ray.kill(actor)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> LimiterBackend:
    """Each backend in turn, on empty state."""
    if request.param == "local":
        return LocalLimiter()
    limiter: LimiterBackend = request.getfixturevalue(f"{request.param}_limiter")
    return limiter


@pytest.fixture(params=BACKENDS)
async def budgets(request: pytest.FixtureRequest, redis_url: str) -> AsyncIterator[BudgetBackend]:
    """Each budget backend in turn, on empty state (the Ray actor in a namespace of its own)."""
    if request.param == "local":
        yield LocalBudgets()
    elif request.param == "ray":
        request.getfixturevalue("ray_actors")  # the module's cluster
        namespace = f"loraplex-test-{uuid.uuid4().hex}"
        backend = RayBudgets(namespace=namespace, timeout_s=20)
        actor = ray.get_actor(BUDGET_ACTOR, namespace=namespace)
        await actor.__ray_ready__.remote()
        try:
            yield backend
        finally:
            ray.kill(actor)
    else:
        prefix = f"loraplex-test:{uuid.uuid4().hex}"
        redis_budgets = RedisBudgets(redis_url, key_prefix=prefix)
        try:
            yield redis_budgets
        finally:
            await redis_budgets.aclose()
            _delete_keys(redis_url, prefix)

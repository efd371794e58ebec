"""Ray-side operations of the load test, each run as its own short-lived driver process so that the load
generator (gevent) never shares a process with Ray's client: wait until the app is healthy, kill one
replica of a deployment and wait until Serve has replaced it, and read the rate limiter's live leases.

Run: python -m bench.ray_ops --address 127.0.0.1:PORT healthy|kill|leases ...; prints one JSON line.
"""

import argparse
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from ray import serve

APP_NAME = "loraplex"
LIMITER_ACTOR = "loraplex-rate-limiter"  # app.limits.ray_backend.ACTOR_NAME, in namespace "loraplex"


def replicas(deployment: str) -> list[str]:
    """Names of the deployment's live replica actors (SERVE_REPLICA::loraplex#<deployment>#<id>)."""
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and f"{APP_NAME}#{deployment}#" in a["name"]
    )


def deployment_states() -> dict[str, Any]:
    app = serve.status().applications.get(APP_NAME)
    if app is None:
        return {"app": "MISSING", "deployments": {}}
    return {
        "app": _name(app.status),
        "deployments": {
            name: {"status": _name(d.status), "replicas": {_name(k): v for k, v in d.replica_states.items()}}
            for name, d in app.deployments.items()
        },
    }


def _name(value: Any) -> str:
    """Serve's status enums are str-mixins whose str() is `Class.MEMBER`; we want the value."""
    return str(getattr(value, "value", value))


def healthy(expected: dict[str, int]) -> bool:
    states = deployment_states()
    if states["app"] != "RUNNING":
        return False
    for name, count in expected.items():
        found = states["deployments"].get(name)
        if found is None or found["status"] != "HEALTHY" or found["replicas"] != {"RUNNING": count}:
            return False
    return True


def wait_healthy(expected: dict[str, int], timeout: float, *, also: Any = None) -> float | None:
    """Epoch time when every expected deployment had exactly its replicas RUNNING (and `also()` held)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if healthy(expected) and (also is None or also()):
                return time.time()
        except Exception:  # the controller may be busy replacing a replica: ask again
            pass
        time.sleep(0.5)
    return None


def kill(deployment: str, expected: dict[str, int], timeout: float) -> dict[str, Any]:
    """Kill one replica actor outright (no Ray restart): Serve's controller must notice and replace it."""
    victims = replicas(deployment)
    if not victims:
        return {"ok": False, "error": f"no replica of {deployment}"}
    victim = victims[0]
    handle = ray.get_actor(victim, namespace="serve")
    killed_at = time.time()
    ray.kill(handle, no_restart=True)
    target = expected.get(deployment, 1)

    def replaced() -> bool:  # a new replica's actor, not only the victim's name gone (status lags)
        names = replicas(deployment)
        return victim not in names and len(names) == target

    recovered_at = wait_healthy(expected, timeout, also=replaced)
    return {
        "ok": recovered_at is not None,
        "victim": victim,
        "killed_at": killed_at,
        "recovered_at": recovered_at,
        "replicas_after": replicas(deployment),
        "states": deployment_states(),
    }


def lease_counter() -> Callable[[Any], dict[str, dict[str, Any]]]:
    """What `leases` runs inside the limiter actor: live leases and waiters per tenant."""

    # Nested, so that cloudpickle ships it by value: the actor's worker cannot import bench/.
    def count(actor: Any) -> dict[str, dict[str, Any]]:
        state = actor.state
        while not hasattr(state, "_tenants"):  # the LimiterState, inside its WaitingState (or more wrappers)
            state = state.state
        now = state.now_ms()
        return {
            tenant: {
                "leases": sum(1 for expiry in t.leases.values() if expiry > now),
                "queued": len(t.queue),
                "ids": sorted(i for i, expiry in t.leases.items() if expiry > now)[:20],
            }
            for tenant, t in state._tenants.items()
        }

    return count


def leases() -> dict[str, Any]:
    """Live (unexpired) concurrency leases and queued waiters per tenant, read inside the limiter actor."""
    count = lease_counter()
    try:
        actor = ray.get_actor(LIMITER_ACTOR, namespace="loraplex")
    except ValueError:
        return {"ok": True, "tenants": {}, "note": "no limiter actor (no limited tenant was ever admitted)"}
    counts: Any = ray.get(actor.__ray_call__.remote(count), timeout=60)
    return {"ok": True, "tenants": counts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", required=True, help="GCS address of the load test's own cluster")
    parser.add_argument("--expect", default="", help="deployment=replicas,... that healthy means")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("command", choices=["healthy", "kill", "leases"])
    parser.add_argument("deployment", nargs="?", help="for kill: the deployment to kill a replica of")
    args = parser.parse_args()
    expected = {k: int(v) for k, v in (item.split("=") for item in args.expect.split(",") if item)}
    ray.init(address=args.address, namespace="serve", log_to_driver=False, logging_level=logging.ERROR)
    try:
        if args.command == "healthy":
            at = wait_healthy(expected, args.timeout)
            result: dict[str, Any] = {"ok": at is not None, "at": at, "states": deployment_states()}
        elif args.command == "kill":
            result = kill(args.deployment, expected, args.timeout)
        else:
            result = leases()
    except Exception as error:  # the caller reads one JSON line whatever happens
        result = {"ok": False, "error": f"{type(error).__name__}: {error}"}
    finally:
        ray.shutdown()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

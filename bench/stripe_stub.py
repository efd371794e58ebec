"""A small stand-in for Stripe's API that the real stripe SDK talks to over HTTP (no stripe-mock offline).

It speaks just enough of Billing Meters: `POST /v1/billing/meter_events` (form-encoded, as the SDK sends it),
`GET /v1/billing/meters` and `GET /v1/billing/meters/{id}/event_summaries` (computed from the recorded
events). As Stripe does, it replays the stored answer for a reused Idempotency-Key (the SDK reuses one across
its own retries) and refuses an identifier seen in the last 24 hours with a 400 invalid_request_error,
"An event already exists with identifier ...", and `Stripe-Should-Retry: false`. Stripe documents no error
code for that refusal; `duplicate_code` adds one to test code-based matching.

Faults: `fail_next(n, "500" | "429" | "400" | "drop")` makes the next n requests fail (a 400 is a refusal
of that one request); with `after_record=True` the event is recorded first, so only the answer is lost (the
case that makes a client retry an event Stripe has).
"""

import itertools
import json
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal
from urllib.parse import parse_qsl, urlsplit

API_KEY = "sk_test_loraplex_stub"
EVENT_NAMES = (
    "loraplex_input_tokens",
    "loraplex_cached_input_tokens",
    "loraplex_output_tokens",
    "loraplex_gpu_ms",
    "loraplex_cost_micros",
)
FaultKind = Literal["500", "429", "400", "drop"]
_DEDUP_WINDOW_S = 24 * 3600
_MAX_AGE_S = 35 * 24 * 3600
_MAX_AHEAD_S = 5 * 60


@dataclass(frozen=True)
class Event:
    identifier: str
    event_name: str
    customer: str
    value: int
    timestamp: int
    received_at: float


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    retry_after: int | None = None
    after_record: bool = False


@dataclass(frozen=True)
class _Answer:
    status: int
    body: dict[str, Any]
    headers: tuple[tuple[str, str], ...] = ()


class StripeStub:
    """Run with `with StripeStub() as stub:`; point the SDK at `stub.url` with api key `stub.api_key`."""

    def __init__(
        self,
        event_names: Iterable[str] = EVENT_NAMES,
        *,
        api_key: str = API_KEY,
        duplicate_code: str | None = None,
    ) -> None:
        self.api_key = api_key
        self.duplicate_code = duplicate_code
        self.meters = {f"mtr_stub{i:04d}": name for i, name in enumerate(event_names)}
        self.events: list[Event] = []
        self.duplicates: list[str] = []  # identifiers refused as reused
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status); -1: connection dropped
        self.replays = 0  # answers replayed for a reused Idempotency-Key
        self._faults: deque[Fault] = deque()
        self._stored: dict[str, _Answer] = {}  # Idempotency-Key -> the answer it got
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        # A short poll interval: shutdown() waits for it, once per test.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="stripe-stub", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "StripeStub":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    # --- test controls -------------------------------------------------------------------------------

    def fail_next(
        self, n: int, kind: FaultKind, *, retry_after: int | None = None, after_record: bool = False
    ) -> None:
        with self._lock:
            self._faults.extend(Fault(kind, retry_after, after_record) for _ in range(n))

    def totals(self) -> dict[tuple[str, str], int]:
        """(customer, event_name) -> the sum of every accepted event's value."""
        totals: dict[tuple[str, str], int] = {}
        with self._lock:
            for event in self.events:
                key = (event.customer, event.event_name)
                totals[key] = totals.get(key, 0) + event.value
        return totals

    def tamper(self, customer: str, event_name: str, value: int, timestamp: int) -> None:
        """Add an event behind the exporter's back (as a second writer to the account would)."""
        with self._lock:
            self.events.append(Event(f"tamper-{next(self._ids)}", event_name, customer, value, timestamp,
                                     time.time()))  # fmt: skip

    # --- the API -------------------------------------------------------------------------------------

    def handle(self, method: str, path: str, headers: dict[str, str], form: list[tuple[str, str]]) -> Any:
        """The answer to one request: an _Answer, or a Fault of kind "drop" (close without answering)."""
        if headers.get("authorization") != f"Bearer {self.api_key}":
            return _error(401, "invalid_request_error", "Invalid API Key provided.")
        with self._lock:
            fault = self._faults.popleft() if self._faults else None
        if fault is not None and not fault.after_record:
            return _fault_answer(fault)
        answer = self._route(method, path, headers, form)
        return _fault_answer(fault) if fault is not None else answer

    def _route(self, method: str, path: str, headers: dict[str, str], form: list[tuple[str, str]]) -> _Answer:
        params = dict(form)
        if method == "POST" and path == "/v1/billing/meter_events":
            key = headers.get("idempotency-key")
            with self._lock:
                stored = self._stored.get(key) if key else None
                if stored is not None:
                    self.replays += 1
                    return _Answer(
                        stored.status, stored.body, (*stored.headers, ("Idempotent-Replayed", "true"))
                    )
                answer = self._create_event(params)
                if key:
                    self._stored[key] = answer
                return answer
        if method == "GET" and path == "/v1/billing/meters":
            data = [_meter(meter_id, name) for meter_id, name in self.meters.items()]
            return _Answer(200, {"object": "list", "data": data, "has_more": False, "url": path})
        parts = path.strip("/").split("/")
        if (
            method == "GET"
            and len(parts) == 5
            and parts[:3] == ["v1", "billing", "meters"]
            and parts[4] == "event_summaries"
        ):
            return self._summaries(parts[3], params, path)
        return _error(404, "invalid_request_error", f"Unrecognized request URL ({method}: {path}).")

    def _create_event(self, params: dict[str, str]) -> _Answer:  # called with the lock held
        name = params.get("event_name", "")
        customer = params.get("payload[stripe_customer_id]", "")
        raw_value = params.get("payload[value]", "")
        identifier = params.get("identifier") or f"stub_{next(self._ids)}"
        now = time.time()
        timestamp = int(params.get("timestamp", int(now)))
        if not name or not customer:
            return _error(400, "invalid_request_error", "Missing required param.", param="event_name")
        if not raw_value.lstrip("-").isdigit():
            return _error(
                400, "invalid_request_error", "The value must be an integer.", param="payload[value]"
            )
        if len(identifier) > 100:
            return _error(400, "invalid_request_error", "identifier is too long.", param="identifier")
        if not now - _MAX_AGE_S <= timestamp <= now + _MAX_AHEAD_S:
            return _error(400, "invalid_request_error", "Timestamp must be within the past 35 calendar days.",
                          param="timestamp")  # fmt: skip
        if any(e.identifier == identifier and now - e.received_at < _DEDUP_WINDOW_S for e in self.events):
            self.duplicates.append(identifier)
            message = f"An event already exists with identifier {identifier}."
            return _error(400, "invalid_request_error", message, param="identifier", code=self.duplicate_code,
                          should_retry=False)  # fmt: skip
        event = Event(identifier, name, customer, int(raw_value), timestamp, now)
        self.events.append(event)
        body = {
            "object": "billing.meter_event",
            "created": int(now),
            "event_name": name,
            "identifier": identifier,
            "livemode": False,
            "payload": {"stripe_customer_id": customer, "value": raw_value},
            "timestamp": timestamp,
        }
        return _Answer(200, body)

    def _summaries(self, meter_id: str, params: dict[str, str], path: str) -> _Answer:
        name = self.meters.get(meter_id)
        if name is None:
            return _error(404, "invalid_request_error", f"No such billing meter: '{meter_id}'", param="id")
        try:
            customer, start, end = params["customer"], int(params["start_time"]), int(params["end_time"])
        except (KeyError, ValueError):
            return _error(400, "invalid_request_error", "customer, start_time and end_time are required.")
        if start % 60 or end % 60:
            return _error(400, "invalid_request_error", "Times must be aligned with minute boundaries.")
        with self._lock:
            value = sum(
                e.value
                for e in self.events
                if e.event_name == name and e.customer == customer and start <= e.timestamp < end
            )
        summary = {
            "id": f"mtrusg_{meter_id}_{customer}_{start}",
            "object": "billing.meter_event_summary",
            "aggregated_value": float(value),
            "end_time": end,
            "livemode": False,
            "meter": meter_id,
            "start_time": start,
        }
        return _Answer(200, {"object": "list", "data": [summary], "has_more": False, "url": path})


def _meter(meter_id: str, name: str) -> dict[str, Any]:
    return {
        "id": meter_id,
        "object": "billing.meter",
        "created": 1700000000,
        "customer_mapping": {"event_payload_key": "stripe_customer_id", "type": "by_id"},
        "default_aggregation": {"formula": "sum"},
        "display_name": name,
        "event_name": name,
        "event_time_window": None,
        "livemode": False,
        "status": "active",
        "status_transitions": {"deactivated_at": None},
        "updated": 1700000000,
        "value_settings": {"event_payload_key": "value"},
    }


def _error(
    status: int,
    kind: str,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    should_retry: bool | None = None,
) -> _Answer:
    error: dict[str, Any] = {"type": kind, "message": message}
    if param is not None:
        error["param"] = param
    if code is not None:
        error["code"] = code
    headers = () if should_retry is None else (("Stripe-Should-Retry", str(should_retry).lower()),)
    return _Answer(status, {"error": error}, headers)


def _fault_answer(fault: Fault) -> Any:
    if fault.kind == "drop":
        return fault
    if fault.kind == "429":
        headers = () if fault.retry_after is None else (("Retry-After", str(fault.retry_after)),)
        body = {"error": {"type": "invalid_request_error", "code": "rate_limit",
                          "message": "Request rate limit exceeded."}}  # fmt: skip
        return _Answer(429, body, headers)
    if fault.kind == "400":
        return _error(400, "invalid_request_error", "Invalid request (injected).", param="payload")
    return _error(500, "api_error", "An unknown error occurred.")


def _handler(stub: StripeStub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def _serve(self, method: str) -> None:
            url = urlsplit(self.path)
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length).decode() if length else ""
            form = parse_qsl(body if method == "POST" else url.query, keep_blank_values=True)
            headers = {name.lower(): value for name, value in self.headers.items()}
            answer = stub.handle(method, url.path, headers, form)
            if isinstance(answer, Fault):  # hang up without a word, as a dropped connection does
                stub.requests.append((method, url.path, -1))
                self.close_connection = True
                return
            stub.requests.append((method, url.path, answer.status))
            payload = json.dumps(answer.body).encode()
            self.send_response(answer.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("Request-Id", f"req_stub{next(stub._ids)}")
            for name, value in answer.headers:
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    return Handler

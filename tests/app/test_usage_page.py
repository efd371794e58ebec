"""The usage page (GET /usage) in headless Chromium: log in with an API key, see the numbers the JSON API
gives, as charts; a wrong key shows the API's error; a screenshot of it is checked pixel by pixel.

Debian's `chromium` is driven by Playwright (its pip wheel only: no browser download). Without Chromium
or Playwright these tests skip, and fail when CI=true, so CI can never go green without running them.
LORAPLEX_TEST_CHROMIUM overrides the browser's path; LORAPLEX_DOCS_SCREENSHOT=1 also writes the screenshot
to docs/usage-page.png (the README's picture), which is otherwise left alone.
"""

import io
import json
import os
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from openai import OpenAI

from bench.admin_upload import post_adapter
from tests.app.conftest import MODEL, Served
from tests.billing.test_usage_queries import make_event
from tests.ci import missing

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

CHROMIUM = os.environ.get("LORAPLEX_TEST_CHROMIUM", "/usr/bin/chromium")
DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "usage-page.png"
VIEWPORT = {"width": 1280, "height": 900}
BATCH_LINES = 4
# The series colours of app/static/usage.js.
PROMPT_RGB, COMPLETION_RGB, GPU_RGB = (0x4F, 0x6D, 0xF5), (0xF5, 0x9F, 0x3A), (0x22, 0xA0, 0x6B)


@pytest.fixture(scope="module")
def browser() -> Iterator["Browser"]:
    absent = None
    if not Path(CHROMIUM).exists():
        absent = f"Chromium not found at {CHROMIUM} (Debian: apt-get install chromium)"
    else:
        try:
            from playwright.sync_api import sync_playwright
        except ImportError:
            absent = "Playwright is not installed (pip install playwright; no `playwright install` needed)"
    if absent is not None:
        missing(f"{absent}: the browser tests need it")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: "Browser") -> Iterator["Page"]:
    context = browser.new_context(viewport=VIEWPORT, device_scale_factor=1)  # type: ignore[arg-type]
    try:
        yield context.new_page()
    finally:
        context.close()


def period() -> tuple[datetime, datetime]:
    """The page's period: the last 30 whole UTC days, today included."""
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return today - timedelta(days=29), today + timedelta(days=1)


@dataclass
class Tenant:
    id: str
    key: str
    adapters: list[str]
    url: str
    batch_id: str

    def get(self, path: str, **params: str) -> Any:
        r = httpx.get(f"{self.url}{path}", params=params, timeout=30,
                      headers={"authorization": f"Bearer {self.key}"})  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()

    def usage(self, group_by: str) -> list[dict[str, Any]]:
        start, end = period()
        rows: list[dict[str, Any]] = self.get(
            "/v1/usage", start=start.isoformat(), end=end.isoformat(), group_by=group_by
        )["data"]
        return rows


def upload(served: Served, name: str, owner: str, source: Path) -> dict[str, Any]:
    with served.admin() as admin:
        r = post_adapter(admin, name, owner, source)
    assert r.status_code == 201, r.text
    return dict(r.json())


@pytest.fixture(scope="module")
def tenant(served: Served) -> Tenant:
    """A tenant with two adapters, real completions on the base model and on both, and recorded usage on
    earlier days (so the daily charts have more than one bar)."""
    tenant_id, key = served.new_tenant(f"page-{uuid.uuid4().hex[:8]}")
    dirs = served.setup.adapter_dirs
    support = upload(served, "support-bot", tenant_id, dirs["demo-sql"])
    poet = upload(served, "poet", tenant_id, dirs["demo-poet"])
    models = [MODEL, MODEL, "support-bot", "support-bot", "poet"]
    with httpx.Client(base_url=served.url, headers={"authorization": f"Bearer {key}"}, timeout=60) as client:
        for model in models:
            body = {"model": model, "prompt": "Tell me", "max_tokens": 6, "temperature": 0}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
    start, _ = period()
    history = [
        make_event(tenant_id, start + timedelta(days=day, hours=hour), adapter_id=adapter,
                   prompt_tokens=prompt, cached_tokens=prompt // 4, completion_tokens=prompt // 2,
                   gpu_ms=prompt * 3.5)
        for day, hour, adapter, prompt in [
            (2, 9, None, 900), (5, 10, support["id"], 1400), (5, 17, None, 600), (9, 8, poet["id"], 700),
            (13, 11, support["id"], 2100), (16, 14, None, 1200), (20, 15, support["id"], 1700),
            (23, 9, poet["id"], 500), (26, 12, None, 1900), (27, 23, support["id"], 800),
        ]
    ]  # fmt: skip
    with served.services.session_factory() as s, s.begin():
        s.add_all(history)
    batch_id = run_batch(served, key, ["support-bot", MODEL, "poet"])
    found = Tenant(tenant_id, key, ["support-bot", "poet"], served.url, batch_id)
    # Live usage reaches the database in the background: wait for all of it.
    expected = len(models) + len(history) + BATCH_LINES
    deadline = datetime.now(UTC) + timedelta(seconds=20)
    while sum(row["requests"] for row in found.usage("model")) != expected:
        assert datetime.now(UTC) < deadline, "usage was not recorded in time"
        time.sleep(0.05)
    return found


def run_batch(served: Served, key: str, models: list[str]) -> str:
    """A Batch API batch of BATCH_LINES completions over `models`, through the OpenAI SDK, run to its end."""
    client = OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0)
    lines = [
        {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": models[i % len(models)], "prompt": "Once", "max_tokens": 3 + i, "temperature": 0}}
        for i in range(BATCH_LINES)
    ]  # fmt: skip
    content = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    file = client.files.create(file=("lines.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while batch.status != "completed":
        assert batch.status in ("validating", "in_progress", "finalizing"), batch
        assert time.monotonic() < deadline, f"the batch did not complete in time: {batch}"
        time.sleep(0.1)
        batch = client.batches.retrieve(batch.id)
    assert batch.request_counts is not None and batch.request_counts.completed == BATCH_LINES
    return str(batch.id)


def log_in(page: "Page", url: str, key: str) -> None:
    page.goto(f"{url}/usage")
    page.get_by_role("textbox", name="API key").fill(key)
    page.get_by_role("button", name="Log in").click()


def test_the_page_is_self_contained(served: Served) -> None:
    r = httpx.get(f"{served.url}/usage")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in r.headers["content-security-policy"]
    assert "http://" not in r.text and "https://" not in r.text  # nothing from another origin
    for name, kind in (("usage.js", "text/javascript"), ("usage.css", "text/css")):
        asset = httpx.get(f"{served.url}/usage/assets/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
        assert "https://" not in asset.text
    for name in ("usage.html", "../routes/usage_page.py", "..%2Fmain.py", "nope.js"):
        assert httpx.get(f"{served.url}/usage/assets/{name}").status_code == 404


def test_a_wrong_key_shows_the_api_error(page: "Page", served: Served) -> None:
    message = httpx.get(f"{served.url}/v1/limits", headers={"authorization": "Bearer sk-wrong"}).json()
    log_in(page, served.url, "sk-wrong")
    error = page.locator("#login-error")
    error.wait_for(state="visible")
    assert error.inner_text() == message["error"]["message"]
    assert page.locator("#dashboard").is_hidden()
    assert page.evaluate("sessionStorage.length") == 0 and "sk-" not in page.url


def test_the_dashboard_shows_the_api_numbers(page: "Page", served: Served, tenant: Tenant) -> None:
    before = tenant.get("/v1/limits")["headroom"]["remaining_requests"]
    problems: list[str] = []  # script errors, CSP violations, failed loads: all reported on the console
    page.on("console", lambda message: problems.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: problems.append(str(error)))
    log_in(page, served.url, tenant.key)
    page.locator("#dashboard[data-state=ready]").wait_for(timeout=20_000)
    assert problems == []
    assert tenant.key not in page.url and page.locator("#api-key").input_value() == ""
    assert page.evaluate("Object.values(sessionStorage)") == [tenant.key]

    hourly = tenant.usage("hour")
    prompt, completion = sum(r["prompt_tokens"] for r in hourly), sum(r["completion_tokens"] for r in hourly)
    names = ("requests", "tokens", "prompt-tokens", "cached-tokens", "completion-tokens", "gpu-seconds")
    shown = {name: page.locator(f"#total-{name}").get_attribute("data-value") for name in names}
    assert shown["requests"] == str(sum(r["requests"] for r in hourly)) == str(15 + BATCH_LINES)
    assert shown["tokens"] == str(prompt + completion)
    assert (shown["prompt-tokens"], shown["completion-tokens"]) == (str(prompt), str(completion))
    assert shown["cached-tokens"] == str(sum(r["cached_tokens"] for r in hourly))
    assert float(shown["gpu-seconds"] or 0) == pytest.approx(sum(r["gpu_ms"] for r in hourly) / 1000)
    assert page.locator("#total-tokens").inner_text() == f"{prompt + completion:,}"

    # The daily chart is the hourly rows summed per UTC day, by the page's own script.
    per_day: dict[str, float] = defaultdict(float)
    for row in hourly:
        per_day[row["hour"][:10]] += row["prompt_tokens"] + row["completion_tokens"]
    assert bar_values("#chart-tokens-day", page) == per_day
    assert len(per_day) == 10  # 9 days of history, and today's completions
    gpu_per_day: dict[str, float] = defaultdict(float)
    for row in hourly:
        gpu_per_day[row["hour"][:10]] += row["gpu_ms"] / 1000
    assert bar_values("#chart-gpu-day", page) == pytest.approx(gpu_per_day)

    by_adapter = tenant.usage("adapter")
    labels = {r["adapter"] if r["adapter"] != "base" else f"{MODEL} (base)": r for r in by_adapter}
    assert set(labels) == {f"{MODEL} (base)", "support-bot", "poet"}
    assert bar_values("#chart-tokens-adapter", page) == {
        label: r["prompt_tokens"] + r["completion_tokens"] for label, r in labels.items()
    }
    for label in labels:
        assert page.locator(f'#chart-tokens-adapter text[data-adapter="{label}"]').count() == 1

    # Headroom: the free tier's 60 requests a minute, less the 5 completions (reads cost nothing).
    requests = page.locator("#headroom-requests")
    after = tenant.get("/v1/limits")["headroom"]["remaining_requests"]
    assert before <= int(requests.get_attribute("data-remaining") or -1) <= after <= 60
    assert requests.get_attribute("data-limit") == "60"
    assert page.locator("#headroom-tokens").get_attribute("data-limit") == "100000"
    assert page.locator("#headroom-concurrent").get_attribute("data-remaining") == "8"
    assert page.locator("#tenant-tier").inner_text() == "tier: free"

    # Batches: the tenant's batch with its line counts and the tokens usage grouped by batch gives it.
    per_batch = tenant.usage("batch")
    by_batch = {row["batch_id"]: row["prompt_tokens"] + row["completion_tokens"] for row in per_batch}
    assert set(by_batch) == {None, tenant.batch_id}
    batch_row = page.locator(f'#batches-body tr[data-batch="{tenant.batch_id}"]')
    assert page.locator("#batches-body tr").count() == 1
    assert batch_row.get_attribute("data-status") == "completed"
    assert batch_row.get_attribute("data-tokens") == str(by_batch[tenant.batch_id]) != "0"
    assert f"{BATCH_LINES} / 0 / {BATCH_LINES}" in batch_row.inner_text()
    share = page.locator("#batch-share")
    assert share.get_attribute("data-batch-tokens") == str(by_batch[tenant.batch_id])
    assert share.get_attribute("data-all-tokens") == str(prompt + completion)
    assert page.locator("#batches-empty").is_hidden()

    # Storage: the batch's input and output files against the free tier's quota, as /v1/usage says.
    start, end = period()
    storage = tenant.get("/v1/usage", start=start.isoformat(), end=end.isoformat())["storage"]
    used = storage["stored_response_bytes"] + storage["file_bytes"]
    stored = page.locator("#storage-left")
    assert storage["file_bytes"] > 0 and stored.get_attribute("data-used") == str(used)
    quota = storage["max_stored_response_bytes"]
    assert stored.get_attribute("data-limit") == ("" if quota is None else str(quota))
    if quota is not None:
        assert stored.get_attribute("data-remaining") == str(quota - used)

    models = [card["id"] for card in tenant.get("/v1/models")["data"]]
    rows = page.locator("#adapters-body tr").evaluate_all("rows => rows.map(r => r.dataset.model)")
    assert rows == models and set(tenant.adapters) <= set(rows)

    check_screenshot(page)


def bar_values(chart: str, page: "Page") -> dict[str, float]:
    """Each bar's stacked total (its segments summed), by the bar's label."""
    rects = page.locator(f"{chart} rect[data-label]").evaluate_all(
        "rects => rects.map(r => [r.dataset.label, Number(r.dataset.value)])"
    )
    totals: dict[str, float] = defaultdict(float)
    for label, value in rects:
        totals[label] += value
    return dict(totals)


def check_screenshot(page: "Page") -> None:
    """The page as a PNG: the full page's size, far from blank, with the bars in their colours."""
    from PIL import Image  # Pillow comes with the pinned gptqmodel

    png = page.screenshot(full_page=True, animations="disabled")
    image = Image.open(io.BytesIO(png)).convert("RGB")
    height = page.evaluate("document.documentElement.scrollHeight")
    assert image.size == (VIEWPORT["width"], height) and height > VIEWPORT["height"] // 2
    colours = Counter(image.getdata())
    assert len(colours) > 50, "too few colours: a blank or unstyled page"
    assert colours.most_common(1)[0][1] < 0.8 * image.width * image.height, "one colour everywhere"

    def pixels_of(selector: str, rgb: tuple[int, int, int]) -> int:
        box = page.locator(selector).bounding_box()
        assert box is not None, selector
        crop = image.crop((int(box["x"]), int(box["y"]), int(box["x"] + box["width"]),
                           int(box["y"] + box["height"])))  # fmt: skip
        return sum(n for colour, n in Counter(crop.getdata()).items() if colour == rgb)

    assert pixels_of("#chart-tokens-day svg", PROMPT_RGB) > 200
    assert pixels_of("#chart-tokens-day svg", COMPLETION_RGB) > 200
    assert pixels_of("#chart-gpu-day svg", GPU_RGB) > 500
    assert pixels_of("#chart-tokens-adapter svg", PROMPT_RGB) > 500
    assert pixels_of("#chart-gpu-adapter svg", GPU_RGB) > 500
    assert pixels_of("#chart-gpu-day svg", PROMPT_RGB) == 0  # each chart only in its own colours
    if os.environ.get("LORAPLEX_DOCS_SCREENSHOT") == "1":
        # A 256-colour palette: the same picture at a fraction of the size, fit to commit.
        image.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(DOCS_SCREENSHOT, optimize=True)


def test_logging_out_forgets_the_key(page: "Page", served: Served, tenant: Tenant) -> None:
    log_in(page, served.url, tenant.key)
    page.locator("#dashboard[data-state=ready]").wait_for(timeout=20_000)
    page.get_by_role("button", name="Log out").click()
    assert page.locator("#login").is_visible() and page.locator("#dashboard").is_hidden()
    assert page.evaluate("sessionStorage.length") == 0
    page.reload()  # and nothing brings it back
    assert page.locator("#login").is_visible() and page.locator("#dashboard").is_hidden()

import httpx

from tests.app.conftest import MODEL, Served


def test_chat_completion_round_trip(served: Served, tenant: tuple[str, str]) -> None:
    _, key = tenant
    r = httpx.post(
        f"{served.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 5,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] >= 1
    assert r.headers["x-request-id"] == body["id"]

import json, time, uuid
import httpx
from tests.e2e.conftest import ServeApp
from tests.e2e.test_responses_e2e import usage_rows

def test_chat_left(serve_app: ServeApp) -> None:
    tid, key = serve_app.new_tenant(f"probe-{uuid.uuid4().hex[:6]}")
    headers = {"authorization": f"Bearer {key}"}
    for kind in ("responses",):
        if kind == "responses":
            body = {"model": "tiny-llama", "input": "tell me a long story", "max_output_tokens": 400, "temperature": 0, "stream": True}
            url = "/v1/responses"
        else:
            body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 400, "temperature": 0, "stream": True}
            url = "/v1/chat/completions"
        with httpx.stream("POST", f"{serve_app.url}{url}", json=body, headers=headers, timeout=60) as r:
            lines = [l for l in r.iter_lines() if l.startswith("data: ")][:0] if False else None
            n = 0
            rid = None
            for line in r.iter_lines():
                if line.startswith("data: "):
                    d = json.loads(line[6:])
                    rid = rid or d.get("id") or d.get("response", {}).get("id")
                    n += 1
                    if n == 4:
                        break
        rid = rid.replace("resp_", "req_").replace("chatcmpl-", "")
        rows = usage_rows(serve_app, [f"resp_{rid[4:]}"], timeout=20)
        print("KIND", kind, rid, [(x.status, x.completion_tokens) for x in rows])

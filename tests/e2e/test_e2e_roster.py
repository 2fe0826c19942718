"""Two proxy processes sharing one roster in a real redis-server, in front of real vLLM: the
encoder and PD are registered through one proxy, requests go through the other, and the answers
must equal the single plain vLLM instance's."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request

import pytest

from epd_proxy_tools.local.supervisor import find_free_port_block, http_ok
from epd_proxy_tools.testing.harness import serve_command
from epd_proxy_tools.testing.polling import eventually_sync
from epd_proxy_tools.testing.redis_server import RedisServer

from .e2e_helpers import chat_body, chat_ok, loaded_hashes, make_image, settled_encoder_total

pytestmark = pytest.mark.e2e
KEY = "e2e-roster-key"


def _call(method: str, url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"X-API-Key": KEY})
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


@pytest.fixture
def shared_roster_proxies(stack):
    base = find_free_port_block(3, start=int(os.environ.get("EPD_E2E_BASE_PORT", "18200")) + 20)
    work = stack.work_dir / "roster"
    store = RedisServer(base, work).start()
    procs, urls = [], []
    try:
        for port in (base + 1, base + 2):
            cmd = serve_command(port)
            cmd += ["--dynamic-registration", "--roster", store.url("e2e"), "--encode-policy", "round_robin"]
            log = open(work / f"proxy-{port}.log", "wb")  # noqa: SIM115 - closed once the child has it
            procs.append(
                subprocess.Popen(cmd, env={**os.environ, "ADMIN_API_KEY": KEY}, stdout=log, stderr=subprocess.STDOUT)
            )
            log.close()
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            eventually_sync(lambda u=url: http_ok(u + "/health"), timeout=30, what=f"{url} answers /health")
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(15)
        store.kill()


def test_registered_through_one_proxy_served_through_the_other(stack, shared_roster_proxies, fidelity):
    registrar, router = shared_roster_proxies
    encoder = stack.encoder_urls[0]
    if not http_ok(encoder + "/health"):
        stack.restart("encoder-0")
    assert _call("POST", registrar + "/instances", {"role": "encode", "url": encoder}) == {"registered": True}
    assert _call("POST", registrar + "/instances", {"role": "prefill_decode", "url": stack.pd_url}) == {
        "registered": True
    }
    want_roster = {"live": [encoder], "evicted": []}
    eventually_sync(
        lambda: _call("GET", router + "/instances")["encode"] == want_roster,
        timeout=30,
        what="the other proxy sees the encoder",
    )
    assert _call("GET", router + "/instances")["prefill_decode"]["live"] == [stack.pd_url]

    images = [make_image(seed) for seed in range(30_000, 30_003)]
    cases = {
        "shared roster: one image via the other proxy": chat_body(images[:1]),
        "shared roster: A B A via the other proxy": chat_body([images[1], images[2], images[1]]),
    }
    before = settled_encoder_total([encoder])
    loaded_before = len(loaded_hashes(stack.log_path("pd")))
    for case, body in cases.items():
        fidelity.check(case, chat_ok(router, body), chat_ok(stack.baseline_url, body))
    # The registered encoder did the encoding (one sub-request per request) and PD loaded every
    # distinct image from the EC store instead of encoding it itself.
    assert settled_encoder_total([encoder], expect=before + 2) == before + 2
    assert len(loaded_hashes(stack.log_path("pd"))) - loaded_before >= 3

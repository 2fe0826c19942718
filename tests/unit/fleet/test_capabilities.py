"""What each consumer takes raw (capabilities.py): vLLM's two answers to the probe read exactly,
anything else read as nothing, against fakes that answer as vLLM does on real loopback servers."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from epd_proxy.fleet.backends import ENCODE, PREFILL_DECODE, Instance
from epd_proxy.fleet.capabilities import MediaProbe, probe_body, verdict
from epd_proxy.fleet.health import Health
from epd_proxy.fleet.prober import Prober, check_pool
from epd_proxy_tools.testing.fake_vllm import ECStore, FakeVLLM

ALL = frozenset({"image", "audio", "video"})


def test_vllms_two_answers_and_nothing_else_are_verdicts():
    assert verdict(400, "At most 0 image(s) may be provided in one prompt.")
    assert verdict(400, "At most 0 video(s) may be provided in one prompt. Set `--limit-mm-per-prompt` to increase")
    assert verdict(400, "tiny-llm is not a multimodal model")
    assert verdict(400, "Invalid data URL 'data:epd-proxy-probe': missing ',' separator.") is False
    for status, message in ((500, "At most 0 image(s)"), (404, "Not Found"), (400, "something else"), (200, "")):
        assert verdict(status, message) is None


def test_the_probe_holds_one_item_of_its_modality_and_nothing_a_client_wrote():
    for modality, kind in (("image", "image_url"), ("audio", "audio_url"), ("video", "video_url")):
        (part,) = probe_body(modality)["messages"][0]["content"]
        assert part["type"] == kind and "," not in part[kind]["url"] and part[kind]["url"].startswith("data:")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def serve():
    servers: list[TestServer] = []

    async def start(app: web.Application, role: str = PREFILL_DECODE) -> Instance:
        server = TestServer(app)
        await server.start_server()
        servers.append(server)
        return Instance(str(server.make_url("")).rstrip("/"), role)

    yield start
    for server in servers:
        await server.close()


@pytest.fixture
async def pool():
    probes = check_pool({})
    yield probes
    await probes.close()


def probe_of(pool, members, clock=None) -> MediaProbe:
    return MediaProbe(pool, lambda: members, timeout_s=2.0, recheck_s=60.0, clock=clock or Clock())


@pytest.mark.parametrize(
    ("options", "refused"),
    [({}, frozenset()), ({"text_only": True}, ALL), ({"no_raw": frozenset({"video"})}, frozenset({"video"}))],
)
async def test_a_fake_vllm_is_read_per_modality(serve, pool, options, refused):
    fake = FakeVLLM("pd", ECStore(), **options)
    inst = await serve(fake.app())
    probe = probe_of(pool, [inst])
    await probe.round()
    assert inst.raw_refused == refused and probe.settled()
    # The probes are no client traffic: nothing recorded, nothing generated.
    assert fake.media_probes == 3 and fake.requests == [] and sum(fake.counts.requests.values()) == 0


async def test_an_answer_that_is_neither_keeps_the_last_verdict_and_is_asked_again(serve, pool):
    answers = {"status": 400, "message": "At most 0 image(s) may be provided in one prompt."}

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        refused = body["messages"][0]["content"][0]["type"] == "image_url"
        message = answers["message"] if refused else "Invalid data URL 'data:x': missing ',' separator."
        return web.json_response({"error": {"message": message}}, status=answers["status"])

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    inst = await serve(app)
    clock = Clock()
    probe = probe_of(pool, [inst], clock)
    await probe.round()
    assert inst.raw_refused == {"image"} and probe.settled()
    answers.update(status=503, message="busy")
    clock.now = 61.0
    assert not probe.settled()
    await probe.round()
    assert inst.raw_refused == {"image"} and not probe.settled(), "no verdict: the last stands, asked again"
    answers.update(status=400, message="Invalid data URL")
    await probe.round()
    assert inst.raw_refused == frozenset() and probe.settled()


async def test_an_unreachable_consumer_keeps_vllms_default_and_encoders_are_not_asked(serve, pool):
    gone = Instance("http://127.0.0.1:9", PREFILL_DECODE)
    encoder = await serve(FakeVLLM("encode", ECStore()).app(), ENCODE)
    probe = probe_of(pool, [gone, encoder])
    await probe.round()
    assert gone.raw_refused == frozenset() and probe.due() == [gone]


async def test_registering_again_asks_again_and_the_checks_carry_the_probes(serve, pool):
    fake = FakeVLLM("pd", ECStore(), text_only=True)
    inst = await serve(fake.app())
    probe = probe_of(pool, [inst])
    health = Health()
    health.joined(inst)
    prober = Prober(pool, health, lambda: [inst], interval_s=60, timeout_s=2.0, media=probe)
    await prober.round()
    assert inst.raw_refused == ALL and fake.health_checks == 1 and fake.media_probes == 3
    await prober.round()
    assert fake.media_probes == 3, "a fresh verdict is not asked again"
    probe.rejoined(inst)
    fake.text_only = False
    await prober.round()
    assert inst.raw_refused == frozenset() and fake.media_probes == 6

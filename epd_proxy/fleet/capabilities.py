"""Which raw media each prefill / PD instance takes, asked of the instance itself.

vLLM 0.32 counts a request's media against the limits per prompt while it reads the messages,
before it loads any item (`renderers/chat_utils.py`: the item tracker's `add` runs
`validate_num_items` of `multimodal/processing/context.py`). A modality whose limit is 0
(`--limit-mm-per-prompt '{"video": 0}'`, every modality under `--language-model-only`, or one the
model does not have) is refused there with a 400, "At most 0 video(s) may be provided in one
prompt."; a model with no multimodal processor at all answers "... is not a multimodal model".
Only afterwards is the item loaded, and a data URL without a comma fails at once with a 400 of its
own ("Invalid data URL ...", `multimodal/media/connector.py` `_load_data_url`). So one chat request
per modality, holding one such item, tells the two apart exactly, and costs the instance no
decode, no processor and no generation.

The probe's body is the proxy's own, so no client can put words in its answer: only these probes
and the operator's flags (`--no-raw-media`, `--text-only-consumers`) decide what a consumer is sent
raw. Until its probe has answered, a consumer is taken to accept every modality (vLLM's default).
A verdict is asked again every `recheck_s`, and on the next round when the instance registers
again; an answer that is neither reading (unreachable, a 5xx, something in front of vLLM) leaves
the last verdict standing and is asked again on the next round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, dataclass, field

import orjson

from epd_proxy.calls.upstream import NoAnswer, Timeouts, Upstream
from epd_proxy.config import MODALITIES
from epd_proxy.fleet.backends import CHAT_PATH, ENCODE, Instance

log = logging.getLogger("epd_proxy.capabilities")

# vLLM cannot load it: no comma between the media type and the data.
PROBE_URL = "data:epd-proxy-probe"
# The probes' request ids, so an operator can tell them in vLLM's logs.
PROBE_REQUEST_ID = "epd-media-probe"
PART_TYPE = {"image": "image_url", "audio": "audio_url", "video": "video_url"}
# What vLLM says when it counted the item against a limit of 0, or has no multimodal processor.
REFUSED = ("At most 0 ", "is not a multimodal model")
# What it says when it got past the count and failed to load the probe's item.
LOADED = "data URL"
RECHECK_S = 300.0


def probe_body(modality: str) -> dict:
    """A chat request with one item of `modality` that vLLM counts, then cannot load."""
    kind = PART_TYPE[modality]
    return {"messages": [{"role": "user", "content": [{"type": kind, kind: {"url": PROBE_URL}}]}], "max_tokens": 1}


def verdict(status: int, message: str) -> bool | None:
    """True: no raw media of the probed modality; False: it takes them; None: the answer is
    neither of vLLM's two, so it says nothing."""
    if status != 400:
        return None
    if any(mark in message for mark in REFUSED):
        return True
    return False if LOADED in message else None


PROBES = {modality: orjson.dumps(probe_body(modality)) for modality in MODALITIES}


@dataclass(eq=False)
class MediaProbe:
    """Probes the consumers that are due (never answered, or answered `recheck_s` ago) and keeps
    each one's `Instance.raw_refused`. Its rounds run with the active health checks (prober.py);
    as a registry watcher it asks an instance that registers again on the next round."""

    pool: Upstream
    members: Callable[[], Iterable[Instance]]
    _: KW_ONLY
    timeout_s: float
    recheck_s: float = RECHECK_S
    clock: Callable[[], float] = time.monotonic
    # When each consumer last answered every modality's probe.
    _answered_at: dict[str, float] = field(default_factory=dict, init=False)

    # -- membership events ---------------------------------------------------------------------------
    def joined(self, inst: Instance) -> None:
        pass

    def rejoined(self, inst: Instance) -> None:
        """Registered again, perhaps restarted with other flags: asked again on the next round."""
        self._answered_at.pop(inst.url, None)

    def left(self, inst: Instance) -> None:
        self._answered_at.pop(inst.url, None)

    # -- probing -------------------------------------------------------------------------------------
    def due(self) -> list[Instance]:
        now = self.clock()
        return [
            inst
            for inst in self.members()
            if inst.role != ENCODE
            and (inst.url not in self._answered_at or now - self._answered_at[inst.url] >= self.recheck_s)
        ]

    def settled(self) -> bool:
        """Whether every consumer has an answer that is still fresh (for tests and /status)."""
        return not self.due()

    async def round(self) -> None:
        await asyncio.gather(*(self.probe(inst) for inst in self.due()))

    async def probe(self, inst: Instance) -> None:
        answers = await asyncio.gather(*(self._ask(inst, modality) for modality in MODALITIES))
        refused = {modality for modality, said in zip(MODALITIES, answers) if said}
        taken = {modality for modality, said in zip(MODALITIES, answers) if said is False}
        before = inst.raw_refused
        inst.raw_refused = frozenset((before - taken) | refused)
        if inst.raw_refused != before:
            refusing = ", ".join(sorted(inst.raw_refused))
            if refusing:
                log.warning(
                    "%s %s takes no raw %s, by its answer to the probe: only embeddings", inst.role, inst.url, refusing
                )
            else:
                log.warning(
                    "%s %s takes raw media of every modality again, by its answer to the probe", inst.role, inst.url
                )
        if len(refused) + len(taken) == len(MODALITIES):
            self._answered_at[inst.url] = self.clock()

    async def _ask(self, inst: Instance, modality: str) -> bool | None:
        try:
            answer = await self.pool.call(
                inst,
                "POST",
                CHAT_PATH,
                body=PROBES[modality],
                headers={"Content-Type": "application/json", "x-request-id": f"{PROBE_REQUEST_ID}-{modality}"},
                timeouts=Timeouts(connect=self.timeout_s, total=self.timeout_s),
                stage="media_probe",
                what="Media probe",
            )
        except NoAnswer:
            return None
        if answer.status < 400:
            return None
        return verdict(answer.status, answer.error().message)

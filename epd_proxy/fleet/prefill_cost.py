"""What a request would cost each prefill / PD instance, in seconds: the work queued on it before
the request's first token, plus the part of the request's prompt the instance does not hold, at
the instance's measured prefill speed. Pure: placement (routing.PrefixAffinity) reads it, the
pipeline feeds it each request's claim and first token.

A fixed bound on requests in flight cannot tell a move that recomputes two thousand cached tokens
from one that recomputes a hundred, nor an instance queued with long prompts from one queued with
short ones; seconds can. The proxy does not tokenize: a prompt's size is what a render server
counted (`--render-urls`), else estimated from its text (CHARS_PER_TOKEN) and media (tokens per
image-equivalent, learnt from the usage answers report); what an instance holds of it comes from
the KV index (in blocks of its own size) or, where the index cannot say, from where the
conversation last ran.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from epd_proxy.fleet.rendered import Rendered
from epd_proxy.fleet.speed import Speed

# JSON chat text runs about this many characters per token in the tokenizers vLLM serves.
CHARS_PER_TOKEN = 4.0
# Tokens one image-equivalent (fleet/cost.py) takes in a prompt until usage says otherwise: a
# typical photo under Qwen2-VL's 28-pixel patches merged 2x2.
PRIOR_MEDIA_TOKENS = 256.0
MEDIA_TOKENS_BOUNDS = (1.0, 16384.0)
# Weight of the newest usage sample in the media-token estimate.
MEDIA_SMOOTHING = 0.1
# What scheduling one more request costs a consumer beyond its prompt, in prompt tokens.
FIXED_TOKENS = 64.0
# A consumer's measured speed counts in full only after many first tokens: until then it is drawn
# toward the fleet's mean as if the mean had been measured this many times. A first token's time
# swings by several times with what else the engine batches, so a few timed through a busy spell
# would otherwise make a consumer look slower than the one next to it and move conversations away
# from their prefixes; a fleet of unlike instances shows its spread within a few hundred requests.
MEAN_WEIGHT_SAMPLES = 64


@dataclass(frozen=True, slots=True)
class Prompt:
    """What placement knows of a request's prompt: estimated, or rendered where a render server
    is configured (its token count then exact)."""

    # Prompt tokens: the rendered count, else estimated (PromptSize.tokens).
    tokens: float
    # Its images' uuids as the consumers' KV events name them: what the KV index is asked about.
    media: Sequence[str] = ()
    # Its token ids and items as vLLM renders them: the KV index is asked about its blocks.
    rendered: Rendered | None = None


class PromptSize:
    """A prompt's size in tokens from its text's characters and its media's image-equivalents;
    the tokens per image-equivalent are learnt from the prompt tokens answers report."""

    def __init__(self) -> None:
        self.media_tokens = PRIOR_MEDIA_TOKENS
        # Answers with media whose prompt tokens were learnt from (status.json `prompt_size`).
        self.heard = 0

    def tokens(self, text_chars: int, media_cost: float) -> float:
        return text_chars / CHARS_PER_TOKEN + media_cost * self.media_tokens

    def observe(self, text_chars: int, media_cost: float, prompt_tokens: int) -> None:
        """A request's reported prompt tokens: what its text does not explain is its media's."""
        if media_cost <= 0 or prompt_tokens <= 0:
            return
        low, high = MEDIA_TOKENS_BOUNDS
        sample = min(high, max(low, (prompt_tokens - text_chars / CHARS_PER_TOKEN) / media_cost))
        self.media_tokens += MEDIA_SMOOTHING * (sample - self.media_tokens)
        self.heard += 1

    def view(self) -> dict[str, float]:
        return {"media_tokens": round(self.media_tokens, 1), "answers_heard": self.heard}


@dataclass(slots=True)
class Turn:
    """One placed request as its conversation's record keeps it: where it went, its prompt's
    tokens, and when its first token came (None before: its prompt is not in that engine's cache
    yet, and a sibling sent meanwhile, with the same opening, finds none of it there)."""

    url: str
    tokens: float
    prefilled_at: float | None = None


def prefill_speed() -> Speed:
    """One consumer's prefill speed: seconds per token of claim (FIXED_TOKENS included), from
    each request's claim and the time from its call to its first token."""
    return Speed(fixed_ratio=0.0)


def claim(tokens: float, cached: float) -> float:
    """The work a request brings a consumer holding `cached` of its `tokens`, in tokens."""
    return FIXED_TOKENS + max(0.0, tokens - cached)


def seconds(speed: float, queued: float, work: float, running: int) -> float:
    """What placing a request's `work` on a consumer costs, in seconds: its own wait for a first
    token behind the `queued` work, and the delay its prefill adds to each of the `running`
    requests there, which share the engine's steps with it (vLLM batches a prefill's chunks with
    every running decode). Its own wait alone is not enough: moving a conversation away from the
    instance holding its prefix to one a little less queued recomputes that prefix, and the big
    claim it leaves there moves the next conversations too; counted as the delay it is to others,
    a move happens where the gain is real (an idle or far less busy instance)."""
    return speed * (queued + work * (1 + running))


def seconds_per_token(speeds: Sequence[Speed], now: float) -> list[float]:
    """Each consumer's measured speed, drawn toward the mean of the measured by how few first
    tokens it has timed; one not measured (or idle and unheard from for long) counts at that
    mean, and with none measured all count alike."""
    known = [(s.item_s, s.samples) if s.item_s is not None and not s.stale(now) else None for s in speeds]
    measured = [k[0] for k in known if k is not None]
    mean = sum(measured) / len(measured) if measured else 1.0
    return [
        mean if k is None else (k[0] * k[1] + mean * MEAN_WEIGHT_SAMPLES) / (k[1] + MEAN_WEIGHT_SAMPLES) for k in known
    ]


def cheapest(costs: Sequence[float], preferred: int, walk: Iterable[int]) -> int:
    """The candidate of least cost; among equals (within a microsecond's rounding) `preferred`,
    then the first the key's `walk` round the ring meets. The walk is taken only as far as an
    equal: at 64 instances a whole walk is hundreds of steps, and most requests have one cheapest."""
    low = min(costs) + 1e-9
    if costs[preferred] <= low:
        return preferred
    for i in walk:
        if costs[i] <= low:
            return i
    raise AssertionError("the walk meets every candidate")

"""Step 1, its second half: media behind http(s) URLs, fetched once by the proxy (calls/media.py)
and sent on as `data:` URLs of those bytes, named by them.

A name is what encoder and consumer caches pair an embedding with, so it must stand for the bytes
both sides decode. Left to each side, an http(s) URL is fetched twice, maybe with two answers (a
"latest screenshot" URL, an origin that answers per caller): the consumer would decode one answer
under a name that stands for another, and load an embedding that belongs to other bytes, or whose
length does not fit its prompt, which vLLM's model runner raises on. Here the one answer goes to
both, so whatever either side holds under its name came from these very bytes; the next request
fetches again (or reuses the answer while its origin calls it fresh) and names what it gets.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace

import pybase64

from epd_proxy.calls.media import Fetched, MediaFetcher
from epd_proxy.errors import BadRequest
from epd_proxy.journey.doors import Door
from epd_proxy.journey.extract import MODALITY, Digest, MediaItem, NormalisedRequest, content_uuid, with_url

_MEDIA = ("image", "audio", "video")
# Answers that are documents, not media: an error page or an API's JSON is a wrong URL.
_DOCUMENT = re.compile(r"json|xml|html|javascript|text|x-www-form")
_TOKEN = re.compile(r"[a-z0-9][a-z0-9.+-]*/[a-z0-9][a-z0-9.+-]*")


def as_data_url(fetched: Fetched, item: MediaItem, url: str) -> str:
    """The `data:` URL both sides decode, or a 400 when the answer is not media. Its media type is
    the origin's where vLLM reads it as the origin's answer, else a neutral one: vLLM reads a
    `video/jpeg` data URL as comma-separated frames, not as the video file it fetched."""
    media_type = fetched.media_type
    top, _, sub = media_type.partition("/")
    if media_type and top not in _MEDIA and not (top == "application" and not _DOCUMENT.search(sub)):
        raise BadRequest(f"media URL {url[:200]} answered {media_type}, not {MODALITY[item.kind]} media")
    if not fetched.data:
        raise BadRequest(f"media URL {url[:200]} answered no bytes")
    if top not in _MEDIA or media_type == "video/jpeg" or not _TOKEN.fullmatch(media_type):
        media_type = "application/octet-stream"
    return f"data:{media_type};base64,{pybase64.b64encode(fetched.data).decode('ascii')}"


# URLs of one request fetched at once: a request of hundreds of URLs neither holds hundreds of
# connections nor pulls hundreds of media bodies into memory together.
FETCHES_PER_REQUEST = 8


async def _fetch_within_budget(fetcher: MediaFetcher, urls: list[str]) -> list[Fetched]:
    """Each URL's bytes, a few at a time; a BadRequest once they add up to more than a request
    body may hold (`--max-body-bytes`: media by URL cost what the same media inline would), and
    the fetches not yet done are dropped."""
    budget = fetcher.rules.request_bytes
    total = 0
    gate = asyncio.Semaphore(FETCHES_PER_REQUEST)

    async def one(url: str) -> Fetched:
        nonlocal total
        async with gate:
            if total > budget:
                raise _over(budget)
            fetched = await fetcher.fetch(url)
        total += len(fetched.data)
        if total > budget:
            raise _over(budget)
        return fetched

    tasks = [asyncio.ensure_future(one(url)) for url in urls]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


def _over(budget: int) -> BadRequest:
    return BadRequest(f"the request's media URLs hold more than {budget} bytes in all (--max-body-bytes)")


async def fetch_media(
    normalised: NormalisedRequest, fetcher: MediaFetcher, door: Door, digest: Digest
) -> NormalisedRequest:
    """The request with every http(s) medium fetched (each URL once), in its body and items as a
    `data:` URL, each item named by those bytes (a trusted client's uuid stays); a BadRequest
    when one cannot be fetched. Nothing to fetch: the request itself."""
    remote = [item for item in normalised.items if item.fetch]
    if not remote:
        return normalised
    urls = list(dict.fromkeys(item.fetch for item in remote if item.fetch))
    got = dict(zip(urls, await _fetch_within_budget(fetcher, urls)))
    items = list(normalised.items)
    moved: list[tuple[MediaItem, str]] = []
    for item in remote:
        assert item.fetch is not None
        url = as_data_url(got[item.fetch], item, item.fetch)
        part = with_url(item.part, item.kind, url)
        uuid = item.uuid or content_uuid(part, item.kind, None, digest)
        items[item.index] = replace(item, part=part, uuid=uuid, fetch=None)
        moved.append((item, url))
    return NormalisedRequest(door.media_in_body(normalised.body, moved), items)

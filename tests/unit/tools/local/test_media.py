"""Deterministic sounds for the local stack's examples (media.py)."""

from __future__ import annotations

import base64
import io
import wave

from epd_proxy_tools.local.media import wav_base64, wav_bytes, wav_data_url


def test_a_sound_is_mono_16_bit_wav_at_the_asked_rate_and_length():
    with wave.open(io.BytesIO(wav_bytes(1, seconds=0.5, rate=16000))) as sound:
        assert (sound.getnchannels(), sound.getsampwidth(), sound.getframerate()) == (1, 2, 16000)
        assert sound.getnframes() == 8000


def test_the_same_seed_gives_the_same_sound_and_another_seed_another():
    assert wav_bytes(3, seconds=0.1) == wav_bytes(3, seconds=0.1) != wav_bytes(4, seconds=0.1)


def test_the_data_url_and_the_bare_base64_carry_the_same_bytes():
    raw = wav_bytes(2, seconds=0.1)
    assert base64.b64decode(wav_base64(2, seconds=0.1)) == raw
    assert wav_data_url(2, seconds=0.1) == "data:audio/wav;base64," + wav_base64(2, seconds=0.1)

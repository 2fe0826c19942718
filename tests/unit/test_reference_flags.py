"""The reference proxy's flags: the first part of `serve`'s configuration, named and defaulted as
vLLM's disagg_epd_proxy.py names them, so its command lines work unchanged."""

from __future__ import annotations

from dataclasses import fields

from epd_proxy.config import Config, options
from epd_proxy.reference_flags import OURS, REFERENCE, ReferenceFlags


def test_the_reference_flags_come_first_and_keep_the_reference_names():
    ours = [item.name for item in fields(Config)]
    reference = [item.name for item in fields(ReferenceFlags)]
    assert ours[: len(reference)] == reference
    flags = {name: declared.flag for name, _, declared in options() if name in reference}
    assert [flags[name] for name in ("host", "port", "encode_urls", "prefill_urls", "decode_urls")] == [
        "--host",
        "--port",
        "--encode-servers-urls",
        "--prefill-servers-urls",
        "--decode-servers-urls",
    ]


def test_every_reference_flag_is_in_the_reference_section_of_help():
    groups = {
        name: declared.group for name, _, declared in options() if name in {f.name for f in fields(ReferenceFlags)}
    }
    # The admin key is an environment variable of our own, not one of the reference's flags.
    assert {name for name, group in groups.items() if group != REFERENCE} == {"admin_api_key"}
    assert groups["admin_api_key"] == OURS

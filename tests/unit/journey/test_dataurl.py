"""One spelling for a media URL (dataurl.py)."""

from __future__ import annotations

import pytest

from epd_proxy.journey.dataurl import canonical_media_url


def test_a_canonical_url_comes_back_as_the_same_object():
    for url in ("data:image/png;base64,iVBORw0KGgo=", "https://example.com/a b.png", "data:text/plain,a b"):
        assert canonical_media_url(url) is url


@pytest.mark.parametrize(
    ("url", "canonical"),
    [
        ("data:image/png;base64,iVBO\nRw0K Ggo=", "data:image/png;base64,iVBORw0KGgo="),
        ("data:image/png;base64,iV\r\n\tBO\f\vR", "data:image/png;base64,iVBOR"),
        ("DATA:Image/PNG;BASE64,iVBO", "data:image/png;base64,iVBO"),
        ("Data:image/png ; base64,iV BO", "data:image/png;base64,iVBO"),
        ("data:audio/wav;name=A.wav;base64,UklG RiQ=", "data:audio/wav;name=A.wav;base64,UklGRiQ="),
    ],
)
def test_base64_payloads_lose_whitespace_and_the_header_is_lower_cased(url, canonical):
    assert canonical_media_url(url) == canonical


def test_whitespace_in_a_payload_that_is_not_base64_is_content():
    # Percent-encoded or plain payloads mean their spaces; only the header is normalised.
    assert canonical_media_url("DATA:text/plain,a b") == "data:text/plain,a b"


def test_parameters_keep_their_case_but_not_their_padding():
    assert canonical_media_url("data:image/png; Name=X.png;base64,AA") == "data:image/png;Name=X.png;base64,AA"


def test_a_data_url_without_a_comma_and_other_schemes_are_left_alone():
    for url in ("data:image/png;base64", "HTTP://Example.com/A.png", "file:///x y.png", ""):
        assert canonical_media_url(url) is url

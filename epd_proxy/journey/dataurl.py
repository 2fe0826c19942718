"""A media URL in one spelling: the one the proxy hashes, forwards and lifts out of a body whole.

The normalising pass (extract.py) writes every media URL in it and the spliced fast path
(splice.py) lifts only URLs already in it, so the two agree on which bytes name an item.
"""

from __future__ import annotations

_WHITESPACE = " \t\r\n\f\v"
_DROP_WHITESPACE = str.maketrans("", "", _WHITESPACE)


def canonical_media_url(url: str) -> str:
    """The same bytes written differently are the same item: a base64 `data:` URL loses the line
    breaks and spaces inside its payload and gets a lower-case scheme and media type. A URL that
    is already canonical comes back unchanged (the same object), so it hashes exactly as the
    reference proxy hashes it. Other URLs are kept as they are.
    """
    if url[:5].lower() != "data:":
        return url
    comma = url.find(",")
    if comma < 0:
        return url
    header = url[:comma]
    mediatype, semicolon, params = header[5:].partition(";")
    param_list = [p.strip() for p in params.split(";")] if semicolon else []
    is_base64 = any(p.lower() == "base64" for p in param_list)
    canonical_header = "data:" + mediatype.strip().lower()
    canonical_header += "".join(";base64" if p.lower() == "base64" else ";" + p for p in param_list)
    # str.find is a memchr-speed scan; slicing or rebuilding a megabyte payload is what costs.
    dirty = is_base64 and any(url.find(c, comma + 1) >= 0 for c in _WHITESPACE)
    if not dirty and canonical_header == header:
        return url
    payload = url[comma + 1 :]
    if dirty:
        payload = payload.translate(_DROP_WHITESPACE)
    return f"{canonical_header},{payload}"

"""dashboards/epd-proxy.json queries only what the proxy's /metrics really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.media import chat, image

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "epd-proxy.json"
# Labels Prometheus attaches at scrape time, and the bucket bound every histogram has.
SCRAPE_LABELS = {"job", "instance", "le"}
PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right"}
# The page's sections: the dashboard must carry the same view.
PAGE_PANELS = {
    "Request rate",
    "In flight",
    "Success",
    "Encoder sub-requests per request",
    "Images per sub-request",
    "Retries and failovers",
    "Roster",
    "Stage latency p50 / p99",
    "Request rate by status",
}


def panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows nest their panels
    return out


def queries(dashboard: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in panels(dashboard) for t in p.get("targets", [])]


def parse_query(expr: str) -> tuple[dict[str, set[str]], set[str]]:
    """Metric names with the label names each selector matches on, and the grouping labels."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    selectors: dict[str, set[str]] = {}
    for name, matchers in re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}", expr):
        selectors.setdefault(name, set()).update(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*[=!]", matchers))
    grouping = set()
    for labels in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        grouping.update(label.strip() for label in labels.split(",") if label.strip())
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    bare = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", bare)
    for match in re.finditer(r"(?<![\w.])([A-Za-z_:][A-Za-z0-9_:]*)(?!\w)(\s*\()?", bare):
        name, is_call = match.group(1), match.group(2)
        if not is_call and name not in PROMQL_WORDS:
            selectors.setdefault(name, set())
    return selectors, grouping


def problems(dashboard: dict, exported: dict[str, set[str]]) -> list[str]:
    found = []
    for title, expr in queries(dashboard):
        selectors, grouping = parse_query(expr)
        if not selectors:
            found.append(f"{title}: {expr!r} names no metric")
        known_labels = set(SCRAPE_LABELS)
        for name, labels in selectors.items():
            if name not in exported:
                found.append(f"{title}: {name} is not exported by the proxy")
                continue
            known_labels |= exported[name]
            found += [f"{title}: {name} has no label {label!r}" for label in labels - exported[name] - SCRAPE_LABELS]
        found += [f"{title}: no metric in {expr!r} has label {label!r}" for label in grouping - known_labels]
    return found


def exposition(text: str) -> dict[str, set[str]]:
    """Sample name -> label names, from Prometheus text format."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s", line)
        assert match, line
        out.setdefault(match.group(1), set()).update(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="', match.group(2) or ""))
    return out


@pytest.fixture
async def exported(make_stack) -> dict[str, set[str]]:
    """Every series the proxy exposes once it has seen traffic, a failover and a retry."""
    stack = await make_stack(encoders=2, prefills=1, decoders=1, decode_retries=1)
    stack.encoders[0].faults.fail_next(1, status=503)
    stack.pd.faults.fail_next(1, status=500)
    for n in range(3):
        async with await stack.chat(chat(image(f"{n}"), image(f"{n}b"))) as resp:
            assert resp.status == 200
    async with stack.client.get(f"{stack.url}/metrics") as resp:
        return exposition(await resp.text())


async def test_every_dashboard_query_names_an_exported_metric_and_label(exported):
    dashboard = json.loads(DASHBOARD.read_text())
    assert len(queries(dashboard)) >= 10
    assert problems(dashboard, exported) == []


async def test_the_checker_catches_a_wrong_metric_or_label(exported):
    bad = {
        "panels": [
            {"title": "typo", "targets": [{"expr": 'sum(rate(epd_request_total{job=~"$job"}[5m]))'}]},
            {"title": "label", "targets": [{"expr": "sum by (backend) (epd_instance_inflight)"}]},
            {"title": "matcher", "targets": [{"expr": 'epd_requests_total{code="200"}'}]},
            {"title": "none", "targets": [{"expr": "vector(1)"}]},
        ]
    }
    assert problems(bad, exported) == [
        "typo: epd_request_total is not exported by the proxy",
        "label: no metric in 'sum by (backend) (epd_instance_inflight)' has label 'backend'",
        "matcher: epd_requests_total has no label 'code'",
        "none: 'vector(1)' names no metric",
    ]


def test_the_dashboard_has_the_status_pages_panels():
    dashboard = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in panels(dashboard)}
    assert PAGE_PANELS <= titles, PAGE_PANELS - titles
    assert dashboard["uid"] == "epd-proxy"
    # Importable anywhere: the data source is a dashboard variable, not a fixed uid.
    for panel in panels(dashboard):
        assert panel["datasource"]["uid"] == "${datasource}"

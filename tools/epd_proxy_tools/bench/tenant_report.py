"""The tenants workload's figures (tenant_bench.py): per arm, block kind and tenant, TTFT, throughput,
shares of the encoders' work and of tokens, and the requests turned away by status with how fast
they were answered; and the interactive tenant's p99 TTFT with the flood over its p99 alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from epd_proxy.ops.recent import percentile
from epd_proxy_tools.bench.tenant_load import (
    FLOOD,
    INTERACTIVE,
    MAX_TOKENS,
    TOKENS_PER_IMAGE,
    TOKENS_PER_REQUEST,
    Sent,
    TenantSpec,
    answered,
)

SHED_STATUSES = (429, 503)
TENANTS = (FLOOD, INTERACTIVE)
# The block kinds (tenant_bench.py): the interactive tenant alone, beside the flood, and both flooding.
KINDS = ("alone", "flood", "both")


def _pct(values: list[float], q: float) -> float | None:
    return percentile(sorted(values), q) if values else None


def _measured(sent: list[Sent], plan) -> list[Sent]:
    """Requests open after the warm-up part of the block, when the queues have formed: a chat
    client still waiting on its first question is what a starved tenant looks like."""
    return [s for s in sent if s.started < plan.seconds and (s.ended is None or s.ended >= plan.warm_s)]


def _tokens(s: Sent) -> float:
    if s.tokens is not None:
        return s.tokens
    return TOKENS_PER_REQUEST + TOKENS_PER_IMAGE * s.images + MAX_TOKENS


def tenant_figures(sent: list[Sent], window_s: float) -> dict[str, Any]:
    ok = [s for s in sent if answered(s)]
    # A request still unanswered when the block gave up waited at least that long for its first
    # token: counted so, its percentiles are lower bounds (`ttft_censored`).
    unanswered = [s.waited for s in sent if s.ended is None and s.waited is not None]
    ttft = [s.ttft for s in ok if s.ttft is not None] + unanswered
    shed = {}
    for status in SHED_STATUSES:
        times = [s.latency for s in sent if s.status == status and s.latency is not None]
        shed[str(status)] = {
            "count": len(times),
            "answer_ms_p50": None if not times else 1000 * (_pct(times, 0.5) or 0.0),
            "answer_ms_p99": None if not times else 1000 * (_pct(times, 0.99) or 0.0),
            "retry_after": sorted({s.retry_after for s in sent if s.status == status and s.retry_after})[:5],
        }
    admitted = [s for s in sent if s.status not in SHED_STATUSES]
    return {
        "sent": len(sent),
        "answered": len(ok),
        "req_per_s": len(ok) / window_s if window_s else 0.0,
        "ttft_s_p50": _pct(ttft, 0.5),
        "ttft_s_p99": _pct(ttft, 0.99),
        "ttft_censored": bool(unanswered),
        "latency_s_p99": _pct([s.latency for s in ok if s.latency is not None], 0.99),
        "shed": shed,
        "other_errors": sum(
            1 for s in sent if s.ended is not None and not answered(s) and s.status not in SHED_STATUSES
        ),
        "unfinished": sum(1 for s in sent if s.ended is None),
        # What the encoders were given: every image of a request that was not turned away.
        "images_admitted": sum(s.images for s in admitted),
        "tokens": sum(_tokens(s) for s in ok),
        "tokens_from_usage": bool(ok) and all(s.tokens is not None for s in ok),
    }


def block_line(block: dict[str, Any], plan) -> str:
    window = plan.seconds - plan.warm_s
    parts = []
    for tenant in TENANTS:
        mine = [s for s in _measured(block["sent"], plan) if s.tenant == tenant]
        if not mine:
            continue
        f = tenant_figures(mine, window)
        p99 = f["ttft_s_p99"]
        shed = "/".join(str(f["shed"][str(s)]["count"]) for s in SHED_STATUSES)
        parts.append(
            f"{tenant} {f['answered']}/{f['sent']} ok, TTFT p99 {'-' if p99 is None else f'{1000 * p99:.0f} ms'}, "
            f"shed 429/503 {shed}"
        )
    return "; ".join(parts)


def _counter_shares(metrics: list[dict[str, dict[str, float]]]) -> tuple[dict[str, float], dict[str, float]]:
    """Per-tenant encoder seconds and tokens from the proxy's counters, summed over blocks ({}
    where it has none)."""
    enc: dict[str, float] = {}
    tok: dict[str, float] = {}
    for m in metrics:
        for name, values in m.items():
            target = enc if "encoder" in name and "second" in name else tok if "token" in name else None
            if target is None:
                continue
            for key, value in values.items():
                tenant = key.split("/", 1)[0]
                target[tenant] = target.get(tenant, 0.0) + value
    return enc, tok


def _share(values: dict[str, float]) -> dict[str, float | None]:
    total = sum(values.get(t, 0.0) for t in TENANTS)
    return {t: (values.get(t, 0.0) / total if total else None) for t in TENANTS}


def _counters(metrics: list[dict[str, dict[str, float]]], name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in metrics:
        for key, value in m.get(name, {}).items():
            out[key] = out.get(key, 0.0) + value
    return out


# The proxy's own histogram of the time to a shed's answer (epd_proxy/ops/metrics.py).
SHED_ANSWER_BUCKETS = "epd_shed_answer_seconds_bucket"
# The promise: every shed answered within this long of arrival.
SHED_PROMISE_S = 0.05


def shed_answers(buckets: dict[str, float]) -> dict[str, float] | None:
    """The proxy's own time to its shed answers, from its histogram's cumulative buckets
    ({"reason/le": count}, summed over blocks): how many, the share answered within
    SHED_PROMISE_S, and the bucket bound the p99 falls within. None when nothing was shed."""
    by_bound: dict[float, float] = {}
    for key, count in buckets.items():
        bound = float(key.rsplit("/", 1)[1])
        by_bound[bound] = by_bound.get(bound, 0.0) + count
    total = by_bound.get(float("inf"), 0.0)
    if not total:
        return None
    bounds = sorted(by_bound)
    within = max((by_bound[b] for b in bounds if b <= SHED_PROMISE_S), default=0.0)
    p99 = next(b for b in bounds if by_bound[b] >= 0.99 * total)
    return {"count": total, "within_promise": within / total, "p99_within_s": p99}


def goodput_images_per_s(blocks: list[dict[str, Any]], plan) -> float:
    """Images of the requests answered whole, without error, between the warm-up and the end of
    sending, per second of that window: what the fleet got done for its tenants. A request answered
    at all was started within its deadline (the proxy turns away the rest at arrival)."""
    window = (plan.seconds - plan.warm_s) * len(blocks)
    done = [
        s
        for b in blocks
        for s in b["sent"]
        if answered(s) and s.ended is not None and plan.warm_s <= s.ended <= plan.seconds
    ]
    return sum(s.images for s in done) / window if window else 0.0


def arm_kind(blocks: list[dict[str, Any]], plan) -> dict[str, Any]:
    """One arm's blocks of one kind, pooled over rounds."""
    window = (plan.seconds - plan.warm_s) * len(blocks)
    sent = [s for b in blocks for s in _measured(b["sent"], plan)]
    per = {t: tenant_figures([s for s in sent if s.tenant == t], window) for t in TENANTS}
    metrics = [b["metrics"] for b in blocks]
    enc_counted, tok_counted = _counter_shares(metrics)
    enc_share = _share(enc_counted) if enc_counted else _share({t: per[t]["images_admitted"] for t in TENANTS})
    tok_share = _share(tok_counted) if tok_counted else _share({t: per[t]["tokens"] for t in TENANTS})
    for t in TENANTS:
        per[t]["encoder_share"] = enc_share[t]
        per[t]["token_share"] = tok_share[t]
    usage = all(per[t]["tokens_from_usage"] for t in TENANTS if per[t]["answered"])
    goodput = goodput_images_per_s(blocks, plan)
    capacity = plan.capacity_images_per_s
    return {
        "tenants": per,
        "goodput_images_per_s": goodput,
        "goodput_of_capacity": goodput / capacity if capacity else None,
        "encoder_share_from": "proxy counters" if enc_counted else "images of the requests not turned away",
        "token_share_from": "proxy counters"
        if tok_counted
        else ("the answers' usage" if usage else "estimated from images (64 tokens each) and answers"),
        "proxy_shed": _counters(metrics, "epd_requests_shed_total"),
        "proxy_shed_answers": shed_answers(_counters(metrics, SHED_ANSWER_BUCKETS)),
        "proxy_requests": _counters(metrics, "epd_tenant_requests_total"),
        "engines": _engine_means([b["engines"] for b in blocks if b.get("engines")]),
    }


def _engine_means(per_block: list[dict[str, float | None]]) -> dict[str, float]:
    """The engines' own per-request figures (engines.summarise), averaged over an arm's blocks of
    one kind: vLLM's work counters, which carry over to other hardware where times do not."""
    out = {}
    for key in sorted({k for block in per_block for k in block}):
        values = [v for block in per_block if (v := block.get(key)) is not None]
        if values:
            out[key] = sum(values) / len(values)
    return out


# The engines' figures the table shows: (key in engines.summarise, heading).
ENGINE_COLUMNS = (
    ("encoder_images_per_request", "images encoded"),
    ("images_per_subrequest", "images per encoder sub-request"),
    ("encoder_queue_ms", "encoder queue ms"),
    ("encoder_prefill_ms", "encoder sub-request ms"),
    ("queue_ms", "PD queue ms"),
    ("prefill_ms", "PD prefill ms"),
    ("prompt_tokens_computed_per_request", "PD prompt tokens computed"),
    ("engine_cpu_ms_per_request", "engines' CPU ms"),
)


def build(arms, plan, tenants: tuple[TenantSpec, ...], mode: str) -> dict[str, Any]:
    out_arms = []
    for arm in arms:
        kinds = {}
        for kind in KINDS:
            blocks = [b for b in arm.blocks if b["kind"] == kind]
            if blocks:
                kinds[kind] = arm_kind(blocks, plan)
        alone = kinds.get("alone", {}).get("tenants", {}).get(INTERACTIVE, {}).get("ttft_s_p99")
        flooded = kinds.get("flood", {}).get("tenants", {}).get(INTERACTIVE, {}).get("ttft_s_p99")
        out_arms.append(
            {
                "name": arm.name,
                "tenants_file": arm.ours,
                "blocks": kinds,
                "interactive_ttft_p99_ratio": flooded / alone if alone and flooded else None,
            }
        )
    result: dict[str, Any] = {
        "mode": mode,
        "plan": {k: v for k, v in vars(plan).items()},
        "tenants": [
            {"name": t.name, "weight": t.weight, "deadline_ms": t.deadline_ms, "key": "(in the run only)"}
            for t in tenants
        ],
        "arms": out_arms,
    }
    result["table_md"] = table(result)
    return result


def _ms(value: float | None, at_least: bool = False) -> str:
    return "-" if value is None else f"{'>= ' if at_least else ''}{1000 * value:.0f}"


def _share_text(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _shed_text(shed: dict[str, Any]) -> str:
    if not shed["count"]:
        return "0"
    return f"{shed['count']} ({shed['answer_ms_p50']:.1f} / {shed['answer_ms_p99']:.1f} ms)"


def table(result: dict[str, Any]) -> str:
    plan = result["plan"]
    flood = next(t for t in result["tenants"] if t["name"] == FLOOD)
    lines = [
        f"Tenants workload against {result['mode']}: the `{FLOOD}` tenant sends {plan['flood_rate']:.1f} req/s "
        f"(6-12 images each; capacity {plan['capacity_rps']:.1f} req/s from {plan['capacity_from']}), the "
        f"`{INTERACTIVE}` tenant {plan['interactive_clients']} chat clients of one image each. Blocks of "
        f"{plan['seconds']:g} s, the first {plan['warm_s']:g} s not measured, {plan['rounds']} round(s). Our proxy's "
        f"tenants file: equal weights, `{FLOOD}` deadline_ms {flood['deadline_ms']}.",
        "",
        "| arm | block | tenant | sent | ok | ok req/s | TTFT p50 ms | TTFT p99 ms | encoder share | token share "
        "| 429 (p50 / p99 to answer) | 503 (p50 / p99 to answer) | other errors | unfinished |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    sources = set()
    for arm in result["arms"]:
        for kind, block in arm["blocks"].items():
            sources.add(f"encoder share: {block['encoder_share_from']}; token share: {block['token_share_from']}")
            for tenant in TENANTS:
                f = block["tenants"][tenant]
                if not f["sent"]:
                    continue
                lines.append(
                    f"| {arm['name']} | {kind} | {tenant} | {f['sent']} | {f['answered']} | {f['req_per_s']:.1f} "
                    f"| {_ms(f['ttft_s_p50'], f['ttft_censored'])} | {_ms(f['ttft_s_p99'], f['ttft_censored'])} | {_share_text(f['encoder_share'])} "
                    f"| {_share_text(f['token_share'])} | {_shed_text(f['shed']['429'])} "
                    f"| {_shed_text(f['shed']['503'])} | {f['other_errors']} | {f['unfinished']} |"
                )
    lines += ["", *sorted(sources)]
    lines += [
        "TTFT `>=`: some requests had no answer when the block gave up on them (`unfinished`); they count with "
        "the time they had waited, so the figure is a lower bound.",
        "",
    ]
    lines += [
        f"| arm | `{INTERACTIVE}` TTFT p99 alone ms | with the flood ms | ratio |",
        "|---|---|---|---|",
    ]
    for arm in result["arms"]:
        alone_f = arm["blocks"].get("alone", {}).get("tenants", {}).get(INTERACTIVE, {})
        flood_f = arm["blocks"].get("flood", {}).get("tenants", {}).get(INTERACTIVE, {})
        ratio = arm["interactive_ttft_p99_ratio"]
        ratio_text = "-" if ratio is None else f"{'>= ' if flood_f.get('ttft_censored') else ''}{ratio:.1f}x"
        lines.append(
            f"| {arm['name']} | {_ms(alone_f.get('ttft_s_p99'), alone_f.get('ttft_censored', False))} "
            f"| {_ms(flood_f.get('ttft_s_p99'), flood_f.get('ttft_censored', False))} | {ratio_text} |"
        )
    weights = {t["name"]: t["weight"] for t in result["tenants"]}
    weight_share = weights[INTERACTIVE] / sum(weights.values())
    lines += [
        "",
        f"Goodput: images of requests answered between the warm-up and the end of sending, per second, against "
        f"the capacity ({plan.get('capacity_images_per_s', 0):.1f} images/s). In `both` blocks `{INTERACTIVE}` floods "
        f"too ({plan.get('backlog_rate', 0):.1f} req/s of the flood's kind), so both tenants are backlogged and "
        f"its share of the encoders is held against its weight's ({100 * weight_share:.0f}%).",
        "",
        f"| arm | block | goodput images/s | of capacity | `{INTERACTIVE}` encoder share | its weight's |",
        "|---|---|---|---|---|---|",
    ]
    for arm in result["arms"]:
        for kind, block in arm["blocks"].items():
            if kind == "alone":
                continue
            of = block.get("goodput_of_capacity")
            lines.append(
                f"| {arm['name']} | {kind} | {block.get('goodput_images_per_s', 0):.1f} "
                f"| {'-' if of is None else f'{100 * of:.0f}%'} "
                f"| {_share_text(block['tenants'][INTERACTIVE]['encoder_share'])} | {100 * weight_share:.0f}% |"
            )
    lines += _engine_table(result)
    shed_lines = []
    for arm in result["arms"]:
        counted = arm["blocks"].get("flood", {}).get("proxy_shed", {})
        if counted:
            text = ", ".join(f"{k} {v:g}" for k, v in sorted(counted.items()) if v)
            shed_lines.append(
                f"- {arm['name']}: `epd_requests_shed_total` (tenant/reason, whole flood blocks) {text or 0}"
            )
        answers = arm["blocks"].get("flood", {}).get("proxy_shed_answers")
        if answers:
            shed_lines.append(
                f"- {arm['name']}: by the proxy's clock (`epd_shed_answer_seconds`, from its handler's start), "
                f"{100 * answers['within_promise']:.1f}% of {answers['count']:g} sheds answered within "
                f"{1000 * SHED_PROMISE_S:g} ms, the p99 within {1000 * answers['p99_within_s']:g} ms"
            )
    if shed_lines:
        lines += ["", *shed_lines]
    return "\n".join(lines) + "\n"


def _engine_table(result: dict[str, Any]) -> list[str]:
    rows = []
    for arm in result["arms"]:
        for kind, block in arm["blocks"].items():
            figures = block.get("engines")
            if figures:
                cells = [_number(figures.get(key)) for key, _ in ENGINE_COLUMNS]
                rows.append(f"| {arm['name']} | {kind} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    return [
        "",
        "The engines' own counters, per answered request of either tenant (mean of the blocks; the "
        "work counters carry over to other hardware):",
        "",
        "| arm | block | " + " | ".join(heading for _, heading in ENGINE_COLUMNS) + " |",
        "|---|---|" + "---|" * len(ENGINE_COLUMNS),
        *rows,
    ]


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.0f}"


def write(out: Path, result: dict[str, Any]) -> None:
    (out / "tenants.md").write_text(result["table_md"])
    (out / "tenants.json").write_text(json.dumps(result, indent=1, default=str))

"""Tables, JSON and a chart for the real-engine benchmark: one row per (load level, arm), medians
over rounds with their min-max spread, ratios to the first arm, and the answers check."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson

from epd_proxy.ops.recent import percentile

SINGLE = "single-instance"


def _median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _spread(values: list[float]) -> dict[str, float | None]:
    values = [v for v in values if v is not None]
    return {
        "rounds": len(values),
        "median": _median(values),
        "min": min(values) if values else None,
        "max": max(values) if values else None,
    }


def _pct(values: list[float], q: float) -> float | None:
    return percentile(sorted(values), q) if values else None


ENGINE_KEYS = (
    "encoder_subrequests_per_request",
    "images_per_subrequest",
    "encoder_cache_hit_share",
    "encoder_queue_ms",
    "queue_ms",
    "prefill_ms",
    "decode_ms",
    "consumer_requests_per_request",
    "encoder_images_per_request",
    "prompt_tokens_per_request",
    "prompt_tokens_computed_per_request",
    "prefix_cache_hit_share",
    "encode_cpu_ms_per_request",
    "pd_cpu_ms_per_request",
    "prefill_cpu_ms_per_request",
    "decode_cpu_ms_per_request",
    "engine_cpu_ms_per_request",
)


def summarise_arm(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    latencies = [x for b in blocks for x in b["latency_s"]]
    ttfts = [x for b in blocks for x in b["ttft_s"]]
    row: dict[str, Any] = {
        "rounds": len(blocks),
        "requests": sum(b["requests"] for b in blocks),
        "failed": sum(b["failed"] for b in blocks),
        "errored": sum(b.get("errored", b["failed"]) for b in blocks),
        "errors": sorted({e for b in blocks for e in b["errors"]})[:5],
        "req_per_s": _spread([b["req_per_s"] for b in blocks]),
        "latency_p50_ms": _ms(_pct(latencies, 0.5)),
        "latency_p90_ms": _ms(_pct(latencies, 0.9)),
        "latency_p99_ms": _ms(_pct(latencies, 0.99)),
        "latency_p99_ms_rounds": _spread([_ms(_pct(b["latency_s"], 0.99)) for b in blocks]),
        "ttft_p50_ms": _ms(_pct(ttfts, 0.5)),
        "ttft_p99_ms": _ms(_pct(ttfts, 0.99)),
        "proxy_cpu_ms_per_request": _spread([b["proxy_cpu_ms_per_request"] for b in blocks]),
        "render_cpu_ms_per_request": _spread([b.get("render_cpu_ms_per_request") for b in blocks]),
        "harness_core_share": _spread([b["harness_core_share"] for b in blocks]),
        "other_load_cores": _spread([b.get("other_load_cores") for b in blocks]),
        "eviction_rate": _spread([b.get("eviction_rate") for b in blocks]),
        "kv_blocks_removed_per_request": _spread([b.get("kv_blocks_removed_per_request") for b in blocks]),
        "restarts": sum(1 for b in blocks if b.get("restart")),
        "restart_down_s": _spread([(b.get("restart") or {}).get("down_s") for b in blocks]),
    }
    for key in ENGINE_KEYS:
        values = [b["engines"].get(key) for b in blocks]
        if any(v is not None for v in values):
            row[key] = _spread(values)
    if all("exact" in b for b in blocks):
        row["exact"] = sum(b["exact"] for b in blocks)
        row["exact_rate"] = row["exact"] / row["requests"] if row["requests"] else None
    return row


# Engine figures compared with the first arm's, by the name the comparison table gives them.
RATIOS = {
    "encoder_cpu": "encode_cpu_ms_per_request",
    "engine_cpu": "engine_cpu_ms_per_request",
    "encoder_images": "encoder_images_per_request",
    "prompt_tokens_computed": "prompt_tokens_computed_per_request",
    "proxy_cpu": "proxy_cpu_ms_per_request",
}


def _median_of(row: dict[str, Any], key: str) -> float | None:
    return (row.get(key) or {}).get("median")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _separate(a: dict, b: dict) -> bool | None:
    # One round has no spread to compare.
    if a["min"] is None or b["min"] is None or min(a["rounds"], b["rounds"]) < 2:
        return None
    return a["min"] > b["max"] or b["min"] > a["max"]


def build(bench, arms: list, levels: list[tuple[str, float]], mix) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    flagged: list[str] = []
    for level in levels:
        per_arm = {}
        for arm in arms:
            blocks = [b for b in arm.blocks if tuple(b["level"]) == level]
            if blocks:
                per_arm[arm.name] = summarise_arm(blocks)
        first = next((name for name in per_arm if name != SINGLE), None)
        single = per_arm.get(SINGLE)
        for name, row in per_arm.items():
            row.update({"arm": name, "level": list(level)})
            base = per_arm.get(first)
            if base is not None and name != first:
                row["vs_first"] = {
                    "arm": first,
                    "req_per_s": _ratio(row["req_per_s"]["median"], base["req_per_s"]["median"]),
                    "latency_p90": _ratio(row["latency_p90_ms"], base["latency_p90_ms"]),
                    "latency_p99": _ratio(row["latency_p99_ms"], base["latency_p99_ms"]),
                    "ttft_p50": _ratio(row["ttft_p50_ms"], base["ttft_p50_ms"]),
                    **{name: _ratio(_median_of(row, key), _median_of(base, key)) for name, key in RATIOS.items()},
                    "req_per_s_ranges_separate": _separate(row["req_per_s"], base["req_per_s"]),
                }
            reasons = []
            if row["failed"]:
                reasons.append(f"{row['failed']} request(s) without an answer")
            if single is not None and name != SINGLE and "exact" in row:
                own = single["requests"] - single["exact"]
                changed = row["requests"] - row["failed"] - row["exact"]
                # Batching alone changes some answers; an arm may not change clearly more.
                allowed = own + 2 * math.sqrt(own + 1)
                if changed > allowed:
                    reasons.append(f"{changed} answers differ from the baseline's (single instance: {own})")
            row["flag"] = "; ".join(reasons)
            if reasons:
                flagged.append(f"{name} at {level[0]} {level[1]:g}: {row['flag']}")
            rows.append(row)
    result = {
        "workload": {"kind": bench.args.workload, "think_ms": [round(t * 1000) for t in bench.think], **mix.summary()},
        "engines": [{"name": e.name, "role": e.role, "url": e.url} for e in bench.engines],
        "arms": [{"name": arm.name, "command": arm.command, "env": arm.env} for arm in arms],
        "rounds": bench.args.rounds,
        "caches_reset_between_blocks": bench.resets,
        "notes": bench.notes,
        "rows": rows,
        "blocks": {arm.name: arm.blocks for arm in arms},
        "flagged": flagged,
    }
    result["table_md"] = table(result)
    return result


def _f(value: Any, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _range(spread: dict | None, fmt: str = "{:.2f}") -> str:
    if not spread or spread.get("median") is None:
        return "-"
    if spread["min"] == spread["max"]:
        return fmt.format(spread["median"])
    return f"{fmt.format(spread['median'])} ({fmt.format(spread['min'])}-{fmt.format(spread['max'])})"


def _med(row: dict, key: str, fmt: str = "{:.1f}") -> str:
    return _f((row.get(key) or {}).get("median"), fmt)


def table(result: dict[str, Any]) -> str:
    w = result["workload"]
    lines = [
        f"Workload: {w['conversations']} conversations, {w['requests']} requests per block "
        f"({w['multi_turn_conversations']} multi-turn), {w['mean_images_per_request']} images per request; "
        f"{result['rounds']} interleaved round(s); engine caches "
        + ("emptied before every block" if result["caches_reset_between_blocks"] else "NOT emptied between blocks"),
        "",
        "| level | arm | req/s (min-max) | p50 ms | p90 ms | p99 ms | TTFT p50 / p99 ms | E sub-req / req "
        "| images / sub-req | E cache hits | answers exact | failed (errors) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        level = f"{'c' if r['level'][0] == 'concurrency' else 'rate'} {r['level'][1]:g}"
        exact = "-" if r.get("exact_rate") is None else f"{100 * r['exact_rate']:.0f}%"
        lines.append(
            f"| {level} | {r['arm']}{' **FLAGGED**' if r['flag'] else ''} | {_range(r['req_per_s'])} "
            f"| {_f(r['latency_p50_ms'], '{:.0f}')} | {_f(r['latency_p90_ms'], '{:.0f}')} "
            f"| {_f(r['latency_p99_ms'], '{:.0f}')} "
            f"| {_f(r['ttft_p50_ms'], '{:.0f}')} / {_f(r['ttft_p99_ms'], '{:.0f}')} "
            f"| {_med(r, 'encoder_subrequests_per_request', '{:.2f}')} | {_med(r, 'images_per_subrequest', '{:.2f}')} "
            f"| {_med(r, 'encoder_cache_hit_share', '{:.0%}')} | {exact} | {r['failed']} ({r['errored']}) |"
        )
    lines += [
        "",
        "Engines' own figures (their /metrics) and CPU per request (their process trees, local stack):",
        "",
        "| level | arm | E queue ms | LM queue / prefill / decode ms | encoder CPU ms/req | LM CPU ms/req "
        "| all engines CPU ms/req (min-max) | proxy CPU ms/req | harness core share | other load, cores |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        level = f"{'c' if r['level'][0] == 'concurrency' else 'rate'} {r['level'][1]:g}"
        lm_cpu = [
            _med(r, k, "{:.0f}")
            for k in ("pd_cpu_ms_per_request", "prefill_cpu_ms_per_request", "decode_cpu_ms_per_request")
            if r.get(k)
        ]
        lines.append(
            f"| {level} | {r['arm']} | {_med(r, 'encoder_queue_ms')} "
            f"| {_med(r, 'queue_ms')} / {_med(r, 'prefill_ms')} / {_med(r, 'decode_ms')} "
            f"| {_med(r, 'encode_cpu_ms_per_request', '{:.0f}')} | {' + '.join(lm_cpu) or '-'} "
            f"| {_range(r.get('engine_cpu_ms_per_request'), '{:.0f}')} "
            f"| {_med(r, 'proxy_cpu_ms_per_request', '{:.2f}')} | {_med(r, 'harness_core_share', '{:.0%}')} "
            f"| {_range(r.get('other_load_cores'))} |"
        )
    lines += [
        "",
        "Work done per request: images sent to the encoders, the first language-model stage's prompt tokens "
        "and those it computed (not from its prefix cache or a KV transfer), its prefix-cache hit share; the "
        "consumers' cached blocks evicted (their KV events' BlockRemoved) per request and per block stored:",
        "",
        "| level | arm | images to encoders / req | prompt tokens / req | computed / req | prefix-cache hits "
        "| blocks evicted / req | evicted / stored | restarts (down s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        level = f"{'c' if r['level'][0] == 'concurrency' else 'rate'} {r['level'][1]:g}"
        lines.append(
            f"| {level} | {r['arm']} | {_med(r, 'encoder_images_per_request', '{:.2f}')} "
            f"| {_med(r, 'prompt_tokens_per_request', '{:.0f}')} "
            f"| {_med(r, 'prompt_tokens_computed_per_request', '{:.0f}')} "
            f"| {_med(r, 'prefix_cache_hit_share', '{:.0%}')} "
            f"| {_med(r, 'kv_blocks_removed_per_request', '{:.1f}')} | {_med(r, 'eviction_rate', '{:.0%}')} "
            f"| {r['restarts']} ({_med(r, 'restart_down_s', '{:.0f}')}) |"
        )
    compared = [r for r in result["rows"] if r.get("vs_first")]
    if compared:
        lines += [
            "",
            "Against the first arm at the same level (ratios of medians):",
            "",
            "| level | arm | vs | req/s | p90 | p99 | TTFT p50 | images to encoders | prompt tokens computed "
            "| encoder CPU / req | all engines CPU / req | proxy CPU / req | req/s ranges |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in compared:
            v = r["vs_first"]
            level = f"{'c' if r['level'][0] == 'concurrency' else 'rate'} {r['level'][1]:g}"
            sep = {True: "separate", False: "overlap", None: "-"}[v["req_per_s_ranges_separate"]]
            lines.append(
                f"| {level} | {r['arm']} | {v['arm']} | {_f(v['req_per_s'], '{:.2f}x')} "
                f"| {_f(v['latency_p90'], '{:.2f}x')} | {_f(v['latency_p99'], '{:.2f}x')} "
                f"| {_f(v['ttft_p50'], '{:.2f}x')} "
                f"| {_f(v['encoder_images'], '{:.2f}x')} | {_f(v['prompt_tokens_computed'], '{:.2f}x')} "
                f"| {_f(v['encoder_cpu'], '{:.2f}x')} | {_f(v['engine_cpu'], '{:.2f}x')} "
                f"| {_f(v['proxy_cpu'], '{:.2f}x')} | {sep} |"
            )
    for note in result["notes"]:
        lines.append(f"\nNote: {note}")
    for flag in result["flagged"]:
        lines.append(f"\nFLAGGED: {flag}")
    return "\n".join(lines) + "\n"


def write(out: Path, result: dict[str, Any], chart: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    (out / "table.md").write_text(result["table_md"])
    if chart:
        draw_chart(out / "chart.png", result)


def draw_chart(path: Path, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in ("concurrency", "rate") if any(r["level"][0] == k for r in result["rows"])]
    fig, axes = plt.subplots(len(kinds), 2, figsize=(11, 4 * len(kinds)), squeeze=False)
    for row_axes, kind in zip(axes, kinds):
        rows = [r for r in result["rows"] if r["level"][0] == kind]
        for arm in dict.fromkeys(r["arm"] for r in rows):
            mine = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["level"][1])
            x = [r["level"][1] for r in mine]
            row_axes[0].plot(x, [r["req_per_s"]["median"] for r in mine], marker="o", label=arm)
            row_axes[1].plot(x, [r["latency_p99_ms"] for r in mine], marker="o", label=arm)
        label = "concurrency (closed loop)" if kind == "concurrency" else "arrival rate, req/s (Poisson)"
        for ax, title in zip(row_axes, ("throughput, req/s", "latency p99, ms")):
            ax.set_xlabel(label)
            ax.set_title(title)
            ax.grid(alpha=0.3)
        row_axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

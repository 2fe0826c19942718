"""Summaries, the markdown table, results.json and the chart."""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

import orjson

from epd_proxy.ops.recent import percentile


def _sum(blocks: list[dict], key: str) -> float:
    return sum(b.get(key, 0) for b in blocks)


def _quantile(sorted_values: list[float], q: float) -> float:
    """NaN for no values, so the differences and ratios below stay numbers."""
    value = percentile(sorted_values, q)
    return float("nan") if value is None else value


def summarise(arm, peak_rss: dict[str, float]) -> dict[str, Any]:
    blocks = arm.blocks
    lat = sorted(arm.latencies_ms)
    measured = _sum(blocks, "measured")
    ok = measured - _sum(blocks, "errors")
    window = _sum(blocks, "window_s")
    everything = max(1, _sum(blocks, "all_requests"))
    wall = max(1e-9, _sum(blocks, "wall_s"))
    subreq = _sum(blocks, "encoder_subrequests")
    out: dict[str, Any] = {
        "name": arm.name,
        "kind": arm.kind,
        "note": arm.note,
        "cluster": arm.cluster,
        "encoder_max_batch_size": arm.batch if arm.kind == "proxy" else None,
        "workers": arm.workers,
        "blocks": len(blocks),
        "measured": measured,
        "errors": measured - ok,
        "req_per_s": ok / window if window else float("nan"),
        # Per-round rates show how much a shared machine disturbed the run; the median resists it.
        "req_per_s_rounds": [b["measured"] / b["window_s"] for b in blocks if b.get("window_s")],
        **_clean(arm, blocks),
        "lat_mean_ms": sum(lat) / len(lat) if lat else float("nan"),
        "lat_p50_ms": _quantile(lat, 0.50),
        "lat_p90_ms": _quantile(lat, 0.90),
        "lat_p99_ms": _quantile(lat, 0.99),
        "lat_max_ms": lat[-1] if lat else float("nan"),
    }
    for key, values in (("unloaded", arm.unloaded_ms), ("unloaded_free", arm.unloaded_free_ms)):
        if values:
            ordered = sorted(values)
            out[f"{key}_p50_ms"] = _quantile(ordered, 0.50)
            out[f"{key}_p99_ms"] = _quantile(ordered, 0.99)
            out[f"{key}_mean_ms"] = sum(ordered) / len(ordered)
    out.update(
        {
            "encoder_subrequests_per_round": subreq / len(blocks) if blocks else 0,
            "encoder_subrequests_per_request": subreq / measured if measured else 0,
            "images_per_subrequest": _sum(blocks, "encoder_images") / subreq if subreq else None,
            "encoder_cache_hit_share": (
                _sum(blocks, "encoder_cache_hits") / _sum(blocks, "encoder_cache_lookups")
                if _sum(blocks, "encoder_cache_lookups")
                else None
            ),
            "pd_requests_per_round": _sum(blocks, "pd_requests") / len(blocks) if blocks else 0,
            "pd_raw_images": _sum(blocks, "pd_raw_images"),
            "pd_kb_per_request": _sum(blocks, "pd_bytes") / 1024 / measured if measured else 0,
            "proxy_cpu_ms_per_request": _sum(blocks, "proxy_cpu_s") * 1000 / everything
            if arm.kind == "proxy"
            else None,
            "proxy_sys_share": (
                _sum(blocks, "proxy_sys_s") / _sum(blocks, "proxy_cpu_s")
                if arm.kind == "proxy" and _sum(blocks, "proxy_cpu_s")
                else None
            ),
            "proxy_cpu_util": _sum(blocks, "proxy_cpu_s") / wall if arm.kind == "proxy" else None,
            "proxy_peak_rss_mb": peak_rss.get(arm.name),
            "proxy_rss_under_load_mb": _median([x for b in blocks for x in b.get("proxy_rss_samples_mb", ())]),
            "loadgen_cpu_ms_per_request": _sum(blocks, "loadgen_cpu_s") * 1000 / everything,
            "fakes_cpu_ms_per_request": _sum(blocks, "fakes_cpu_s") * 1000 / everything,
            "harness_cpu_ms_per_request": _sum(blocks, "harness_cpu_s") * 1000 / everything,
            "other_load": {
                k: sum(b["other_load"][k] * b["wall_s"] for b in blocks) / wall
                for k in (blocks[0].get("other_load") or {} if blocks else {})
            },
            "core_busy": {
                str(c): sum(b["core_busy"][c] * b["wall_s"] for b in blocks) / wall
                for c in (blocks[0]["core_busy"] if blocks else {})
            },
        }
    )
    return out


# A block counts as undisturbed when other tenants used less than this share of our cores.
CLEAN_OTHER_LOAD = 0.10


def _clean(arm, blocks: list[dict]) -> dict[str, Any]:
    """req/s over the blocks nobody else disturbed. The direct arm runs nothing on the proxy
    cores, so only the harness cores count for it."""
    keys = ("harness_cores",) if arm.kind == "direct" else ("proxy_cores", "harness_cores")
    clean = [b for b in blocks if b.get("other_load") and all(b["other_load"][k] < CLEAN_OTHER_LOAD for k in keys)]
    window = sum(b["window_s"] for b in clean)
    ok = sum(b["measured"] - b["errors"] for b in clean)
    return {"clean_blocks": len(clean), "req_per_s_clean": ok / window if window else None}


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _ratio(a: Any, b: Any) -> float | None:
    if a is None or b is None or not b or (isinstance(a, float) and math.isnan(a)):
        return None
    return a / b


def build(bench, arms: list, floor: dict[str, float], peak_rss: dict[str, float], pool) -> dict[str, Any]:
    summaries = [summarise(arm, peak_rss) for arm in arms if not arm.skipped]
    first = summaries[0] if summaries else None
    direct = next((s for s in summaries if s["kind"] == "direct"), None)
    for s in summaries:
        if first is not None:
            s["vs_first"] = {
                "req_per_s": _ratio(s["req_per_s"], first["req_per_s"]),
                "lat_p50": _ratio(s["lat_p50_ms"], first["lat_p50_ms"]),
                "lat_p99": _ratio(s["lat_p99_ms"], first["lat_p99_ms"]),
                "proxy_cpu_per_request": _ratio(
                    s.get("proxy_cpu_ms_per_request"), first.get("proxy_cpu_ms_per_request")
                ),
                "encoder_subrequests": _ratio(
                    s.get("encoder_subrequests_per_round"), first.get("encoder_subrequests_per_round")
                ),
            }
        if direct is not None and s["kind"] == "proxy" and s["cluster"] == direct["cluster"]:
            s["added_latency_ms"] = {
                "p50": s["lat_p50_ms"] - direct["lat_p50_ms"],
                "p99": s["lat_p99_ms"] - direct["lat_p99_ms"],
            }
        if direct is not None and s["kind"] == "proxy" and "unloaded_p50_ms" in s:
            base = "unloaded" if s["cluster"] == direct["cluster"] else "unloaded_free"
            if f"{base}_p50_ms" in direct:
                s["added_unloaded_ms"] = {
                    "p50": s["unloaded_p50_ms"] - direct[f"{base}_p50_ms"],
                    "p99": s["unloaded_p99_ms"] - direct[f"{base}_p99_ms"],
                }
        cpu = s.get("proxy_cpu_ms_per_request")
        # What one fully busy core would sustain at this CPU cost: steadier than req/s on a shared box.
        s["req_per_s_per_proxy_core"] = 1000 / cpu if cpu else None
    a = bench.args
    result = {
        "preset": bench.preset,
        "settings": {
            "seed": a.seed,
            "pool_size": bench.pool_size,
            "concurrency": bench.concurrency,
            "measured_per_round": bench.requests,
            "rounds": bench.rounds,
            "warmup": bench.warmup,
            "encoders": a.encoders,
            "encoder_ms": a.encoder_ms,
            "encoder_image_ms": a.encoder_image_ms,
            "encoder_speeds": getattr(a, "encoder_speeds", None),
            "encoder_repeat_factor": getattr(a, "encoder_repeat_factor", 1.0),
            "encoder_cache_items": getattr(a, "encoder_cache_items", 0),
            "pd_ms": a.pd_ms,
            "clients": a.clients,
            "proxy_env": a.proxy_env,
            "pinned": bench.pin,
            "proxy_cpus": a.proxy_cpus if bench.pin else None,
            "harness_cpus": a.harness_cpus if bench.pin else None,
            "cpu_count": __import__("os").cpu_count(),
        },
        "workload": {
            "bodies": len(pool.bodies),
            "mean_images_per_request": pool.mean_images,
            "max_images_per_request": max(pool.images_per_request),
            "mean_image_kb": sum(pool.image_bytes) / len(pool.image_bytes) / 1024,
            "min_image_kb": min(pool.image_bytes) / 1024,
            "max_image_kb": max(pool.image_bytes) / 1024,
            "mean_body_kb": sum(map(len, pool.bodies)) / len(pool.bodies) / 1024,
        },
        "floor": floor,
        "arms": summaries,
        "skipped": {arm.name: arm.skipped for arm in arms if arm.skipped},
        "notes": bench.notes,
    }
    result["table_md"] = table(result)
    return result


def _f(value: Any, fmt: str = "{:.1f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def _unloaded(a: dict[str, Any], q: str) -> str:
    main = _f(a.get(f"unloaded_{q}_ms"))
    if f"unloaded_free_{q}_ms" in a:
        return f"{main} (costs 0: {_f(a[f'unloaded_free_{q}_ms'])})"
    return main


def _rounds(rates: list[float] | None) -> str:
    if not rates:
        return "-"
    return f"{_median(rates):.0f} ({min(rates):.0f}-{max(rates):.0f})"


def _other(load: dict[str, float] | None) -> str:
    if not load:
        return "-"
    return f"{100 * load['proxy_cores']:.0f} / {100 * load['harness_cores']:.0f}"


def _pct(value: float | None) -> str:
    return _f(value * 100 if value is not None else None, "{:.0f}")


def _grid(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"] + ["| " + " | ".join(r) + " |" for r in rows]


def table(result: dict[str, Any]) -> str:
    s = result["settings"]
    arms = result["arms"]
    lines = [
        f"EPD proxy benchmark ({result['preset']}): concurrency {s['concurrency']}, {s['rounds']} interleaved rounds "
        f"x {s['measured_per_round']} measured requests per arm, {s['encoders']} fake encoders "
        f"({s['encoder_ms']:g} ms + {s['encoder_image_ms']:g} ms/image"
        + (f", speeds {s['encoder_speeds']}" if s.get("encoder_speeds") else "")
        + (
            f", repeats {s['encoder_repeat_factor']:g}x within the last {s['encoder_cache_items']} images"
            if s.get("encoder_repeat_factor", 1.0) != 1.0
            else ""
        )
        + f"), PD {s['pd_ms']:g} ms; "
        f"{result['workload']['mean_images_per_request']:.2f} images/request, "
        f"{result['workload']['mean_body_kb']:.0f} KB/body",
        "",
    ]
    lines += _grid(
        [
            "arm",
            "req/s",
            "req/s per round: median (min-max)",
            "req/s undisturbed rounds (n)",
            "mean ms",
            "p50 ms",
            "p99 ms",
            "errors",
            "unloaded p50 ms",
            "unloaded p99 ms",
        ],
        [
            [
                a["name"],
                _f(a["req_per_s"]),
                _rounds(a.get("req_per_s_rounds")),
                f"{_f(a.get('req_per_s_clean'))} ({a.get('clean_blocks', 0)})",
                _f(a["lat_mean_ms"]),
                _f(a["lat_p50_ms"]),
                _f(a["lat_p99_ms"]),
                str(a["errors"]),
                _unloaded(a, "p50"),
                _unloaded(a, "p99"),
            ]
            for a in arms
        ],
    )
    lines.append("")
    lines += _grid(
        [
            "arm",
            "enc sub-req/round",
            "sub-req/req",
            "images/sub-req",
            "enc cache hits %",
            "proxy CPU ms/req",
            "of it kernel %",
            "req/s per proxy core (1000/CPU ms)",
            "proxy core %",
            "proxy peak RSS MB",
            "proxy RSS under load MB (median)",
            "loadgen CPU ms/req",
            "fakes CPU ms/req",
            "core0 %",
            "core1 %",
            "other load proxy/harness cores %",
        ],
        [
            [
                a["name"],
                _f(a.get("encoder_subrequests_per_round"), "{:.0f}"),
                _f(a.get("encoder_subrequests_per_request"), "{:.2f}"),
                _f(a.get("images_per_subrequest"), "{:.2f}"),
                _pct(a.get("encoder_cache_hit_share")),
                _f(a.get("proxy_cpu_ms_per_request"), "{:.2f}"),
                _pct(a.get("proxy_sys_share")),
                _f(a.get("req_per_s_per_proxy_core"), "{:.0f}"),
                _pct(a.get("proxy_cpu_util")),
                _f(a.get("proxy_peak_rss_mb"), "{:.0f}"),
                _f(a.get("proxy_rss_under_load_mb"), "{:.0f}"),
                _f(a.get("loadgen_cpu_ms_per_request"), "{:.2f}"),
                _f(a.get("fakes_cpu_ms_per_request"), "{:.2f}"),
                _pct((a.get("core_busy") or {}).get("0")),
                _pct((a.get("core_busy") or {}).get("1")),
                _other(a.get("other_load")),
            ]
            for a in arms
        ],
    )
    lines.append("")
    lines += _grid(
        [
            "arm",
            "req/s x",
            "p50 x",
            "p99 x",
            "proxy CPU/req x",
            "enc sub-req x",
            "added p50 ms",
            "added p99 ms",
            "added unloaded p50 ms",
            "added unloaded p99 ms",
        ],
        [
            [
                a["name"],
                *(
                    _f(a.get("vs_first", {}).get(k), "{:.2f}")
                    for k in ("req_per_s", "lat_p50", "lat_p99", "proxy_cpu_per_request", "encoder_subrequests")
                ),
                _f(a.get("added_latency_ms", {}).get("p50")),
                _f(a.get("added_latency_ms", {}).get("p99")),
                _f(a.get("added_unloaded_ms", {}).get("p50")),
                _f(a.get("added_unloaded_ms", {}).get("p99")),
            ]
            for a in arms
        ],
    )
    f = result["floor"]
    lines += [
        "",
        f"JSON floor (one core, same bodies): orjson.loads+dumps {f['json_loads_dumps_ms_per_request']:.2f} ms/request; "
        f"sha256 of the image URLs {f['sha256_urls_ms_per_request']:.2f} ms/request "
        f"(blake3 {f['blake3_urls_ms_per_request']:.2f}) ({f['mean_body_kb']:.0f} KB/body). "
        f"Splice's read (lift, strict base64 check, skeleton parse) {f['splice_read_ms_per_request']:.3f} ms/request"
        + (
            f"; msgspec with the URLs as Raw spans {f['msgspec_raw_decode_ms_per_request']:.3f}."
            if "msgspec_raw_decode_ms_per_request" in f
            else "."
        ),
        "Ratios are to the first arm; added latency = proxy arm minus the direct arm under the same load (it includes "
        "the fake encoders' cost and the queueing a slower arm builds up in a closed loop). Unloaded = one request in "
        "flight; for zero-cost arms the added unloaded latency is against the zero-cost PD, i.e. the proxy alone. CPU ms/req counts warm-up and cool-down requests too. Other load = core busy time none of the "
        "benchmark's processes account for (other tenants, kernel); high values mean a disturbed run, and "
        f"'undisturbed rounds' pools only the rounds where it stayed under {100 * CLEAN_OTHER_LOAD:.0f}%.",
    ]
    for name, why in result["skipped"].items():
        lines.append(f"Skipped arm {name}: {why}.")
    for note in result["notes"]:
        lines.append(f"Note: {note}")
    return "\n".join(lines)


def write(out: Path, result: dict[str, Any], arms: list, chart: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    (out / "table.md").write_text(result["table_md"] + "\n")
    (out / "latencies.json").write_bytes(
        orjson.dumps({arm.name: [round(x, 3) for x in arm.latencies_ms] for arm in arms if not arm.skipped})
    )
    if chart:
        try:
            draw_chart(out / "chart.png", result, arms)
        except ImportError as exc:
            print(f"no chart: {exc} (pip install matplotlib)")


def draw_chart(path: Path, result: dict[str, Any], arms: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [arm for arm in arms if not arm.skipped and arm.latencies_ms]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for arm in shown:
        lat = sorted(arm.latencies_ms)
        ys = [(i + 1) / len(lat) for i in range(len(lat))]
        left.plot(lat, ys, label=arm.name)
    left.set_xscale("log")
    left.set_xlabel("latency (ms, log)")
    left.set_ylabel("fraction of requests")
    left.set_title("latency distribution (CDF)")
    left.grid(True, which="both", alpha=0.3)
    left.legend()
    by_name = {a["name"]: a for a in result["arms"]}
    names = [arm.name for arm in shown]
    rates = [by_name[n]["req_per_s"] for n in names]
    bars = right.bar(names, rates, color="tab:blue")
    for bar, name in zip(bars, names):
        cpu = by_name[name].get("proxy_cpu_ms_per_request")
        label = f"{bar.get_height():.0f}" + (f"\n{cpu:.2f} ms CPU/req" if cpu else "")
        right.annotate(
            label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8
        )
    right.set_ylabel("requests / s")
    right.set_title("throughput per arm (closed loop)")
    right.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def _short(frame: str) -> str:
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    file = m.group("file")
    for marker in ("site-packages/", "lib/python3"):
        if marker in file:
            file = file.split(marker, 1)[1]
            break
    else:
        file = file.rsplit("/", 2)[-1] if "epd_proxy" not in file else "epd_proxy/" + file.split("epd_proxy/", 1)[-1]
    return f"{m.group('func')} ({file})"


def _idle(stack: str) -> bool:
    """Waiting is not work: py-spy sometimes samples a thread-pool worker blocked on its queue, or
    (with --native) the event loop inside epoll_wait."""
    if "_queue_SimpleQueue_get" in stack or "epoll_wait" in stack:
        return True
    leaf = stack.rsplit(";", 1)[-1]
    return leaf.startswith("_worker (") and "concurrent/futures/thread.py" in leaf


def summarise_profile(raw: Path, top: int = 30) -> str:
    """py-spy's collapsed stacks -> the functions with the most self and inclusive samples."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = idle = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        if _idle(stack):
            idle += n
            continue
        total += n
        frames = [_short(f) for f in stack.split(";")]
        frames = [f for f in frames if not f.startswith("process ") and not f.startswith("thread ")]
        if frames:
            own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    if not total:
        return "py-spy recorded no samples\n"
    lines = [
        f"py-spy busy samples: {total} (idle samples left out: {idle})",
        "",
        "## self time",
        "",
        "| % | function |",
        "|---|---|",
    ]
    lines += [f"| {100 * n / total:.1f} | `{f}` |" for f, n in own.most_common(top)]
    lines += ["", "## inclusive time", "", "| % | function |", "|---|---|"]
    lines += [f"| {100 * n / total:.1f} | `{f}` |" for f, n in inclusive.most_common(top)]
    return "\n".join(lines) + "\n"

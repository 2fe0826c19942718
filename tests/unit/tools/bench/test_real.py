"""The real-engine benchmark's pure parts: arm specs, vLLM's /metrics, the engines' per-request
figures, answers read from a stream, arrivals, the workload's repeats and the report's flags."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import orjson
import pytest

from epd_proxy_tools.bench import chat_load, engines, real, real_report
from epd_proxy_tools.bench.engines import ENCODE, PD, Engine
from epd_proxy_tools.bench.flags import RealBenchOptions
from epd_proxy_tools.bench.real import think_range
from epd_proxy_tools.bench.workload import (
    AGENT_SYSTEM,
    EARLIER_REPLY,
    AgentSpec,
    ChatMixSpec,
    agent_preamble,
    generate_agent_sessions,
    generate_chats,
)

# The exposition format vLLM 0.32 serves (names from vllm/v1/metrics/loggers.py), two engines'
# worth of label sets, as a Prometheus client writes them.
METRICS = """\
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny-vlm"} 3.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny-vlm"} 4.0
# HELP vllm:mm_cache_queries_total Multi-modal cache queries, in terms of number of queried items.
# TYPE vllm:mm_cache_queries_total counter
vllm:mm_cache_queries_total{engine="0",model_name="tiny-vlm"} 20.0
# HELP vllm:mm_cache_hits_total Multi-modal cache hits, in terms of number of cached items.
# TYPE vllm:mm_cache_hits_total counter
vllm:mm_cache_hits_total{engine="0",model_name="tiny-vlm"} 5.0
# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_sum{engine="0",model_name="tiny-vlm"} 1.5
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="tiny-vlm"} 2.0
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="tiny-vlm"} 7.0
vllm:request_queue_time_seconds_count{engine="0",model_name="tiny-vlm"} 7.0
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny-vlm",source="local_compute"} 30.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny-vlm",source="local_cache_hit"} 64.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny-vlm",source="external_kv_transfer"} 0.0
# HELP vllm:request_success_created Count of successfully processed requests.
# TYPE vllm:request_success_created gauge
vllm:request_success_created{engine="0",finished_reason="stop",model_name="tiny-vlm"} 1.7e+09
"""


def test_counters_are_summed_over_label_sets_and_histograms_give_sum_and_count():
    m = engines.parse_metrics(METRICS)
    assert m["requests"] == 7.0
    assert (m["mm_items"], m["mm_hits"]) == (20.0, 5.0)
    assert (m["queue_sum"], m["queue_count"]) == (1.5, 7.0)
    assert m["prefill_count"] == 0.0  # absent families read as zero, so deltas stay defined
    assert m["prompt_computed"] == 30.0  # only the tokens the engine prefilled itself


def test_engine_figures_per_request_come_from_counter_deltas():
    fleet = [Engine("encoder-0", ENCODE, "u0"), Engine("encoder-1", ENCODE, "u1"), Engine("pd", PD, "u2")]
    zero = engines.parse_metrics("")
    deltas = {
        "encoder-0": {**zero, "requests": 3, "mm_items": 9, "mm_hits": 3, "cpu_s": 0.6},
        "encoder-1": {**zero, "requests": 1, "mm_items": 3, "cpu_s": 0.2},
        "pd": {
            **zero,
            "requests": 4,
            "queue_sum": 0.4,
            "queue_count": 4,
            "decode_sum": 2.0,
            "decode_count": 4,
            "prompt_tokens": 400,
            "prompt_computed": 100,
            "prefix_queries": 400,
            "prefix_hits": 300,
        },
    }
    out = engines.summarise(fleet, deltas, requests=4)
    assert out["encoder_subrequests_per_request"] == 1.0
    assert out["images_per_subrequest"] == 3.0
    assert out["encoder_cache_hit_share"] == 0.25
    assert out["queue_ms"] == pytest.approx(100.0)
    assert out["decode_ms"] == pytest.approx(500.0)
    assert out["encode_cpu_ms_per_request"] == pytest.approx(200.0)
    assert out["consumer_requests_per_request"] == 1.0
    assert out["encoder_images_per_request"] == 3.0
    assert (out["prompt_tokens_per_request"], out["prompt_tokens_computed_per_request"]) == (100.0, 25.0)
    assert out["prefix_cache_hit_share"] == 0.75
    assert "pd_cpu_ms_per_request" not in out  # no process tree known for it: not invented


def test_an_arm_is_a_command_line_with_leading_environment_words():
    arm = real.parse_arm("ref=ENCODER_MAX_BATCH_SIZE=1 python disagg_epd_proxy.py --prefill-servers-urls none")
    assert arm.env == {"ENCODER_MAX_BATCH_SIZE": "1"}
    assert arm.command == [sys.executable, "disagg_epd_proxy.py", "--prefill-servers-urls", "none"]
    assert not arm.ours
    ours = real.parse_arm("affinity=epd-proxy serve --encode-policy content_affinity")
    assert ours.ours and ours.command == [
        sys.executable,
        "-m",
        "epd_proxy",
        "serve",
        "--encode-policy",
        "content_affinity",
    ]
    variant = real.parse_variant("before:PYTHONPATH=/tmp/tree,X=1")
    assert variant.ours and variant.env == {"PYTHONPATH": "/tmp/tree", "X": "1"}
    with pytest.raises(SystemExit):
        real.parse_arm("no-command=")


def test_real_mode_is_chosen_by_the_engine_flags_only():
    assert real.wants_real_mode(["--stack", "--quick"])
    assert real.wants_real_mode(["--encode-urls=http://e:8000", "--decode-urls", "http://d:8000"])
    assert not real.wants_real_mode(["--quick", "--arms", "batched"])


def _sse(*events) -> list[bytes]:
    return [orjson.dumps(e) for e in events] + [b"[DONE]"]


def test_an_answer_is_the_streamed_text_with_finish_reason_and_usage():
    events = _sse(
        {"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]},
        {"choices": [{"delta": {"content": "two "}, "finish_reason": None}]},
        {"choices": [{"delta": {"content": "cats"}, "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 90, "completion_tokens": 2}},
    )
    answer, error = chat_load.read_answer(events)
    assert error is None
    assert answer == chat_load.Answer("two cats", "length", 90, 2)


def test_vllms_in_band_error_after_a_200_is_an_error_not_an_answer():
    events = _sse(
        {"choices": [{"delta": {"content": "x"}}]},
        {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}},
    )
    answer, error = chat_load.read_answer(events)
    assert answer is None and "engine died" in error


def test_time_to_first_token_waits_for_generated_output_not_the_role_chunk():
    role = b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
    assert not chat_load.carries_a_token(role)
    assert chat_load.carries_a_token(b'{"choices":[{"index":0,"delta":{"content":"A"}}]}')
    assert chat_load.carries_a_token(b'{"choices":[{"index":0,"delta":{"reasoning_content":"hm"}}]}')
    assert not chat_load.carries_a_token(b'{"choices":[],"usage":{"prompt_tokens":3}}')
    assert not chat_load.carries_a_token(b"[DONE]")


def test_poisson_arrivals_are_seeded_and_have_the_asked_rate():
    a = chat_load.arrival_times(4000, rate=5.0, seed=7)
    assert a == chat_load.arrival_times(4000, rate=5.0, seed=7)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    assert 4000 / a[-1] == pytest.approx(5.0, rel=0.08)


def test_later_turns_resend_every_earlier_image_and_the_mix_has_repeats():
    mix = generate_chats(ChatMixSpec(seed=3, conversations=14, multi_turn_share=0.6, popular_share=0.6))
    multi = [c for c in mix.conversations if len(c) > 1]
    assert multi, "the mix must hold multi-turn conversations"
    for turns in multi:
        bodies = [orjson.loads(b) for b in turns]
        first_urls = [p["image_url"]["url"] for p in bodies[0]["messages"][0]["content"] if p["type"] == "image_url"]
        last = bodies[-1]["messages"]
        assert [m["role"] for m in last[:2]] == ["user", "assistant"] and last[1]["content"] == EARLIER_REPLY
        assert [p["image_url"]["url"] for p in last[0]["content"] if p["type"] == "image_url"] == first_urls
    urls = [
        p["image_url"]["url"]
        for turns in mix.conversations
        for p in orjson.loads(turns[0])["messages"][-1]["content"]
        if p["type"] == "image_url"
    ]
    assert len(set(urls)) < len(urls), "popular images must recur across conversations"
    assert max(n for counts in mix.images for n in counts) <= 12


def test_agent_sessions_add_one_screenshot_per_step_and_resend_the_history():
    mix = generate_agent_sessions(AgentSpec(seed=5, conversations=6))
    for turns in mix.conversations:
        assert 6 <= len(turns) <= 10
        bodies = [orjson.loads(b) for b in turns]
        screens = [
            [p["image_url"]["url"] for m in b["messages"] if isinstance(m["content"], list) for p in m["content"][1:]]
            for b in bodies
        ]
        for n in range(1, len(screens)):
            assert screens[n][:-1] == screens[n - 1] and screens[n][-1] not in screens[n - 1]
        assert bodies[-1]["messages"][: len(bodies[-2]["messages"])] == bodies[-2]["messages"]
    assert mix.images[0] == list(range(1, len(mix.conversations[0]) + 1))


def test_agents_pause_between_steps_by_default_and_the_chat_mix_does_not():
    assert think_range(RealBenchOptions(stack=True, workload="agent")) == (0.1, 0.4)
    assert think_range(RealBenchOptions(stack=True)) == (0.0, 0.0)
    assert think_range(RealBenchOptions(stack=True, think_ms="50-80")) == (0.05, 0.08)
    with pytest.raises(SystemExit):
        think_range(RealBenchOptions(stack=True, think_ms="9-3"))


def _block(level, round_no, rps, exact, requests=10, failed=0):
    return {
        "level": list(level),
        "round": round_no,
        "requests": requests,
        "answered": requests - failed,
        "failed": failed,
        "errors": [],
        "wall_s": 1.0,
        "req_per_s": rps,
        "latency_s": [0.1] * (requests - failed),
        "ttft_s": [0.05] * (requests - failed),
        "proxy_cpu_ms_per_request": 1.0,
        "harness_core_share": 0.01,
        "engines": {"encoder_subrequests_per_request": 2.0, "encode_cpu_ms_per_request": 50.0},
        "exact": exact,
    }


def _result(arm_blocks):
    arms = [SimpleNamespace(name=n, command=[], env={}, blocks=b) for n, b in arm_blocks.items()]
    bench = SimpleNamespace(
        engines=[], args=SimpleNamespace(rounds=2, workload="mix"), think=(0.0, 0.0), resets=True, notes=[]
    )
    mix = SimpleNamespace(
        summary=lambda: {
            "conversations": 5,
            "requests": 10,
            "multi_turn_conversations": 2,
            "mean_images_per_request": 4.0,
        }
    )
    return real_report.build(bench, arms, [("concurrency", 4.0)], mix)


def test_an_arm_that_changes_answers_beyond_the_single_instance_rate_is_flagged():
    level = ("concurrency", 4.0)
    result = _result(
        {
            "a": [_block(level, 0, 2.0, 10), _block(level, 1, 2.2, 10)],
            "b": [_block(level, 0, 3.0, 4), _block(level, 1, 3.1, 5)],
            real.SINGLE: [_block(level, 0, 5.0, 10), _block(level, 1, 5.0, 9)],
        }
    )
    rows = {r["arm"]: r for r in result["rows"]}
    assert rows["a"]["flag"] == "" and rows[real.SINGLE]["flag"] == ""
    assert "answers differ" in rows["b"]["flag"]
    assert result["flagged"] and "FLAGGED" in result["table_md"]
    assert rows["b"]["vs_first"]["req_per_s"] == pytest.approx(3.05 / 2.1)
    assert rows["b"]["vs_first"]["req_per_s_ranges_separate"] is True


def test_lost_answers_are_flagged_and_overlapping_ranges_are_said_to_overlap():
    level = ("concurrency", 4.0)
    result = _result(
        {
            "a": [_block(level, 0, 2.0, 10), _block(level, 1, 3.0, 10)],
            "b": [_block(level, 0, 2.5, 9, failed=1), _block(level, 1, 2.6, 10)],
        }
    )
    rows = {r["arm"]: r for r in result["rows"]}
    assert "1 request(s) without an answer" in rows["b"]["flag"]
    assert rows["b"]["vs_first"]["req_per_s_ranges_separate"] is False


def test_a_local_url_is_traced_to_the_process_listening_on_it():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert engines.listening_pid(f"http://127.0.0.1:{port}") == os.getpid()
    assert engines.listening_pid(f"http://127.0.0.1:{port}") is None
    assert engines.listening_pid("http://encoder-0.encoders.svc:8000") is None


def _screens(body: dict) -> list[str]:
    return [p["image_url"]["url"] for m in body["messages"] if isinstance(m["content"], list) for p in m["content"][1:]]


def test_agent_sessions_of_a_fixed_length_share_a_preamble_and_a_few_first_screens():
    spec = AgentSpec(seed=5, conversations=12, steps=10, preamble_chars=1500, shared_screens=4)
    mix = generate_agent_sessions(spec)
    assert [len(turns) for turns in mix.conversations] == [10] * 12
    firsts, preambles = set(), set()
    for turns in mix.conversations:
        bodies = [orjson.loads(b) for b in turns]
        system = bodies[0]["messages"][0]
        assert system["role"] == "system" and len(system["content"]) == 1500
        assert all(b["messages"][0] == system for b in bodies)
        preambles.add(system["content"])
        firsts.add(_screens(bodies[0])[0])
        later = [s for s in _screens(bodies[-1])[1:]]
        assert len(set(later)) == 9 and not set(later) & firsts
        assert all(b["max_tokens"] == 16 for b in bodies)
    assert len(preambles) == 1
    # Every session's first screen is one of the four shared ones, and 12 sessions use more than one.
    assert 1 < len(firsts) <= 4
    other_seed = generate_agent_sessions(AgentSpec(seed=6, conversations=2, steps=2, shared_screens=4))
    assert not {_screens(orjson.loads(t[0]))[0] for t in other_seed.conversations} & firsts


def test_agent_sessions_without_the_new_fields_are_the_bodies_they_always_were():
    plain = generate_agent_sessions(AgentSpec(seed=5, conversations=3))
    explicit = generate_agent_sessions(AgentSpec(seed=5, conversations=3, steps=None, preamble_chars=0))
    assert plain.conversations == explicit.conversations
    assert orjson.loads(plain.conversations[0][0])["messages"][0]["content"] == AGENT_SYSTEM


def test_the_preamble_is_the_system_prompt_and_tool_definitions_cut_to_length():
    text = agent_preamble(1500)
    assert len(text) == 1500 and text.startswith(AGENT_SYSTEM) and "click_0(x: int, y: int)" in text
    assert agent_preamble(10) == AGENT_SYSTEM


def test_the_agent_flags_reach_the_workload_and_the_stack():
    options = RealBenchOptions(
        stack=True, workload="agent", steps=10, preamble_chars=1500, shared_screens=4, kv_blocks=256
    )
    assert (options.steps, options.preamble_chars, options.shared_screens, options.kv_blocks) == (10, 1500, 4, 256)
    defaults = RealBenchOptions(stack=True)
    assert (defaults.kv_blocks, defaults.max_model_len, defaults.restart_after) == (2048, 2048, None)

"""The fleet simulation of the KV index at a tiny scale: its accounting agrees with the PDs' own
pools, placement follows a session to the PD that kept its prefix, and the report is written."""

from __future__ import annotations

import json

from epd_proxy_tools.bench import kv_sim

TINY = kv_sim.Settings(
    pds=3, sessions=24, blocks_per_pd=160, requests=200, warmup=60, shared_first_screenshots=0, in_flight_per_pd=0
)


def test_the_index_holds_what_the_pools_hold_and_never_more_than_a_cache():
    result, fleet = kv_sim.simulate(TINY)
    assert result.decisions == TINY.requests
    assert result.removed_blocks > 0, "the caches are small enough that sessions are evicted"
    for feed, pool in zip(fleet.feeds, fleet.pools):
        held = fleet.index.size(feed.engine)
        # The index never claims more than the engine holds (a block cached twice is one entry).
        assert 0 < held <= len(pool._holders) <= TINY.blocks_per_pd
        assert held >= 0.9 * len(pool._holders)
    assert result.index_blocks == sum(result.per_pd_blocks) == fleet.index.blocks
    assert result.index_evictions == 0
    assert result.stored_blocks >= result.stored_batches > 0
    assert result.images >= result.decisions
    assert 0 < result.bytes_per_block < 2000


def test_a_session_goes_back_to_the_pd_that_kept_its_prefix():
    result, _ = kv_sim.simulate(TINY)
    assert 0 < result.prefix_kept < result.decisions
    # No load and no shared screenshot: the index sends every such step back where it ran.
    assert result.prefix_followed == result.prefix_kept
    # Most by the index; the rest by where the last step ran (an image whose last block no
    # later block follows yet is not counted as held by the index).
    assert result.placed_by_index > result.prefix_kept / 2
    assert result.cached_tokens > 0


def test_the_walk_of_the_index_agrees_with_what_its_code_allocated():
    result, _ = kv_sim.simulate(kv_sim.Settings(**{**TINY.__dict__, "tracemalloc": True, "requests": 60}))
    assert result.traced_bytes is not None
    assert 0.7 < result.traced_bytes / result.index_bytes < 1.3


def test_the_command_prints_a_row_per_run_and_writes_the_figures(tmp_path, capsys):
    out = tmp_path / "sim.json"
    argv = ["--pds", "2,3", "--sessions", "12", "--blocks-per-pd", "120", "--requests", "40", "--warmup", "20"]
    assert kv_sim.main([*argv, "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["PDs", "sessions"]
    assert [line.split()[:2] for line in lines[1:3]] == [["2", "12"], ["3", "12"]]
    runs = json.loads(out.read_text())
    assert [(run["pds"], run["decisions"]) for run in runs] == [(2, 40), (3, 40)]
    assert all(run["us_per_decision"] > 0 and run["us_per_stored_block"] > 0 for run in runs)

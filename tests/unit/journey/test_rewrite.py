from __future__ import annotations

import copy

from epd_proxy.journey.extract import ReadOptions, normalise_request
from epd_proxy.journey.match import ItemMatch, Matches
from epd_proxy.journey.prefill import prefill_request
from epd_proxy.journey.rewrite import flatten_metadata, rewrite_request
from tests.media import audio, chat, image, video


def matched(items, metadata_by_index, handles=None):
    matches = Matches()
    for i, md in metadata_by_index.items():
        matches.items[i] = ItemMatch(md, f"h{i}", f"t{i}")
    matches.handles.update(handles or {})
    return matches


def test_flatten_one_level_per_key():
    assert flatten_metadata({"image_grid_thw": [[1, 2, 2]], "n": [3], "s": 5}) == {
        "image_grid_thw": [1, 2, 2],
        "n": [3],
        "s": 5,
    }


def test_matched_items_become_embeds_references_and_input_is_untouched():
    body = chat(image("A"), image("B"), seed=7, mm_processor_kwargs={"size": {"shortest_edge": 10}})
    body["messages"].insert(0, {"role": "system", "content": "be brief"})
    before = copy.deepcopy(body)
    items = normalise_request(body).items
    out = rewrite_request(body, items, matched(items, {0: {"image_grid_thw": [[1, 4, 6]]}}, {"h0": {"x": 1}}))
    assert body == before
    content = out["messages"][1]["content"]
    assert content[0] == {"type": "text", "text": "What is shown?"}
    # B has no metadata: raw media, with the uuid so the consumer finds what the encoder stored;
    # and A stays raw too, as vLLM refuses raw images mixed with image embeddings
    assert content[1] == {**image("A"), "uuid": items[0].uuid}
    assert content[2] == {**image("B"), "uuid": items[1].uuid}
    assert out["messages"][0] is body["messages"][0]
    both = rewrite_request(body, items, matched(items, {0: {"image_grid_thw": [[1, 4, 6]]}, 1: {"g": [2]}}))
    assert both["messages"][1]["content"][1] == {
        "type": "image_embeds",
        "image_embeds": {"image_grid_thw": [1, 4, 6]},
        "uuid": items[0].uuid,
    }
    assert out["ec_transfer_params"] == {"h0": {"x": 1}, "ec_items": [{"mm_hash": "h0", "transfer_id": "t0"}]}
    assert out["seed"] == 7 and out["mm_processor_kwargs"] == body["mm_processor_kwargs"]


def test_audio_requests_reference_all_or_nothing():
    body = chat(image("A"), audio("s"))
    items = normalise_request(body).items
    out = rewrite_request(body, items, matched(items, {0: {"image_grid_thw": [[1, 2, 2]]}, 1: {}}))
    content = out["messages"][0]["content"]
    assert [p["type"] for p in content[1:]] == ["image_url", "audio_url"]
    assert all(p["uuid"] == i.uuid for p, i in zip(content[1:], items))
    both = rewrite_request(
        body, items, matched(items, {0: {"image_grid_thw": [[1, 2, 2]]}, 1: {"audio_num_tokens": [9]}})
    )
    assert [p["type"] for p in both["messages"][0]["content"][1:]] == ["image_embeds", "audio_embeds"]


def test_client_transfer_params_are_kept_under_ours_when_trusted():
    body = chat(image("A"), ec_transfer_params={"client": 1})
    items = normalise_request(body, ReadOptions(trust_client_fields=True)).items
    out = rewrite_request(body, items, matched(items, {0: {"g": [1]}}))
    assert out["ec_transfer_params"]["client"] == 1 and out["ec_transfer_params"]["ec_items"]


def test_no_rewrite_keeps_media_and_attaches_handles():
    body = chat(image("A"))
    items = normalise_request(body).items
    matches = matched(items, {0: {"g": [1]}}, {"h0": {"metadata": {"g": [1]}}})
    out = rewrite_request(body, items, matches, rewrite=False)
    assert out["messages"] is body["messages"]
    assert out["ec_transfer_params"] == {"h0": {"metadata": {"g": [1]}}}
    pushed = rewrite_request(body, items, matches, rewrite=False, push_mode=True)
    assert pushed["ec_transfer_params"]["ec_items"] == [{"mm_hash": "h0", "transfer_id": "t0"}]


def test_text_only_is_passed_through():
    body = chat()
    out = rewrite_request(body, [], Matches())
    assert out == body and "ec_transfer_params" not in out


def test_prefill_runs_one_token_without_streaming():
    prepared = chat(stream=True, stream_options={"include_usage": True}, max_completion_tokens=50)
    body = prefill_request(prepared)
    assert body["max_tokens"] == 1 and body["max_completion_tokens"] == 1 and body["stream"] is False
    assert "stream_options" not in body
    assert body["kv_transfer_params"]["do_remote_decode"] is True
    assert prepared["stream"] is True and "kv_transfer_params" not in prepared


def test_ec_items_stay_aligned_with_item_occurrences_when_an_item_has_no_metadata():
    # B, before the repeated A, has no entry: a consumer resolving ec_items by position must
    # still find each A under its own transfer id (Mooncake matches ec_items[i] to feature i).
    normalised = normalise_request(chat(image("A"), image("B"), image("A")))
    body, items = normalised.body, normalised.items
    matches = Matches()
    matches.items[0] = ItemMatch({"image_grid_thw": [[1, 2, 2]]}, "hA", "t0")
    matches.items[1] = ItemMatch({}, None, "t1")
    matches.items[2] = ItemMatch({"image_grid_thw": [[1, 2, 2]]}, "hA", "t2")
    out = rewrite_request(body, items, matches, push_mode=True)
    assert [i["transfer_id"] for i in out["ec_transfer_params"]["ec_items"]] == ["t0", "t1", "t2"]
    assert out["messages"][0]["content"][2] == {**image("B"), "uuid": items[1].uuid}
    assert out["messages"][0]["content"][1] == {**image("A"), "uuid": items[0].uuid}


def test_one_item_without_metadata_keeps_only_its_own_modality_raw():
    # vLLM answers 400 to raw media and embeddings of one modality in one request; another
    # modality is unaffected (without audio in the request).
    normalised = normalise_request(chat(image("A"), video("v"), video("w")))
    body, items = normalised.body, normalised.items
    out = rewrite_request(
        body, items, matched(items, {0: {"image_grid_thw": [[1, 2, 2]]}, 1: {"video_grid_thw": [[2, 2, 2]]}, 2: {}})
    )
    assert [p["type"] for p in out["messages"][0]["content"][1:]] == ["image_embeds", "video_url", "video_url"]
    assert all(p["uuid"] == i.uuid for p, i in zip(out["messages"][0]["content"][1:], items))


def test_prefill_drops_what_contradicts_a_single_token():
    body = chat(image("A"), min_tokens=5, n=3, best_of=4, use_beam_search=True, stop=["x"], max_completion_tokens=9)
    out = prefill_request(body)
    assert (out["max_tokens"], out["max_completion_tokens"], out["n"]) == (1, 1, 1)
    assert not {"min_tokens", "best_of", "use_beam_search"} & out.keys()
    assert out["stop"] == ["x"] and body["min_tokens"] == 5

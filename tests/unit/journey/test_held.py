"""What this process takes the fleet to hold (held.py): the names, the record, and its bounds."""

from __future__ import annotations

from epd_proxy.fleet.kv_names import media_key
from epd_proxy.journey.extract import normalise_request
from epd_proxy.journey.held import INDEX_CATCH_UP_S, HeldMedia, decide_held, index_uuids, media_names
from epd_proxy.journey.messages_api import normalise_messages
from tests.media import agent_messages, audio, chat, image

PD, PD2 = "http://pd", "http://pd2"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def named(body: dict) -> tuple[list, dict[int, str]]:
    items = normalise_request(body).items
    names = media_names(body, items)
    assert names is not None
    return items, names


def test_a_name_is_the_content_under_the_options_vllm_folds_into_its_identifier():
    _, plain = named(chat(image("a")))
    assert named(chat(image("a"), text="another question"))[1] == plain
    for options in ({"mm_processor_kwargs": {"size": 2}}, {"media_io_kwargs": {"image": {"x": 1}}}, {"model": "m2"}):
        assert named(chat(image("a"), **options))[1] != plain
    assert named(chat(image("b")))[1] != plain


def test_a_client_uuid_changes_no_name():
    forged = {**image("b"), "uuid": normalise_request(chat(image("a"))).items[0].uuid}
    assert named(chat(forged))[1] == named(chat(image("b")))[1]


def test_an_item_the_consumer_names_by_its_content_has_a_name_of_its_own():
    body = agent_messages("a")
    (item,) = normalise_messages(body).items
    (chat_item,) = normalise_request(chat(image("a"))).items
    assert item.uuid == chat_item.uuid and not item.named
    assert media_names(body, [item]) != media_names(chat(image("a")), [chat_item])


def test_options_that_cannot_be_written_give_no_names():
    deep: dict = {}
    for _ in range(300):
        deep = {"x": deep}
    body = chat(image("a"), mm_processor_kwargs=deep)
    assert media_names(body, normalise_request(chat(image("a"))).items) is None


def test_an_encoded_image_is_held_for_every_consumer_a_sent_one_for_its_own():
    items, names = named(chat(image("a"), image("b"), audio("c")))
    held = HeldMedia()
    assert held.held(items, names, PD).held == frozenset()
    held.encoded([names[0], names[2]])
    held.sent(PD2, [names[1]])
    # Audio is encoded again: its decode on the consumer costs what a repeat encode does.
    assert held.held(items, names, PD).held == {0} and held.held(items, names, PD2).held == {0, 1}


def test_the_record_is_bounded_and_forgets_what_it_has_not_seen_again():
    items, names = named(chat(image("a"), image("b"), image("c")))
    clock = Clock()
    held = HeldMedia(capacity=2, ttl_s=100.0, clock=clock)
    held.encoded(names.values())  # three into two places: the oldest goes
    assert held.held(items, names, PD).held == {1, 2}
    clock.now = 60.0
    held.encoded([names[2]])  # seen again: its time starts over
    clock.now = 120.0
    assert held.held(items, names, PD).held == {2}


def test_the_consumers_kv_index_decides_where_it_is_fresh_and_the_record_where_it_is_not():
    # 0 encoded, 1 sent only, 2 never seen, 3 sent only; the index: 0 gone, 1 gone, 2 held, 3 silent.
    holding = decide_held(range(4), encoded={0}, sent={1, 3}, depth={0: 0, 1: 0, 2: 5, 3: None})
    # Seen encoded stays held (the EC store has it); inside a held prefix is held though never
    # seen; sent only and gone from the consumer is encoded again; where the index cannot say,
    # the record decides.
    assert holding.held == {0, 2, 3}
    assert (holding.by_index, holding.by_record, holding.lost) == (1, 2, 1)
    # Without the index the record alone decides, as before.
    assert decide_held(range(4), encoded={0}, sent={1, 3}, depth={}).held == {0, 1, 3}


def test_the_record_feeds_the_rule_and_only_images_are_held():
    items, names = named(chat(image("a"), image("b"), audio("c")))
    clock = Clock()
    held = HeldMedia(clock=clock)
    held.sent(PD, [names[1]])
    holding = held.held(items, names, PD, {0: 3, 1: 0, 2: 4}, heard_at=clock.now + INDEX_CATCH_UP_S)
    assert holding.held == {0} and holding.lost == 1


def test_only_images_named_by_the_proxys_uuid_are_asked_of_the_index():
    body = chat(image("a"), audio("c"))
    items = normalise_request(body).items
    assert index_uuids(body, items) == {0: items[0].uuid}
    # vLLM folds processing options into the identifier: the uuid no longer names the blocks.
    assert index_uuids({**body, "mm_processor_kwargs": {"size": 1}}, items) == {}
    (anthropic,) = normalise_messages(agent_messages("a")).items
    assert index_uuids(agent_messages("a"), [anthropic]) == {}


def test_the_images_of_a_request_naming_a_lora_adapter_are_asked_for_in_its_blocks():
    body = {**chat(image("a")), "model": "ada"}
    items = normalise_request(body).items
    adapters = {"ada"}

    def adapter_for(model: object) -> str | None:
        return model if isinstance(model, str) and model in adapters else None

    assert index_uuids(body, items, adapter_for) == {0: media_key(items[0].uuid, "ada")}
    assert index_uuids({**body, "model": "base"}, items, adapter_for) == {0: items[0].uuid}


def test_an_index_that_has_not_caught_up_with_a_send_does_not_overrule_it():
    # The next turn often comes before the consumer's events for this one: "not held" then only
    # means "not heard yet" (real vLLM, a conversation whose PD encoded each turn's image itself).
    items, names = named(chat(image("a")))
    clock = Clock()
    held = HeldMedia(clock=clock)
    clock.now = 10.0
    held.sent(PD, [names[0]])
    # Heard before the send, or too soon after it to vouch for it.
    for too_soon in (None, 9.0, 10.0, 10.0 + INDEX_CATCH_UP_S / 2):
        assert held.held(items, names, PD, {0: 0}, heard_at=too_soon).held == {0}
    holding = held.held(items, names, PD, {0: 0}, heard_at=10.0 + INDEX_CATCH_UP_S)
    assert holding.held == frozenset() and holding.lost == 1

"""What this process takes the fleet to hold (held.py): the names, the record, and its bounds."""

from __future__ import annotations

from epd_proxy.journey.extract import normalise_request
from epd_proxy.journey.held import HeldMedia, media_names
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
    assert held.held(items, names, PD) == frozenset()
    held.encoded([names[0], names[2]])
    held.sent(PD2, [names[1]])
    # Audio is encoded again: its decode on the consumer costs what a repeat encode does.
    assert held.held(items, names, PD) == {0} and held.held(items, names, PD2) == {0, 1}


def test_the_record_is_bounded_and_forgets_what_it_has_not_seen_again():
    items, names = named(chat(image("a"), image("b"), image("c")))
    clock = Clock()
    held = HeldMedia(capacity=2, ttl_s=100.0, clock=clock)
    held.encoded(names.values())  # three into two places: the oldest goes
    assert held.held(items, names, PD) == {1, 2}
    clock.now = 60.0
    held.encoded([names[2]])  # seen again: its time starts over
    clock.now = 120.0
    assert held.held(items, names, PD) == {2}

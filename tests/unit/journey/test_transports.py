from epd_proxy.fleet.backends import DECODE, ENCODE, PREFILL, PREFILL_DECODE, Instance
from epd_proxy.journey.transports import PUSH, STORE, transport, view


def test_a_consumer_named_by_a_control_address_is_pushed_to_and_gets_no_reuse_or_raw_media():
    assert transport(Instance("http://pd", PREFILL_DECODE, zmq_addrs=("tcp://pd:1",))) == PUSH
    assert transport(Instance("http://p", PREFILL, zmq_addrs=("tcp://p:1",))) == PUSH
    assert transport(Instance("http://pd", PREFILL_DECODE)) == STORE
    pushed = view(Instance("http://pd", PREFILL_DECODE, zmq_addrs=("tcp://pd:1",)))
    assert pushed is not None and not pushed["reuse"] and not pushed["consumer_encodes"]


def test_instances_that_receive_no_encoder_output_have_no_transport():
    assert transport(Instance("http://e", ENCODE)) is None
    assert view(Instance("http://d", DECODE, zmq_addrs=())) is None

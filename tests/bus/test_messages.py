"""Wire-format guards for bus/messages.py: round trips, golden bytes, and the channel-union contract."""

from __future__ import annotations

import types
from typing import Any

import msgspec
import pagebus.bus.messages as m
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pagebus.bus.codec import Codec, check_channel_union, union_members

CHANNELS: dict[str, Any] = {
    "ToScheduler": m.ToScheduler,
    "FromScheduler": m.FromScheduler,
    "ToWorker": m.ToWorker,
    "FromWorker": m.FromWorker,
    "Handshake": m.Handshake,
    "ToTokenizer": m.ToTokenizer,
    "FromTokenizer": m.FromTokenizer,
}
# The messages that deliberately travel on several channels (the "exactly one union" rule's
# exceptions): Shutdown stops every process kind, an abort enters at the tokenizer pool and is
# forwarded to the scheduler, and EngineDead is relayed from the scheduler to the frontend.
SHARED = {
    m.Shutdown: {"ToScheduler", "ToWorker", "ToTokenizer"},
    m.AbortRequest: {"ToScheduler", "ToTokenizer"},
    m.EngineDead: {"FromScheduler", "FromTokenizer"},
}

PARAMS = m.SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[2], seed=7)
LP = m.TokenLogprobs(token_id=5, logprob=-0.5, rank=1, top_token_ids=[5, 6], top_logprobs=[-0.5, -1.5])

# One representative value per tagged message; the golden bytes below are their encodings.
SAMPLES: dict[type, Any] = {
    m.AddRequest: m.AddRequest(request_id="r1", prompt_token_ids=[1, 2, 3], params=PARAMS, arrival_time=1.5),
    m.AbortRequest: m.AbortRequest(request_ids=["r1", "r2"], samples=[m.SampleKey("r#3", 1)]),
    m.Shutdown: m.Shutdown(drain=False),
    m.ExecuteBatch: m.ExecuteBatch(
        step_id=3,
        new_seqs=[m.NewSeq("s1", [1, 2, 3], 3, PARAMS, [0, 1], 0, 3, 0)],
        cached_seqs=[m.CachedSeq("s0", [4], 17, 1)],
        finished_seq_ids=["s9"],
    ),
    m.BatchResult: m.BatchResult(step_id=3, seq_ids=["s1", "s0"], token_ids=[42, 43], logprobs=[LP, None]),
    m.StepOutput: m.StepOutput(
        updates=[m.SeqUpdate("r1", 0, [42], m.FinishReason.STOP, 2, [], 3, 0, None)],
        stats=m.SchedulerStats(num_running=1, kv_usage=0.25),
    ),
    m.Hello: m.Hello(version=1, role="worker", rank=0, pid=1234),
    m.Ready: m.Ready(
        role="scheduler",
        rank=0,
        model=m.ModelFacts(
            num_kv_blocks=512,
            max_model_len=2048,
            vocab_size=49152,
            eos_token_id=None,
            dtype="bfloat16",
            device="cpu",
            num_threads=2,
        ),
        worker_pids=[4321],
    ),
    m.StartupFailed: m.StartupFailed(role="worker", rank=1, reason="worker-1 failed during start-up: OOM"),
    m.EngineDead: m.EngineDead(reason="worker-0 died"),
    m.WorkerFailed: m.WorkerFailed(rank=1, reason="CUDA OOM"),
    m.GenerateRequest: m.GenerateRequest(
        request_id="g1", params=PARAMS, messages=[m.ChatMessage(role="user", content="hi")], echo=True
    ),
    m.TokenizeRequest: m.TokenizeRequest(request_id="t1", prompt="hello", add_special_tokens=False),
    m.DetokenizeRequest: m.DetokenizeRequest(request_id="d1", token_ids=[1, 2]),
    m.DeltaBatch: m.DeltaBatch(
        deltas=[
            m.RequestDelta(
                "r1", [m.SampleDelta(0, "hi", [42], [LP], m.FinishReason.STOP, "\n")], True, 3, 1, [1, 2, 3]
            )
        ],
        stats=m.SchedulerStats(num_steps=2),
    ),
    m.TokenizeResult: m.TokenizeResult(request_id="t1", token_ids=[7, 8]),
}

# Encoded with bus.codec at PROTOCOL_VERSION 1, at 2 for AbortRequest, Ready and StartupFailed, and at 3
# for ExecuteBatch, BatchResult, StepOutput and DeltaBatch (speculative decoding's fields: the messages
# each version changed), and at 5 for ExecuteBatch (CachedSeq.new_token_ids). Never regenerate these
# to make a test pass.
GOLDEN: dict[type, str] = {
    m.AddRequest: "87a174a3616464aa726571756573745f6964a27231b070726f6d70745f746f6b656e5f69647393010203a6706172616d73de0004aa6d61785f746f6b656e7308ab74656d7065726174757265cb0000000000000000a47365656407ae73746f705f746f6b656e5f6964739102ac6172726976616c5f74696d65cb3ff8000000000000a87072696f7269747900aa63616368655f73616c74c0",
    m.AbortRequest: "83a174a561626f7274ab726571756573745f69647392a27231a27232a773616d706c65739192a372233301",
    m.Shutdown: "82a174a873687574646f776ea5647261696ec2",
    m.ExecuteBatch: "95a465786563039198a273319301020303de0004aa6d61785f746f6b656e7308ab74656d7065726174757265cb0000000000000000a47365656407ae73746f705f746f6b656e5f69647391029200010003009197a273309104110190ff9091a27339",
    m.BatchResult: "96a6726573756c740392a27331a27330922a2b929505cbbfe00000000000000192050692cbbfe0000000000000cbbff8000000000000c090",
    m.StepOutput: "93a4737465709199a2723100912aa473746f7002900300c08eab6e756d5f72756e6e696e6701ab6e756d5f77616974696e6700a86b765f7573616765cb3fd0000000000000af6e756d5f667265655f626c6f636b7300b06e756d5f746f74616c5f626c6f636b7300b47072656669785f63616368655f7175657269657300b17072656669785f63616368655f6869747300af6e756d5f707265656d7074696f6e7300a96e756d5f737465707300af737065635f6e756d5f64726166747300b5737065635f6e756d5f64726166745f746f6b656e7300b8737065635f6e756d5f61636365707465645f746f6b656e7300b9737065635f647261667465645f7065725f706f736974696f6e90ba737065635f61636365707465645f7065725f706f736974696f6e90",
    m.Hello: "85a174a568656c6c6fa776657273696f6e01a4726f6c65a6776f726b6572a472616e6b00a3706964cd04d2",
    m.Ready: "85a174a57265616479a4726f6c65a97363686564756c6572a472616e6b00a56d6f64656c88ad6e756d5f6b765f626c6f636b73cd0200ad6d61785f6d6f64656c5f6c656ecd0800aa766f6361625f73697a65cdc000ac656f735f746f6b656e5f6964c0a56474797065a862666c6f61743136a6646576696365a3637075ab6e756d5f7468726561647302ae737461727475705f70686173657380ab776f726b65725f7069647391cd10e1",
    m.StartupFailed: "84a174a5736661696ca4726f6c65a6776f726b6572a472616e6b01a6726561736f6ed924776f726b65722d31206661696c656420647572696e672073746172742d75703a204f4f4d",
    m.EngineDead: "82a174a464656164a6726561736f6ead776f726b65722d302064696564",
    m.WorkerFailed: "83a174a5776661696ca472616e6b01a6726561736f6ea843554441204f4f4d",
    m.GenerateRequest: "8da174a367656eaa726571756573745f6964a26731a6706172616d73de0004aa6d61785f746f6b656e7308ab74656d7065726174757265cb0000000000000000a47365656407ae73746f705f746f6b656e5f6964739102a670726f6d7074c0b070726f6d70745f746f6b656e5f696473c0a86d657373616765739182a4726f6c65a475736572a7636f6e74656e74a26869b56164645f67656e65726174696f6e5f70726f6d7074c3a87072696f7269747900aa63616368655f73616c74c0ac6172726976616c5f74696d65cb0000000000000000a46563686fc3a5746f6f6c73c0aa66696e616c5f6f6e6c79c2",
    m.TokenizeRequest: "86a174a3746f6baa726571756573745f6964a27431a670726f6d7074a568656c6c6fa86d65737361676573c0b26164645f7370656369616c5f746f6b656e73c2b56164645f67656e65726174696f6e5f70726f6d7074c3",
    m.DetokenizeRequest: "83a174a56465746f6baa726571756573745f6964a26431a9746f6b656e5f696473920102",
    m.DeltaBatch: "93a664656c7461739199a27231919600a26869912a919505cbbfe00000000000000192050692cbbfe0000000000000cbbff8000000000000a473746f70a10ac3030193010203c0c0c08eab6e756d5f72756e6e696e6700ab6e756d5f77616974696e6700a86b765f7573616765cb0000000000000000af6e756d5f667265655f626c6f636b7300b06e756d5f746f74616c5f626c6f636b7300b47072656669785f63616368655f7175657269657300b17072656669785f63616368655f6869747300af6e756d5f707265656d7074696f6e7300a96e756d5f737465707302af737065635f6e756d5f64726166747300b5737065635f6e756d5f64726166745f746f6b656e7300b8737065635f6e756d5f61636365707465645f746f6b656e7300b9737065635f647261667465645f7065725f706f736974696f6e90ba737065635f61636365707465645f7065725f706f736974696f6e90",
    m.TokenizeResult: "85a174a6746f6b726573aa726571756573745f6964a27431a9746f6b656e5f696473920708a474657874c0a56572726f72c0",
}


def _tagged_structs() -> list[type]:
    return [
        v
        for v in vars(m).values()
        if isinstance(v, type)
        and issubclass(v, msgspec.Struct)
        and v.__module__ == m.__name__
        and v.__struct_config__.tag is not None
    ]


def _channels_of(tp: type) -> set[str]:
    return {name for name, u in CHANNELS.items() if tp in union_members(u)}


def test_channel_unions_are_the_module_unions() -> None:
    unions = {k for k, v in vars(m).items() if isinstance(v, types.UnionType)}
    assert unions == set(CHANNELS)


@pytest.mark.parametrize("name", sorted(CHANNELS))
def test_every_union_member_has_an_explicit_unique_tag(name: str) -> None:
    check_channel_union(CHANNELS[name])


def test_every_tagged_struct_is_in_exactly_one_channel() -> None:
    for tp in _tagged_structs():
        homes = _channels_of(tp)
        if tp in SHARED:
            assert homes == SHARED[tp]
        else:
            assert len(homes) == 1, f"{tp.__name__} is in {sorted(homes) or 'no channel'}"


def test_untagged_structs_are_in_no_channel() -> None:
    members = {t for u in CHANNELS.values() for t in union_members(u)}
    untagged = [
        v
        for v in vars(m).values()
        if isinstance(v, type) and issubclass(v, msgspec.Struct) and v.__struct_config__.tag is None
    ]
    assert untagged and not members & set(untagged)


def test_tags_are_unique_across_the_module() -> None:
    tags = [tp.__struct_config__.tag for tp in _tagged_structs()]
    assert len(tags) == len(set(tags))


def test_samples_cover_every_tagged_struct() -> None:
    assert set(SAMPLES) == set(_tagged_structs()) == set(GOLDEN)


@pytest.mark.parametrize("tp", list(SAMPLES), ids=lambda t: t.__name__)
def test_round_trip_through_its_channel(tp: type) -> None:
    codec = Codec()
    frames = codec.encode(SAMPLES[tp])
    assert len(frames) == 1
    for name in _channels_of(tp):
        assert codec.decode(frames, CHANNELS[name]) == SAMPLES[tp]


@pytest.mark.parametrize("tp", list(SAMPLES), ids=lambda t: t.__name__)
def test_golden_bytes(tp: type) -> None:
    # A failure here means the wire changed: append fields with defaults, or bump PROTOCOL_VERSION.
    assert Codec().encode(SAMPLES[tp])[0].hex() == GOLDEN[tp]


@given(
    step=st.integers(0, 2**40),
    tokens=st.lists(st.integers(0, 2**31 - 1), max_size=300),
    blocks=st.lists(st.integers(0, 2**20), max_size=20),
)
def test_execute_batch_round_trips(step: int, tokens: list[int], blocks: list[int]) -> None:
    msg = m.ExecuteBatch(
        step_id=step,
        new_seqs=[m.NewSeq("s", tokens, len(tokens), PARAMS, blocks, 0, len(tokens))],
        cached_seqs=[m.CachedSeq("c", blocks, step, 1)],
        finished_seq_ids=[],
    )
    codec = Codec()
    assert codec.decode(codec.encode(msg), m.ToWorker) == msg

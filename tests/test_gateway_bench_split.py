"""bench.gateway's split of a round's gateway CPU into a cost per request and a cost per later token."""

from bench.gateway import Rounds, _split_cpu


def test_a_round_splits_into_the_1_token_streams_cost_and_each_later_tokens():
    # 10 streams of 5 tokens took 10 * (1 ms + 4 * 20 us); 10 streams of 1 token took 10 * 1 ms.
    r = Rounds(cpu=10 * (1e-3 + 4 * 20e-6), tokens=50, short_cpu=10e-3, short_streams=10)
    split = _split_cpu(r, streams=10, tokens=5)
    assert abs(split["gateway_cpu_ms_per_stream_request"] - 1.0) < 1e-9
    assert abs(split["gateway_cpu_us_per_later_token"] - 20.0) < 1e-6


def test_no_split_without_1_token_rounds_or_with_1_token_streams():
    assert _split_cpu(Rounds(cpu=1.0, tokens=10), streams=10, tokens=1) == {}
    assert _split_cpu(Rounds(cpu=1.0, tokens=20), streams=10, tokens=2) == {}

"""The trace readers (engine/tools/trace_readers.py): the shipped samples, every kind of bad line
(one error naming the file and the line), Mooncake's shared hash ids as shared token prefixes,
scaling and caps reported, and `python -m engine simulate --trace-file` at full scale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.tools.trace_readers import (
    TraceError,
    describe,
    detect_format,
    parse_timestamp,
    read_azure,
    read_mooncake,
    read_trace,
)

DATA = Path(__file__).resolve().parent / "data"
MOONCAKE = DATA / "mooncake_sample.jsonl"
AZURE = DATA / "azure_sample.csv"
VOCAB = 49152
SPECIALS = (0, 1, 2)


def test_samples_read_whole_with_lengths_and_arrivals():
    for path, fmt in ((MOONCAKE, "mooncake"), (AZURE, "azure")):
        assert detect_format(path) == fmt
        trace = read_trace(path, VOCAB, special_ids=SPECIALS)
        lines = [t for t in path.read_text().splitlines() if t.strip()]
        expected = len(lines) - (fmt == "azure")  # the CSV's header
        assert 20 <= len(trace.requests) == expected == trace.conditions["requests_in_file"]
        arrivals = [r.arrival for r in trace.requests]
        assert arrivals[0] == 0 and arrivals == sorted(arrivals)
        for r in trace.requests:
            assert r.ignore_eos and r.max_tokens == r.output_len >= 1
            assert min(r.prompt_token_ids) >= 3 and max(r.prompt_token_ids) < VOCAB
    first = json.loads(MOONCAKE.read_text().splitlines()[0])
    trace = read_mooncake(MOONCAKE, VOCAB)
    assert len(trace.requests[0].prompt_token_ids) == first["input_length"]
    assert trace.requests[0].output_len == first["output_length"]
    azure = read_azure(AZURE, VOCAB)
    t0, ctx, gen = AZURE.read_text().splitlines()[1].split(",")
    t1 = AZURE.read_text().splitlines()[2].split(",")[0]
    assert azure.requests[1].arrival == pytest.approx(parse_timestamp(t1) - parse_timestamp(t0))
    assert (len(azure.requests[0].prompt_token_ids), azure.requests[0].output_len) == (
        int(ctx),
        int(gen),
    )


def test_timestamps_datetime_and_seconds():
    assert parse_timestamp("2023-11-16 18:15:46.6805900") - parse_timestamp(
        "2023-11-16 18:15:46"
    ) == pytest.approx(0.68059)
    assert parse_timestamp(" 12.5 ") == 12.5
    assert parse_timestamp("2024-05-10 00:00:01.5+00:00") - parse_timestamp(
        "2024-05-10 02:00:00+02:00"
    ) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        parse_timestamp("yesterday")


def test_shared_hash_ids_give_equal_token_prefixes():
    """Equal hash-id prefixes → equal token prefixes, exactly as long as the shared blocks (a
    partial last block included); a different id → different tokens from there on."""
    rows = [json.loads(t) for t in MOONCAKE.read_text().splitlines()]
    trace = read_mooncake(MOONCAKE, VOCAB, special_ids=SPECIALS)
    pairs = 0
    for i in range(len(rows)):
        for j in range(i):
            a, b = rows[i]["hash_ids"], rows[j]["hash_ids"]
            shared = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            ta, tb = trace.requests[i].prompt_token_ids, trace.requests[j].prompt_token_ids
            n = min(shared * 512, len(ta), len(tb))
            assert ta[:n] == tb[:n]
            if shared < min(len(a), len(b)):
                assert ta[n : n + 512] != tb[n : n + 512]
            pairs += shared > 0
    assert pairs > 20  # the sample really shares
    again = read_mooncake(MOONCAKE, VOCAB, special_ids=SPECIALS)
    assert [r.prompt_token_ids for r in again.requests] == [
        r.prompt_token_ids for r in trace.requests
    ]  # deterministic: the same file gives the same tokens on every run


def test_scaling_and_caps_are_counted_and_described():
    whole = read_mooncake(MOONCAKE, VOCAB)
    trace = read_mooncake(
        MOONCAKE, VOCAB, time_scale=4, max_requests=10, max_input_len=300, max_output_len=40
    )
    c = trace.conditions
    assert len(trace.requests) == c["requests"] == 10 and c["requests_in_file"] == 32
    for scaled, full in zip(trace.requests, whole.requests):
        assert scaled.arrival == pytest.approx(full.arrival / 4)
        assert scaled.prompt_token_ids == full.prompt_token_ids[:300]  # a cut keeps the prefix
        assert scaled.output_len == min(full.output_len, 40)
    assert c["capped_input"] == sum(len(r.prompt_token_ids) > 300 for r in whole.requests[:10])
    assert c["capped_output"] == sum(r.output_len > 40 for r in whole.requests[:10]) > 0
    text = describe(trace)
    assert "10 of 32 requests" in text and "÷4" in text and "prompt ≤ 300" in text
    assert f"(shortened {c['capped_output']})" in text and "distinct" in text
    assert c["blocks"] == 10  # one 512-token block each: a 300-token prompt reaches no further
    context = read_azure(AZURE, VOCAB, max_total_len=512)
    assert all(len(r.prompt_token_ids) + r.output_len <= 512 for r in context.requests)
    assert context.conditions["capped_to_context"] > 0
    for bad in ({"time_scale": 0}, {"max_requests": 0}, {"max_input_len": -1}):
        with pytest.raises(ValueError):
            read_azure(AZURE, VOCAB, **bad)


GOOD_MOONCAKE = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}'
BAD_MOONCAKE = [
    ("{not json", "not JSON"),
    ('{"input_length": 600, "output_length": 5, "hash_ids": [1, 2]}', "'timestamp'"),
    ('{"timestamp": 5, "output_length": 5, "hash_ids": [1, 2]}', "'input_length'"),
    ('{"timestamp": 5, "input_length": 600, "output_length": -3, "hash_ids": [1, 2]}', "negative"),
    ('{"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": [1]}', "hash_ids"),
    ('{"timestamp": 5, "input_length": 600, "output_length": 5}', "hash_ids"),
    ('{"timestamp": -1, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}', "back"),
    ('{"timestamp": "x", "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}', "ms"),
    ('{"timestamp": 5, "input_length": 0, "output_length": 5, "hash_ids": []}', "0 tokens"),
    ("[1, 2]", "not a JSON object"),
]
GOOD_AZURE = "2023-11-16 18:15:46.6805900,120,30"
BAD_AZURE = [
    ("2023-11-16 18:15:45.0000000,120,30", "back in time"),
    ("not a time,120,30", "TIMESTAMP"),
    ("2023-11-16 18:15:47.0,-5,30", "negative"),
    ("2023-11-16 18:15:47.0,12.5,30", "not an integer"),
    ("2023-11-16 18:15:47.0,120", "columns"),
    ("2023-11-16 18:15:47.0,120,", "not an integer"),
]


@pytest.mark.parametrize("line, problem", BAD_MOONCAKE)
def test_bad_mooncake_line_names_file_line_and_problem(tmp_path, line, problem):
    path = tmp_path / "trace.jsonl"
    path.write_text(f"{GOOD_MOONCAKE}\n\n{line}\n{GOOD_MOONCAKE.replace('0,', '9,', 1)}\n")
    with pytest.raises(TraceError) as error:
        read_trace(path, VOCAB)
    assert error.value.line == 3 and problem in str(error.value)
    assert str(path) in str(error.value) and "line 3" in str(error.value)


@pytest.mark.parametrize("line, problem", BAD_AZURE)
def test_bad_azure_line_names_file_line_and_problem(tmp_path, line, problem):
    path = tmp_path / "trace.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n{GOOD_AZURE}\n{line}\n")
    with pytest.raises(TraceError) as error:
        read_trace(path, VOCAB)
    assert error.value.line == 3 and problem in str(error.value), str(error.value)


def test_bad_files(tmp_path):
    header = tmp_path / "header.csv"
    header.write_text("TIMESTAMP,ContextTokens\n1,2\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    seconds = tmp_path / "seconds.csv"
    seconds.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0.5,10,0\n2.5,10,3\n")
    binary = tmp_path / "upload.jsonl"  # e.g. a compressed file uploaded in the app
    binary.write_bytes(b'{"timestamp": 0}\n' + bytes(range(128, 256)) * 4)
    huge = tmp_path / "huge.csv"  # a field past the csv module's limit
    huge.write_text('TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,"' + "9" * 200_000 + '"\n')
    for path, problem in (
        (header, "GeneratedTokens"),
        (empty, "neither"),
        (tmp_path / "missing.csv", "no such file"),
        (binary, "not UTF-8 text"),
        (huge, "not a readable CSV"),
    ):
        with pytest.raises(TraceError, match=problem):
            read_trace(path, VOCAB)
    trace = read_trace(seconds, VOCAB)  # plain seconds; an output of 0 runs as 1, counted
    assert [r.arrival for r in trace.requests] == [0.0, 2.0]
    assert trace.conditions["output_raised_to_1"] == 1 and "outputs of 0" in describe(trace)
    with pytest.raises(ValueError, match="unknown trace format"):
        read_trace(seconds, VOCAB, "sharegpt")


def test_cli_simulate_replays_a_trace_at_full_scale(tmp_path):
    from engine.__main__ import main

    out_path = tmp_path / "result.json"
    argv = ["simulate", "--trace-file", str(MOONCAKE), "--model-preset", "llama-3.1-8b"]
    argv += ["--hardware", "h100-sxm", "--json", str(out_path)]
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(argv) == 0
    out = buffer.getvalue()
    assert "mooncake_sample.jsonl" in out and "32 of 32 requests" in out and "÷1" in out
    data = json.loads(out_path.read_text())
    assert len(data["requests"]) == 32
    assert data["conditions"]["workload"]["trace_format"] == "mooncake"
    assert (
        data["summary"]["output_tokens"]
        == read_mooncake(MOONCAKE, VOCAB).conditions["output_tokens"]
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text(GOOD_MOONCAKE + "\n{oops\n")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["simulate", "--trace-file", str(bad)]) == 1
    assert "line 2" in err.getvalue() and "not JSON" in err.getvalue()

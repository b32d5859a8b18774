"""Chapter 10 (prefix caching): the page under Streamlit's AppTest (its lab and the three small
experiments run on the tiny model and draw), and the experiment functions of ui/experiments/ch10.py
on tiny engines: hits measured by the engine equal the block arithmetic, salts isolate, LRU evicts
a prefix tail first, the output is still computed."""

from __future__ import annotations

import pytest
from _apptest import app_fixture, assert_charts

from ui.experiments import ch10
from ui.experiments.common import make_config, run_workload

PAGE = "pages/ch10_prefix_caching.py"
B = 16


# -- the experiment functions ------------------------------------------------------------------


def test_block_chain_links_each_hash_to_the_previous_one():
    ids = list(range(100, 100 + 4 * B - 1))  # one token short of four blocks
    chain = ch10.block_chain(ids, B)
    assert [link.full for link in chain] == [True, True, True, False]
    assert chain[-1].block_hash is None and chain[-1].num_tokens == B - 1
    for prev, link in zip(chain, chain[1:3]):
        assert link.parent_hash == prev.block_hash
    # one token changed in block 1: block 0 keeps its hash, every later full block changes
    changed = list(ids)
    changed[B + 3] += 1
    other = ch10.block_chain(changed, B)
    assert other[0].block_hash == chain[0].block_hash
    assert other[1].block_hash != chain[1].block_hash
    assert other[2].block_hash != chain[2].block_hash  # same tokens, different parent
    # a salt changes the first block's hash, hence all of them
    salted = ch10.block_chain(ids, B, salt="tenant-A")
    assert all(a.block_hash != b.block_hash for a, b in zip(salted[:3], chain[:3]))


def test_expected_hit_tokens_counts_whole_blocks_and_leaves_the_last_token():
    assert ch10.expected_hit_tokens(4 * B - 1, 4 * B - 1, B) == 3 * B
    assert ch10.expected_hit_tokens(4 * B, 4 * B, B) == 3 * B  # the last token is computed
    assert ch10.expected_hit_tokens(4 * B + 1, 4 * B + 1, B) == 4 * B
    assert ch10.expected_hit_tokens(100, 40, B) == 2 * B
    assert ch10.expected_hit_tokens(100, 0, B) == 0


def test_prompts_share_their_beginnings(tiny_tokenizer):
    shared = ch10.shared_prefix_prompts(tiny_tokenizer, 3)
    system = len(ch10._encode(tiny_tokenizer, ch10.SYSTEM_PROMPT, True))
    assert system >= 2 * B
    for p in shared[1:]:
        assert ch10.common_prefix_len(shared[0], p) >= system
    chat = ch10.chat_prompts(tiny_tokenizer, 4)
    for prev, cur in zip(chat, chat[1:]):
        assert len(cur) > len(prev) and cur[: len(prev)] == prev
    wl = ch10.prefix_workload(tiny_tokenizer, "chat", 3, 250.0, max_tokens=5)
    assert [s.arrival_ms for s in wl.requests] == [0.0, 250.0, 500.0]
    assert [s.name for s in wl.requests] == ["턴-1", "턴-2", "턴-3"]
    assert wl.requests[2].prompt_token_ids == chat[2]


@pytest.fixture(scope="module")
def tiny_config(tiny_model_dir):
    return make_config(
        None,
        model=str(tiny_model_dir),
        device="cpu",
        block_size=B,
        num_kv_blocks=64,
        max_model_len=512,
        max_num_batched_tokens=512,
    )


@pytest.fixture(scope="module")
def chat_comparison(tiny_config, tiny_tokenizer):
    wl = ch10.prefix_workload(tiny_tokenizer, "chat", 4, 1000.0, max_tokens=5)
    runs = {
        label: run_workload(make_config(tiny_config, enable_prefix_caching=on), wl, label)
        for label, on in ch10.CACHING_MODES.items()
    }
    return ch10.prefix_comparison(runs)


def test_chat_hits_grow_turn_by_turn_and_match_the_block_arithmetic(chat_comparison):
    t = chat_comparison.table
    hits = list(t["히트 토큰 (켬)"])
    assert hits[0] == 0 and hits == sorted(hits) and hits[-1] > hits[1] > 0
    # turns arrive one after another, so each finds every whole block of the previous prompt
    assert hits == list(t["최대 가능 히트 (계산값)"])
    assert list(t["계산한 프롬프트 토큰 (켬)"]) == list(t["프롬프트 토큰"] - t["히트 토큰 (켬)"])
    off = chat_comparison.runs["prefix caching 끔"]
    assert ch10.hit_tokens_by_request(off.records) == {r: 0 for r in t["요청"]}
    assert 0 < chat_comparison.hit_rate < 1


def test_a_hit_does_not_cache_the_output(chat_comparison):
    t = chat_comparison.table
    # decode still runs once per output token after the first, on both sides, same tokens
    assert (t["decode 스텝 (켬)"] == t["decode 스텝 (끔)"]).all()
    assert (t["decode 스텝 (켬)"] == 4).all()
    assert (t["출력 토큰 같음"] == "예").all()
    assert t["TTFT 켬 (ms)"].notna().all() and t["TTFT 끔 (ms)"].notna().all()


def test_simultaneous_requests_share_blocks(tiny_config, tiny_tokenizer):
    wl = ch10.prefix_workload(tiny_tokenizer, "shared", 3, 0.0, max_tokens=4)
    res = run_workload(tiny_config, wl, "켬")
    rec = ch10.most_shared_record(res.records)
    shared = ch10.num_shared_blocks(rec.kv)
    assert shared >= 2  # the system prompt's blocks, kept once for three requests
    assert max(b.ref_cnt for b in rec.kv.blocks) == 3
    fig = ch10.shared_grid_figure(rec.kv)
    z = [v for row in fig.data[0].z for v in row if v == v]
    assert z.count(4) == sum(1 for b in rec.kv.blocks if b.ref_cnt >= 3)  # category ref ≥3
    hits = ch10.hit_rate_figure(res.records)
    assert hits.data  # one bar trace per series even when nothing was found


def test_hash_chain_experiment_one_token_short_of_a_block(make_engine):
    r = ch10.hash_chain_experiment(make_engine, 4 * B - 1, 40, B)
    hits = {s.name: s.hit_tokens for s in r.sent}
    assert hits == r.expected
    assert list(hits.values()) == [0, 3 * B, 2 * B]
    assert all(s.decode_steps == 3 for s in r.sent)  # 4 output tokens, the first from prefill
    fig = ch10.hash_chain_figure(r.chains, B)
    colors = [shape.fillcolor for shape in fig.layout.shapes]
    assert colors[:4] == ["#9ecae1"] * 3 + ["#dddddd"]
    assert colors[4:] == ["#a1d99b", "#a1d99b", "#fc9272", "#dddddd"]


@pytest.mark.parametrize("num_blocks, resent_hits", [(6, 0), (8, 2 * B), (12, 4 * B)])
def test_lru_evicts_a_cached_prefix_tail_first(make_engine, num_blocks, resent_hits):
    r = ch10.lru_experiment(make_engine, num_blocks, B)
    assert r.resent_hit_tokens == resent_hits
    assert r.expected_full_hit == 4 * B
    assert list(r.rows["캐시에 남은 A의 꽉 찬 블록"])[:2] == [
        "4/4",
        f"{resent_hits // B}/4",
    ]
    assert len(r.snapshots) == 3
    after_b = list(r.contents.values())[1]
    kept = sorted(v for v in after_b.values() if v.startswith("A"))
    assert kept == [f"A{i}" for i in range(resent_hits // B)]  # the head of A survives
    fig = ch10.shared_grid_figure(list(r.snapshots.values())[1], labels=after_b)
    assert set(kept) <= {t for row in fig.data[0].text for t in row}


def test_salts_isolate_equal_prompts(make_engine):
    t = ch10.salt_experiment(make_engine, 80, B)
    assert list(t["히트 토큰 (측정값)"]) == [0, 0, 64, 0]
    assert list(t["히트 토큰 (측정값)"]) == list(t["같은 salt가 앞서 계산한 만큼 (계산값)"])


# -- the page ----------------------------------------------------------------------------------


app = app_fixture()  # each test opens the page itself


def test_page_lab_and_experiments_run(app):
    app.switch_page(PAGE)
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    assert any("실험실" in h.value for h in app.header)
    assert any("이 실험이 보여 줄 것" in i.value and "TTFT" in i.value for i in app.info)
    app.slider(key="ch10_n").set_value(3).run()
    app.button(key="ch10_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    result = app.session_state["ch10_result"]
    assert list(result.runs) == ["prefix caching 켬", "prefix caching 끔"]
    assert len(result.table) == 3 and result.hit_rate > 0
    assert_charts(
        app, ["ch10_hits", "ch10_shared_grid", "ch10_ttft", "ch10_on_kvgrid", "ch10_off_schedule"]
    )
    text = " ".join(m.value for m in app.markdown)
    assert "측정값" in text and "계산값" in text

    app.slider(key="ch10_chain_len").set_value(47).run()
    app.button(key="ch10_chain_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    chain = app.session_state["ch10_chain"]
    assert chain.prompt_len == 47 and chain.sent[1].hit_tokens == 32
    app.button(key="ch10_lru_run").click().run()
    app.button(key="ch10_salt_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    assert app.session_state["ch10_lru"].resent_hit_tokens == 2 * B
    assert list(app.session_state["ch10_salt"]["히트 토큰 (측정값)"]) == [0, 0, 64, 0]
    assert_charts(app, ["ch10_chain_fig", "ch10_lru_grid_0", "ch10_lru_grid_2"])
    assert sum(1 for m in app.markdown if m.value.startswith("**문제 ")) >= 3


def test_chat_scenario_runs(app):
    app.switch_page(PAGE)
    app.run()
    app.radio(key="ch10_scenario").set_value("멀티턴 대화").run()
    app.button(key="ch10_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    table = app.session_state["ch10_result"].table
    assert list(table["요청"])[:2] == ["턴-1", "턴-2"]
    assert list(table["히트 토큰 (켬)"]) == list(table["최대 가능 히트 (계산값)"])


def test_workload_specs_carry_exact_prompts_and_salts(tiny_config):
    from ui.experiments.common import RequestSpec, Workload

    ids = list(range(200, 200 + 3 * B + 5))

    def hits(salts):
        specs = [
            RequestSpec(len(ids), 3, 1000.0 * i, f"r{i}", prompt_token_ids=ids, cache_salt=s)
            for i, s in enumerate(salts)
        ]
        res = run_workload(tiny_config, Workload(specs), "켬")
        assert [r.prompt_token_ids for r in res.requests] == [ids] * len(salts)
        return [ch10.hit_tokens_by_request(res.records)[f"r{i}"] for i in range(len(salts))]

    assert hits(["t1", "t2"]) == [0, 0]
    assert hits(["t1", "t1"]) == [0, 3 * B]

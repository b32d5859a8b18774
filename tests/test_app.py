"""The Streamlit app under streamlit.testing.v1.AppTest: every chapter page opens (ready ones and
"준비 중" ones), and the lab buttons of chapters 00–03 drive the real engine (new StepRecords, new
tokens) while the three plots are present and non-empty.

Uses the real default artifact (slow-ish: the weights load once per process, each step is a real
forward pass on the CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest  # noqa: E402
from streamlit.util import calc_hash  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
APP = str(ROOT / "app.py")
TIMEOUT = 240  # torch start-up and real forward passes on a (possibly busy) CPU

from _apptest import open_tab, open_tab_of  # noqa: E402

from ui.lesson import CHAPTERS  # noqa: E402


@pytest.fixture(scope="module")
def app(default_model_dir):
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def open_chapter(at: AppTest, chapter_id: str) -> AppTest:
    ch = next(c for c in CHAPTERS if c.id == chapter_id)
    path = ch.page_file()
    if path is not None:
        at.switch_page(str(path.relative_to(ROOT)))
    else:  # a "준비 중" page is a callable st.Page: its hash is the hash of its url_path
        at._page_hash = calc_hash(ch.url_path)
    at.run()
    assert not at.exception, (chapter_id, [e.value for e in at.exception])
    return at


def chart_data(at: AppTest) -> list[list]:
    return [json.loads(c.proto.spec)["data"] for c in at.get("plotly_chart")]


def assert_lab_plots(at: AppTest, key: str) -> None:
    """The lab's three figures (journey, scheduler decisions, KV grid) plus usage are drawn with
    data, each with its tab open (only the open tab is drawn); the journey tab is left open."""
    for name in ("schedule", "kvgrid", "kvusage", "journey"):
        open_tab_of(at, f"{key}_{name}")
        ids = [c.proto.id for c in at.get("plotly_chart")]
        specs = {i: json.loads(c.proto.spec) for i, c in zip(ids, at.get("plotly_chart"))}
        match = [s for i, s in specs.items() if f"{key}_{name}" in i]
        assert match, f"plot {key}_{name} missing (ids: {ids})"
        data = match[0]["data"]
        assert data and any(trace.get("x") or trace.get("z") or trace.get("y") for trace in data), (
            name
        )


def records(at: AppTest, key: str) -> list:
    return at.session_state["_records"][key]


def engine_of(at: AppTest, key: str):
    return at.session_state["_engines"][key]["engine"]


def test_navigation_lists_every_chapter(app):
    """What the running app registered with st.navigation: a page per chapter 00-16, ready
    chapters as their files, the rest as 준비 중 pages, every URL plain ASCII."""
    from ui.lesson import PAGES

    assert sorted(PAGES) == [f"{i:02d}" for i in range(17)]
    for ch in CHAPTERS:
        page = PAGES[ch.id]
        assert ch.url_path.isascii()
        assert page.url_path == ("" if ch.id == "00" else ch.url_path)  # the default page is "/"
        ready = ch.page_file() is not None
        assert page.title == (ch.title if ready else f"{ch.title} (준비 중)")


# Every page on the real model: slow (chapters 11-12 build quantized and tensor-parallel engines of
# the 135M model). The fast tier renders every page on the tiny model in tests/test_lessons.py
# (test_every_marked_control_exists_on_its_page) and each lab page in its tests/test_app_chNN.py.
@pytest.mark.slow
@pytest.mark.parametrize("chapter_id", [c.id for c in CHAPTERS])
def test_every_page_opens(app, chapter_id):
    at = open_chapter(app, chapter_id)
    ch = next(c for c in CHAPTERS if c.id == chapter_id)
    text = (
        " ".join(m.value for m in at.markdown)
        + " ".join(t.value for t in at.title)
        + " ".join(h.value for h in at.header)
    )
    if ch.page_file() is None:
        assert any("준비 중" in i.value for i in at.info), "placeholder page shows 준비 중"
    else:
        assert f"# {chapter_id}." in text or ch.title.split("·")[-1].strip() in text


def test_ch00_lab_steps_the_engine(app):
    at = open_chapter(app, "00")
    at.button(key="main_reset").click().run()
    assert len(records(at, "main")) == 0
    at.number_input(key="main_max_tokens").set_value(6).run()
    at.button(key="main_add_preset").click().run()
    engine = engine_of(at, "main")
    assert engine.has_unfinished_requests()
    at.button(key="main_step").click().run()
    assert not at.exception, [e.value for e in at.exception]
    recs = records(at, "main")
    assert len(recs) == 1 and recs[0].total_tokens > 0
    assert_lab_plots(at, "main")
    # The decision table of the step is shown, in the scheduler tab.
    assert not any("요청" in df.value.columns for df in at.dataframe)
    open_tab(at, "main", "스케줄러 결정")
    assert any("요청" in df.value.columns for df in at.dataframe)
    open_tab(at, "main", "요청 여정")
    at.button(key="main_step").click().run()
    assert len(records(at, "main")) == 2
    request = engine.all_requests()[0]
    assert request.num_output_tokens == 2
    at.button(key="main_to_end").click().run()
    assert not engine_of(at, "main").has_unfinished_requests()
    assert request.is_finished and request.num_output_tokens == 6
    assert at.session_state["_texts"]["main"][request.request_id]  # streamed text grew
    assert any(t.value.strip() and t.value != "…" for t in at.text)
    assert_lab_plots(at, "main")
    open_tab(at, "main", "KV 캐시")
    usage = [s for c, s in zip(at.get("plotly_chart"), chart_data(at)) if "kvusage" in c.proto.id]
    assert usage and len(usage[0][0]["x"]) == len(records(at, "main"))


def test_play_and_reset(app):
    at = open_chapter(app, "00")
    at.button(key="main_reset").click().run()
    at.number_input(key="main_max_tokens").set_value(3).run()
    at.button(key="main_add_preset").click().run()
    at.button(
        key="main_play"
    ).click().run()  # 재생: the fragment steps once per run (run_every never fires here)
    assert at.session_state["_playing_main"] is True
    before = len(records(at, "main"))
    at.run()
    assert len(records(at, "main")) > before
    at.button(key="main_play").click().run()  # 일시정지
    assert at.session_state["_playing_main"] is False
    n = len(records(at, "main"))
    at.run()
    assert len(records(at, "main")) == n
    at.button(key="main_reset").click().run()
    assert len(records(at, "main")) == 0 and not engine_of(at, "main").all_requests()


def test_n_steps_progress_and_reset_with_the_lab_component(app):
    """The shared lab (ui/lab.py): N 스텝 advances N steps, counters follow, 리셋 clears; the
    prediction box is locked once the run started and compared after the request finished."""
    at = open_chapter(app, "00")
    at.button(key="main_reset").click().run()
    at.number_input(key="predict_ch00_steps").set_value(4.0).run()
    at.number_input(key="main_max_tokens").set_value(4).run()
    at.button(key="main_add_preset").click().run()
    at.number_input(key="main_step_count").set_value(2).run()
    at.button(key="main_nsteps").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert len(records(at, "main")) == 2
    assert any("스텝 **2**" in m.value for m in at.markdown)  # the lab's own counter
    assert at.number_input(key="predict_ch00_steps").disabled
    at.button(key="main_to_end").click().run()
    assert not engine_of(at, "main").has_unfinished_requests()
    assert any(m.label == "측정값" for m in at.metric)  # prediction ↔ measurement side by side
    assert at.session_state["_predictions"]["ch00_steps"]["value"] == 4.0
    at.button(key="main_reset").click().run()
    assert len(records(at, "main")) == 0 and not at.number_input(key="predict_ch00_steps").disabled


def test_small_kv_cache_is_fixed_in_the_form_not_a_traceback(app):
    at = open_chapter(app, "00")
    at.number_input(key="cfg_num_kv_blocks").set_value(10)
    at.button(key="cfg_apply").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("160토큰으로 낮춰" in w.value for w in at.sidebar.warning)
    assert at.session_state["_engine_settings"].max_model_len == 160
    assert engine_of(at, "main").num_blocks == 10
    at.number_input(key="cfg_num_kv_blocks").set_value(1)
    at.number_input(key="cfg_block_size").set_value(8)
    at.button(key="cfg_apply").click().run()  # 8 tokens: refused, the old settings stay
    assert not at.exception and any("설정은 바꾸지 않았습니다" in e.value for e in at.sidebar.error)
    assert at.session_state["_engine_settings"].num_kv_blocks == 10
    at.number_input(key="cfg_num_kv_blocks").set_value(64)
    at.number_input(key="cfg_block_size").set_value(16)
    at.number_input(key="cfg_max_len").set_value(1024)
    at.button(key="cfg_apply").click().run()
    assert at.session_state["_engine_settings"].max_model_len == 1024
    assert engine_of(at, "main").num_blocks == 64


def test_engine_errors_become_korean_messages():
    from engine.sampling_params import InvalidRequestError
    from engine.worker.worker import CacheTooSmallError
    from ui.errors import korean_error

    msg = korean_error(CacheTooSmallError(10, 16, 1024))
    assert "블록 10개" in msg and "160" in msg and "1024" in msg
    msg = korean_error(
        InvalidRequestError(
            "this model's maximum context length is 160 tokens, but the request has 150 prompt "
            "tokens and asks for 32 output tokens (182 in total)",
            "max_tokens",
            max_model_len=160,
            num_prompt_tokens=150,
            max_tokens=32,
        )
    )
    assert "150" in msg and "max_tokens" in msg
    assert korean_error(RuntimeError("boom")).startswith("엔진이")


def test_custom_prompt_and_sampling(app):
    at = open_chapter(app, "00")
    at.button(key="main_reset").click().run()
    at.number_input(key="main_max_tokens").set_value(3).run()
    at.slider(key="main_temperature").set_value(0.8).run()
    at.number_input(key="main_seed").set_value(7).run()
    at.text_area(key="main_custom").set_value("부산을 한 문장으로 소개해 주세요.").run()
    at.button(key="main_add_custom").click().run()
    request = engine_of(at, "main").all_requests()[0]
    assert (
        request.sampling_params.temperature == pytest.approx(0.8)
        and request.sampling_params.seed == 7
    )
    assert request.sampling_params.max_tokens == 3
    at.button(key="main_to_end").click().run()
    assert request.is_finished
    at.slider(key="main_temperature").set_value(0.0).run()


def test_sidebar_settings_rebuild_the_engine(app):
    at = open_chapter(app, "00")
    at.number_input(key="cfg_num_kv_blocks").set_value(80)
    at.button(key="cfg_apply").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert engine_of(at, "main").num_blocks == 80
    assert any("80" in m.value for m in at.sidebar.markdown)  # status: blocks used/total
    # which code runs attention: the C++ kernel when it builds here, else the torch reference
    from engine import kernels

    path = engine_of(at, "main").executor.worker.model.kernel_path
    expected = f"C++ ({kernels.cpu_isa()})" if path == "cpu" else "torch 참조 경로"
    assert any(f"어텐션 **{expected}**" in m.value for m in at.sidebar.markdown)
    # and which library runs the float32 linears (timed on this CPU: engine/models/llama.py)
    assert any(
        "float32 선형층 **MKL**" in m.value or "float32 선형층 **oneDNN**" in m.value
        for m in at.sidebar.markdown
    )
    at.number_input(key="cfg_num_kv_blocks").set_value(64)
    at.button(key="cfg_apply").click().run()
    assert engine_of(at, "main").num_blocks == 64


def test_ch01_inspector_and_http_request(app):
    at = open_chapter(app, "01")
    badges = " ".join(m.value for m in at.markdown if "badge" in m.value)
    assert "계산값" in badges and "측정값" in badges and "134,515,008" in badges
    at.number_input(key="ch01_max_tokens").set_value(6).run()
    at.button(key="ch01_send").click().run()
    assert not at.exception, [e.value for e in at.exception]
    if at.session_state["_ch01_server"] is None:  # pragma: no cover - server module missing
        pytest.skip("engine.entrypoints.server is not available")
    result = at.session_state["_ch01_result"]
    assert result["status"] == 200 and result["chunks"][-1]["data"] == "[DONE]"
    assert any("HTTP **200**" in m.value for m in at.markdown)
    journey = [df.value for df in at.dataframe if "이벤트" in df.value.columns]
    assert journey and {"arrival", "tokenized", "scheduled", "first_token", "finished"} <= set(
        journey[0]["이벤트"]
    )
    assert "engine/entrypoints/server/app.py" in set(journey[0]["처리한 모듈"])
    assert_lab_plots(at, "ch01")


def test_ch02_tokens_timing_and_metrics(app):
    at = open_chapter(app, "02")
    assert any("글자당 토큰" in m.value and "측정값" in m.value for m in at.markdown)
    at.multiselect(key="ch02_sizes").set_value([16, 64]).run()
    at.slider(key="ch02_num_decode").set_value(2).run()
    at.button(key="ch02_measure").click().run()
    assert not at.exception, [e.value for e in at.exception]
    results, cond = at.session_state["ch02_results"]
    assert [r.num_prompt_tokens for r in results] == [16, 64]
    assert all(r.prefill_ms > 0 and len(r.decode_ms) == 2 for r in results)
    assert cond["장치"] and cond["dtype"]
    at.number_input(key="ch02_max_tokens").set_value(4).run()
    at.button(key="ch02_add_preset").click().run()
    at.button(key="ch02_to_end").click().run()
    assert not at.exception, [e.value for e in at.exception]
    metrics = [
        df.value
        for df in at.dataframe
        if "TTFT (ms)" in df.value.columns and "E2E (ms)" in df.value.columns
    ]
    assert metrics and metrics[0]["TTFT (ms)"].iloc[0] > 0
    assert_lab_plots(at, "ch02")


def test_ch03_cache_comparison_and_growth(app):
    at = open_chapter(app, "03")
    assert any("46,080" in m.value for m in at.markdown if "badge" in m.value)
    at.select_slider(key="ch03_prompt_len").set_value(16).run()
    at.slider(key="ch03_new_tokens").set_value(4).run()
    at.button(key="ch03_compare").click().run()
    assert not at.exception, [e.value for e in at.exception]
    result, _ = at.session_state["ch03_result"]
    assert len(result.step_ms_uncached) == 4 and result.same_tokens
    assert sum(result.tokens_computed_uncached) > sum(result.tokens_computed_cached)
    at.button(key="ch03_reset").click().run()
    at.number_input(key="ch03_max_tokens").set_value(5).run()
    at.button(key="ch03_add_preset").click().run()
    at.button(key="ch03_step").click().run()
    first = records(at, "ch03")[-1].kv.num_used
    assert first >= 1
    at.button(key="ch03_to_end").click().run()
    assert records(at, "ch03")[-1].kv.num_used == 0  # blocks returned when the request finished
    assert_lab_plots(at, "ch03")


def test_figures_show_preemption_and_reasons(tiny_model_dir):
    """Pure figure builders on a real, deliberately tight engine (the tiny model: the figures
    depend on the scheduler's decisions, not on the weights): preemptions appear in the journey,
    Korean reason labels in the decision table, free/cached/used blocks in the KV grid."""
    from engine.core import EngineConfig, EngineCore
    from engine.sampling_params import SamplingParams
    from ui import figures
    from ui.widgets import REASON_KO, decision_table

    engine = EngineCore(
        EngineConfig(
            model=str(tiny_model_dir),
            device="cpu",
            num_kv_blocks=8,
            block_size=16,
            max_model_len=96,
            max_num_batched_tokens=64,
            max_num_seqs=8,
            enable_prefix_caching=True,
        )
    )
    params = SamplingParams(max_tokens=34, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(prompt_token_ids=[100 + i] * 16, sampling_params=params)
    recs = []
    while engine.has_unfinished_requests() and len(recs) < 400:
        recs.append(engine.step())
    assert not engine.has_unfinished_requests()
    assert any(r.preempted for r in recs), "the tight cache should force a preemption"
    journey = figures.journey_figure(engine.all_requests())
    names = {t.name for t in journey.data}
    assert {"tokenize", "prefill", "decode", "선점", "대기열(선점 후)", "완료"} <= names
    bars = [t for t in journey.data if t.type == "bar"]
    assert all(min(t.x) > 0 and t.base is not None for t in bars)
    schedule = figures.schedule_figure(recs)
    assert any(t.name == "토큰 예산" for t in schedule.data)
    assert sum(sum(t.y) for t in schedule.data if t.type == "bar") == sum(
        r.total_tokens for r in recs
    )
    waiting = next(r for r in recs if r.unscheduled)
    table = decision_table(waiting)
    assert set(table["이유"]) - {""} <= set(REASON_KO.values())
    busy = max(recs, key=lambda r: r.kv.num_used)
    grid = figures.kv_grid_figure(busy.kv)
    heat = grid.data[0]
    assert heat.type == "heatmap" and heat.xgap and heat.ygap
    cells = [v for row in heat.z for v in row if v == v]  # not NaN
    assert len(cells) == 8 and max(cells) >= 2  # owners use codes 2..
    final = figures.kv_grid_figure(recs[-1].kv)
    assert all(
        v in (0, 1) for row in final.data[0].z for v in row if v == v
    )  # all free or cached-free
    usage = figures.kv_usage_figure(recs)
    assert max(usage.data[0].y) > 50


def test_quiz_gives_feedback(app):
    at = open_chapter(app, "00")
    from ui.lesson import load_quiz

    questions = load_quiz("00")
    choice = next(i for i, q in enumerate(questions, 1) if q["kind"] == "choice")
    q = questions[choice - 1]
    wrong = next(o for o in q["options"] if o != q["options"][q["answer"]])
    at.radio(key=f"quiz_ch00_{choice}").set_value(wrong).run()
    assert any(e.value.startswith("다시 생각해 보세요") for e in at.error)
    at.radio(key=f"quiz_ch00_{choice}").set_value(q["options"][q["answer"]]).run()
    assert any(s.value.startswith("정답입니다") for s in at.success)
    # an open question is self-assessed: write, reveal the model answer, mark yourself
    own = next(i for i, q in enumerate(questions, 1) if q["kind"] == "self")
    at.text_area(key=f"quiz_ch00_{own}").input("모르겠어요").run()
    at.checkbox(key=f"quiz_ch00_{own}_reveal").check().run()
    assert any(questions[own - 1]["model_answer"] in m.value for m in at.info)
    assert sum(s.value.startswith("정답입니다") for s in at.success) == 1

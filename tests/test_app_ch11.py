"""Chapter 11 under streamlit.testing.v1.AppTest: the page opens from app.py, its lab's 실행 runs
float32, int8 and int4 engines side by side on the tiny test model, the decode summary, the
agreement table and the quality measurement appear with their evidence labels, and the sidebar's
weight quantization setting reaches the engine."""

from __future__ import annotations

from dataclasses import replace

from _apptest import app_fixture, chart
from ui.session import SETTINGS_KEY

PAGE = "pages/ch11_quantization.py"
TIMEOUT = 240


app = app_fixture(PAGE, TIMEOUT)


def test_lab_runs_three_engines_and_summarises(app):
    assert any("실험실" in h.value for h in app.header)
    # the tiny model has no GGUF source, so that engine is not offered
    assert "gguf (Q4_1)" not in app.multiselect(key="ch11_sides").options
    app.button(key="ch11_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    runs = app.session_state["ch11_result"]
    assert list(runs) == ["float32", "int8", "int4"]
    assert {r.config.quantization for r in runs.values()} == {None, "int8", "int4"}
    assert all(
        len(r.requests) == 1 and r.requests[0].num_output_tokens == 24 for r in runs.values()
    )
    bars = chart(app, "ch11_decode_fig")["data"][0]
    assert list(bars["x"]) == ["float32", "int8", "int4"] and bars["y"]
    frames = [df.value for df in app.dataframe]
    summary = next(f for f in frames if "디코드 스텝 중앙값 (ms)" in f.columns)
    mb = dict(zip(summary["엔진"], summary["가중치 (MB)"]))
    assert mb["int4"] < mb["int8"] < mb["float32"] / 3
    agreement = next(f for f in frames if "float32와 같은 토큰 비율" in f.columns)
    assert agreement.iloc[0]["float32와 같은 토큰 비율"] == 100.0
    text = " ".join(m.value for m in app.markdown)
    assert "측정값" in text and "계산값" in text and "양자화=int8" in text
    assert sum(1 for m in app.markdown if m.value.startswith("**문제 ")) >= 3


def test_bytes_table_matches_the_formats(app):
    frames = [df.value for df in app.dataframe]
    column = "디코드 스텝당 읽는 가중치 (MB)"
    table = next(f for f in frames if column in f.columns).set_index("형식")
    ratio = table["float32 대비"]
    assert ratio["bfloat16"] == 0.5 and 0.25 < ratio["int8"] < 0.3
    assert ratio["int4 (그룹 32)"] < 0.25
    assert table.loc["int8", "선형층 비트/가중치"] > 8


def test_quality_measurement_and_outlier_table(app):
    app.multiselect(key="ch11_q_variants").set_value(["int8", "int4/64"]).run()
    app.slider(key="ch11_q_len").set_value(64).run()
    app.button(key="ch11_quality_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    table, n = app.session_state["ch11_quality"]
    assert n == 64 and list(table["변형"]) == ["float32", "int8", "int4/64"]
    assert table.iloc[0]["top-1 일치 (%)"] == 100.0
    assert table.iloc[2]["top-1 일치 (%)"] < table.iloc[1]["top-1 일치 (%)"]
    assert chart(app, "ch11_quality_fig")["data"][0]["y"]
    frames = [df.value for df in app.dataframe]
    outliers = next(f for f in frames if "이상치 행, 먼 곳" in f.columns)
    assert len(outliers) == 2


def test_batch_slider_drives_the_workload(app):
    app.slider(key="ch11_batch").set_value(2).run()
    app.multiselect(key="ch11_sides").set_value(["float32", "int8"]).run()
    app.button(key="ch11_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    runs = app.session_state["ch11_result"]
    assert list(runs) == ["float32", "int8"] and all(len(r.requests) == 2 for r in runs.values())


def test_sidebar_quantization_reaches_the_engine(app, tiny_model_dir):
    settings = app.session_state[SETTINGS_KEY]
    app.session_state[SETTINGS_KEY] = replace(settings, quantization="int8")
    app.switch_page("pages/ch08_continuous_batching.py")
    app.run()
    app.button(key="ch08_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    result = app.session_state["ch08_result"]
    assert all(r.config.quantization == "int8" for r in result.runs.values())
    app.session_state[SETTINGS_KEY] = settings

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
    summary = next(f for f in frames if "decode 스텝 중앙값 (ms)" in f.columns)
    mb = dict(zip(summary["엔진"], summary["가중치 (MB)"]))
    assert mb["int4"] < mb["int8"] < mb["float32"] / 3
    agreement = next(f for f in frames if "float32와 같은 토큰 비율" in f.columns)
    assert agreement.iloc[0]["float32와 같은 토큰 비율"] == 100.0
    text = " ".join(m.value for m in app.markdown)
    assert "측정값" in text and "계산값" in text and "양자화=int8" in text
    assert sum(1 for m in app.markdown if m.value.startswith("**문제 ")) >= 3


def test_bytes_table_matches_the_formats(app):
    frames = [df.value for df in app.dataframe]
    column = "decode 스텝당 읽는 가중치 (MB)"
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


def test_peer_rows_put_each_engine_variant_beside_llama_cpp():
    from ui.experiments.ch11 import peer_rows

    assert peer_rows(None) is None
    variant = {"name": "float32 + gguf", "weight_bytes_per_step": 108.3e6}
    results = {"variants": {"rows": [dict(variant, decode_tokens_per_s=90.0, decode_step_ms=11.1)]}}
    assert peer_rows(results) is None  # no peer in that run
    results["llama_cpp"] = {"skipped": "llama-cpp-python is not installed"}
    assert peer_rows(results) is None
    results["llama_cpp"] = {"version": "0.3.36", "decode_tokens_per_s": 100.0}
    results["llama_cpp"]["decode_step_ms"] = 10.0
    table = peer_rows(results)
    assert list(table["엔진"]) == ["우리 엔진 · float32 + gguf", "llama.cpp 0.3.36 · Q4_1"]
    assert list(table["÷ llama.cpp"]) == [0.9, 1.0]
    assert table["스텝당 MB"].iloc[0] == 108.3
    # a variant the run could not measure (no speed) is left out, not a traceback on the page
    results["variants"]["rows"].append({"name": "float32 + int4", "weight_bytes_per_step": 1e8})
    assert len(peer_rows(results)) == 2
    # where llama.cpp's extra buffers crashed it, the row says which setting it is
    results["llama_cpp"]["prompt_lengths"] = [1]
    assert peer_rows(results)["엔진"].iloc[-1].endswith("AMX 등 확장 버퍼, 1토큰 프롬프트")
    results["llama_cpp"]["extra_buffers"] = False
    assert peer_rows(results)["엔진"].iloc[-1].endswith("AMX 등 확장 버퍼 없이")


def test_page_shows_the_llama_cpp_comparison_of_the_latest_bench(app, monkeypatch):
    import ui.experiments.ch04 as ch04

    fake = {
        "conditions": {
            "device_name": "test CPU",
            "threads": 2,
            "date": "2026-12-01",
            "load_before": 0.4,
            "load_after": 2.1,
            "busy": False,
        },
        "variants": {
            "rows": [
                {
                    "name": "float32 + int4",
                    "weight_bytes_per_step": 108.3e6,
                    "decode_tokens_per_s": 96.0,
                    "decode_step_ms": 10.4,
                }
            ]
        },
        "llama_cpp": {"version": "0.3.36", "decode_tokens_per_s": 107.3, "decode_step_ms": 9.3},
    }
    monkeypatch.setattr(ch04, "latest_bench", lambda: fake)
    app.switch_page(PAGE)  # the module's app may be on another page (the sidebar test's)
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    assert any("llama.cpp" in s.value for s in app.subheader)
    frames = [d.value for d in app.dataframe if "÷ llama.cpp" in d.value.columns]
    assert frames and list(frames[0]["decode 토큰/s"]) == [96.0, 107.3]
    shown = " ".join(m.value for m in app.markdown) + " ".join(c.value for c in app.caption)
    assert "부하 평균=0.40→2.10" in shown and "test CPU" in shown

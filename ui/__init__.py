"""Shared Streamlit widgets and plotly figure builders for the chapter pages.

- ui.session: engine settings, one EngineCore per browser session, step records
- ui.figures: plotly figures (pure functions, no Streamlit)
- ui.lab:     the one lab component (requests, 다음 스텝 / N 스텝 / 재생 / 끝까지 / 리셋, the three
              live views, engines in lockstep), run inside st.fragment
- ui.predict: predict → run → compare
- ui.errors:  engine errors as Korean messages
- ui.experiments: engine-driving experiments, one module per chapter (no Streamlit)
- ui.widgets: decision table, evidence labels, code panel
- ui.lesson:  chapter layout (lesson text → lab → rest → quiz → next chapter) and the chapter list
"""

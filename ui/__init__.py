"""Shared Streamlit widgets and plotly figure builders for the chapter pages.

- ui.session: engine settings, one EngineCore per browser session, step records
- ui.figures: plotly figures (pure functions, no Streamlit)
- ui.widgets: the lab controls, plots, decision table, evidence labels, quiz, code panel
- ui.lesson:  chapter layout (lesson text → lab → rest → quiz → next chapter) and the chapter list
"""

"""The Streamlit side of a chapter's lab, when it is more than a page should hold.

A page composes its lesson (ui.lesson.render_chapter) and its lab; the lab's drawing parts live
here, one module per chapter, and what they measure is computed in ui/experiments/chNN*.py (no
Streamlit there).

    ch14.py  the server lab: the learner's own server on 127.0.0.1, simulated users, the
             load-latency curve, streamed vs whole answers, a stream the learner cuts
"""

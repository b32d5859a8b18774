"""The Streamlit side of a chapter's lab, when it is more than a page should hold.

A page composes its lesson (ui.lesson.render_chapter) and its lab; the lab's drawing parts live
here, one module per chapter, and what they measure is computed in ui/experiments/chNN*.py (no
Streamlit there).

    ch01.py  the artifact inspector and one real HTTP request traced through the engine
    ch04.py  latency per request and as percentiles, the history of runs, the bench JSON
    ch05.py  the memory-budget calculator, its budget on a simulated GPU, the dtype measurement
    ch09.py  preemption: a burst that does not fit, recompute vs swap, scheduling policies
    ch10.py  prefix caching on/off, the block-hash chain, LRU eviction, cache salts
    ch11.py  float32/bfloat16/int8/int4 side by side, the quality against float32, bench tables
    ch12.py  the tensor-parallel lab's views: what each worker holds, compute vs all-reduce
             time per step, the layouts' step times, the communication share as tp grows
    ch13.py  speculative decoding on/off: drafts, acceptance, outputs, the speed section
    ch14.py  the server lab: the learner's own server on 127.0.0.1, simulated users, the
             load-latency curve, streamed vs whole answers, a stream the learner cuts
"""

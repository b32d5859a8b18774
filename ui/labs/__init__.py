"""The Streamlit side of each chapter's lab, one module per chapter.

A page (pages/chNN_*.py) composes its lesson (ui.lesson.render_chapter) and its lab: its lab()
calls the parts defined here, which draw on the shared lab component (ui/lab.py); what they
measure is computed in ui/experiments/chNN*.py (no Streamlit there).

    ch01.py  the artifact inspector and one real HTTP request traced through the engine
    ch02.py  token boundaries, prefill vs decode timing, TTFT vs TPOT
    ch03.py  generation with and without the KV cache, KV bytes per token, the cache growing
    ch04.py  latency per request and as percentiles, the history of runs, the bench JSON
    ch05.py  the memory-budget calculator, its budget on a simulated GPU, the dtype measurement
    ch06.py  the block grid and block tables, contiguous reservation vs paged blocks
    ch07.py  sequential vs static vs continuous batching: the sides, the summary, the workload note
    ch08.py  chunked prefill on/off under one token budget, the simulated budget sweep
    ch09.py  preemption: a burst that does not fit, recompute vs swap, scheduling policies
    ch10.py  prefix caching on/off, the block-hash chain, LRU eviction, cache salts
    ch11.py  float32/bfloat16/int8/int4 side by side, the quality against float32, bench tables
    ch12.py  tp 1 vs tp N (and pp 2): the sides, starting the workers, what each worker holds,
             compute vs all-reduce per step, the step times, the communication share as tp grows
    ch13.py  speculative decoding on/off: drafts, acceptance, outputs, the speed section
    ch14.py  prefill fairness, then the server lab: the learner's own server on 127.0.0.1,
             simulated users, the load curve, streamed vs whole answers, a stream the learner cuts
"""

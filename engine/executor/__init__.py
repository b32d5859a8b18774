"""Executors: hand each step to the worker(s) behind one interface (abstract.py): one worker in
this process (uniproc.py) or one worker process per rank (multiproc.py, tensor and pipeline
parallel). The simulated executor is an instrument (engine/tools/simulator.py)."""

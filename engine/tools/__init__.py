"""The instruments wing: bench, calibration, cost model, simulator, presets, quality, selfcheck,
peers and the shared workload. They measure and model the engine from outside; the engine never
imports them (only engine/__main__.py and engine/entrypoints/cli.py, the app and the tests do)."""

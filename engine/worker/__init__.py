"""The data path: one worker per device (worker.py) owns the weights and the KV-cache memory; its
model runner (model_runner.py) turns a scheduler decision into tensors, runs the model and
samples (sampler.py); attention.py builds the paged-attention metadata; cuda_graphs.py replays
decode steps; quantization.py makes weight-only int8/int4 models."""

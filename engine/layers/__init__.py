"""The model's building blocks: linear layers that own their tensor-parallel shard (linear.py),
ops whose implementation is chosen once (ops.py) and the pure maths of who holds what
(sharding.py, no torch)."""

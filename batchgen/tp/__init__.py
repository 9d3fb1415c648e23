"""Tensor-parallel ranks (engine.tensor_parallel_size): the engine's process is rank 0, which schedules and sends each
step (ranks.py, steps.py); ranks 1..N-1 are follower processes it starts (engine/tp_follower.py), which run the same
steps on their shards of the model; group.py holds their process groups."""

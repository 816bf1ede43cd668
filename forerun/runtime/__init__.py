"""The runtime layer: batches of chunks -> one forward over the paged KV cache (eager or CUDA-graph replay).

Imports run one way: runtime (models, attention, kvcache below it) <- drafters <- engine."""

"""One rank: the model shard, its KV cache and its half of a weight update (`ModelRunner`). The
forward's input and output types (`forward_batch`) are plain data any layer above may build."""

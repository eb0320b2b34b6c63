"""The paged KV cache's bookkeeping on the host: pages, page tables, the prefix cache."""

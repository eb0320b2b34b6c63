"""DiffusionGemma (`diffusion_gemma`): Gemma-4 layers run as an encoder pass (causal, writes K/V) and
a canvas pass (bidirectional over a canvas, reads the committed K/V without writing) on one set of
weights. `config` reads config.json, `network` is the layer stack, `attention` its paged attention
over per-layer-group caches, `kv_layout` the page geometry of the two layer groups."""

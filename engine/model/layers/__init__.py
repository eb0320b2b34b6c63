"""The building blocks every model family assembles its network from: the tensor-parallel context and
its parallel linears and embedding (each declaring how a checkpoint tensor is split across ranks),
norms, rotary embeddings, the attention and MLP sublayers, MoE blocks and the generic pre-norm
decoder LM. Nothing here belongs to one family."""

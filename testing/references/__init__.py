"""Each family's published decoding loop, written out literally over a full recompute: the oracles the
engine's outputs are compared against. One module per family (named as its package under
engine/model/families); `sdar` also holds the typed decisions every block-diffusion reference shares."""

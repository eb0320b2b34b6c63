"""transformers' DiffusionGemmaForBlockDiffusion driven pass by pass as its `generate()` drives it:
`model.model.encoder` over the uncommitted tokens with the masks `_prepare_encoder_inputs` builds
(prompt prefill, then each commit), and the model's forward on a canvas with the decoder mask
`create_diffusion_decoder_attention_mask` builds, reading the DynamicCache without writing it."""

from __future__ import annotations

import torch


class ReferenceSequence:
    """One sequence at batch 1 in a DynamicCache: `encode` appends tokens, `canvas` scores a canvas."""

    def __init__(self, model):
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config.text_config)
        self.length = 0

    @torch.no_grad()
    def encode(self, ids: list[int]) -> torch.Tensor:
        """Encoder pass over `ids` (written to the cache); their logits [n, V] (LM head + softcap of
        the encoder's final hidden states)."""
        input_ids = torch.tensor([ids])
        positions = torch.arange(self.length, self.length + len(ids), dtype=torch.int32)[None]
        mask_2d = torch.ones((1, self.length + len(ids)), dtype=torch.bool)
        unprocessed, masks = self.model._prepare_encoder_inputs(
            input_ids=input_ids, attention_mask=mask_2d, encoder_position_ids=positions, cache=self.cache,
            is_prefill=True, canvas_length=len(ids), batch_size=1)
        out = self.model.model.encoder(input_ids=unprocessed, attention_mask=masks, cache=self.cache,
                                       position_ids=positions)
        self.length += len(ids)
        return _softcap(self.model, self.model.lm_head(out.last_hidden_state)[0])

    @torch.no_grad()
    def canvas(self, ids: list[int], self_conditioning: torch.Tensor | None = None) -> torch.Tensor:
        """Canvas pass over `ids` at the next positions; float32 logits [L, V]. `self_conditioning`:
        the previous step's processed logits [L, V] (cast to the weights' dtype, as generate() does)."""
        canvas = torch.tensor([ids])
        positions = torch.arange(self.length, self.length + len(ids), dtype=torch.int32)[None]
        mask_2d = torch.ones((1, self.length + len(ids)), dtype=torch.bool)
        masks = self.model.model.decoder.create_diffusion_decoder_attention_mask(
            config=self.model.config, inputs_embeds=canvas.unsqueeze(-1), cache=self.cache,
            decoder_attention_mask=mask_2d)
        sc = None
        if self_conditioning is not None:
            sc = self_conditioning[None].to(self.model.model.decoder.embed_tokens.weight.dtype)
        out = self.model(decoder_input_ids=canvas, self_conditioning_logits=sc, decoder_attention_mask=masks,
                         cache=self.cache, decoder_position_ids=positions)
        return out.logits[0]


def _softcap(model, logits: torch.Tensor) -> torch.Tensor:
    cap = model.config.text_config.final_logit_softcapping
    return torch.tanh(logits.float() / cap) * cap


def load_reference(path) -> object:
    from transformers import DiffusionGemmaForBlockDiffusion

    return DiffusionGemmaForBlockDiffusion.from_pretrained(str(path), dtype=torch.float32,
                                                           attn_implementation="sdpa").eval()


def random_tokens(n: int, seed: int, vocab: int) -> list[int]:
    """`n` seeded uniform token ids (prompts and canvases of the tests)."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-4) -> None:
    """Same shape, max absolute difference under `tol` (the tests' bar against transformers)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item()
    assert err < tol, err


class Drafts:
    """A streamer for `generate()`: every denoising step's processed logits (`put_draft`), and where
    each canvas ended (`put`; the first put is the prompt)."""

    _takes_logits = True

    def __init__(self):
        self.steps: list[torch.Tensor] = []
        self.canvas_ends: list[int] = []

    def put(self, value) -> None:
        self.canvas_ends.append(len(self.steps))

    def put_draft(self, logits) -> None:
        self.steps.append(logits[0].float().clone())

    def end(self) -> None:
        pass


def settle_steps(drafts: Drafts) -> list[int]:
    """Per generated token: the request-wide step from which its position's argmax never changed."""
    out, bounds = [], drafts.canvas_ends[1:]  # the first put is the prompt
    start = 0
    for end in bounds:
        argmax = torch.stack([z.argmax(-1) for z in drafts.steps[start:end]])  # [steps, L]
        final = argmax[-1]
        for pos in range(argmax.shape[1]):
            j = argmax.shape[0]
            while j > 0 and argmax[j - 1, pos] == final[pos]:
                j -= 1
            out.append(start + j + 1)
        start = end
    return out

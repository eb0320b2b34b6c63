"""transformers' DiffusionGemmaForBlockDiffusion driven pass by pass as its `generate()` drives it:
`model.model.encoder` over the uncommitted tokens with the masks `_prepare_encoder_inputs` builds
(prompt prefill, then each commit), and the model's forward on a canvas with the decoder mask
`create_diffusion_decoder_attention_mask` builds, reading the DynamicCache without writing it.

`renoise` is `generate()`'s loop at batch 1 over those passes, with transformers' own sampler,
temperature schedule and stop rule, extended with typed decisions (a template, allowed sets, a read)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

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
    def canvas(self, ids: list[int], self_conditioning: torch.Tensor | None = None,
               zero_rows: list[int] | None = None) -> torch.Tensor:
        """Canvas pass over `ids` at the next positions; float32 logits [L, V]. `self_conditioning`:
        the previous step's processed logits [L, V] (cast to the weights' dtype, as generate() does);
        `zero_rows`: canvas positions whose self-conditioning signal is zero instead."""
        canvas = torch.tensor([ids])
        positions = torch.arange(self.length, self.length + len(ids), dtype=torch.int32)[None]
        mask_2d = torch.ones((1, self.length + len(ids)), dtype=torch.bool)
        masks = self.model.model.decoder.create_diffusion_decoder_attention_mask(
            config=self.model.config, inputs_embeds=canvas.unsqueeze(-1), cache=self.cache,
            decoder_attention_mask=mask_2d)
        sc = None
        if self_conditioning is not None:
            sc = self_conditioning[None].to(self.model.model.decoder.embed_tokens.weight.dtype)
        with _zero_conditioning(self.model, zero_rows):
            out = self.model(decoder_input_ids=canvas, self_conditioning_logits=sc, decoder_attention_mask=masks,
                             cache=self.cache, decoder_position_ids=positions)
        return out.logits[0]


@contextlib.contextmanager
def _zero_conditioning(model, rows: list[int] | None):
    """While open, the self-conditioning module sees a zero soft embedding at canvas positions `rows`."""
    if not rows:
        yield
        return
    index = torch.tensor(rows)

    def zero(module, args):
        embeds, soft = args
        return embeds, soft.index_fill(1, index, 0.0)

    handle = model.model.decoder.self_conditioning.register_forward_pre_hook(zero)
    try:
        yield
    finally:
        handle.remove()


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
        out += _settled(torch.stack([z.argmax(-1) for z in drafts.steps[start:end]]), start)
        start = end
    return out


def _settled(argmax: torch.Tensor, steps_before: int) -> list[int]:
    """Per position of a canvas whose steps' argmax were `argmax` [steps, L]: the request-wide step
    from which it never changed (the canvas's first step is steps_before + 1)."""
    final, out = argmax[-1], []
    for pos in range(argmax.shape[1]):
        j = argmax.shape[0]
        while j > 0 and argmax[j - 1, pos] == final[pos]:
            j -= 1
        out.append(steps_before + j + 1)
    return out


@dataclass
class Renoised:
    """What `renoise` made: the output tokens, their settle steps (0 at a pin), per canvas its step count
    and its last step's raw logits [L, V], each allowed set's label mass by generated index, and the
    encoder passes run (the prompt's and the commits')."""

    tokens: list[int] = field(default_factory=list)
    settle: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    last: list[torch.Tensor] = field(default_factory=list)
    label_mass: dict[int, float] = field(default_factory=dict)
    encodes: int = 0


def allowed_ids(g: int, template: list[int | None] | None, allowed: list[int] | dict[int, list[int]] | None
                ) -> list[int] | None:
    """The ids generated index g may take: with a template only its slots have a set; one list is every
    slot's (every position's without a template), a dict names them per generated index."""
    if allowed is None or template and (g >= len(template) or template[g] is not None):
        return None
    return allowed.get(g) if isinstance(allowed, dict) else allowed


@torch.no_grad()
def renoise(model, prompt: list[int], max_new_tokens: int, *, max_denoising_steps: int, t_min: float, t_max: float,
            entropy_bound: float, stability_threshold: int, confidence_threshold: float,
            template: list[int | None] | None = None, allowed: list[int] | dict[int, list[int]] | None = None,
            read_steps: int | None = None, canvas_length: int | None = None) -> Renoised:
    """`generate()`'s loop at batch 1, drawing from the global generator (seed it first) exactly what
    generate() draws: per canvas the uniform init, per step the multinomial over the processed logits
    and the renoise. Without the last three arguments it makes what generate() makes (no stop id).

    - `template` (an id pins its generated index, None leaves a slot; at most one canvas): the first
      canvas's init is drawn, then the pins overwrite it; every step's renoised canvas and argmax are
      overwritten at the pins again, and the self-conditioning signal is zero there. A pin's settle
      step is 0.
    - `allowed` (see `allowed_ids`): before the temperature, every logit outside a position's set is
      -inf, so the sampler, entropy, acceptance, stop rule and argmax read the restricted row; the
      self-conditioning reads the unrestricted one, and the renoise draws from the whole vocabulary.
      Each set's label mass (its raw softmax mass) is taken at its canvas's last step.
    - `read_steps` k: the first canvas also stops after step k; it is emitted without the commit
      (encoder) pass and nothing follows it.
    - `canvas_length`: a narrower canvas than the config's (vLLM's `diffusion_canvas_length`): the
      sampler and every pass run on that many positions.
    """
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        EntropyBoundSampler,
        EntropyBoundSamplerConfig,
        LinearTemperatureScheduleLogitsProcessor,
        StableAndConfidentStoppingCriteria,
    )

    length, vocab = canvas_length or model.config.canvas_length, model.config.text_config.vocab_size
    sampler = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=entropy_bound), length, vocab,
                                  max_denoising_steps)
    schedule = LinearTemperatureScheduleLogitsProcessor(t_min, t_max, max_denoising_steps)
    stopper = StableAndConfidentStoppingCriteria(stability_threshold, confidence_threshold)
    seq, out = ReferenceSequence(model), Renoised()
    seq.encode(prompt)
    out.encodes += 1
    template = template or []
    for first in range(0, max_new_tokens, length):
        if first:
            seq.encode(out.tokens[-length:])  # the commit of the previous canvas
            out.encodes += 1
        pins = {pos: t for pos, t in enumerate(template[first: first + length]) if t is not None}
        rows, ids = torch.tensor(list(pins), dtype=torch.long), torch.tensor(list(pins.values()), dtype=torch.long)
        sets = {pos: s for pos in range(length) if (s := allowed_ids(first + pos, template, allowed)) is not None}
        canvas = sampler.initialize_canvas(1, torch.device("cpu"))
        canvas[0, rows] = ids
        stopper.reset()
        soft, argmaxes = None, []
        for step, countdown in enumerate(range(max_denoising_steps, 0, -1), start=1):
            cur_step = torch.tensor(countdown, dtype=torch.int32)
            raw = seq.canvas(canvas[0].tolist(), soft, list(pins))
            restricted = raw.clone()
            for pos, s in sets.items():
                restricted[pos] = torch.full_like(raw[pos], float("-inf")).index_copy(0, torch.tensor(s), raw[pos, s])
            processed = schedule(None, restricted[None], cur_step)
            probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
            denoised = torch.multinomial(probs.view(-1, vocab), num_samples=1).view(1, length)
            argmax = torch.argmax(processed, dim=-1)
            argmax[0, rows] = ids
            accepted = sampler.accept_canvas(canvas, denoised, processed, cur_step).clone()
            canvas = sampler.renoise_canvas(accepted, cur_step).clone()
            canvas[0, rows] = ids
            stop = bool(stopper(argmax, processed)[0]) or step == read_steps
            soft = schedule(None, raw[None], cur_step)[0]
            argmaxes.append(argmax[0])
            if stop:
                break
        settle = _settled(torch.stack(argmaxes), sum(out.steps))
        out.settle += [0 if pos in pins else s for pos, s in enumerate(settle)]
        out.tokens += argmaxes[-1].tolist()
        out.steps.append(len(argmaxes))
        out.last.append(raw)
        for pos, s in sets.items():
            out.label_mass[first + pos] = raw[pos].softmax(-1)[s].sum().item()
        if read_steps is not None:
            break
    out.tokens, out.settle = out.tokens[:max_new_tokens], out.settle[:max_new_tokens]
    return out

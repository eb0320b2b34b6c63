"""The release's LinearSpec draft adapter (`linear_spec_lora/`: PEFT LoRA on every `o_proj`, for drafts
only) on the network (lora.py), against the release's `linear_spec_generate` run by
`DraftAdaptedMinistral3` (the adapter on a draft pass's block rows, the plain weights for the prefix and
every causal forward).

The engine runs it with `dllm_draft_lora=True`: the strategy flags each linear_spec request's draft
passes in the forward batch (`draft_rows`), and only their rows run the adapter -- a `diffusion`
request's denoising passes, bidirectional too, run the plain weights beside them.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine import EngineConfig, pipeline
from engine.errors import CheckpointError
from engine.model.families.nemotron_labs_diffusion.lora import DraftAdapter, lora_scale, read_draft_lora
from engine.model.layers.parallel import RowSplit, TPContext
from testing.references import nemotron_labs_diffusion as ref
from testing.tiny.nemotron_labs_diffusion import (
    DraftAdaptedMinistral3,
    load_ministral3,
    write_tiny_linear_spec_lora,
    write_tiny_nemotron_labs_diffusion,
)
from tests.support import nemotron
from tests.support.nemotron import LOGIT_SCALE, NEW_TOKENS, assert_speculated, gen, make_prompt, speculation

ids = nemotron.ids  # the checkpoint's ids (of this module's own ckpt, which carries the adapter)
CONFIG = EngineConfig(max_model_len=128, kv_block_size=8, logprobs_mode="raw_logprobs")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A head whose row 17 wins most rows (so plain drafts often match the verify and whole blocks are
    accepted) and an adapter that moves the drafts off it: what is accepted tells the two apart."""
    path = write_tiny_nemotron_labs_diffusion(tmp_path_factory.mktemp("nld_lora"), seed=5, logit_scale=LOGIT_SCALE)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["diffusion_head.weight"][17] = tensors["diffusion_head.weight"].abs().sum(0) * 4
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    write_tiny_linear_spec_lora(path, seed=1)
    return path


@pytest.fixture(scope="module")
def plain(ckpt):
    return load_ministral3(ckpt)


@pytest.fixture(scope="module")
def adapted(ckpt) -> DraftAdaptedMinistral3:
    return DraftAdaptedMinistral3(load_ministral3(ckpt), ckpt / "linear_spec_lora")


@pytest.fixture(scope="module")
def pipe(ckpt):
    with pipeline(str(ckpt), CONFIG.model_copy(update={"dllm_draft_lora": True})) as p:
        yield p


@pytest.mark.parametrize("threshold", [None, 0.5])
@pytest.mark.parametrize("length", [7, 20])
def test_greedy_drafts_run_the_adapter_as_the_release(pipe, adapted, ids, threshold, length):
    """Tokens (greedy: AR's, whatever the drafts), step maps, verify logprobs, forwards and acceptance
    lengths are the adapted loop's; batched, each request as alone."""
    prompts = [make_prompt(length), make_prompt(length + 13)]
    outs = pipe(prompts, gen(threshold, dllm_mode="linear_spec"))
    for out, prompt in zip(outs, prompts, strict=True):
        assert_speculated(out, speculation(adapted, ids, prompt, threshold))


def test_the_adapter_changes_what_is_accepted(pipe, plain, ids):
    """Greedy: the same tokens as without the adapter (the verifies decide them), fewer accepted."""
    prompt = make_prompt(7)
    out, without = pipe(prompt, gen(None, dllm_mode="linear_spec")), speculation(plain, ids, prompt)
    assert out.token_ids == without.token_ids and max(without.acceptance) == ids["block"]
    assert out.acceptance_lengths != without.acceptance and out.nfe > without.nfe


def test_seeded_drafts_draw_from_the_adapted_distribution(pipe, adapted, plain, ids):
    """Sampled drafts come from the adapter's distribution: the output is the adapted loop's, not the plain
    loop's under the same seed."""
    prompt = make_prompt(20)
    out = pipe(prompt, gen(None, dllm_mode="linear_spec", do_sample=True, temperature=0.8, random_seed=3))
    assert_speculated(out, speculation(adapted, ids, prompt, temperature=0.8, seed=3))
    assert out.token_ids != speculation(plain, ids, prompt, temperature=0.8, seed=3).token_ids


def test_without_draft_rows_the_network_is_the_plain_model(pipe, plain, adapted, ids):
    """Forwards that flag no row (the prefill, verifies, `ar`, `diffusion`'s denoising passes) compute the
    plain weights, in the same batch as drafts that run the adapter."""
    prompts = [make_prompt(20), make_prompt(9), make_prompt(7)]
    ar, diffusion, spec = pipe(prompts, [gen(None, dllm_mode="ar"), gen(0.9, dllm_mode="diffusion"),
                                         gen(None, dllm_mode="linear_spec")])
    assert ar.token_ids == ref.ar_generate(plain, prompts[0], max_new_tokens=NEW_TOKENS, eos_ids=set()).token_ids
    want = ref.diffusion_generate(plain, prompts[1], max_new_tokens=NEW_TOKENS, block_length=ids["block"],
                                  mask_id=ids["mask_id"], eos_ids=set(), threshold=0.9)
    assert (diffusion.token_ids, diffusion.step_map) == (want.token_ids, want.step_map)
    assert_speculated(spec, speculation(adapted, ids, prompts[2]))


def test_the_switch_on_another_family_is_refused_at_start(tmp_path):
    """dllm_draft_lora is seeded-block decoding's: an engine of another paradigm refuses it by name."""
    from testing.tiny_checkpoint import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "sdar", model_type="sdar", seed=1)
    with pytest.raises(ValueError, match="dllm_draft_lora"):
        pipeline(str(path), EngineConfig(max_model_len=64, dllm_draft_lora=True))


def test_draft_rows_without_an_adapter_are_refused(ckpt):
    with pipeline(str(ckpt), CONFIG) as p:
        net = p.engine.executor.runner.model
        with pytest.raises(ValueError, match="no draft adapter is loaded"):
            net.forward(torch.tensor([1]), torch.tensor([0]), [], None, None, draft_rows=torch.tensor([True]))


def test_a_rank_share_adds_up_to_the_merged_projection(ckpt):
    """tp=2: each rank's o_proj columns plus its A columns (B whole) sum, over the ranks, to the
    projection with the adapter merged in: W + scale * B A."""
    lora_dir, cfg = ckpt / "linear_spec_lora", json.loads((ckpt / "config.json").read_text())
    in_features, hidden = cfg["num_attention_heads"] * cfg["head_dim"], cfg["hidden_size"]
    tensors = load_file(str(lora_dir / "adapter_model.safetensors"))
    a = tensors["base_model.model.encoder.layers.1.self_attn.o_proj.lora_A.weight"]
    b = tensors["base_model.model.encoder.layers.1.self_attn.o_proj.lora_B.weight"]
    weight = torch.randn(hidden, in_features)
    x = torch.randn(5, in_features)
    merged = x @ (weight + lora_scale(json.loads((lora_dir / "adapter_config.json").read_text())) * b @ a).T
    total = torch.zeros(5, hidden)
    for rank in range(2):
        tp = TPContext(rank=rank, size=2)
        o_proj = nn.Linear(in_features // 2, hidden, bias=False)
        o_proj.weight.data = RowSplit(tp).read(weight, tuple(o_proj.weight.shape))
        adapter = DraftAdapter(read_draft_lora(lora_dir, cfg["num_hidden_layers"], in_features, hidden, tp),
                               [nn.Identity(), o_proj])
        with adapter.rows(torch.ones(5, dtype=torch.bool)):
            total += o_proj(x[:, rank * in_features // 2:(rank + 1) * in_features // 2])
    torch.testing.assert_close(total, merged, atol=1e-5, rtol=1e-5)


def test_peft_scale():
    assert lora_scale({"r": 4, "lora_alpha": 8}) == 2.0
    assert lora_scale({"r": 4, "lora_alpha": 8, "use_rslora": True}) == 4.0
    assert lora_scale({"r": 16}) == 1.0
    assert math.isclose(lora_scale({"r": 2, "lora_alpha": 1, "use_rslora": True}), 2 ** -0.5)


def _broken(ckpt, tmp_path, config: dict | None = None, drop: str | None = None, reshape: str | None = None):
    """A copy of the adapter with `config` merged into adapter_config.json, tensors containing `drop`
    left out, or the first tensor containing `reshape` given one row less."""
    folder = tmp_path / "linear_spec_lora"
    folder.mkdir()
    src = ckpt / "linear_spec_lora"
    cfg = json.loads((src / "adapter_config.json").read_text()) | (config or {})
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = {n: t for n, t in load_file(str(src / "adapter_model.safetensors")).items() if not drop or drop not in n}
    if reshape:
        name = next(n for n in tensors if reshape in n)
        tensors[name] = tensors[name][1:].contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


@pytest.mark.parametrize(("broken", "message"), [
    ({"config": {"target_modules": ["q_proj", "o_proj"]}}, "target_modules=['q_proj', 'o_proj'] is not supported"),
    ({"config": {"use_dora": True}}, "use_dora=True is not supported"),
    ({"config": {"bias": "all"}}, "bias='all' is not supported"),
    ({"config": {"r": 0}}, "r=0 must be a positive integer"),
    ({"drop": "layers.1.self_attn.o_proj.lora_B"}, "layer 1's o_proj lora_B is missing"),
    ({"reshape": "layers.0.self_attn.o_proj.lora_A"}, "layer 0's o_proj lora_A is shape [3, 128], the model needs "
                                                      "[4, 128]"),
])
def test_an_adapter_that_does_not_fit_is_refused_by_name(ckpt, tmp_path, broken, message):
    cfg = json.loads((ckpt / "config.json").read_text())
    folder = _broken(ckpt, tmp_path, **broken)
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_draft_lora(folder, cfg["num_hidden_layers"], cfg["num_attention_heads"] * cfg["head_dim"],
                        cfg["hidden_size"])


def test_a_tensor_of_another_module_is_refused(ckpt, tmp_path):
    folder = _broken(ckpt, tmp_path)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    tensors["base_model.model.encoder.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 64)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    with pytest.raises(CheckpointError, match="q_proj.lora_A.weight' is no LoRA of a layer's o_proj"):
        read_draft_lora(folder, 2, 128, 64)

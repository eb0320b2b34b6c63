"""The canvases of one pass stepped together (`renoising.step_canvases`, as the renoising strategy runs
them) get, draw for draw, what each gets stepped alone: the same reports, tokens, argmax, settle steps,
stops, logprobs and label masses, and the same generator states after -- whatever their knobs, filters,
pins, sets and reads. A canvas whose logits hold a NaN fails alone, its generator untouched, and the
stability test is the one of the last `stability_threshold` argmaxes."""

from __future__ import annotations

import torch

from engine.core.decoding.renoising import (
    STABLE,
    CanvasDecisions,
    CanvasState,
    RenoiseKnobs,
    StepReport,
    step_canvases,
)

V, L = 40, 8


def _canvases() -> list[CanvasState]:
    """Six canvases with different knobs, filters, decisions and reads."""
    plain = RenoiseKnobs(max_denoising_steps=12, entropy_bound=1.5, stop_entropy=0.6)
    kinds = [
        (plain, {}, None),
        (RenoiseKnobs(max_denoising_steps=9, entropy_bound=0.4, t_min=0.2, t_max=1.1, stability_threshold=2,
                      stop_entropy=0.9), {"top_k": 6}, None),
        (RenoiseKnobs(max_denoising_steps=7, entropy_bound=3.0, stability_threshold=0, stop_entropy=0.3),
         {"top_p": 0.7, "logprobs": 2}, None),
        (plain, {"logprobs": 0}, CanvasDecisions.of([None, 5, None, 7], {0: [1, 2, 3], 6: [9, 10]}, L, "cpu")),
        (RenoiseKnobs(max_denoising_steps=10, entropy_bound=2.0, stability_threshold=3, stop_entropy=1.2),
         {"read_steps": 4, "logprobs": 1}, CanvasDecisions.of([None, None, 11], {}, L, "cpu")),
        (plain, {"top_k": 3, "top_p": 0.9}, None),
    ]
    out = []
    for seed, (knobs, extra, decisions) in enumerate(kinds):
        state = CanvasState(knobs, torch.Generator().manual_seed(100 + seed), L, V, **extra)
        state.open_canvas(decisions)
        out.append(state)
    return out


def _snapshot(c: CanvasState) -> tuple:
    return (c.tokens.tolist(), c.argmax.tolist() if c.argmax is not None else None, c.settle.tolist()
            if c.changed_at is not None else None, c.unchanged_steps, c.countdown, c.stop, c.last_logprobs,
            c.label_mass, list(c.replay), c.generator.get_state().tolist())


def _next_canvas(c: CanvasState, decisions: CanvasDecisions | None) -> None:
    c.close_canvas()
    c.open_canvas(decisions)


def test_a_group_steps_each_canvas_as_alone():
    together, alone = _canvases(), _canvases()
    logits_gen = torch.Generator().manual_seed(7)
    histories: list[list[list[int]]] = [[] for _ in alone]
    stops = set()
    # each canvas's rows: sharp at some positions, flatter at others, and a little noise every step (so
    # argmaxes mostly hold: canvases stop stable as well as at their step limits)
    base = torch.randn(len(alone), L, V, generator=logits_gen) * torch.tensor([3.0, 9.0] * (L // 2))[None, :, None]
    for _ in range(40):
        raw = base + 0.3 * torch.randn(len(alone), L, V, generator=logits_gen)
        reports = step_canvases(together, raw.clone())
        for i, (a, b) in enumerate(zip(together, alone, strict=True)):
            single = step_canvases([b], raw[i: i + 1].clone())[0]
            assert isinstance(single, StepReport) and reports[i] == single
            assert _snapshot(a) == _snapshot(b)
            # the stability test: the argmax equals each of the previous `stability_threshold` ones
            threshold, argmax = b.knobs.stability_threshold, b.argmax.tolist()
            earlier = histories[i][-threshold:] if threshold else []
            stable = len(earlier) == threshold and all(h == argmax for h in earlier)
            confident = bool(torch.tensor(single.mean_entropy) < b.knobs.stop_entropy)
            assert (b.stop == STABLE) == (stable and confident)
            histories[i].append(argmax)
            if single.ended:
                stops.add(b.stop)
                histories[i] = []
                decisions = a.decisions
                _next_canvas(a, decisions)
                _next_canvas(b, decisions)
    assert stops == {"stable", "max_steps"}


def test_a_canvas_with_nan_logits_fails_alone():
    together, alone = _canvases()[:3], _canvases()[:3]
    raw = torch.randn(3, L, V, generator=torch.Generator().manual_seed(3))
    raw[1, 4, 0] = float("nan")
    before = together[1].generator.get_state()
    reports = step_canvases(together, raw)
    assert isinstance(reports[1], RuntimeError) and "nan" in str(reports[1])
    assert torch.equal(together[1].generator.get_state(), before) and together[1].argmax is None
    for i in (0, 2):
        assert reports[i] == step_canvases([alone[i]], raw[i: i + 1])[0]
        assert _snapshot(together[i]) == _snapshot(alone[i])


def test_grouping_leaves_an_engines_outputs_unchanged(tmp_path, monkeypatch):
    """Seeded requests of two canvas widths, sampled in one group per width or each canvas alone
    (`GROUP_LOGITS_BYTES` below one canvas): the same tokens, step maps, logprobs, traces and replays."""
    from engine.core.decoding import canvas_renoising
    from testing.tiny.diffusion_gemma import write_tiny_diffusion_gemma
    from tests.support.gemma_decoding import make_engine, params, run

    ckpt = write_tiny_diffusion_gemma(tmp_path / "tiny")
    requests = {f"r{i}": ([5 + i, 17, 3 * i + 1],
                          params(max_new_tokens=24, random_seed=i, logprobs=1 if i % 2 else None,
                                 return_step_trace=True, dllm_canvas_length=8 if i % 3 else None))
                for i in range(6)}

    def outputs() -> dict:
        results = run(make_engine(ckpt), requests)
        return {rid: (r.token_ids, r.step_map, r.logprobs, r.step_trace, r.dllm_replay_canvases)
                for rid, r in results.items()}

    grouped = outputs()
    monkeypatch.setattr(canvas_renoising, "GROUP_LOGITS_BYTES", 1)
    assert outputs() == grouped

"""The knob table (`configs.knobs`) is the one source of what restates it: every knob appears, with its
table's name, type, default, choices and help, in the resolved settings of its paradigm
(`UnmaskingSettings`, `RenoiseKnobs`), among the flags of `python -m engine.trace` and in the viewer's knob
row of each paradigm that reads it -- a knob added to the table appears in all of them. The family rows
name their paradigm with the table's one `Paradigm`."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from configs.knobs import DIFFUSION, KNOBS, PARADIGMS, Knob, Paradigm, settings_of
from deployments.viewer import knob_table
from engine.core.decoding import paradigm_of
from engine.core.decoding.renoising import RenoiseKnobs
from engine.core.decoding.unmasking import UnmaskingSettings
from engine.model.families import FAMILIES
from engine.model.families.diffusion_gemma import generation_defaults
from engine.trace import build_parser

SETTINGS = {UnmaskingSettings: DIFFUSION, RenoiseKnobs: (Paradigm.RENOISING,)}


def _resolved(knob: Knob, paradigms: tuple[Paradigm, ...]) -> bool:
    """Whether a request's resolved settings of `paradigms` hold `knob`."""
    return knob.per_request and not knob.fixed and bool(set(paradigms) & set(knob.used_by))


def _flags() -> dict[str, argparse.Action]:
    """EngineConfig field -> the trace's flag for it."""
    return {a.dest: a for a in build_parser()._actions}


@pytest.mark.parametrize("cls", list(SETTINGS))
def test_each_paradigms_settings_are_its_knobs(cls):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    expected = [k for k in KNOBS.values() if _resolved(k, SETTINGS[cls])]
    assert list(fields) == [k.setting for k in expected]
    for knob in expected:
        default = fields[knob.setting].default
        assert default is dataclasses.MISSING or default == knob.default, knob.name
    assert cls.__dataclass_params__.frozen


def test_the_settings_keep_their_defaults_and_positions():
    assert RenoiseKnobs() == RenoiseKnobs(48, 0.1, 0.4, 0.8, 1, 0.005)
    settings = UnmaskingSettings("sequential", 4, 0.9, 0.35, 0.5, 2)
    assert (settings.strategy, settings.denoising_steps, settings.confidence_threshold, settings.entropy_threshold,
            settings.edit_threshold, settings.max_post_edit_steps, settings.penalty_lambda) == \
        ("sequential", 4, 0.9, 0.35, 0.5, 2, 0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.strategy = "random"  # type: ignore[misc]


def test_every_knob_is_a_trace_flag_as_the_table_declares_it():
    flags = _flags()
    for knob in KNOBS.values():
        action = flags[knob.name]
        assert knob.flag in action.option_strings and action.default is None, knob.name
        assert action.help.startswith(f"{knob.name}: {knob.doc}".replace("%", "%%")), knob.name
        assert all(p in action.help for p in knob.used_by), knob.name
        assert action.choices == knob.choices(), knob.name
        if action.nargs != 0:  # a switch takes no value
            assert action.type in (knob.value_type, str), knob.name
    assert flags["dllm_t_min"].option_strings == ["--t-min"] and flags["dllm_stop_entropy"].type is float


def test_every_offered_knob_is_in_the_viewer_row_of_each_paradigm_that_reads_it():
    table = knob_table()
    assert set(table) == set(PARADIGMS)
    for knob in KNOBS.values():
        for paradigm in PARADIGMS:
            row = {k["name"]: k for k in table[paradigm]}
            assert (knob.name in row) == _resolved(knob, (paradigm,)), (knob.name, paradigm)
            if knob.name in row:
                assert row[knob.name]["label"] == knob.label and row[knob.name].get("choices") == \
                    knob.choices(paradigm), knob.name
    assert [k["name"] for k in table["renoising"]] == [k.name for k in KNOBS.values() if "renoising" in k.used_by]


def test_a_knob_added_to_the_table_appears_everywhere(monkeypatch):
    new = Knob("dllm_canvas_warmth", float, 0.5, "renoising: how warm a canvas starts", (Paradigm.RENOISING,),
               {"ge": 0.0})
    monkeypatch.setitem(KNOBS, new.name, new)

    @settings_of(Paradigm.RENOISING)
    class Settings:
        pass

    assert [f.name for f in dataclasses.fields(Settings)][-1] == "canvas_warmth" and Settings().canvas_warmth == 0.5
    assert _flags()["dllm_canvas_warmth"].option_strings == ["--canvas-warmth"]
    row = knob_table.__wrapped__()["renoising"][-1]
    assert (row["name"], row["label"], row["kind"], row["min"]) == (new.name, "Canvas warmth", "float", 0.0)


def test_one_paradigm_names_how_a_family_decodes():
    for family in FAMILIES.values():
        assert isinstance(family.paradigm, Paradigm) and family.paradigm in PARADIGMS
        assert paradigm_of(family) == family.paradigm
        assert family.is_dllm == (family.paradigm != "autoregressive")
    assert FAMILIES["diffusion_gemma"].paradigm == "renoising" and f"{Paradigm.SUB_BLOCK}" == "sub_block"
    row = dataclasses.replace(FAMILIES["sdar"], paradigm="sub_block")
    assert row.paradigm is Paradigm.SUB_BLOCK
    with pytest.raises(ValueError, match="DLLM"):
        dataclasses.replace(FAMILIES["sdar"], paradigm="DLLM")


def test_a_generation_config_sets_every_renoising_knob_by_its_transformers_name():
    gen = {"max_denoising_steps": 32, "sampler_config": {"entropy_bound": 0.2}, "t_min": 0.3, "t_max": 0.9,
           "stability_threshold": 2, "confidence_threshold": 0.01}
    renoising = {k.name for k in KNOBS.values() if "renoising" in k.used_by}
    # every renoising knob but the canvas width, which config.json's canvas_length gives (not generation_config.json)
    assert set(generation_defaults(gen)) == renoising - {"dllm_canvas_length"}
    assert generation_defaults({"sampler_config": None, "t_max": 0.7}) == {"dllm_t_max": 0.7}

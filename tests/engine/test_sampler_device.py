"""Device placement of the sampler and the logprob gathers, checked without a GPU: every tensor they
build follows the logits onto their device (a fake CUDA device under FakeTensorMode, which raises on
a CPU/CUDA mix), and the random draws come from the host, so nothing needs a device generator.
The fake-CUDA machinery (`fake_cuda`) is explained in tests/support/fake_cuda.py."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

from configs import GenerationConfig
from engine.core.logprobs import logprob_values
from engine.core.sampler import RowGroup, pick_tokens
from tests.support.fake_cuda import fake_cuda, fake_cuda_guard  # noqa: F401 - fixtures

VOCAB = 64
GROUPS = {
    "plain_greedy": [GenerationConfig()],
    "greedy_with_penalty_and_min_tokens": [GenerationConfig(repetition_penalty=1.3, min_new_tokens=2,
                                                            max_new_tokens=4)],
    "sampled_with_every_filter": [GenerationConfig(do_sample=True, temperature=0.7, top_k=8, top_p=0.9, min_p=0.05)],
    "mixed": [GenerationConfig(), GenerationConfig(do_sample=True, top_p=5e-324), GenerationConfig(do_sample=True)],
}


def _groups(params: list[GenerationConfig], rows: int = 3, want_entropy: bool = True, suppress: bool = True):
    return [(i * rows, rows, RowGroup(p, seed=7 + i, first_draw=0, penalty_ids=[1, 5, 9], suppress=[suppress] * rows,
                                       stop_ids=frozenset({2, 3}), want_entropy=want_entropy))
            for i, p in enumerate(params)]


@pytest.mark.parametrize("case", list(GROUPS))
@pytest.mark.parametrize("keep_processed", [False, True])
def test_sampler_stays_on_the_logits_device(fake_cuda, case, keep_processed):  # noqa: F811 - fixture
    groups = _groups(GROUPS[case])
    with fake_cuda():
        logits = torch.empty(3 * len(groups), VOCAB, device="cuda", dtype=torch.bfloat16)
        picked = pick_tokens(logits, groups, need_confidence=True, keep_processed=keep_processed)
        for t in (picked.tokens, picked.confidence, picked.entropy, picked.processed):
            assert t is None or t.device.type == "cuda"
        for mode in ("raw_logprobs", "raw_logits", "processed_logprobs"):
            values = picked.processed if keep_processed else logits
            chosen_v, top_v, top_i = logprob_values(values, picked.tokens, 4, mode)
            assert {chosen_v.device.type, top_v.device.type, top_i.device.type} == {"cuda"}


def test_plain_greedy_ar_without_confidence(fake_cuda):  # noqa: F811 - fixture
    with fake_cuda():
        logits = torch.empty(4, VOCAB, device="cuda")
        groups = _groups([GenerationConfig()], rows=4, want_entropy=False, suppress=False)
        picked = pick_tokens(logits, groups, need_confidence=False)
        assert picked.tokens.device.type == "cuda" and picked.confidence is None


def test_a_host_index_meeting_device_logits_is_caught(fake_cuda):  # noqa: F811 - fixture
    """The check has teeth: a gather index left on the host raises, as it would on a GPU."""
    with fake_cuda():
        logits = torch.empty(4, VOCAB, device="cuda")
        with pytest.raises((FakeTensorDeviceMismatchError, RuntimeError)):
            logprob_values(logits, torch.zeros(4, dtype=torch.long), 2, "raw_logprobs")

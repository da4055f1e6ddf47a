"""vLLM 0.26 drops routed experts when its front end merges streamed outputs; fleetrl's patch keeps them.

vLLM 0.32 (this machine's) merges correctly, so 0.26's ``RequestOutput.add`` is reproduced here by a stand-in
that forgets ``routed_experts`` the way 0.26's does (it copies tokens, logprobs and finish_reason only)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.unit


def _output(tokens: list[int], finished: bool, routes: np.ndarray | None):
    from vllm.outputs import CompletionOutput, RequestOutput

    completion = CompletionOutput(
        0, "", tokens, None, None, routed_experts=routes, finish_reason="length" if finished else None
    )
    return RequestOutput("r", None, [1, 2], None, [completion], finished)


@pytest.fixture
def add_of_vllm_026(monkeypatch):
    from vllm.outputs import RequestOutput

    fixed_add = RequestOutput.add

    def add_forgetting_routes(self, next_output, aggregate):
        kept = [c.routed_experts for c in self.outputs]
        fixed_add(self, next_output, aggregate)
        for completion, routes in zip(self.outputs, kept, strict=False):
            completion.routed_experts = routes  # what 0.26's add leaves: the pending output's (None)

    monkeypatch.setattr(RequestOutput, "add", add_forgetting_routes)
    return RequestOutput


def test_a_merged_terminal_output_loses_its_routes_without_the_patch_and_keeps_them_with_it(add_of_vllm_026):
    from rollout_service.vllm_adapter import keep_routes_through_output_merges

    routes = np.arange(3 * 2 * 2, dtype=np.uint8).reshape(3, 2, 2)
    pending = _output([7], False, None)
    pending.add(_output([8], True, routes), aggregate=True)
    assert pending.outputs[0].routed_experts is None  # the 0.26 symptom: a finished sample without routes

    assert keep_routes_through_output_merges() is True
    assert keep_routes_through_output_merges() is False  # once only
    pending = _output([7], False, None)
    pending.add(_output([8], True, routes), aggregate=True)
    merged = pending.outputs[0]
    assert list(merged.token_ids) == [7, 8] and merged.finish_reason == "length"
    assert np.array_equal(merged.routed_experts, routes)

"""The export plan (trainer_service.export_plan) on synthetic parameters: views and row gathers learned from an
export, equal to it after the parameters change in place; refused where neither describes a tensor."""

from __future__ import annotations

import pytest
import torch

from trainer_service import export_plan

pytestmark = pytest.mark.unit


def parameters() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "qkv": torch.randn(12, 4, generator=gen),  # 2 query groups of 6 rows: 4 q, 1 k, 1 v (interleaved)
        "fc1": torch.randn(2, 6, 4, generator=gen),  # per expert: gate rows then up rows
        "norm": torch.randn(4, generator=gen),
    }


def bridge_export(params):
    """What a bridge does: q/k/v de-interleaved (copies), experts' gate/up halves (views), the norm as it is."""
    grouped = params["qkv"].view(2, 6, 4)
    yield "q.weight", grouped[:, :4].reshape(-1, 4)
    yield "k.weight", grouped[:, 4].reshape(-1, 4)
    yield "v.weight", grouped[:, 5].reshape(-1, 4)
    for expert in range(2):
        yield f"experts.{expert}.gate.weight", params["fc1"][expert, :3]
        yield f"experts.{expert}.up.weight", params["fc1"][expert, 3:]
    yield "norm.weight", params["norm"]


def test_a_learned_plan_reproduces_the_export_after_the_parameters_change_in_place():
    params = parameters()
    plan = export_plan.learn(list(params.values()), bridge_export(params))
    kinds = {name: type(source).__name__ for name, source in plan.sources}
    assert kinds["q.weight"] == "RowsOf" and kinds["experts.1.up.weight"] == "ViewOf"
    with torch.no_grad():
        for tensor in params.values():
            tensor.mul_(1.5).add_(0.25)  # a training step: in place
    assert plan.differs_from(bridge_export(params)) == ""


def test_a_tensor_the_export_computes_is_refused():
    params = parameters()

    def transposing(params):
        yield from bridge_export(params)
        yield "head.weight", params["qkv"].t().contiguous()

    with pytest.raises(export_plan.ExportRefused, match="head.weight"):
        export_plan.learn(list(params.values()), transposing(params))


def test_rows_that_repeat_in_the_parameter_are_not_matched():
    params = parameters()
    params["qkv"][5] = params["qkv"][0]  # two equal rows: which one a later version's row comes from is unknown
    with pytest.raises(export_plan.ExportRefused, match="distinct rows"):
        export_plan.learn(list(params.values()), bridge_export(params))


def test_the_planned_export_learns_once_relearns_when_parameters_move_and_checks_against_the_bridge(monkeypatch):
    params = parameters()
    calls = []

    def bridge():
        calls.append(1)
        return bridge_export(params)

    planned = export_plan.PlannedExport(lambda: list(params.values()), bridge, enabled=True)
    assert [n for n, _ in planned()] == [n for n, _ in bridge_export(params)]
    list(planned())
    assert len(calls) == 1  # the second export did not call the bridge
    params["norm"] = params["norm"].clone()  # a load replaced a parameter
    list(planned())
    assert len(calls) == 2 and planned.plan is not None
    monkeypatch.setattr(export_plan, "CHECK_EVERY", 1)

    def drifted():
        calls.append(1)
        for name, tensor in bridge_export(params):
            yield name, tensor + (1.0 if name == "norm.weight" else 0.0)

    planned.bridge_export = drifted
    list(planned())
    assert planned.plan is None and not planned.enabled  # dropped for good after a difference

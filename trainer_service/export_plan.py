"""The export plan: the trainer's HF-named tensors as views (or fixed row gathers) of its own parameters, learned
from one megatron-bridge export and checked equal to it, then produced without the bridge for later versions.

Why: the bridge's ``export_hf_weights`` converts every tensor in Python (name mapping, expert splitting, QKV
de-interleaving) each time it is called; on one GPU most HF tensors are plain views of Megatron's parameters (an
expert's ``gate_proj`` is half of its ``linear_fc1`` weight) and the rest fixed row selections of one (q, k and v out
of the interleaved ``linear_qkv``). Those relations do not change while the parameters are updated in place.

- ``learn``: for every exported tensor, a view of some parameter's storage with the same bytes, or, for a 2-D tensor
  that is no view, the rows of one parameter it selects (matched by an exact per-row hash; the parameter's rows must
  be distinct, so the match is the only one). A tensor that is neither refuses the plan (the bridge stays).
- ``export``: the recorded views, and one ``index_select`` per gathered tensor.
- ``check``: every ``CHECK_EVERY`` versions the plan's tensors are compared with a bridge export again; a difference
  drops the plan for good (logged).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

logger = logging.getLogger("trainer_service")

CHECK_EVERY = 100  # versions between two comparisons of the plan with a bridge export


class ExportRefused(Exception):
    """An exported tensor is neither a view nor a row selection of a parameter."""


@dataclass(frozen=True)
class ViewOf:
    owner: torch.Tensor  # any tensor on the storage (a parameter)
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int

    def tensor(self) -> torch.Tensor:
        return self.owner.as_strided(self.shape, self.stride, self.storage_offset)


@dataclass(frozen=True)
class RowsOf:
    parameter: torch.Tensor  # 2-D
    rows: torch.Tensor  # int64 indices on the parameter's device

    def tensor(self) -> torch.Tensor:
        return self.parameter.index_select(0, self.rows)


class ExportPlan:
    def __init__(self, sources: list[tuple[str, ViewOf | RowsOf]]):
        self.sources = sources

    def export(self) -> Iterator[tuple[str, torch.Tensor]]:
        with torch.no_grad():
            for name, source in self.sources:
                yield name, source.tensor()

    def differs_from(self, exported: Iterable[tuple[str, torch.Tensor]]) -> str:
        """'' when ``exported`` (a bridge export) equals the plan's tensors, else the first difference."""
        ours = dict(self.export())
        seen = 0
        for name, tensor in exported:
            seen += 1
            mine = ours.get(name)
            if mine is None or mine.shape != tensor.shape or not torch.equal(mine, tensor):
                return f"{name} differs"
        return "" if seen == len(ours) else f"the bridge exported {seen} tensors, the plan has {len(ours)}"


def learn(parameters: list[torch.Tensor], exported: Iterable[tuple[str, torch.Tensor]]) -> ExportPlan:
    """The plan for ``exported`` (consumed whole) in terms of ``parameters``; raises ExportRefused."""
    by_storage = {p.untyped_storage().data_ptr(): p for p in parameters}
    rows = RowIndex(parameters)
    sources: list[tuple[str, ViewOf | RowsOf]] = []
    for name, tensor in exported:
        owner = by_storage.get(tensor.untyped_storage().data_ptr())
        if owner is not None and owner.dtype == tensor.dtype:
            sources.append((name, ViewOf(owner, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())))
        else:
            sources.append((name, rows.rows_of(name, tensor)))
    return ExportPlan(sources)


class RowIndex:
    """Every row of the 2-D parameters with distinct rows, by (dtype, width, row hash): finds which parameter and
    rows a gathered tensor was taken from in one lookup per row (built lazily per dtype and width)."""

    def __init__(self, parameters: list[torch.Tensor]):
        self.parameters = [p for p in parameters if p.dim() == 2]
        self.index: dict[tuple[torch.dtype, int], dict[int, tuple[int, int]]] = {}

    def _rows(self, dtype: torch.dtype, width: int) -> dict[int, tuple[int, int]]:
        key = (dtype, width)
        if key not in self.index:
            found: dict[int, tuple[int, int]] = {}
            repeated: set[int] = set()
            for number, parameter in enumerate(self.parameters):
                if parameter.dtype != dtype or parameter.shape[1] != width:
                    continue
                for row, row_hash in enumerate(_row_hashes(parameter).tolist()):
                    if row_hash in found:
                        repeated.add(row_hash)  # equal rows: which one a later version's row comes from is unknown
                    found[row_hash] = (number, row)
            self.index[key] = {h: where for h, where in found.items() if h not in repeated}
        return self.index[key]

    def rows_of(self, name: str, tensor: torch.Tensor) -> RowsOf:
        if tensor.dim() != 2 or tensor.shape[0] == 0:
            raise ExportRefused(f"{name} is no view of a parameter")
        index = self._rows(tensor.dtype, tensor.shape[1])
        located = [index.get(h) for h in _row_hashes(tensor).tolist()]
        if None in located or len({number for number, _ in located}) != 1:
            raise ExportRefused(f"{name} is neither a view nor a row selection of one parameter with distinct rows")
        parameter = self.parameters[located[0][0]]
        selected = RowsOf(parameter, torch.tensor([row for _, row in located], device=parameter.device))
        if not torch.equal(selected.tensor(), tensor):
            raise ExportRefused(f"{name}: its rows' fingerprints match but their values do not")
        return selected


def _row_hashes(matrix: torch.Tensor) -> torch.Tensor:
    """An exact per-row fingerprint: the row's bits as integers, mixed with fixed odd weights (int64 wraps)."""
    bits = matrix.detach().contiguous().view(_int_dtype(matrix.dtype)).to(torch.int64)
    weights = torch.arange(matrix.shape[1], device=matrix.device, dtype=torch.int64) * 2654435761 + 97531
    return (bits * weights).sum(dim=1) * 1000003 + (bits * (weights * 40503 + 1)).sum(dim=1)


def _int_dtype(dtype: torch.dtype) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]


class PlannedExport:
    """A backend's export through its plan once learned (world size 1, no LoRA); the bridge otherwise."""

    def __init__(self, parameters, bridge_export, enabled: bool):
        self.parameters = parameters  # () -> list of the model's parameters
        self.bridge_export = bridge_export  # () -> iterator of (HF name, tensor)
        self.enabled = enabled
        self.plan: ExportPlan | None = None
        self.pointers: list[int] = []  # the parameters' addresses the plan was learned on
        self.exports = 0

    def __call__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.exports += 1
        if not self.enabled:
            return self.bridge_export()
        pointers = [p.data_ptr() for p in self.parameters()]
        if self.plan is None or pointers != self.pointers:  # parameters moved (a load): learn anew
            self.pointers = pointers
            return self._learn()
        if self.exports % CHECK_EVERY == 0:
            difference = self.plan.differs_from(self.bridge_export())
            if difference:
                logger.warning(
                    "export plan dropped (the bridge's export changed: %s); exporting through it", difference
                )
                self.plan, self.enabled = None, False
                return self.bridge_export()
        return self.plan.export()

    def _learn(self) -> Iterator[tuple[str, torch.Tensor]]:
        exported = list(self.bridge_export())
        try:
            self.plan = learn(self.parameters(), exported)
            views = sum(isinstance(source, ViewOf) for _, source in self.plan.sources)
            logger.info(
                "export plan learned: %d tensors, %d views of parameters, %d row gathers",
                len(exported),
                views,
                len(exported) - views,
            )
        except ExportRefused as error:
            logger.warning("no export plan (the bridge exports every version): %s", error)
            self.enabled = False
        return iter(exported)

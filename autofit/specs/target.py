"""The target of a search: what is trained (model), on what (cluster), on which data (workload),
and the memory budget a plan must fit in. Every evaluation and every stored study has one."""

from __future__ import annotations

from dataclasses import dataclass

from autofit.specs.cluster import ClusterSpec
from autofit.specs.models import ModelSpec
from autofit.specs.workload import Workload


@dataclass(frozen=True)
class Target:
    model: ModelSpec
    cluster: ClusterSpec
    workload: Workload
    headroom: float = 0.05

    @property
    def capacity_bytes(self) -> int:
        return self.cluster.gpu.memory_bytes

    @property
    def budget_bytes(self) -> int:
        return int(self.capacity_bytes * (1 - self.headroom))

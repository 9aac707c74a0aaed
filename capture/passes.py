"""Inductor's one ``post_grad_custom_pre_pass`` slot, holding graphrt's graph passes."""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass


class PrePasses(CustomGraphPass):
    """Several passes in Inductor's one pre-pass slot, run in order; the uuid that keys
    Inductor's on-disk cache joins theirs."""

    def __init__(self, passes: list[CustomGraphPass]) -> None:
        self.passes = passes

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> bytes:
        return b"|".join(p.uuid() for p in self.passes)

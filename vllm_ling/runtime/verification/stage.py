"""Which part of the model this process holds: its pipeline stage (rank, size, the target's layer
range) and whether the head is here. Every count a check expects is the stage's."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Stage:
    """This process's pipeline stage: rank, size and the target's layer range [start, end)."""

    rank: int
    size: int
    start: int
    end: int

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def label(self) -> str:
        return f"pipeline stage {self.rank} of {self.size} (layers {self.start}..{self.end - 1})"


def pipeline_stage(target, num_layers: int) -> Stage:
    """The stage from vLLM's pipeline group and the target's own layer range (the whole model
    when there is no distributed state, e.g. in unit tests)."""
    try:
        from vllm.distributed import get_pp_group

        group = get_pp_group()
        rank, size = group.rank_in_group, group.world_size
    except Exception:  # noqa: BLE001 - no distributed state
        rank, size = 0, 1
    model = getattr(target, "model", None)
    return Stage(rank, size, int(getattr(model, "start_layer", 0)), int(getattr(model, "end_layer", num_layers)))


def has_head(target) -> bool:
    """False on a pipeline stage without the head (vLLM's PPMissingLayer stands in)."""
    return hasattr(getattr(target, "lm_head", None), "quant_method")

"""CUDA graphs for prefill-sized steps: vLLM's capture sizes plus a ladder up to the prefill chunk.

Why: vLLM sizes its CUDA graphs for decode batches (2 x max_num_seqs x the decode query length,
at most 512 tokens), so a prompt's chunks run outside them and every kernel of the step is
dispatched from Python. For Ling's full-size model on an H100 that is 140-155 ms of host time per
1,920-token chunk where the kernels need 72 ms, in vLLM's composition and ours alike
(``benchmarks/results/prefill_profile_h100.md``). Patch P13 calls :func:`add_prefill_sizes` right
after vLLM computed its own sizes: vLLM's list stays as it is (its decode sizes included) and the
ladder's sizes above it are added, up to ``VLLM_LING_PREFILL_GRAPH_TOKENS`` and at most
``max_num_batched_tokens``. Prefill steps then replay piecewise graphs; the attention and KDA
layers still run eagerly between the pieces, where vLLM splits the graph.

The decision is recorded on the target's hf_config (it reaches every process, as the speculative
selection does) and checked against the sizes in force in each worker
(:mod:`vllm_ling.runtime.verification.prefill_graphs`).
"""

from __future__ import annotations

import dataclasses
import logging

from vllm_ling.log import get_logger, log_once
from vllm_ling.options import Choice, LingOptions, opt_out_setting
from vllm_ling.selection import Feature, Selection, record_on_config, recorded_on_config

logger = get_logger("config")

PREFILL_GRAPHS_ATTR = "vllm_ling_prefill_graphs"
# Powers of two up to FINE_UP_TO tokens, then multiples of COARSE_STEP: a step pads to the next size
# (wasted GPU work, cheap while a step is host-bound), and the hybrid model's 1,920-token chunk is one.
FINE_UP_TO = 256
COARSE_STEP = 128


class PrefillGraphs(Choice):
    ADDED = "added"        # the ladder's sizes above vLLM's were added
    COVERED = "covered"    # vLLM's own sizes already reach the limit
    OPTED_OUT = "vllm"     # VLLM_LING_PREFILL_GRAPH_TOKENS=0: vLLM's sizes
    USER = "user"          # the user's --compilation-config capture sizes
    NO_GRAPHS = "none"     # vLLM captures no piecewise graphs (--enforce-eager, or its cudagraph mode)


SERVING = frozenset((PrefillGraphs.ADDED, PrefillGraphs.COVERED))


@dataclasses.dataclass(frozen=True)
class PrefillGraphsSelection(Selection):
    """``up_to``: the largest step (tokens) that replays a graph once this decision is applied."""

    up_to: int = 0

    def served_as(self) -> tuple:
        return (self.choice, self.up_to)


def prefill_ladder(limit: int) -> list[int]:
    """The prefill sizes up to ``limit`` tokens, ``limit`` itself included."""
    sizes, n = [], 8
    while n <= min(limit, FINE_UP_TO):
        sizes.append(n)
        n *= 2
    sizes += range(FINE_UP_TO + COARSE_STEP, limit + 1, COARSE_STEP)
    return sorted(set(sizes) | {limit}) if limit >= 1 else []


def graphs_in_force(compilation_config) -> int:
    """The largest step that replays a piecewise graph under this compilation config (0: none)."""
    mode = compilation_config.cudagraph_mode
    sizes = compilation_config.cudagraph_capture_sizes or []
    return max(sizes) if sizes and mode is not None and mode.has_piecewise_cudagraphs() else 0


def add_prefill_sizes(vllm_config, user_gave_sizes: bool, options: LingOptions | None = None) -> PrefillGraphsSelection:
    """Extend vLLM's just-computed capture sizes (P13), record the decision on the target's
    hf_config and log it once; returns the selection."""
    options = options or LingOptions.current()
    compilation = vllm_config.compilation_config
    sizes = sorted(compilation.cudagraph_capture_sizes or [])
    vllm_up_to = graphs_in_force(compilation)
    wanted = min(options.prefill_graph_tokens, vllm_config.scheduler_config.max_num_batched_tokens)
    if vllm_up_to == 0:
        why = ("--enforce-eager" if vllm_config.model_config.enforce_eager
               else f"cudagraph_mode {getattr(compilation.cudagraph_mode, 'name', compilation.cudagraph_mode)}")
        selection = PrefillGraphsSelection(Feature.PREFILL_GRAPHS, PrefillGraphs.NO_GRAPHS,
                                           f"vLLM captures no piecewise CUDA graphs ({why})")
    elif user_gave_sizes:
        selection = PrefillGraphsSelection(Feature.PREFILL_GRAPHS, PrefillGraphs.USER,
                                           "the capture sizes given in --compilation-config", up_to=vllm_up_to)
    elif options.prefill_graph_tokens == 0:
        selection = PrefillGraphsSelection(Feature.PREFILL_GRAPHS, PrefillGraphs.OPTED_OUT,
                                           f"opted out ({opt_out_setting('VLLM_LING_PREFILL_GRAPH_TOKENS')})",
                                           up_to=vllm_up_to)
        log_once(logger, logging.WARNING, "prefill-graphs-off",
                 "Prefill CUDA graphs are OFF (%s): vLLM's capture sizes end at %d tokens, so longer prefill "
                 "steps dispatch every kernel from Python.", selection.reason, vllm_up_to)
    else:
        added = [n for n in prefill_ladder(wanted) if n > vllm_up_to]
        if added:
            compilation.cudagraph_capture_sizes = sorted(set(sizes) | set(added))
            compilation.max_cudagraph_capture_size = compilation.cudagraph_capture_sizes[-1]
            compilation.post_init_cudagraph_sizes()
            selection = PrefillGraphsSelection(
                Feature.PREFILL_GRAPHS, PrefillGraphs.ADDED,
                f"{len(added)} prefill sizes added above vLLM's {vllm_up_to}", up_to=compilation.max_cudagraph_capture_size)
        else:
            selection = PrefillGraphsSelection(Feature.PREFILL_GRAPHS, PrefillGraphs.COVERED,
                                               f"vLLM's sizes reach {vllm_up_to} tokens", up_to=vllm_up_to)
    record_prefill_graphs(vllm_config.model_config.hf_config, selection)
    if selection.choice is PrefillGraphs.ADDED:
        log_once(logger, logging.INFO, "prefill-graphs",
                 "Prefill steps up to %d tokens replay piecewise CUDA graphs (%s).", selection.up_to, selection.reason)
    return selection


def record_prefill_graphs(hf_config, selection: PrefillGraphsSelection) -> None:
    record_on_config(hf_config, PREFILL_GRAPHS_ATTR, selection)


def recorded_prefill_graphs(hf_config) -> PrefillGraphsSelection | None:
    """The decision P13 recorded (None: vLLM never sized CUDA graphs here, e.g. the CPU platform)."""
    return recorded_on_config(hf_config, PREFILL_GRAPHS_ATTR, PrefillGraphsSelection, Feature.PREFILL_GRAPHS,
                              PrefillGraphs)

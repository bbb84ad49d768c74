"""Runs Megatron-LM's own interleaved pipeline schedule (megatron-core's
`forward_backward_pipelining_with_interleaving`) up to the point where it has checked the number of
micro-batches against the pipeline and the micro-batch group, and prints what it decided as JSON:
tests/tuner/test_export.py runs this in a process of its own, because importing megatron.core takes
~10 s and patches torch.

    python tests/tuner/megatron_schedule.py '{"NAME": [pp, virtual_stages, num_microbatches, group], ...}'

group is --microbatch-group-size-per-virtual-pipeline-stage, or null when the command leaves it out
(Megatron's TransformerConfig then sets it to pp). For each NAME one JSON object: the version of
megatron-core, `error` (what the schedule raised) or null, and `table`, the (micro-batch, model chunk)
order every rank runs its forward passes in (Megatron's get_schedule_table).

Nothing is faked in the decision itself: the config is Megatron's TransformerConfig, and the function
is Megatron's. What it is given instead of a cluster: a pipeline group that only answers its size and
rank, model chunks that carry the config, and fake tensors (its token counter is allocated on cuda).
The first thing it asks of the communicator after the checks (it never asks before them) raises
`PastTheChecks`, so a layout that gets that far is one the schedule accepted.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import warnings
from types import SimpleNamespace


class PastTheChecks(Exception):
    """Raised by the stand-in communicator: the schedule got past its checks and started to run."""


class _Group:
    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


class _Communicator:
    """Answers pp_group and config, as megatron's P2PCommunicator does; any other use means the
    schedule went on to communicate."""

    def __init__(self, pp: int, config):
        self.pp_group, self.config = _Group(pp), config

    def __getattr__(self, name: str):
        raise PastTheChecks(name)


def run_schedule(pp: int, virtual_stages: int, num_microbatches: int, group: int | None) -> str | None:
    """None when Megatron's interleaved schedule accepts the layout, else what it raised."""
    import torch
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torch._subclasses.fake_tensor import FakeTensorMode

    config = TransformerConfig(
        num_layers=pp * virtual_stages, hidden_size=64, num_attention_heads=4, pipeline_dtype=torch.bfloat16,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=virtual_stages,
        microbatch_group_size_per_vp_stage=group,
    )  # fmt: skip
    chunks = []
    for _ in range(virtual_stages):
        chunk = torch.nn.Module()
        chunk.config, chunk.model_type = config, ModelType.encoder_or_decoder
        chunks.append(chunk)
    one = _Group(1)
    groups = SimpleNamespace(tp=one, cp=one, embd=None, pos_embd=None, pp=_Group(pp), dp_cp=one)

    def forward_step(*args, **kwargs):
        raise PastTheChecks("forward_step")

    try:
        with FakeTensorMode():
            schedules.forward_backward_pipelining_with_interleaving(
                forward_step_func=forward_step, data_iterator=[iter(())] * virtual_stages, model=chunks,
                num_microbatches=num_microbatches, seq_length=8, micro_batch_size=1,
                p2p_communicator=_Communicator(pp, config), pg_collection=groups,
            )  # fmt: skip
    except PastTheChecks:
        return None
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("the schedule returned without communicating")


def main() -> None:
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed" on every import
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    version = importlib.metadata.version("megatron-core")
    results = {}
    for name, (pp, virtual_stages, num_microbatches, group) in json.loads(sys.argv[1]).items():
        error = run_schedule(pp, virtual_stages, num_microbatches, group)
        table = get_schedule_table(num_microbatches, virtual_stages, group or pp) if error is None else []
        results[name] = {"megatron_core": version, "error": error, "table": [list(t) for t in table]}
    print(json.dumps(results))


if __name__ == "__main__":
    main()

"""The search space: every enumerated layout is valid, every rejection names a rule it breaks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from tuner.space import RULE_BATCH, RULE_CROSS_NODE_TP, RULE_GPUS, SearchSpace
from tuner.spec import SpaceSpec, parse_spec


def _obeys_every_rule(space: SearchSpace, c: ParallelConfig) -> bool:
    """The constraints, written out plainly, independent of the code under test."""
    m = space.model
    interleaved = c.pp_schedule == "interleaved_1f1b"
    v_shaped = c.pp_schedule in ("zbv", "dualpipev")
    return (
        c.tp * c.pp * c.dp == space.num_gpus
        and c.micro_batch_size * c.num_microbatches * c.dp == space.global_batch_size
        and m.num_heads % c.tp == 0
        and (m.num_kv_heads or m.num_heads) % c.tp == 0
        and m.num_layers >= c.pp * c.virtual_stages
        and (not c.sequence_parallel or (c.tp > 1 and m.seq_len % c.tp == 0))
        and (c.tp <= space.gpus_per_node or space.space.allow_cross_node_tp)
        and (
            not interleaved
            or c.pp == 1
            or (c.virtual_stages >= 2 and c.num_microbatches % max(1, c.num_microbatches // c.pp) == 0)
        )
        and (c.pp == 1 or c.pp_schedule != "1f1b" or c.num_microbatches >= c.pp)
        and (c.virtual_stages == 1 or (c.pp > 1 and (interleaved or v_shaped)))
        and (not v_shaped or c.pp == 1 or (c.virtual_stages == 2 and c.num_microbatches >= 2 * c.pp))
        and ((c.zero_stage == 0 and c.dp_shard == 1) or (c.zero_stage > 0 and c.dp_shard * c.cp > 1))
        and c.zero_stage in (0, 2, 3)
    )


# rule -> predicate that must hold when explain() names the rule
BROKEN = {
    RULE_GPUS: lambda s, c: c.world_size != s.num_gpus,
    RULE_BATCH: lambda s, c: c.global_batch_size != s.global_batch_size,
    RULE_CROSS_NODE_TP: lambda s, c: c.tp > s.gpus_per_node,
    "tp must divide num_heads": lambda s, c: s.model.num_heads % c.tp != 0,
    "tp must divide num_kv_heads": lambda s, c: (s.model.num_kv_heads or s.model.num_heads) % c.tp != 0,
    "tp must divide ffn_hidden_size": lambda s, c: s.model.ffn_size % c.tp != 0,
    "tp must divide vocab_size": lambda s, c: s.model.vocab_size % c.tp != 0,
    "sequence_parallel needs tp > 1": lambda s, c: c.sequence_parallel and c.tp == 1,
    "sequence_parallel needs tp to divide seq_len": lambda s, c: (
        c.sequence_parallel and s.model.seq_len % c.tp != 0
    ),
    "every pipeline stage needs a layer": lambda s, c: s.model.num_layers < c.pp * c.virtual_stages,
    "1F1B needs num_microbatches >= pp": lambda s, c: c.pp_schedule == "1f1b" and c.num_microbatches < c.pp,
    "interleaved_1f1b needs virtual_stages >= 2": lambda s, c: (
        c.pp_schedule == "interleaved_1f1b" and c.virtual_stages < 2
    ),
    "virtual_stages > 1 needs a multi-stage schedule with pp > 1": lambda s, c: (
        c.virtual_stages > 1 and (c.pp == 1 or c.pp_schedule not in ("interleaved_1f1b", "zbv", "dualpipev"))
    ),
    "a V schedule needs virtual_stages 2": lambda s, c: (
        c.pp_schedule in ("zbv", "dualpipev") and c.virtual_stages != 2
    ),
    "a V schedule with block recompute is not priced": lambda s, c: (
        c.pp_schedule in ("zbv", "dualpipev")
        and c.pp > 1
        and c.activation_checkpoint in ("selective", "op", "full")
    ),
    "a V schedule needs num_microbatches >= 2 pp": lambda s, c: (
        c.pp_schedule in ("zbv", "dualpipev") and c.num_microbatches < 2 * c.pp
    ),
    "interleaved 1F1B needs num_microbatches to be a multiple of num_microbatches // pp": lambda s, c: (
        c.num_microbatches % max(1, c.num_microbatches // c.pp) != 0
    ),
    "zero_stage not offered by the trainer": lambda s, c: c.zero_stage == 1,
    "dp_shard > 1 needs zero_stage 2 or 3": lambda s, c: c.dp_shard > 1 and c.zero_stage == 0,
    "zero_stage > 0 needs dp > 1": lambda s, c: c.dp_shard == 1 and c.zero_stage > 0 and c.cp == 1,
}

pow2 = st.sampled_from([1, 2, 4, 8, 16])


@st.composite
def spaces(draw) -> SearchSpace:
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]))
    kv_heads = draw(st.sampled_from([None, *(k for k in range(1, heads + 1) if heads % k == 0)]))  # GQA
    llama = draw(st.booleans())
    model = ModelConfig(
        num_layers=draw(st.integers(1, 40)), hidden_size=heads * draw(st.sampled_from([8, 16, 64])),
        num_heads=heads, vocab_size=draw(st.sampled_from([256, 1000, 50304])),
        seq_len=draw(st.sampled_from([32, 100, 2048])), num_kv_heads=kv_heads,
        **({"norm": "rmsnorm", "mlp": "swiglu", "positions": "rope"} if llama else {}),
    )  # fmt: skip
    space = SpaceSpec(
        tp=draw(st.lists(pow2, min_size=1, max_size=4)), pp=draw(st.lists(pow2, min_size=1, max_size=4)),
        micro_batch_size=draw(st.lists(st.sampled_from([1, 2, 3, 4, 8]), min_size=1, max_size=3)),
        zero_stage=draw(st.lists(st.sampled_from([0, 1, 2, 3]), min_size=1)),
        pp_schedule=draw(st.lists(st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"]), min_size=1)),
        virtual_stages=draw(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=3)),
        allow_cross_node_tp=draw(st.booleans()),
        dp_replicate=draw(st.lists(st.sampled_from([1, 2, 4]), min_size=1, max_size=2, unique=True)),
    )  # fmt: skip
    return SearchSpace(model, draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64])), draw(st.sampled_from([1, 2, 4, 8])),
                       draw(st.integers(1, 512)), space)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(spaces())
def test_every_enumerated_layout_is_valid(space: SearchSpace) -> None:
    result = space.enumerate()
    for c in result.valid:
        assert space.explain(c) == [], c
        assert _obeys_every_rule(space, c), c
    assert result.space_size == len(result.valid) + result.num_rejected
    assert len(set(result.valid)) == len(result.valid)


@settings(max_examples=300, deadline=None)
@given(
    spaces(),
    st.builds(
        ParallelConfig,
        tp=st.integers(1, 16),
        pp=st.integers(1, 16),
        dp_replicate=st.integers(1, 4),
        dp_shard=st.integers(1, 4),
        micro_batch_size=st.integers(1, 8),
        num_microbatches=st.integers(1, 32),
        zero_stage=st.integers(0, 3),
        activation_checkpoint=st.sampled_from(["none", "selective", "full"]),
        sequence_parallel=st.booleans(),
        pp_schedule=st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"]),
        virtual_stages=st.integers(1, 4),
    ),
)
def test_every_named_rule_is_really_broken(space: SearchSpace, c: ParallelConfig) -> None:
    violations = space.violations(c)
    for rule, message in violations:
        assert rule in BROKEN, f"untested rule {rule!r}"
        assert BROKEN[rule](space, c), f"{rule!r} named for {c} but not broken ({message})"
    if not violations:
        assert _obeys_every_rule(space, c)


def test_tp_beyond_a_node_is_valid_unless_the_study_excludes_it() -> None:
    """Megatron-LM runs tp across nodes (slowly; Narayanan et al. 2021 fig. 13): a valid layout,
    priced over the inter-node link, that a study may still leave out."""
    model = ModelConfig(num_layers=8, hidden_size=1024, num_heads=16)
    layout = ParallelConfig(tp=16, micro_batch_size=1, num_microbatches=4)
    assert SearchSpace(model, 16, 8, 4).explain(layout) == []
    excluded = SearchSpace(model, 16, 8, 4, SpaceSpec(allow_cross_node_tp=False)).explain(layout)
    assert any("gpus_per_node (8)" in r for r in excluded)


def test_an_unpadded_vocabulary_is_padded_not_rejected() -> None:
    """GPT-2's 50257 tokens: Megatron pads to a multiple of 128 x tp, so every tp is a layout."""
    model = ModelConfig(num_layers=8, hidden_size=1024, num_heads=16, vocab_size=50257)
    result = SearchSpace(model, 8, 8, 8, SpaceSpec(tp=[1, 2, 4, 8])).enumerate()
    assert {c.tp for c in result.valid} == {1, 2, 4, 8}
    assert not any("vocab" in rule for rule in result.rejected)


def test_pinned_pp_outside_the_defaults() -> None:
    """pp=35 for a 105-layer model is a valid layout even though 35 is no power of two."""
    model = ModelConfig(num_layers=105, hidden_size=12288, num_heads=96)
    space = SearchSpace(model, 35 * 8 * 2, 8, 70, SpaceSpec(tp=[8], pp=[35]))
    valid = space.enumerate().valid
    assert valid and all(c.pp == 35 and c.dp == 2 for c in valid)


def test_one_trillion_on_3072_gpus_enumerates() -> None:
    """Its speed (issue: under 1 s) is measured by bench/plan_speed.py, not here."""
    spec = parse_spec({"model": "gpt-1t", "cluster": {"preset": "frontier-mi250x", "num_nodes": 384},
                       "training": {"global_batch_size": 1536}})  # fmt: skip
    result = SearchSpace.from_spec(spec).enumerate()
    assert len(result.valid) > 1000 and result.space_size == len(result.valid) + result.num_rejected

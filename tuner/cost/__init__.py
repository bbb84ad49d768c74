"""The cost model by parts: what a layout costs in step time and memory, from one `Case` (case.py:
the model, the layout, the hardware, the dtype's bytes, the constants) and each axis's part.

    case.py         the case and what every part reads of it
    dtypes.py       bytes per value of the compute dtype (the one place a precision becomes bytes)
    collectives.py  a collective's or a send's price on a group's link, by tier (Comm, Link)
    layer.py        one decoder layer: its parameters and the activations it keeps
    compute.py      GEMMs, attention and memory-bound work per stage; the launch floor
    tensor.py       tensor parallelism (1D, 2D): its collectives and waits
    pipeline.py     pipeline parallelism: bubble, sends; stage layers, in-flight micro-batches
    data.py         data parallelism and ZeRO/FSDP: gradients, gathers, optimizer; model states
    context.py      context parallelism: K/V gathers, attention keys; gathered K/V and masks
    experts.py      a mixture of experts: experts' GEMMs, all-to-all, imbalance; expert states
    terms.py        StepTerms, Estimate: what an estimate says
    step.py         the step: each part's terms, summed (estimate_case)
    memory.py       the memory: each part's bytes on the fullest rank, by phase

tuner/perfmodel.py and tuner/memmodel.py keep the entry points (`estimate`, `memory`) with their
(model, layout, ...) signatures; tuner/pricing.py (a study bound once, memoised) calls `estimate`.
"""

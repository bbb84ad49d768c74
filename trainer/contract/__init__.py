"""The trainer's contract: what the tuner and the API may import of the trainer (torch-free).

axes.py       THE table of parallel axes; everything that lists axes derives from it
rules.py      each axis's layout rules (its validity hook in the table)
parallel.py   ParallelConfig, its fields made from the axis table
model.py      ModelConfig: the fields of every model family, validated
blocks.py     THE table of block parts (norms, MLPs, positions, attention) and their facts
families/     THE registry of model families: block, presets, Hugging Face readers, export support
presets.py    every family's named shapes, in the registry's order
result.py     BenchmarkConfig (one trial), BenchmarkResult, trainer_problems
trial_dir.py  a trial's work directory and environment
topology.py   where a layout's ranks sit (the placement rule)
devices.py    device peaks and bandwidths
"""

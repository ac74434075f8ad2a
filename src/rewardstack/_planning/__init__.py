"""Planning: full-size memory on a laptop (the meta-device simulation) and `rewardstack plan`.

Sits above the scorers (the simulation runs each family's own scoring code on the meta device) and
below the commands: `replay`, `plan`, the benchmark and the GPU check read it. `btlm` is the
BTLM-like remote code the simulation runs for the default DPO model.
"""

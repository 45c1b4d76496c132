"""DMT towers (Disaggregated Multi-Tower, MLSys 2024): the variant of the sparse side in which
groups of features are compressed on the parameter nodes before they cross to the trainers.

    plan.py       the plan file: which features form which tower, and each tower's c_t
    partition.py  finding a plan: balanced clustering of strongly interacting features
    report.py     describing a plan: cost balance, kept interaction share
    layout.py     placing a plan on a job: servers per tower, their sharding, trainer routing
    module.py     the tower module (runs on the servers; served models run it too)
    stage.py      the tower stage that plugs into the server loop and the distributed client

This file imports nothing, so that serving can load ``module.py`` without the training kernels.
"""

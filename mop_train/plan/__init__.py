"""The per-rank memory plan: what each rank's device and host will hold at the step's peak, term by
term, from the model, the layout and the operators' own bounds -- before anything launches.

    mop-train plan --world 64 --gpu-memory 141GiB --host-memory 2TiB configs/mop_667b.toml   # report.py
    mop-train plan --auto --objective context --world 64 ... configs/mop_667b.toml         # auto.py

- terms.py       the plan's terms: device bytes at the largest of three moments of the step (the loss,
                 the first and the last block's backward) and the host bytes the operators pin. Every
                 operator's line is its `device_bound(settings, shapes) -> DeviceBound`
                 (mop_train.ops.bound), the model's lines what its modules save (mop_train.models.memory).
- job.py         a job's plan from its configuration: on paper (a meta model, no process group) or from
                 the parts the launch built (mop_train.train.build prints and checks it at launch).
- report.py      `mop-train plan`: the printed plan and whether it fits the GPU and the node's host.
- settings.py    one configuration the --auto search tries (the searched keys, its overrides, its plan).
- search_space.py what the --auto search may try (degrees, dispatch, Ring-DTP, SCO, the optimizer's device
                 share and streaming, checkpointing, from the keys the user fixed) and each try's predicted
                 step and plan, memoised.
- auto.py        `mop-train plan --auto`: the search over that space for the longest context or the most
                 tokens/s, and the explanation when nothing fits.
- auto_report.py the search's result and its printed table of runners-up.
- cost_model.py  the step-time model that ranks configurations (calibrated on `small`, one and two H200s).

Imports models, ops, parallel and layout; imported by train and cli, never the reverse.
"""

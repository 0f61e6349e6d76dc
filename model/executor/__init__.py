"""The executor: what runs the scheduler's plans on the devices.

    device_layout.py    `DeviceLayout`: where the runner's arrays live (built by `sharding/`),
                        and the functions that place and jit a step over it
    runner.py           `ModelRunner`: a step plan -> one compiled ragged step
    split_step.py       a step as its forward pass, then its sampling (masks computed between)
    pipeline_runner.py  `PipelineRunner`: a pipeline schedule -> one call over the stage axis
    steps.py            the compiled step's parts: embed, layers, logits and sampling
    sampler.py          sampling on the device from the host's sampling arrays

The network it runs (`meshserve.model.transformer` and its layers) knows nothing of plans,
pages or placement; everything here imports it, never the other way round.
"""

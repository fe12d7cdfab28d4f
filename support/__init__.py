"""The support beneath the method: what the top-level files stand on, none of it needed to
follow Flow-GRPO from train.py through the rollout to the update.

It never imports the method files (tests/test_layout.py checks it). What is here:

    batching.py        left padding, the text rows share, batches of similar length (engine.prefill's plan)
    kv_cache.py        the sampler's KV cache, allocated once and written in place
    models.py          loading a model; the offline default converted once
    device_memory.py   the memory plan of a run, and the sampler's sub-batches within it
    optim.py           AdamW with fp32 master weights; which weights train; the frozen reference
    ranks.py           several processes under torchrun: shares, gradient sums, gathers
    checkpoints.py     save and resume, atomically
    seeds.py           every seed a run derives from its one seed
    run_log.py         what a run writes: its start (config.json, the plan), each step's
                       trajectories and metrics row, learning.json
    provenance.py      run.json: where and with what each process of a run ran; what made
                       an evaluation folder's rows (made_by.json)
    config.py          every knob, its default, its range, validation (the tools' settings
                       too), the preflight
    registry.py        named functions a config names (turn scores, estimators, planner views)
    datasets.py        benchmark and task files -> items
    answers.py, math_answer.py   reading answers for the judge's rules
    web.py, reply_cache.py, sandbox.py, bm25.py   beneath the tools
    text.py            one way to cut text, one way to write a plan
    report/            report.html and run comparisons
"""

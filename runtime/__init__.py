"""zgraph runtime (installed as ``zgraph.runtime``): process groups, sharded state, executors.

Files::

    process_group.py   process groups: from torchrun's environment, an existing default group, or none
    hybrid.py          hybrid sharding's shard and replicate groups, hpZ's secondary group
    devices.py         where a step's state lives, which backend serves it, how the host reads from it
    agreement.py       what crosses ranks besides the graph's tensors, as bytes (never pickled)
    consistency.py     all ranks run the same graph: a cheap check each call, an error instead of a hang
    state.py           the training state a step reads and writes: parameters, buffers, optimizers
    optimizers.py      which optimizers a step binds (a wrapper is the optimizer it wraps)
    sharded_state.py   where each parameter, gradient and optimizer-state shard lives on each rank
    state_io.py        a step graph's inputs read from that state, its outputs written back
    storage_guard.py   reading a sharded tensor's bytes outside zgraph: a clear error
    meta_init.py       a meta-device model made real where the step keeps it
    offload.py         offload tiers for optimizer states and parameter shards
    offload_store.py   what every offload tier does around a graph
    offload_host.py    the ``"cpu"`` tier: device state kept in host memory
    offload_nvme.py    the ``"nvme"`` tier: state kept in files
    offload_activations.py  the activation tier: saved activations between forward and backward, within a step
    host_state.py      the update on the host: which parameters, their state moved to host memory
    host_update.py     the update on the host: its copies served, its partitions run on a host thread
    host_partitions.py the update on the host: the optimizer's host nodes cut into partitions (a backend rewrite)
    host_fused.py      the update on the host: Adam/AdamW op by op replaced by torch's fused CPU kernel (a rewrite)
    host_memory.py     freed host memory kept for the next step
    reinplace.py       in-place updates for the eager backend, as ``torch.optim`` makes them
    executor.py        backends that turn the final graph into something to call
    compile_turns.py   ranks of one host compile a graph in turn: all but the first load it from inductor's cache
    float64_scalars.py inductor: Python arithmetic on host scalars in float64, as eager computes it
    unbacked_scalars.py  inductor: host-known ``.item()`` values as numbers only the run knows
    random_order.py    inductor runs the ops that share a random generator in the graph's order
    memory.py          live tensor bytes on any device, measured exactly
    cost_model.py      cost of collectives and compute, for bucket sizes and schedules
    timeline.py        how a lowered graph runs: one compute and one communication stream
    pipeline_schedule.py  pipeline parallelism's schedules: each rank's forwards, backwards, sends and receives
    pipeline_simulate.py  a pipeline schedule checked (no deadlock) and timed: its predicted bubble, a timeline
    stage_state.py     pipeline parallelism's state: a rank holds its stages' parameters, others' released to meta
    pipeline_groups.py pipeline parallelism's groups over P x D ranks: each rank's pipeline and data-parallel group
    pipeline_run.py    one rank's actions of a pipelined step: its stages' graphs, point-to-point sends, the update
    sum_in_graph.py    a pipeline stage's backward adding its gradient contributions into their sums (eager backend)
"""

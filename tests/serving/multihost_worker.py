"""One process of a multi-process `LLM` job, for test_multihost.py. Run as a script:

    python multihost_worker.py --coordinator HOST:PORT --num-processes 2 --process-id I \
        --devices 2 --model DIR --mesh model=4 [--mesh data=2,model=2 ...] --out DIR \
        [--other-prompts]

One job runs an `LLM` on each `--mesh` in turn. Each process writes `<out>/<process id>.json`:
per mesh, the token ids its `generate` calls returned, its plan-stream counters and the weight
bytes it holds. `--other-prompts` makes process 1 pass prompts that differ from process 0's (a
misuse the job must refuse).
"""

import argparse
import json
import os
import re
from pathlib import Path

from meshserve.batching.sampling import SamplingParams  # plain Python: jax is not imported yet

ENGINE = dict(num_pages=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=64,
              prefill_chunk=32, max_model_len=128, compilation_cache=False, warmup=False)
# Short prompts and equal output lengths keep every call in a few buckets: few compiles.
PROMPTS = [[5, 17, 3, 99, 42], [7, 8, 9], list(range(10, 22)), [200, 1, 2, 3, 4, 5, 6]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=8, temperature=0.9, seed=7, ignore_eos=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--coordinator", "--model", "--out"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--mesh", action="append", required=True)
    for flag in ("--num-processes", "--process-id", "--devices"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--peer-timeout", type=float, default=5.0)
    parser.add_argument("--other-prompts", action="store_true")
    args = parser.parse_args()
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices} {flags}"

    import jax

    from meshserve.serving.python_api.llm import LLM
    from meshserve.serving.engine.multihost import ClusterConfig

    cluster = ClusterConfig(coordinator=args.coordinator, num_processes=args.num_processes,
                            process_id=args.process_id, peer_timeout=args.peer_timeout)
    prompts = PROMPTS[::-1] if args.other_prompts and args.process_id == 1 else PROMPTS
    results = {}
    for mesh in args.mesh:
        llm = LLM(args.model, cluster=cluster, mesh=mesh, **ENGINE)
        stream = llm.cluster.stream
        before = stream.stats()
        greedy = llm.generate(prompts, GREEDY, use_tqdm=False)
        sampled = llm.generate(prompts, SAMPLED, use_tqdm=False)
        leaves = jax.tree.leaves(llm.engine.runner.params)
        results[mesh] = {
            "greedy": [o.outputs[0].token_ids for o in greedy],
            "sampled": [o.outputs[0].token_ids for o in sampled],
            "stream": {key: stream.stats()[key] - before[key]
                       for key in ("messages", "runs", "seconds", "payload_bytes")},
            "steps": llm.engine.stats.num_steps,
            "weight_bytes": sum(leaf.nbytes for leaf in leaves),
            "local_weight_bytes": sum(shard.data.nbytes for leaf in leaves
                                      for shard in leaf.addressable_shards)}
    Path(args.out, f"{args.process_id}.json").write_text(json.dumps(results))
    llm.shutdown()


if __name__ == "__main__":
    main()

"""One process of a multi-process `LLM` job, for test_multihost.py. Run as a script:

    python multihost_worker.py --coordinator HOST:PORT --num-processes 2 --process-id I \
        --devices 2 --model DIR --mesh model=4 --out DIR [--other-prompts]

Each process writes `<out>/<process id>.json`: the token ids its `generate` calls returned, and
its plan-stream counters. `--other-prompts` makes process 1 pass prompts that differ from
process 0's (a misuse the job must refuse).
"""

import argparse
import json
import os
from pathlib import Path

ENGINE = dict(num_pages=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=64,
              prefill_chunk=32, max_model_len=128, compilation_cache=False, warmup=False)
PROMPTS = [[5, 17, 3, 99, 42], [7, 8, 9], list(range(10, 50)), [200, 1, 2, 3, 4, 5, 6]]


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--coordinator", "--model", "--mesh", "--out"):
        parser.add_argument(flag, required=True)
    for flag in ("--num-processes", "--process-id", "--devices"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--peer-timeout", type=float, default=5.0)
    parser.add_argument("--other-prompts", action="store_true")
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"

    import jax

    from meshserve.batching.sampling import SamplingParams
    from meshserve.serving.llm import LLM
    from meshserve.serving.multihost import ClusterConfig

    cluster = ClusterConfig(coordinator=args.coordinator, num_processes=args.num_processes,
                            process_id=args.process_id, peer_timeout=args.peer_timeout)
    llm = LLM(args.model, cluster=cluster, mesh=args.mesh, **ENGINE)
    prompts = PROMPTS[::-1] if args.other_prompts and args.process_id == 1 else PROMPTS
    greedy = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    sampled = llm.generate(prompts[:2], SamplingParams(max_tokens=6, temperature=0.9, seed=7),
                           use_tqdm=False)
    leaves = jax.tree.leaves(llm.engine.runner.params)
    result = {"greedy": [o.outputs[0].token_ids for o in greedy],
              "sampled": [o.outputs[0].token_ids for o in sampled],
              "stream": llm.cluster.stream.stats(),
              "steps": llm.engine.stats.num_steps,
              "weight_bytes": sum(leaf.nbytes for leaf in leaves),
              "local_weight_bytes": sum(shard.data.nbytes for leaf in leaves
                                        for shard in leaf.addressable_shards)}
    Path(args.out, f"{args.process_id}.json").write_text(json.dumps(result))
    llm.shutdown()


if __name__ == "__main__":
    main()

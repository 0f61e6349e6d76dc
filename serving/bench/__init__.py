"""Measurement tooling: benchmarks, load generation, latency metrics, the roofline, peers, plots,
the mesh planner's command and the mesh sweep.

The `meshserve` subcommands `bench` (`bench_command`), `roofline` (`roofline_command`), `plan`
(`plan_command`) and `mesh-sweep` (`mesh_sweep`) live here. Nothing on the serving path imports
this package; it drives the engine and the server from outside. Importing the package itself
imports nothing, so `latency`, `loadgen` and `plan_command` stay free of jax.
"""

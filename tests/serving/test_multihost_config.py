"""ClusterConfig's validation and the CLI's cluster flags (no process joins a job here)."""

import pytest

from meshserve.serving.engine import multihost
from meshserve.serving.cli.main import build_parser
from meshserve.serving.options import cluster_config_from_args as _cluster_config
from meshserve.serving.engine.multihost import ClusterConfig


def _args(command: str, *flags: str):
    extra = ["--input", "x", "--output", "y"] if command == "batch" else []
    return build_parser().parse_args([command, *extra, *flags])


def test_valid_config_keeps_its_fields():
    config = ClusterConfig(coordinator="10.0.0.1:8476", num_processes=4, process_id=3,
                           peer_timeout=2.5)
    assert (config.coordinator, config.num_processes, config.process_id) == ("10.0.0.1:8476", 4, 3)
    assert config.peer_timeout == 2.5


def test_default_config_leaves_everything_to_the_environment():
    config = ClusterConfig()
    assert (config.coordinator, config.num_processes, config.process_id) == (None, None, None)
    assert config.peer_timeout == multihost.DEFAULT_PEER_TIMEOUT


@pytest.mark.parametrize("coordinator", ["host:1234", "[::1]:8476", "node-0.cluster.local:1"])
def test_coordinator_with_host_and_port_is_accepted(coordinator):
    assert ClusterConfig(coordinator=coordinator).coordinator == coordinator


@pytest.mark.parametrize("coordinator", ["host", "host:", ":1234", "host:port", "host:12a",
                                         "host:-1", ""])
def test_coordinator_without_a_numeric_port_is_refused(coordinator):
    with pytest.raises(ValueError, match="HOST:PORT"):
        ClusterConfig(coordinator=coordinator)


@pytest.mark.parametrize("process_id, num_processes", [(2, 2), (5, 2), (1, 1)])
def test_process_id_past_the_last_process_is_refused_naming_the_range(process_id, num_processes):
    with pytest.raises(ValueError) as err:
        ClusterConfig(num_processes=num_processes, process_id=process_id)
    assert f"ids 0..{num_processes - 1}" in str(err.value)
    assert f"process_id {process_id}" in str(err.value)


def test_last_process_id_is_accepted():
    assert ClusterConfig(num_processes=3, process_id=2).process_id == 2


def test_negative_process_id_is_refused():
    with pytest.raises(ValueError, match="process_id must be >= 0"):
        ClusterConfig(num_processes=2, process_id=-1)
    with pytest.raises(ValueError, match="process_id must be >= 0"):
        ClusterConfig(process_id=-1)


@pytest.mark.parametrize("num_processes", [0, -3])
def test_fewer_than_one_process_is_refused(num_processes):
    with pytest.raises(ValueError, match="num_processes must be >= 1"):
        ClusterConfig(num_processes=num_processes)


@pytest.mark.parametrize("peer_timeout", [0, 0.0, -1.0, float("nan")])
def test_peer_timeout_must_be_positive(peer_timeout):
    with pytest.raises(ValueError, match="peer_timeout must be > 0"):
        ClusterConfig(peer_timeout=peer_timeout)


def test_initialization_timeout_must_be_at_least_a_second():
    with pytest.raises(ValueError, match="initialization_timeout"):
        ClusterConfig(initialization_timeout=0)


@pytest.mark.parametrize("peer_timeout", [0.001, 0.25, 1.0, 4.9, 5.0, 9.99, 10.0, 10.5, 60.0,
                                          1234.5])
def test_jax_heartbeat_timeout_is_well_past_peer_timeout(peer_timeout):
    timeout = ClusterConfig(peer_timeout=peer_timeout).jax_heartbeat_timeout
    assert isinstance(timeout, int)
    assert timeout > peer_timeout + 5


@pytest.mark.parametrize("command", ["serve", "batch"])
def test_no_cluster_flags_means_running_alone(command):
    assert _cluster_config(_args(command)) is None


@pytest.mark.parametrize("command", ["serve", "batch"])
def test_all_three_flags_give_a_config(command):
    config = _cluster_config(_args(command, "--coordinator", "head:8476", "--num-processes", "4",
                                   "--process-id", "1"))
    assert isinstance(config, ClusterConfig)
    assert (config.coordinator, config.num_processes, config.process_id) == ("head:8476", 4, 1)
    assert config.peer_timeout == multihost.DEFAULT_PEER_TIMEOUT


@pytest.mark.parametrize("command", ["serve", "batch"])
@pytest.mark.parametrize("flags", [
    ("--coordinator", "head:8476"),
    ("--num-processes", "4"),
    ("--process-id", "0"),
    ("--coordinator", "head:8476", "--num-processes", "4"),
    ("--num-processes", "4", "--process-id", "0"),
])
def test_some_flags_without_distributed_are_refused(command, flags):
    with pytest.raises(ValueError, match="--distributed"):
        _cluster_config(_args(command, *flags))


@pytest.mark.parametrize("command", ["serve", "batch"])
def test_distributed_alone_leaves_all_three_to_the_environment(command):
    config = _cluster_config(_args(command, "--distributed"))
    assert isinstance(config, ClusterConfig)
    assert (config.coordinator, config.num_processes, config.process_id) == (None, None, None)


def test_distributed_with_some_flags_keeps_those_given():
    config = _cluster_config(_args("serve", "--distributed", "--process-id", "2"))
    assert (config.coordinator, config.num_processes, config.process_id) == (None, None, 2)


@pytest.mark.parametrize("command", ["serve", "batch"])
def test_peer_timeout_flag_is_passed_through(command):
    config = _cluster_config(_args(command, "--distributed", "--peer-timeout", "3.5"))
    assert config.peer_timeout == 3.5


def test_peer_timeout_alone_does_not_join_a_job():
    assert _cluster_config(_args("serve", "--peer-timeout", "3.5")) is None


def test_invalid_flag_values_surface_as_value_error():
    with pytest.raises(ValueError, match="out of range"):
        _cluster_config(_args("serve", "--coordinator", "head:1", "--num-processes", "2",
                              "--process-id", "2"))
    with pytest.raises(ValueError, match="peer_timeout"):
        _cluster_config(_args("batch", "--distributed", "--peer-timeout", "0"))

"""The emulated cluster (perf/cluster): shaped links really carry the configured rate, MPI
runs across the emulated hosts with one node per host, and nothing is ever left behind,
whether the owning process ends normally, by SIGTERM, or by SIGKILL (then `cleanup`).

Needs root and network namespaces; elsewhere the tests that build a cluster skip, naming
why. Input validation is tested everywhere."""
import json
import signal
import sys
import textwrap

import pytest

from perf import cluster
from perf.cluster import network
from support.cluster import assert_gone, builds_a_cluster, cli, require_namespaces, start_owner


def probe_allreduce(c, nbytes=4096):
    proc = c.run([sys.executable, "-m", "mpi4py", "-m", "perf.cluster.allreduce_probe",
                  str(nbytes), "1", "3"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("rate, bits", [("1gbit", 10**9), ("10GBIT", 10**10),
                                        ("500mbit", 5 * 10**8), (" 2.5 gbit ", 25 * 10**8),
                                        (10**9, 10**9)])
def test_parse_rate(rate, bits):
    assert network.parse_rate(rate) == bits


@pytest.mark.parametrize("rate", ["10gbps", "fast", "", "-1gbit", "0gbit", "1 g bit", None])
def test_bad_rate_is_a_clear_error(rate):
    with pytest.raises(cluster.ClusterError, match="rate"):
        network.parse_rate(rate)


@pytest.mark.parametrize("kwargs, match", [({"hosts": 0}, "hosts"),
                                           ({"hosts": 2.5}, "hosts"),
                                           ({"hosts": 2, "ranks_per_host": 0}, "ranks per host"),
                                           ({"hosts": 254}, "hosts must be <= 253")])
def test_bad_layout_is_a_clear_error(kwargs, match):
    with pytest.raises(cluster.ClusterError, match=match):
        cluster.Cluster(**kwargs)


@pytest.mark.parametrize("args, message", [
    (["check", "--rate", "10gbps"], "rate '10gbps'"),
    (["exec", "--hosts", "0", "--", "true"], "hosts must be"),
    (["check", "--hosts", "1"], "check needs --hosts >= 2")])
def test_cli_reports_bad_input_without_traceback(args, message):
    proc = cli(*args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


@builds_a_cluster
def test_bandwidth_allreduce_and_cleanup():
    require_namespaces()
    with cluster.Cluster(hosts=2, ranks_per_host=1, rate="1gbit") as c:
        run_id = c.run_id
        assert run_id in cluster.leftovers()
        result = cluster.measure_bandwidth(c, seconds=2.0)
        assert abs(result["gbit_per_s"] / 1.0 - 1) <= 0.15, result
        # A ring of 2 hosts: both directions at once, each on its own shaped end
        both_ways = cluster.measure_ring_bandwidth(c, seconds=1.0)
        assert len(both_ways) == 2
        assert all(abs(r["gbit_per_s"] / 1.0 - 1) <= 0.15 for r in both_ways), both_ways
        ar = probe_allreduce(c)
    assert ar["ranks"] == 2
    # One node per emulated host, and dynar's node key agrees.
    assert [(r["hostname"], r["shared_size"], r["node_key"]) for r in ar["layout"]] == \
        [(ns, 1, str(i)) for i, ns in enumerate(c.namespaces)]
    assert run_id not in cluster.leftovers()


@builds_a_cluster
def test_removed_shapers_leave_the_links_unlimited():
    require_namespaces()
    with cluster.Cluster(hosts=2, ranks_per_host=1, rate="100mbit") as c:
        c.network.remove_shapers()
        result = cluster.measure_bandwidth(c, seconds=1.0)
    # Shaped, one stream carries at most 95.6 Mbit/s; veth alone carries gigabits.
    assert result["gbit_per_s"] > 0.5, result


@builds_a_cluster
def test_ranks_of_one_host_share_a_node():
    require_namespaces()
    with cluster.Cluster(hosts=2, ranks_per_host=2, rate="1gbit") as c:
        ar = probe_allreduce(c)
    assert [(r["shared_size"], r["node_key"]) for r in ar["layout"]] == \
        [(2, "0"), (2, "0"), (2, "1"), (2, "1")]


OWNER = textwrap.dedent("""
    import sys
    from perf.cluster import Cluster
    with Cluster(hosts=2, ranks_per_host=1, rate="1gbit") as c:
        print(c.run_id, flush=True)
        c.run([sys.executable, "-c", "import time; time.sleep(300)"])
""")


def start_owner_with_running_job():
    """(owner, run id, pids): a daemon and a rank on each host."""
    owner, (run_id,), pids = start_owner(OWNER, processes=4)
    return owner, run_id, pids


@builds_a_cluster
def test_sigterm_removes_everything():
    require_namespaces()
    owner, run_id, pids = start_owner_with_running_job()
    owner.send_signal(signal.SIGTERM)
    assert owner.wait(timeout=30) != 0
    assert_gone(run_id, pids)


@builds_a_cluster
def test_sigkill_leftovers_removed_by_cleanup_command():
    require_namespaces()
    owner, run_id, pids = start_owner_with_running_job()
    owner.kill()
    owner.wait(timeout=10)
    assert run_id in cluster.leftovers()  # nothing ran in the owner: it left all behind
    proc = cli("cleanup")
    assert proc.returncode == 0, proc.stderr
    assert run_id in proc.stdout
    assert_gone(run_id, pids)

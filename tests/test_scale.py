"""The scale simulator's prediction logic (perf/scale.py) on synthetic profiles and known
link models: no MPI, no profiling, no files."""
import numpy as np
import pytest

from dynar.dist.costmodel import LinkModel
from perf import scale

LINK = LinkModel(alpha=2e-6, beta=8 / 100e9, gamma=5e-11)


def synthetic_profile(layers=8, mb_per_layer=4.0, backward_s=0.08, forward_s=0.04,
                      update_s=0.005, model="synthetic"):
    """Layers finalized evenly over backward, the last one at its end."""
    return {"model": model, "forward_s": forward_s, "backward_s": backward_s,
            "update_s": update_s,
            "sizes_bytes": [int(mb_per_layer * 2 ** 20)] * layers,
            "ready_s": list(np.linspace(backward_s / layers, backward_s, layers))}


def rows_by(rows, mode):
    return sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["nodes"])


def test_one_node_has_no_communication_and_efficiency_one():
    prof = synthetic_profile()
    compute = prof["forward_s"] + prof["backward_s"] + prof["update_s"]
    for r in scale.predict(prof, LINK):
        if r["nodes"] == 1:
            assert r["exposed_s"] == 0.0
            assert r["step_s"] == pytest.approx(compute)
            assert r["efficiency"] == pytest.approx(1.0)
        else:
            assert r["efficiency"] <= 1.0
            assert r["step_s"] == pytest.approx(compute + r["exposed_s"])


def test_fused_efficiency_never_increases_with_nodes():
    rows = rows_by(scale.predict(synthetic_profile(), LINK), "fused")
    assert [r["nodes"] for r in rows] == scale.NODES
    eff = [r["efficiency"] for r in rows]
    assert all(b <= a for a, b in zip(eff, eff[1:]))
    assert eff[-1] < eff[1] < 1.0      # a test that could fail: communication does cost


def test_fused_exposed_is_one_ring_allreduce_of_everything():
    prof = synthetic_profile(layers=4, mb_per_layer=1.0)
    n, p = 4 * 2 ** 20, 8
    expected = 2 * (p - 1) * LINK.alpha + (2 * (p - 1) / p * LINK.beta
                                           + (p - 1) / p * LINK.gamma) * n
    assert scale.predict_step(prof, LINK, p, "fused")["exposed_s"] == pytest.approx(expected)


@pytest.mark.parametrize("link", [LINK, LinkModel(alpha=50e-6, beta=8 / 10e9, gamma=2e-10),
                                  LinkModel(alpha=1e-3, beta=1e-12, gamma=0.0)])
@pytest.mark.parametrize("layers,mb", [(8, 4.0), (30, 0.5), (5, 40.0)])
def test_dynamic_never_worse_than_the_fixed_modes(link, layers, mb):
    rows = scale.predict(synthetic_profile(layers=layers, mb_per_layer=mb), link)
    for n in scale.NODES:
        at = {r["mode"]: r["step_s"] for r in rows if r["nodes"] == n}
        for mode in ("per-layer", "fused", "buckets"):
            assert at["dynamic"] <= at[mode] * (1 + 1e-12), (n, mode)


def test_per_layer_pays_every_blocking_allreduce():
    prof = synthetic_profile(layers=3, mb_per_layer=2.0)
    cost = LINK.time("mpi", 2 * 2 ** 20, 16)
    got = scale.predict_step(prof, LINK, 16, "per-layer")
    assert got["exposed_s"] == pytest.approx(3 * cost)
    assert got["buckets"] == 3


def test_compute_slowdown_rule():
    assert scale.compute_slowdown(1, 2) == 1.0
    assert scale.compute_slowdown(2, 2) == 1.0
    assert scale.compute_slowdown(4, 2) == 2.0
    assert scale.compute_slowdown(3, 2) == 1.5
    assert scale.compute_slowdown(8, 64) == 1.0
    with pytest.raises(ValueError):
        scale.compute_slowdown(0, 2)


def test_slowdown_scales_compute_and_ready_times():
    prof = synthetic_profile()
    free = LinkModel(0.0, 0.0, 0.0)
    one = scale.predict_step(prof, free, 4, "buckets")["step_s"]
    two = scale.predict_step(prof, free, 4, "buckets", slowdown=2.0)["step_s"]
    assert two == pytest.approx(2 * one)


def test_validate_reports_relative_errors():
    prof = synthetic_profile(model="m")
    free = LinkModel(0.0, 0.0, 0.0)       # no communication cost: prediction = compute
    compute = prof["forward_s"] + prof["backward_s"] + prof["update_s"]
    records = [
        {"model": "m", "hosts": 2, "ranks_per_host": 1, "rate_gbit": 10, "sync": "fused",
         "step_s": compute / 1.1, "comm_exposed_s": 0.001},
        {"model": "m", "hosts": 4, "ranks_per_host": 1, "rate_gbit": 10, "sync": "buckets",
         "step_s": 2 * compute * 1.5},            # 4 ranks on 2 cores: compute x 2
        {"model": "not profiled", "hosts": 2, "ranks_per_host": 1, "rate_gbit": 10,
         "sync": "fused", "step_s": 1.0},
    ]
    rows = scale.validate(records, {10: free}, {"m": prof}, cores=2)
    assert len(rows) == 2
    assert rows[0]["slowdown"] == 1.0 and rows[1]["slowdown"] == 2.0
    assert rows[0]["predicted_step_s"] == pytest.approx(compute)
    assert rows[0]["rel_error"] == pytest.approx(0.1)
    assert rows[0]["within_tolerance"]
    assert rows[0]["measured_exposed_s"] == 0.001
    assert rows[1]["rel_error"] == pytest.approx(1 / 1.5 - 1)
    assert not rows[1]["within_tolerance"]


def test_validate_counts_the_link_and_a_single_link_model():
    prof = synthetic_profile(model="m")
    rec = {"model": "m", "hosts": 2, "ranks_per_host": 1, "rate_gbit": 10, "sync": "fused",
           "step_s": 0.2}
    (row,) = scale.validate([rec], LINK, {"m": prof}, cores=2)
    expected = scale.predict_step(prof, LINK, 2, "fused")["step_s"]
    assert row["predicted_step_s"] == pytest.approx(expected)
    assert row["predicted_exposed_s"] > 0
    assert row["rel_error"] == pytest.approx(expected / 0.2 - 1)


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="sync mode"):
        scale.predict_step(synthetic_profile(), LINK, 2, "magic")


def test_emulated_link_without_probes_uses_the_configured_rate():
    link, info = scale.emulated_link([], gamma=1e-10, rate_gbit=10, fallback_alpha=3e-6)
    assert link.alpha == 3e-6 and link.gamma == 1e-10
    assert link.beta == pytest.approx(8 / (scale.TCP_GOODPUT_FRACTION * 10e9))
    assert info["probes"] == 0


def test_emulated_link_recovers_alpha_and_efficiency_from_probes():
    gamma, alpha, eta = 1e-10, 40e-6, 0.9
    truth = LinkModel(alpha, 8 / (eta * 1e9), gamma)
    probes = []
    for hosts, nbytes, rate in [(4, 8 << 20, 1e9), (2, 8 << 20, 1e9), (4, 1 << 10, 1e9),
                                (4, 8 << 20, 10e9)]:
        link = LinkModel(alpha, 8 / (eta * rate), gamma)
        probes.append({"case": "allreduce", "hosts": hosts, "ranks": hosts,
                       "ranks_per_host": 1, "bytes": nbytes, "configured_bit_s": rate,
                       "time_s": link.time("mpi", nbytes, hosts)})
    link, info = scale.emulated_link(probes, gamma, rate_gbit=1)
    assert link.alpha == pytest.approx(truth.alpha, rel=1e-6)
    assert info["eta"] == pytest.approx(eta, rel=1e-6)
    assert link.beta == pytest.approx(truth.beta, rel=1e-6)


def test_loopback_samples_pick_the_flat_dynar_algorithms():
    records = [{"network": "loopback", "ranks": 2, "bytes": 1024, "method": m, "time_s": 1e-5}
               for m in ("dynar ring", "dynar recursive_doubling", "dynar rabenseifner",
                         "dynar mpi", "MPI_Allreduce (mpi4py)", "dynar ring fp16 wire")]
    records.append({"network": "emulated", "ranks": 2, "bytes": 1024, "method": "dynar ring",
                    "time_s": 1e-5})
    got = scale.loopback_samples(records)
    assert [s[0] for s in got] == ["ring", "recursive_doubling", "rabenseifner"]
    assert all(s[1:] == (2, 1, 1024, 1e-5) for s in got)


def test_measured_training_records_are_read_from_cluster_results(tmp_path, monkeypatch):
    import json
    monkeypatch.setattr(scale.harness, "RESULTS_DIR", str(tmp_path))
    assert scale.measured_training_records() == [] and scale.cluster_probes() == []
    run = {"model": "alexnet-cifar", "hosts": 2, "ranks_per_host": 1, "sync": "buckets",
           "step_s": 0.2}
    (tmp_path / "cluster.json").write_text(json.dumps({"records": [
        {"case": "allreduce", "hosts": 4, "ranks": 4, "bytes": 8, "time_s": 1e-3},
        dict(run, rate_gbit=10)]}))
    (tmp_path / "cluster_dist.json").write_text(json.dumps({"runs": [
        dict(run, rate="1gbit"), dict(run, configured_bit_s=25e9), dict(run)]}))
    got = scale.measured_training_records()
    assert [r["rate_gbit"] for r in got] == [10, 1, 25]    # the rate-less record is dropped
    assert [r["case"] for r in scale.cluster_probes()] == ["allreduce"]


def test_without_spare_cores_every_plan_exposes_all_its_communication():
    prof = synthetic_profile(layers=8, mb_per_layer=4.0)
    p = 4
    total = 32 * 2 ** 20
    one_ring = 2 * (p - 1) * LINK.alpha + (2 * (p - 1) / p * LINK.beta
                                           + (p - 1) / p * LINK.gamma) * total
    fused = scale.predict_step(prof, LINK, p, "fused", overlap=False)["exposed_s"]
    buckets = scale.predict_step(prof, LINK, p, "buckets", overlap=False)["exposed_s"]
    assert fused == pytest.approx(one_ring)
    # Overlap would hide most of the bucketed transfer; without it, two buckets cost two
    # start-ups more than one.
    assert buckets > fused
    assert scale.predict_step(prof, LINK, p, "buckets")["exposed_s"] < buckets
    # Dynamic sync keeps the cheapest candidate it tries: never more than fused.
    assert scale.predict_step(prof, LINK, p, "dynamic", overlap=False)["exposed_s"] <= fused


def test_global_batchnorm_costs_its_sums_on_the_critical_path_and_nothing_on_one_node():
    # Two BatchNorm layers of 64 and 512 channels among 8 layers, fused sync (nothing
    # overlaps, so the backward delay is not hidden by the buckets either).
    prof = dict(synthetic_profile(), batchnorm=[[1, 64], [5, 512]])
    rows = {r["nodes"]: r for r in scale.predict_batchnorm(prof, LINK, mode="fused")}
    assert rows[1]["batch_stats_s"] == 0.0 and rows[1]["overhead"] == 0.0
    for n in (8, 512):
        steps = np.log2(n)                 # recursive doubling: log2 p exchanges of n bytes
        one = lambda values: steps * (LINK.alpha + values * 8 * (LINK.beta + LINK.gamma))  # noqa: E731
        expected = sum(one(3 * c + 1) + one(2 * c) for c in (64, 512))   # forward, backward
        assert rows[n]["batch_stats_s"] == pytest.approx(expected)
        assert rows[n]["global_step_s"] - rows[n]["local_step_s"] == pytest.approx(expected)
    assert rows[512]["overhead"] > rows[8]["overhead"] > 0

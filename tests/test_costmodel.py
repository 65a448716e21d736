"""The allreduce cost model: structural terms, fits that recover known parameters, JSON
round trips (tuning files: test_tuning_files.py)."""
import json

import numpy as np
import pytest

from dynar.dist import costmodel as cm
from dynar.dist.costmodel import ALGORITHMS, AlgorithmCost, CostModel, LinkModel


def test_single_rank_costs_nothing():
    for algorithm in ALGORITHMS:
        assert cm.terms(algorithm, 1) == (0.0, 0.0, 0.0)
        assert cm.terms(algorithm, 1, ranks_per_node=8) == (0.0, 0.0, 0.0)
        assert LinkModel(1e-6, 1e-9, 1e-9).time(algorithm, 10 ** 6, ranks=1) == 0.0


@pytest.mark.parametrize("algorithm, ranks, ranks_per_node, expected", [
    ("ring", 4, 1, (6, 1.5, 0.75)),                       # 2(p-1), 2(p-1)/p, (p-1)/p
    ("ring", 2, 1, (2, 1.0, 0.5)),
    ("mpi", 4, 1, (6, 1.5, 0.75)),                        # extrapolated as ring
    ("recursive_doubling", 8, 1, (3, 3, 3)),              # log2 p full-vector steps
    ("recursive_doubling", 6, 1, (2 + 2, 2 + 2, 2 + 1)),  # q = 4, plus fold in/out
    ("rabenseifner", 8, 1, (6, 1.75, 0.875)),             # 2 log2 p, 2(p-1)/p, (p-1)/p
    ("rabenseifner", 6, 1, (4 + 2, 1.5 + 2, 0.75 + 1)),   # q = 4, plus fold in/out
    ("hierarchical", 8, 1, (14, 1.75, 0.875)),            # one rank per node: a ring
    ("hierarchical", 8, 4, (2, 1.0, 0.5 + 2 + 0.75)),     # ring of 2 leaders + node stages
    ("hierarchical", 4, 4, (0, 0.0, 2 + 0.75)),           # one node: memory traffic only
])
def test_structural_terms(algorithm, ranks, ranks_per_node, expected):
    assert cm.terms(algorithm, ranks, ranks_per_node) == pytest.approx(expected, rel=1e-15)


def test_terms_reject_bad_arguments():
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'tree'"):
        cm.terms("tree", 4)
    with pytest.raises(ValueError, match="ranks must be a positive integer"):
        cm.terms("ring", 0)
    with pytest.raises(ValueError, match="ranks_per_node must be a positive integer"):
        cm.terms("ring", 4, ranks_per_node=0)


def test_link_time_is_the_terms_priced():
    link = LinkModel(alpha=2e-6, beta=1e-9, gamma=5e-10)
    lat, bw, red = cm.terms("rabenseifner", 6, 1)
    n = 12345
    assert link.time("rabenseifner", n, 6) == pytest.approx(
        lat * 2e-6 + bw * 1e-9 * n + red * 5e-10 * n, rel=1e-12)
    assert link.time("ring", 0, 4) == 0.0
    sizes = np.array([0, 10, 1000])
    assert np.allclose(link.time("ring", sizes, 4),
                       [0.0, link.time("ring", 10, 4), link.time("ring", 1000, 4)])


def test_algorithm_cost_time():
    cost = AlgorithmCost(alpha=1e-5, beta=1e-9)
    assert cost.time(0) == 0.0
    assert cost.time(1000) == pytest.approx(1e-5 + 1e-6)
    assert isinstance(cost.time(1000), float)
    with pytest.raises(ValueError, match="nonnegative"):
        cost.time(-1)


def _noisy(rng, seconds, noise=0.01):
    return seconds * (1 + noise * rng.standard_normal())


def test_fit_link_recovers_alpha_beta_gamma(rng):
    truth = LinkModel(alpha=3e-6, beta=1 / 8e9, gamma=1 / 12e9)
    samples = []
    for algorithm in ("ring", "recursive_doubling", "rabenseifner", "hierarchical"):
        for ranks, per_node in ((2, 1), (3, 1), (4, 2), (8, 4), (16, 4)):
            for nbytes in np.logspace(3, 26, 12, base=2).astype(int):
                seconds = truth.time(algorithm, nbytes, ranks, per_node)
                samples.append({"algorithm": algorithm, "ranks": ranks,
                                "ranks_per_node": per_node, "nbytes": int(nbytes),
                                "seconds": _noisy(rng, seconds)})
    fit = cm.fit_link(samples)
    assert fit.alpha == pytest.approx(truth.alpha, rel=0.03)
    assert fit.beta == pytest.approx(truth.beta, rel=0.03)
    assert fit.gamma == pytest.approx(truth.gamma, rel=0.03)
    # Tuples are accepted as well as dicts.
    as_tuples = [tuple(s[k] for k in ("algorithm", "ranks", "ranks_per_node", "nbytes",
                                      "seconds")) for s in samples]
    assert cm.fit_link(as_tuples) == fit


def test_fit_link_refuses_samples_that_cannot_separate_beta_and_gamma():
    link = LinkModel(3e-6, 1e-10, 1e-10)
    # Ring moves exactly twice the bytes it reduces at every p: β and γ are confounded.
    samples = [("ring", p, 1, n, link.time("ring", n, p)) for p in (2, 4, 8)
               for n in (1e3, 1e5, 1e7)]
    with pytest.raises(ValueError, match="cannot separate"):
        cm.fit_link(samples)


def test_fit_rejects_bad_samples():
    with pytest.raises(ValueError, match="single-rank"):
        cm.fit_link([("ring", 1, 1, 100, 1e-6)])
    with pytest.raises(ValueError, match="must be positive"):
        cm.fit_link([("ring", 2, 1, 100, 0.0)])
    with pytest.raises(ValueError, match="lacks the field 'seconds'"):
        cm.fit_algorithms([{"algorithm": "ring", "ranks": 2, "ranks_per_node": 1,
                            "nbytes": 100}])
    with pytest.raises(ValueError, match="unknown allreduce algorithm"):
        cm.fit_algorithms([("bogus", 2, 1, 100, 1e-6)])


def test_fit_algorithms_recovers_each_algorithm(rng):
    truth = {"mpi": AlgorithmCost(4e-6, 2e-10), "ring": AlgorithmCost(2e-5, 1.2e-10),
             "recursive_doubling": AlgorithmCost(1e-6, 6e-10)}
    samples = [(a, 8, 4, int(n), _noisy(rng, c.time(int(n))))
               for a, c in truth.items() for n in np.logspace(3, 26, 20, base=2)]
    fit = cm.fit_algorithms(samples)
    assert set(fit) == set(truth)
    for algorithm, cost in truth.items():
        assert fit[algorithm].alpha == pytest.approx(cost.alpha, rel=0.03)
        assert fit[algorithm].beta == pytest.approx(cost.beta, rel=0.03)


def test_fit_algorithms_needs_one_communicator_and_two_sizes():
    with pytest.raises(ValueError, match="mix"):
        cm.fit_algorithms([("ring", 4, 1, 100, 1e-5), ("ring", 8, 1, 1000, 1e-5)])
    with pytest.raises(ValueError, match="two or more message sizes"):
        cm.fit_algorithms([("ring", 4, 1, 100, 1e-5), ("ring", 4, 1, 100, 2e-5)])


def test_cost_model_from_link_matches_the_link():
    link = LinkModel(alpha=2e-6, beta=1e-10, gamma=5e-11)
    model = CostModel.from_link(link, ranks=16, ranks_per_node=4)
    assert model.algorithms == ALGORITHMS
    for algorithm in ALGORITHMS:
        for n in (0, 100, 10 ** 7):
            assert model.time(algorithm, n) == pytest.approx(link.time(algorithm, n, 16, 4),
                                                             rel=1e-12)
    with pytest.raises(ValueError, match="'ring' is not in this cost model"):
        CostModel.from_link(link, 4, algorithms=("mpi",)).time("ring", 10)


def test_cost_model_orders_algorithms_canonically():
    model = CostModel(4, 1, {"ring": AlgorithmCost(1e-6, 1e-9), "mpi": AlgorithmCost(1e-6, 1e-9)})
    assert model.algorithms == ("mpi", "ring")


def test_default_model_is_usable():
    model = CostModel.default(ranks=8, ranks_per_node=2)
    assert model.algorithms == ALGORITHMS
    assert all(model.time(a, 2 ** 20) > 0 for a in ALGORITHMS)
    assert CostModel.default(1).time("ring", 2 ** 20) == 0.0


@pytest.mark.parametrize("link", [LinkModel(2e-6, 1e-10, 5e-11), None])
def test_json_round_trip(link):
    if link is None:
        model = CostModel(4, 2, {"mpi": AlgorithmCost(3e-6, 2e-10),
                                 "hierarchical": AlgorithmCost(1e-5, 1e-10)})
    else:
        model = CostModel.from_link(link, 32, 8)
    data = json.loads(json.dumps(model.to_json()))
    back = CostModel.from_json(data)
    assert back == model
    assert back.link == link
    assert back.to_json() == model.to_json()


def test_from_json_rejects_malformed():
    with pytest.raises(ValueError, match="not a cost model"):
        CostModel.from_json({"ranks": 4})
    with pytest.raises(ValueError, match="not a cost model"):
        CostModel.from_json(None)

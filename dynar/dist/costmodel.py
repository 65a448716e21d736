"""What an allreduce costs: the α-β-γ model of each algorithm, fitted to measurements.

Dynamic Allreduce (docs/DESIGN.md) picks bucket boundaries and one algorithm per bucket
by predicting how long each candidate allreduce takes. Two levels of model serve that:

- `LinkModel` (α, β, γ): the machine. α is the latency of one message step, β the seconds
  per byte on the wire, γ the seconds per byte reduced (or streamed through memory). With
  `terms()` giving each algorithm's step and byte counts (Thakur, Rabenseifner & Gropp,
  "Optimization of Collective Communication Operations in MPICH", 2005), one fitted link
  predicts every algorithm at every rank count, including ones never measured.
- `AlgorithmCost` (α, β) per algorithm: one communicator. Measuring each algorithm on the
  communicator actually used and fitting time = α + β·n directly captures what the
  structural model misses (the MPI library's own choices, contention, intra-node links).

`CostModel` holds the per-algorithm costs of one communicator; the planner only calls its
`time(algorithm, nbytes)` and reads `algorithms`. Measuring, and the tuning files that keep
a measured model for later jobs of the same shape, are tuning.py's.

Pure Python/numpy on purpose: planning and fitting must be testable without MPI.
"""
import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from .algorithms import ALGORITHMS

def check_ranks(ranks, ranks_per_node):
    if int(ranks) != ranks or ranks < 1:
        raise ValueError(f"ranks must be a positive integer, got {ranks!r}")
    if int(ranks_per_node) != ranks_per_node or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")


def _price(value, what):
    """`value` as a cost (seconds, or seconds per byte): a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)


def _check_algorithm(algorithm):
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown allreduce algorithm {algorithm!r}; "
                         f"choose one of {', '.join(ALGORITHMS)}")


def _ring_terms(p):
    """Reduce-scatter then allgather around a ring of p: 2(p-1) steps of n/p bytes each,
    and (p-1) of them reduce n/p bytes."""
    return 2 * (p - 1), 2 * (p - 1) / p, (p - 1) / p


def terms(algorithm, ranks, ranks_per_node=1):
    """(lat, bw, red): multipliers such that an allreduce of n bytes over `ranks` ranks takes
    lat·α + bw·β·n + red·γ·n.

    p = ranks; for the power-of-two algorithms q = 2^floor(log2 p) and, when p is not a
    power of two, the p - q extra ranks first fold their whole vector into a partner (one
    step, n bytes sent, n bytes reduced) and get the result back at the end (one step, n
    bytes): +2 steps, +2n on the wire, +n reduced (the MPICH scheme).

    - ring:               2(p-1),          2(p-1)/p,              (p-1)/p
    - recursive_doubling: log2 q (+2),     log2 q (+2),           log2 q (+1)
      (every step exchanges and reduces the whole vector: latency-optimal, byte-heavy)
    - rabenseifner:       2·log2 q (+2),   2(q-1)/q (+2),         (q-1)/q (+1)
      (recursive-halving reduce-scatter, recursive-doubling allgather)
    - hierarchical, with c = min(ranks_per_node, p) ranks on a node and m = ceil(p / c)
      nodes: ring over the m node leaders, plus, when c > 1, the node-local stages charged
      at γ per byte, because both are streaming passes over memory: every rank copies its
      vector into shared memory (n), the c cores reduce one 1/c slice each ((c-1)/c·n),
      every rank copies the result out (n). Shared-memory barriers (~1 µs) are left out:
      they are small against a network step α.
          2(m-1),          2(m-1)/m,              (m-1)/m + [c > 1]·(2 + (c-1)/c)
    - mpi: the MPI library chooses its own algorithm, hidden from us; it is extrapolated
      with ring's shape (the bandwidth-optimal choice libraries make for large messages).
      Its measured per-communicator cost (`fit_algorithms`) is what planning should use.

    p = 1: all zero (nothing to communicate). The flat algorithms ignore ranks_per_node:
    the model prices every step at the slowest (inter-node) link.
    """
    _check_algorithm(algorithm)
    check_ranks(ranks, ranks_per_node)
    p = int(ranks)
    if p == 1:
        return 0.0, 0.0, 0.0
    if algorithm in ("ring", "mpi"):
        lat, bw, red = _ring_terms(p)
    elif algorithm == "hierarchical":
        c = min(int(ranks_per_node), p)
        lat, bw, red = _ring_terms(math.ceil(p / c))
        if c > 1:
            red += 2 + (c - 1) / c
    else:
        steps = p.bit_length() - 1            # log2 q, q the largest power of two <= p
        q = 1 << steps
        fold = q != p
        if algorithm == "recursive_doubling":
            lat, bw, red = steps, steps, steps
        else:  # rabenseifner
            lat, bw, red = 2 * steps, 2 * (q - 1) / q, (q - 1) / q
        if fold:
            lat, bw, red = lat + 2, bw + 2, red + 1
    return float(lat), float(bw), float(red)


def _elementwise_time(nbytes, latency, per_byte):
    """latency + per_byte·n for n > 0 and 0 for n == 0 (nothing is sent), elementwise; a
    float for a scalar n."""
    n = np.asarray(nbytes, dtype=np.float64)
    if np.any(n < 0):
        raise ValueError(f"nbytes must be nonnegative, got {nbytes!r}")
    t = np.where(n > 0, latency + per_byte * n, 0.0)
    return float(t) if t.ndim == 0 else t


@dataclass(frozen=True)
class LinkModel:
    """The machine's α (s per message step), β (s per byte sent), γ (s per byte reduced)."""
    alpha: float
    beta: float
    gamma: float

    def algorithm_cost(self, algorithm, ranks, ranks_per_node=1):
        """The AlgorithmCost this link predicts for one algorithm on one communicator."""
        lat, bw, red = terms(algorithm, ranks, ranks_per_node)
        return AlgorithmCost(alpha=lat * self.alpha, beta=bw * self.beta + red * self.gamma)

    def time(self, algorithm, nbytes, ranks, ranks_per_node=1):
        """Predicted seconds for an allreduce of nbytes (scalar or array; 0 bytes cost 0)."""
        return self.algorithm_cost(algorithm, ranks, ranks_per_node).time(nbytes)


@dataclass(frozen=True)
class AlgorithmCost:
    """One algorithm on one communicator: time(n) = alpha + beta·n seconds (0 for n = 0)."""
    alpha: float
    beta: float

    def time(self, nbytes):
        """Seconds for nbytes (scalar -> float, array -> elementwise array)."""
        return _elementwise_time(nbytes, self.alpha, self.beta)


def _sample_fields(sample):
    """(algorithm, ranks, ranks_per_node, nbytes, seconds) from a dict or a 5-tuple."""
    if isinstance(sample, dict):
        try:
            fields = tuple(sample[k] for k in
                           ("algorithm", "ranks", "ranks_per_node", "nbytes", "seconds"))
        except KeyError as exc:
            raise ValueError(f"sample {sample!r} lacks the field {exc.args[0]!r}") from None
    else:
        fields = tuple(sample)
        if len(fields) != 5:
            raise ValueError(f"sample {sample!r}: expected (algorithm, ranks, ranks_per_node, "
                             f"nbytes, seconds)")
    algorithm, ranks, ranks_per_node, nbytes, seconds = fields
    _check_algorithm(algorithm)
    check_ranks(ranks, ranks_per_node)
    if not nbytes > 0 or not seconds > 0 or not math.isfinite(seconds):
        raise ValueError(f"sample {sample!r}: nbytes and seconds must be positive")
    return algorithm, int(ranks), int(ranks_per_node), float(nbytes), float(seconds)


def _relative_nnls(rows, seconds):
    """Nonnegative x minimizing sum(((rows @ x) - seconds) / seconds)^2.

    Dividing each row by its measured time fits relative errors: otherwise the largest
    messages (milliseconds) would swamp the small ones (microseconds) that determine α.
    Columns are scaled to unit norm first because α and β differ by ~10^4 in magnitude."""
    a = rows / seconds[:, None]
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    x, _ = nnls(a / norms, np.ones(len(seconds)))
    return x / norms


def fit_link(samples):
    """LinkModel fitted to measured allreduces.

    samples: iterable of (algorithm, ranks, ranks_per_node, nbytes, seconds) tuples or dicts
    with those keys, nbytes and seconds > 0. Least squares over `terms()` with α, β, γ >= 0,
    relative errors weighted equally (see _relative_nnls). The samples must tell the three
    apart (e.g. ring and recursive doubling at several sizes: ring alone moves exactly twice
    the bytes it reduces, so β and γ would be inseparable) - else ValueError. Single-rank
    samples carry no communication and are rejected."""
    rows, seconds = [], []
    for sample in samples:
        algorithm, ranks, ranks_per_node, nbytes, secs = _sample_fields(sample)
        if ranks == 1:
            raise ValueError(f"sample {sample!r}: a single-rank allreduce communicates nothing")
        lat, bw, red = terms(algorithm, ranks, ranks_per_node)
        rows.append((lat, bw * nbytes, red * nbytes))
        seconds.append(secs)
    rows, seconds = np.array(rows, dtype=np.float64).reshape(-1, 3), np.array(seconds)
    if np.linalg.matrix_rank(rows / np.linalg.norm(rows, axis=0).clip(min=1e-300)) < 3:
        raise ValueError(f"{len(seconds)} samples cannot separate α, β and γ: measure several "
                         f"message sizes with algorithms whose byte and reduction counts "
                         f"differ (e.g. ring and recursive_doubling)")
    alpha, beta, gamma = _relative_nnls(rows, seconds)
    return LinkModel(alpha=float(alpha), beta=float(beta), gamma=float(gamma))


def fit_algorithms(samples):
    """{algorithm: AlgorithmCost} fitted per algorithm to measurements on one communicator.

    samples: as for fit_link (the same measurements can feed both), all with the same ranks
    and ranks_per_node (ValueError otherwise). Each algorithm needs at least two distinct
    message sizes; α, β >= 0, relative errors weighted equally (see _relative_nnls)."""
    by_algorithm, shape = {}, None
    for sample in samples:
        algorithm, ranks, ranks_per_node, nbytes, secs = _sample_fields(sample)
        if shape is None:
            shape = (ranks, ranks_per_node)
        elif (ranks, ranks_per_node) != shape:
            raise ValueError(f"fit_algorithms fits one communicator, but samples mix "
                             f"(ranks, ranks_per_node) {shape} and {(ranks, ranks_per_node)}")
        by_algorithm.setdefault(algorithm, []).append((nbytes, secs))
    if not by_algorithm:
        raise ValueError("fit_algorithms: no samples")
    costs = {}
    for algorithm in ALGORITHMS:
        if algorithm not in by_algorithm:
            continue
        nbytes, seconds = np.array(by_algorithm[algorithm]).T
        if len(np.unique(nbytes)) < 2:
            raise ValueError(f"fit_algorithms: {algorithm!r} needs samples at two or more "
                             f"message sizes to separate its latency from its per-byte cost")
        rows = np.column_stack([np.ones_like(nbytes), nbytes])
        alpha, beta = _relative_nnls(rows, seconds)
        costs[algorithm] = AlgorithmCost(alpha=float(alpha), beta=float(beta))
    return costs


class CostModel:
    """Allreduce times of each available algorithm on one communicator.

    CostModel(ranks, ranks_per_node, costs={algorithm: AlgorithmCost}, link=None); `link` is
    the LinkModel the costs were derived from, if any (kept for extrapolating to other rank
    counts and for the record)."""

    def __init__(self, ranks, ranks_per_node, costs, link=None):
        check_ranks(ranks, ranks_per_node)
        if not costs:
            raise ValueError("a CostModel needs at least one algorithm")
        for algorithm, cost in costs.items():
            _check_algorithm(algorithm)
            if not isinstance(cost, AlgorithmCost):
                raise TypeError(f"cost of {algorithm!r} must be an AlgorithmCost, got {cost!r}")
        self.ranks = int(ranks)
        self.ranks_per_node = int(ranks_per_node)
        self.link = link
        # Canonical order, so `algorithms` (and with it the planner's tie-breaking) does not
        # depend on how the caller built the dict.
        self._costs = {a: costs[a] for a in ALGORITHMS if a in costs}

    @classmethod
    def from_link(cls, link, ranks, ranks_per_node=1, algorithms=ALGORITHMS):
        """Every algorithm in `algorithms` as `link` predicts it on this communicator."""
        return cls(ranks, ranks_per_node,
                   {a: link.algorithm_cost(a, ranks, ranks_per_node) for a in algorithms},
                   link=link)

    @classmethod
    def default(cls, ranks, ranks_per_node=1):
        """Round prices for when nothing was measured (jobs tune instead; tests and examples
        use it): α = 5 µs, β = 1/(5 GB/s), γ = 1/(10 GB/s), roughly shared memory or a fast
        interconnect. Plans made with it are plausible, not optimal."""
        return cls.from_link(LinkModel(alpha=5e-6, beta=1 / 5e9, gamma=1 / 10e9),
                             ranks, ranks_per_node)

    @property
    def algorithms(self):
        """The algorithms this model can price, in ALGORITHMS order."""
        return tuple(self._costs)

    def cost(self, algorithm):
        """The AlgorithmCost of one available algorithm."""
        if algorithm not in self._costs:
            raise ValueError(f"algorithm {algorithm!r} is not in this cost model "
                             f"(has {', '.join(self._costs)})")
        return self._costs[algorithm]

    def time(self, algorithm, nbytes):
        """Predicted seconds to allreduce nbytes (scalar -> float, array -> array; 0 bytes
        cost 0: nothing is sent)."""
        return self.cost(algorithm).time(nbytes)

    def to_json(self):
        """A plain dict (json-serializable) that from_json() turns back into this model."""
        link = self.link
        return {
            "ranks": self.ranks,
            "ranks_per_node": self.ranks_per_node,
            "algorithms": {a: {"alpha": c.alpha, "beta": c.beta} for a, c in self._costs.items()},
            "link": None if link is None else
            {"alpha": link.alpha, "beta": link.beta, "gamma": link.gamma},
        }

    @classmethod
    def from_json(cls, data):
        """The CostModel a to_json() dict describes; ValueError if it is malformed (a
        missing field, a cost that is not a finite number >= 0)."""
        try:
            costs = {a: AlgorithmCost(alpha=_price(c["alpha"], f"{a} alpha"),
                                      beta=_price(c["beta"], f"{a} beta"))
                     for a, c in data["algorithms"].items()}
            link = data["link"]
            if link is not None:
                link = LinkModel(**{k: _price(link[k], f"link {k}")
                                    for k in ("alpha", "beta", "gamma")})
            return cls(data["ranks"], data["ranks_per_node"], costs, link=link)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a cost model description ({type(exc).__name__}: {exc})") \
                from None

    def __eq__(self, other):
        if not isinstance(other, CostModel):
            return NotImplemented
        return self.to_json() == other.to_json()

    def __repr__(self):
        return (f"CostModel(ranks={self.ranks}, ranks_per_node={self.ranks_per_node}, "
                f"costs={self._costs!r}, link={self.link!r})")

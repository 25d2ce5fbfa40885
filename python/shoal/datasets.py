"""shoal.datasets: shoal's demo datasets for the examples (shoal/datasets/, docs/data.md), outside
the API as in C++. SyntheticCtr is a click-through-rate set whose best possible logloss and AUC are
known: sample i a pure function of (seed, i), ids from a power law, labels from a hidden
factorization machine; the same samples as C++'s shoal::datasets::SyntheticCtr after the same
options.

    data = shoal.datasets.SyntheticCtr(size=100_000, seed=0)
    ids, dense, label, probability = data.get_batch([0, 5, 7])    # probability: the Bayes predictor
    shoal.datasets.logloss(p, label), shoal.datasets.auc(p, label)"""
from . import _C  # noqa: F401  (first: the extension's errors are shoal._C's)
from . import _arguments, _datasets
_arguments.wrap_module(_datasets, "shoal.datasets")

auc, logloss = _datasets.auc, _datasets.logloss


def SyntheticCtr(seed=0, size=1_000_000, fields=26, vocabulary=100_000, zipf=1.1, dense=13, factors=8, bias=-1.5,
                 linear_scale=1.0, dense_scale=0.2, factor_scale=0.6, id_decay=1.0):
    """The set of SyntheticCtrOptions' fields, by the same names and defaults. get_batch(indices)
    and range(first, count) give (ids int64 [rows, fields], dense float32 [rows, dense], label
    float32 [rows], probability float32 [rows])."""
    return _datasets.SyntheticCtr(seed=seed, size=size, fields=fields, vocabulary=vocabulary, zipf=zipf,
                                  dense=dense, factors=factors, bias=bias, linear_scale=linear_scale,
                                  dense_scale=dense_scale, factor_scale=factor_scale, id_decay=id_decay)

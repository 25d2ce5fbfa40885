"""DeepFM on shoal.datasets.SyntheticCtr, a click-through-rate set whose best possible logloss and
AUC are known, trained on parameter servers: examples/ctr.cpp in Python. The embedding tables (one
row per id of every field) live on the servers, which update only the rows a step touched; the
dense layers too. Prints a progress line per report and, at the end, the held-out logloss and AUC
beside the Bayes optimum's.

    PYTHONPATH=build/python build/bin/shoal run --servers 2 -n 2 /usr/bin/python3 examples/python/ctr.py [--samples N] ...
    SHOAL_PS_MODE=async ... (or ssp:S)
    PYTHONPATH=build/python /usr/bin/python3 examples/python/ctr.py     (one process: the servers' rules, in-process)

Its two parameter-server lines: shoal.init() and shoal.ps.Optimizer; shoal.ps.Embedding stands
where torch.nn.Embedding(..., sparse=True) stood. It builds the C++ example's model from the same
initial values and trains on the same batches, so it prints the C++ example's figures."""
import argparse
import time

import torch

import shoal


class DeepFm(torch.nn.Module):
    """DeepFM (Guo et al. 2017): first-order weights per id, a factorization machine over the ids'
    embeddings, and an MLP over the embeddings and the dense features, added into one logit."""

    def __init__(self, fields, vocabulary, dense, dim, hidden):
        super().__init__()
        rows = fields * vocabulary
        self.fields, self.vocabulary = fields, vocabulary
        self.first = shoal.ps.Embedding(rows, 1, init="zeros")                     # shoal
        self.embedding = shoal.ps.Embedding(rows, dim, init="normal", a=0, b=0.01)  # shoal
        self.dense_linear = torch.nn.Linear(dense, 1)
        layers, width = [], fields * dim + dense
        for h in hidden:
            layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
            width = h
        self.mlp = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))

    def forward(self, ids, dense):
        rows = ids + torch.arange(self.fields) * self.vocabulary  # one table for all fields
        linear = self.first(rows).sum((1, 2))
        e = self.embedding(rows)  # [rows, fields, dim]
        fm = 0.5 * (e.sum(1).pow(2) - e.pow(2).sum(1)).sum(1)
        deep = self.mlp(torch.cat([e.flatten(1), dense], 1)).squeeze(1)
        return linear + fm + deep + self.dense_linear(dense).squeeze(1)


def main():
    parser = argparse.ArgumentParser(description="DeepFM on a synthetic click-through-rate set with a known optimum.")
    parser.add_argument("--samples", type=int, default=3_000_000, help="training samples (the set's first N)")
    parser.add_argument("--test-samples", type=int, default=100_000, help="held-out samples (the N after them)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1024, help="samples per step")
    parser.add_argument("--lr", type=float, default=0.02, help="Adagrad's learning rate")
    parser.add_argument("--dim", type=int, default=8, help="embedding width")
    parser.add_argument("--vocabulary", type=int, default=100_000, help="ids per field")
    parser.add_argument("--seed", type=int, default=0, help="the data set's seed (the model's is 0)")
    parser.add_argument("--reports", type=int, default=10, help="progress lines per epoch")
    args = parser.parse_args()

    shoal.init()  # shoal
    data = shoal.datasets.SyntheticCtr(seed=args.seed, size=args.samples + args.test_samples,
                                       vocabulary=args.vocabulary)
    torch.manual_seed(0)
    model = DeepFm(26, args.vocabulary, 13, args.dim, [64, 32])
    optimizer = shoal.ps.Optimizer(model, torch.optim.Adagrad, lr=args.lr)  # shoal
    workers, rank = shoal.world_size(), shoal.rank()
    test = data.range(args.samples, args.test_samples)

    def evaluate():
        model.eval()
        with torch.no_grad():
            p = torch.sigmoid(model(test[0], test[1]))
        model.train()
        return shoal.datasets.logloss(p, test[2]), shoal.datasets.auc(p, test[2])

    steps = (args.samples + args.batch - 1) // args.batch
    start = time.monotonic()
    for epoch in range(args.epochs):
        order = torch.randperm(args.samples).tolist()
        loss_sum, loss_count = 0.0, 0
        for step in range(steps):
            first = step * args.batch
            rows = min(args.batch, args.samples - first)
            begin, end = first + rows * rank // workers, first + rows * (rank + 1) // workers
            ids, dense, label, _ = data.get_batch(order[begin:end])
            optimizer.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(ids, dense), label)
            loss.backward()
            optimizer.step()
            loss_sum += loss.item()
            loss_count += 1
            if ((step + 1) % max(1, steps // args.reports) == 0 or step + 1 == steps) and shoal.is_main():
                seconds = time.monotonic() - start
                print("epoch %d step %d/%d  train logloss %.4f  %.0f samples/s  staleness %d"
                      % (epoch + 1, step + 1, steps, loss_sum / loss_count, (epoch * args.samples + first + rows) / seconds,
                         optimizer.staleness()), flush=True)
                loss_sum, loss_count = 0.0, 0
        if epoch + 1 < args.epochs and shoal.is_main():
            logloss, auc = evaluate()
            print("epoch %d  test logloss %.4f  AUC %.4f" % (epoch + 1, logloss, auc), flush=True)
    if not shoal.is_main():
        return
    bayes_logloss, bayes_auc = shoal.datasets.logloss(test[3], test[2]), shoal.datasets.auc(test[3], test[2])
    logloss, auc = evaluate()
    print("test logloss %.4f (Bayes %.4f)  AUC %.4f (Bayes %.4f, ratio %.4f)"
          % (logloss, bayes_logloss, auc, bayes_auc, auc / bayes_auc))


if __name__ == "__main__":
    main()

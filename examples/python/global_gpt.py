"""A character-level GPT on global tensors, trained on the GNU GPL's text (which Debian's
base-files installs): examples/global_gpt.cpp in Python, its plans that run the model whole. The
plans differ only in placement and SBP; on the same seed they train the same model to the same
losses, and to the C++ example's:

    PYTHONPATH=build/python /usr/bin/python3 examples/python/global_gpt.py --plan one           # one process
    PYTHONPATH=build/python build/bin/shoal run -n 4 /usr/bin/python3 examples/python/global_gpt.py --plan data
    ... --plan tensor    # Megatron: heads split
    ... --plan hybrid    # 2 x n/2: data x tensor

--checkpoint FILE saves the model, its optimizer and the batches' stream after training, and
--resume FILE goes on from such a file in any plan, or from the C++ example's (the same names).
(The C++ example's pipeline plans, a pipeline of global layers, are not yet reachable from
Python: docs/python.md.)"""
import argparse

import torch

import shoal

g = shoal.global_


class Embed(torch.nn.Module):
    """The first layer: token and position embeddings. ids [batch, time] -> [batch, time, dim]."""

    def __init__(self, vocabulary, time, dim, dropout, layout):
        super().__init__()
        self.tokens = g.nn.Embedding(vocabulary, dim, layout.placement, layout.column())
        self.positions = g.nn.Embedding(time, dim, layout.placement, layout.replicated())
        self.dropout, self.layout = dropout, layout

    def forward(self, ids):
        where = g.arange(ids.shape[1], self.layout.placement, self.layout.replicated())
        return g.dropout(self.tokens(ids) + self.positions(where), self.dropout, self.training)


class Head(torch.nn.Module):
    """The last layer: the final norm and the output head. -> logits [batch, time, vocabulary]."""

    def __init__(self, vocabulary, dim, layout):
        super().__init__()
        self.norm = g.nn.LayerNorm(dim, layout.placement)
        self.head = g.nn.Linear(dim, vocabulary, layout.placement, layout.column(), bias=False)

    def forward(self, x):
        return self.head(self.norm(x))


class Gpt(torch.nn.Module):
    """One Sequential of layers, so that its parameters have the C++ example's names
    ("layers.0.tokens.weight", ...)."""

    def __init__(self, vocabulary, time, dim, heads, blocks, dropout, layout):
        super().__init__()
        self.layers = torch.nn.Sequential(
            Embed(vocabulary, time, dim, dropout, layout),
            *[g.nn.TransformerBlock(dim, heads, layout, dropout=dropout) for _ in range(blocks)],
            Head(vocabulary, dim, layout))

    def forward(self, ids):
        return self.layers(ids)


def plan_of(name):
    n = shoal.world_size()
    if name == "one":
        return g.nn.Layout(g.Placement([0]), []), [g.broadcast()]
    if name == "data":
        return g.nn.Layout(g.Placement.all(), []), [g.split(0)]
    if name == "tensor":
        return g.nn.Layout(g.Placement.all(), [0]), [g.broadcast()]
    if name == "hybrid":
        if n % 2:
            raise shoal.UsageError("--plan hybrid: expected an even number of workers, got %d" % n)
        return g.nn.Layout(g.Placement.mesh([2, n // 2]), [1]), [g.split(0), g.broadcast()]
    raise shoal.UsageError("--plan: expected one, data, tensor or hybrid, got '%s'" % name)


def main():
    parser = argparse.ArgumentParser(description="A character-level GPT on global tensors, in one of four plans.")
    parser.add_argument("--plan", default="one", help="one, data, tensor or hybrid")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--checkpoint", help="after training, save the model, its optimizer and the batches' stream")
    parser.add_argument("--resume", help="go on from a --checkpoint file, saved in any plan (or by the C++ example)")
    args = parser.parse_args()
    time_, batch, dim, heads = 32, 8, 64, 4

    shoal.init()
    layout, batch_sbp = plan_of(args.plan)
    data = open(args.text, "rb").read()
    characters = sorted(set(data))
    id_of = {c: i for i, c in enumerate(characters)}
    corpus = torch.tensor([id_of[c] for c in data])
    torch.manual_seed(0)
    model = Gpt(len(characters), time_, dim, heads, args.layers, args.dropout, layout)
    # The batches have their own random stream, the same on every worker.
    batches = torch.Generator().manual_seed(1)
    sync = g.nn.GradientSync(model)  # noqa: F841  (sums the data axes' gradients while it lives)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first_step = 1
    if args.resume:
        extras = shoal.load(args.resume, model, optimizer)
        if "step" not in extras or "batches" not in extras:
            raise shoal.UsageError("--resume: %s was not saved by --checkpoint" % args.resume)
        first_step = int(extras["step"]) + 1
        batches.set_state(extras["batches"])
    for step in range(first_step, first_step + args.steps):
        # Every worker draws the whole batch (the same, after the same seed) and keeps its piece.
        starts = torch.randint(len(corpus) - time_ - 1, (batch,), generator=batches)
        inputs = torch.stack([corpus[s:s + time_] for s in starts.tolist()])
        targets = torch.stack([corpus[s + 1:s + 1 + time_] for s in starts.tolist()])
        x = g.from_full(inputs, layout.placement, batch_sbp)
        y = g.from_full(targets, layout.placement, batch_sbp)
        optimizer.zero_grad()
        logits = model(x)
        rows = logits.size(0) * logits.size(1)
        loss = g.cross_entropy(g.reshape(logits, [rows, len(characters)]), g.reshape(y, [rows]))
        loss.backward()
        optimizer.step()
        value = loss.detach().full().item()
        if shoal.is_main():
            print("step %d loss %.9g" % (step, value), flush=True)
    if args.checkpoint:
        shoal.save(args.checkpoint, model, optimizer,
                   extras={"step": torch.tensor(first_step + args.steps - 1), "batches": batches.get_state()})


if __name__ == "__main__":
    main()

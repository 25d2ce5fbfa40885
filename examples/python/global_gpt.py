"""A character-level GPT on global tensors, trained on the GNU GPL's text (which Debian's
base-files installs): examples/global_gpt.cpp in Python. The plans differ only in placement and
SBP; on the same seed they train the same model to the same losses, and to the C++ example's:

    PYTHONPATH=build/python /usr/bin/python3 examples/python/global_gpt.py --plan one           # one process
    PYTHONPATH=build/python build/bin/shoal run -n 4 /usr/bin/python3 examples/python/global_gpt.py --plan data
    ... --plan tensor    # Megatron: heads split
    ... --plan hybrid    # 2 x n/2: data x tensor
    ... --plan pipeline  # a stage per worker (--schedule gpipe|1f1b|interleaved|zb, --micro-batches M)
    ... --plan 3d        # on 8 workers: 2 stages x 2 data x 2 tensor

--checkpoint FILE saves the model, its optimizer and the batches' stream after training, and
--resume FILE goes on from such a file in a plan that runs the model whole, or from the C++
example's (the same names). A pipeline draws each micro-batch's dropout mask on its own, so its
losses equal one process's at --dropout 0."""
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
    ("layers.0.tokens.weight", ...); layouts[i] is layer i's."""

    def __init__(self, vocabulary, time, dim, heads, dropout, layouts):
        super().__init__()
        self.layers = torch.nn.Sequential(
            Embed(vocabulary, time, dim, dropout, layouts[0]),
            *[g.nn.TransformerBlock(dim, heads, layout, dropout=dropout) for layout in layouts[1:-1]],
            Head(vocabulary, dim, layouts[-1]))

    def forward(self, ids):
        return self.layers(ids)


def plan_of(name, layers, stages_per_worker):
    """Each layer's layout, the batch's SBP, and whether the plan is a pipeline (as the C++
    example's make_plan)."""
    n = shoal.world_size()
    if name == "one":
        return [g.nn.Layout(g.Placement([0]), [])] * layers, [g.broadcast()], False
    if name == "data":
        return [g.nn.Layout(g.Placement.all(), [])] * layers, [g.split(0)], False
    if name == "tensor":
        return [g.nn.Layout(g.Placement.all(), [0])] * layers, [g.broadcast()], False
    if name == "hybrid":
        if n % 2:
            raise shoal.UsageError("--plan hybrid: expected an even number of workers, got %d" % n)
        return [g.nn.Layout(g.Placement.mesh([2, n // 2]), [1])] * layers, [g.split(0), g.broadcast()], False
    # A pipeline: the layers cut into stages (balanced by parameter count), stage s on the
    # placement of worker group s % groups.
    if name == "pipeline":
        groups, batch = [g.nn.Layout(g.Placement([w]), []) for w in range(n)], [g.broadcast()]
    elif name == "3d":
        if n % 4:
            raise shoal.UsageError("--plan 3d: expected a multiple of 4 workers (2 stages x 2 data x tensor), got %d" % n)
        groups = [g.nn.Layout(g.Placement.mesh([2, n // 4], list(range(w * n // 2, (w + 1) * n // 2))), [1])
                  for w in range(2)]
        batch = [g.split(0), g.broadcast()]
    else:
        raise shoal.UsageError("--plan: expected one, data, tensor, hybrid, pipeline or 3d, got '%s'" % name)
    weights = [2] + [12] * (layers - 2) + [2]  # a block's 12 dim^2, about; the ends 2 dim^2
    layouts = []
    for stage, length in enumerate(shoal.pipeline.balanced_split(weights, len(groups) * stages_per_worker)):
        layouts += [groups[stage % len(groups)]] * length
    return layouts, batch, True


def main():
    parser = argparse.ArgumentParser(description="A character-level GPT on global tensors, in one of four plans.")
    parser.add_argument("--plan", default="one", help="one, data, tensor or hybrid")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--schedule", default="1f1b", help="pipeline plans: gpipe, 1f1b, interleaved or zb")
    parser.add_argument("--micro-batches", type=int, default=4, help="pipeline plans: micro-batches per batch")
    parser.add_argument("--checkpoint", help="after training, save the model, its optimizer and the batches' stream")
    parser.add_argument("--resume", help="go on from a --checkpoint file, saved in any plan (or by the C++ example)")
    args = parser.parse_args()
    time_, batch, dim, heads = 32, 8, 64, 4

    shoal.init()
    layouts, batch_sbp, pipelined = plan_of(args.plan, args.layers + 2, 2 if args.schedule == "interleaved" else 1)
    data = open(args.text, "rb").read()
    characters = sorted(set(data))
    id_of = {c: i for i, c in enumerate(characters)}
    corpus = torch.tensor([id_of[c] for c in data])
    torch.manual_seed(0)
    vocabulary = len(characters)
    model = Gpt(vocabulary, time_, dim, heads, args.dropout, layouts)
    # The batches have their own random stream: a pipeline's stages draw different dropout masks
    # from the default one, and every worker must still draw the same batches.
    batches = torch.Generator().manual_seed(1)

    def loss_of(logits, y):
        rows = logits.size(0) * logits.size(1)
        return g.cross_entropy(g.reshape(logits, [rows, vocabulary]), g.reshape(y, [rows]))

    # A pipeline plan runs the layers in stages and sums the gradients itself (GradientSync would
    # sum them at every micro-batch's backward); the other plans run the model whole.
    if pipelined:
        pipe = shoal.pipeline.Pipeline(model.layers, micro_batches=args.micro_batches, schedule=args.schedule,
                                       batch=batch_sbp)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    else:
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
        optimizer.zero_grad()
        if pipelined:
            value = pipe.step(inputs, targets, loss_of).item()
        else:
            x = g.from_full(inputs, layouts[0].placement, batch_sbp)
            y = g.from_full(targets, layouts[-1].placement, batch_sbp)
            loss = loss_of(model(x), y)
            loss.backward()
            value = loss.detach().full().item()
        optimizer.step()
        if shoal.is_main():
            print("step %d loss %.9g" % (step, value), flush=True)
    if args.checkpoint:
        shoal.save(args.checkpoint, model, optimizer,
                   extras={"step": torch.tensor(first_step + args.steps - 1), "batches": batches.get_state()})


if __name__ == "__main__":
    main()

"""A worker of tests/python/test_global.py: a small GPT of shoal.global_.nn layers (an embedding, a
transformer block, a layer norm and a head) trained STEPS AdamW steps in one plan, with
GradientSync, and saved with shoal.save. Step k trains on batch k % 3 of three fixed batches, so
that three steps resumed from a checkpoint after three repeat the three after them of a run of
six.

    global_model_worker.py OUT PLAN STEPS [CHECKPOINT_IN]

PLAN: data (the batch split over every worker, the weights whole), tensor (the weights split over
every worker, the batch whole) or 2-D (a 2 x 2 mesh, data by tensor). With CHECKPOINT_IN, the
model is first loaded from it (a file saved in another plan). The first worker writes OUT
(torch.save): the losses, and every parameter's whole value after training (from full()); every
worker saves the model and its optimizer to OUT.ckpt. PLAN "lost": the data plan, but the second
worker leaves just before its second backward, and the first writes to OUT what its backward
raised."""
import os
import sys

import torch

import shoal

g = shoal.global_
VOCAB, DIM, HEADS, BATCH, TIME = 32, 16, 2, 4, 6


def layout_of(plan):
    if plan == "data":
        return g.nn.Layout(g.Placement.all(), []), [g.split(0)]
    if plan == "tensor":
        return g.nn.Layout(g.Placement.all(), [0]), [g.broadcast()]
    return g.nn.Layout(g.Placement.mesh([2, 2]), [1]), [g.split(0), g.broadcast()]


def gpt(layout):
    torch.manual_seed(0)  # every plan draws the same initial values
    placement = layout.placement
    return torch.nn.Sequential(g.nn.Embedding(VOCAB, DIM, placement, layout.replicated()),
                               g.nn.TransformerBlock(DIM, HEADS, layout),
                               g.nn.LayerNorm(DIM, placement),
                               g.nn.Linear(DIM, VOCAB, placement, layout.column()))


def main(out, plan, steps, resume=None):
    shoal.init()
    lost, plan = plan == "lost", "data" if plan == "lost" else plan
    layout, batch_sbp = layout_of(plan)
    model = gpt(layout)
    sync = g.nn.GradientSync(model)  # noqa: F841  (sums the data axes' gradients while it lives)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    if resume:
        shoal.load(resume, model, optimizer)
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, BATCH, TIME + 1))
    losses = []
    for step in range(int(steps)):
        x = g.from_full(ids[step % 3, :, :-1], layout.placement, batch_sbp)
        y = g.from_full(ids[step % 3, :, 1:].reshape(-1), layout.placement, batch_sbp)
        optimizer.zero_grad()
        logits = model(x)
        loss = g.cross_entropy(g.reshape(logits, [-1, VOCAB]), y)
        if lost:
            if shoal.rank() == 1 and step == 1:
                os._exit(0)
            try:
                loss.backward()
            except shoal.CommError as error:
                with open(out, "w") as f:
                    f.write("%s at step %d: %s" % (type(error).__name__, step, error))
                return
            continue
        loss.backward()
        optimizer.step()
        losses.append(float(loss.full()))
    whole = {}
    for path, layer in g.nn.global_layers(model):
        for name, value in layer.named_global_parameters():
            whole["%s.%s" % (path, name)] = value.full()
    shoal.save(out + ".ckpt", model, optimizer)
    if shoal.is_main():
        torch.save({"losses": losses, "whole": whole}, out)


if __name__ == "__main__":
    main(*sys.argv[1:])

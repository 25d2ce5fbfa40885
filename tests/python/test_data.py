"""shoal.data.DataLoader from Python, against its oracles: every sample of an epoch is seen once
by exactly one worker, each global batch cut as shoal cuts it (8 over 3 workers: 3, 3, 2), with
torch's loader processes reading ahead; a state saved after three batches on 2 workers resumes
on 3 at exactly the next batch (the rest of the epoch, every sample once over both runs); and
DataParallel over it, with an uneven last batch that gives one worker 0 rows, ends at the
one-process parameters. A batch size changed mid-epoch (as BatchPolicy.goodput changes it)
takes effect at the next batch, whatever torch's processes had read ahead."""
import torch

import dp_program as program
from jobs import run_job


def seen_by(out, workers):
    return [torch.load("%s.%d" % (out, r)) for r in range(workers)]


def test_every_sample_once_per_epoch_with_loader_processes_reading_ahead(tmp_path):
    out = tmp_path / "seen"
    run_job(3, "data_worker.py", out, "once")
    seen = seen_by(out, 3)
    orders = []
    for epoch in range(2):
        batches = [seen[r][epoch] for r in range(3)]
        assert [len(b) for b in batches] == [7] * 3  # ceil(50 / 8) global batches each
        everything = sorted(i for b in batches for share in b for i in share)
        assert everything == list(range(50))
        for k in range(7):
            global_rows = 8 if k < 6 else 2
            assert [len(batches[r][k]) for r in range(3)] == [len(s) for s in torch.tensor_split(torch.arange(global_rows), 3)]
        orders.append([i for k in range(7) for r in range(3) for i in batches[r][k]])
    assert orders[0] != orders[1]  # a permutation per epoch


def test_a_saved_position_resumes_at_the_next_batch_on_another_worker_count(tmp_path):
    out, state = tmp_path / "seen", tmp_path / "state.pt"
    run_job(2, "data_worker.py", out, "resume_before", state)
    before = seen_by(out, 2)
    saved = torch.load(state)
    # Three global batches handed out, whatever torch's processes had read ahead.
    assert int(saved["cursor"]) == 24 and int(saved["epoch"]) == 0
    after_out = tmp_path / "after"
    run_job(3, "data_worker.py", after_out, "resume_after", state)
    after = seen_by(after_out, 3)
    everything = sorted(i for w in before for b in w for i in b) + sorted(i for w in after for b in w for i in b)
    assert sorted(everything) == list(range(50))
    assert len(everything) == 50


def test_data_parallel_over_it_gives_the_one_process_parameters_with_an_empty_share(tmp_path):
    out = tmp_path / "trained"
    run_job(3, "data_worker.py", out, "train")
    results = seen_by(out, 3)
    # The last batch (rows 48 and 49) gave worker 2 no row.
    assert [r["seen"][-1] for r in results] == [[48], [49], []]
    # One process over the same global batches.
    import data_worker
    dataset = data_worker.Indices()
    net = program.model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for begin in range(0, 50, 16):
        rows = [dataset[i] for i in range(begin, min(begin + 16, 50))]
        x, y = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
    for r in range(3):
        for g, w in zip(results[r]["params"], net.parameters()):
            assert torch.allclose(g, w.detach(), rtol=1e-5, atol=1e-6), (g - w).abs().max()


def test_a_new_batch_size_takes_effect_at_the_next_batch_whatever_was_read_ahead():
    # What BatchPolicy.goodput does at a commit: torch's two loader processes have read batches of
    # 4 ahead; from the fourth batch on they are of 10, and every sample still comes once.
    import shoal
    loader = shoal.data.DataLoader(list(range(50)), batch_size=4, shuffle=True, seed=3, num_workers=2,
                                   prefetch_factor=4)
    sizes, seen = [], []
    for batch in loader.epoch(0):
        sizes.append(len(batch))
        seen += batch.tolist()
        if len(sizes) == 3:
            loader.sampler.set_batch_size(10)
    assert sizes == [4, 4, 4, 10, 10, 10, 8]
    assert sorted(seen) == list(range(50))
    assert loader.sampler.cursor == 50

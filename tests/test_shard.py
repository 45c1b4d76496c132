import math

import pytest
import torch

import embedding_server.shard as shard_mod
from dlrm_core.batch import SparseFeatures
from dlrm_core.schema import TableSpec
from embedding_server.client.local import InProcessEmbeddingClient
from embedding_server.kernels.optimizers import SparseOptimizerConfig, apply_sparse_update
from embedding_server.kernels.tbe import FBGEMM_IMPORT_ERROR
from embedding_server.local_table import LocalTable, init_rows
from embedding_server.shard import EmbeddingShard

TABLES = [
    LocalTable(TableSpec(name="a", rows=50, dim=8), 0),
    LocalTable(TableSpec(name="b", rows=30, dim=4, pooling="mean"), 1),
    LocalTable(TableSpec(name="c", rows=20, dim=12), 2),
]
needs_fbgemm = pytest.mark.skipif(
    FBGEMM_IMPORT_ERROR is not None, reason="fbgemm_gpu not importable"
)


def torch_shard(tables, cfg, monkeypatch):
    monkeypatch.setattr(shard_mod, "fbgemm_supports", lambda *a: "forced by the test")
    s = EmbeddingShard(tables, cfg)
    monkeypatch.undo()
    return s


def random_batch(gen, num_features=3, batch=6, max_len=4, rows=20):
    lengths = torch.randint(0, max_len, (num_features, batch), generator=gen)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
    return SparseFeatures.from_lengths(values, lengths)


@needs_fbgemm
@pytest.mark.parametrize("kind", ["rowwise_adagrad", "adagrad", "sgd"])
def test_fbgemm_and_torch_kernels_agree(kind, monkeypatch):
    cfg = SparseOptimizerConfig(kind=kind, lr=0.1)
    fb = EmbeddingShard(TABLES, cfg)
    pt = torch_shard(TABLES, cfg, monkeypatch)
    assert (fb.kernel_name, pt.kernel_name) == ("fbgemm", "torch")
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        batch = random_batch(gen)
        out_fb, out_pt = fb(batch), pt(batch)
        assert out_fb.shape == (6, 24)
        torch.testing.assert_close(out_fb, out_pt, atol=1e-6, rtol=1e-5)
        grad = torch.randn(out_fb.shape, generator=gen)
        out_fb.backward(grad)
        out_pt.backward(grad)
    a, b = fb.export_state(), pt.export_state()
    for key in a:
        if key != "step":
            torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-5)


@needs_fbgemm
@pytest.mark.parametrize("kind", ["rowwise_adagrad", "adagrad"])
def test_features_sharing_tables_agree_across_kernels(kind, monkeypatch):
    # Five features over three tables, a shared table's features not adjacent (fbgemm's CPU
    # row-wise Adagrad needs them together: the shard reorders them inside the kernel).
    cfg = SparseOptimizerConfig(kind=kind, lr=0.1)
    fmap = [0, 1, 0, 2, 1]
    fb = EmbeddingShard(TABLES, cfg, feature_map=fmap)
    monkeypatch.setattr(shard_mod, "fbgemm_supports", lambda *a: "forced by the test")
    pt = EmbeddingShard(TABLES, cfg, feature_map=fmap)
    monkeypatch.undo()
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        batch = random_batch(gen, num_features=5)
        out_fb, out_pt = fb(batch), pt(batch)
        assert out_fb.shape == (6, 8 + 4 + 8 + 12 + 4)
        torch.testing.assert_close(out_fb, out_pt, atol=1e-6, rtol=1e-5)
        grad = torch.randn(out_fb.shape, generator=gen)
        out_fb.backward(grad)
        out_pt.backward(grad)
    a, b = fb.export_state(), pt.export_state()
    for key in a:
        if key != "step":
            torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-5)


@needs_fbgemm
@pytest.mark.parametrize("kind", ["rowwise_adagrad", "sgd"])
def test_embedding_weight_decay_agrees_across_kernels(kind, monkeypatch):
    cfg = SparseOptimizerConfig(kind=kind, lr=0.1, weight_decay=0.05)
    fb = EmbeddingShard(TABLES, cfg)
    pt = torch_shard(TABLES, cfg, monkeypatch)
    plain = EmbeddingShard(TABLES, SparseOptimizerConfig(kind=kind, lr=0.1))
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        batch = random_batch(gen)
        outs = [fb(batch), pt(batch), plain(batch)]
        grad = torch.randn(outs[0].shape, generator=gen)
        for out in outs:
            out.backward(grad)
    a, b, c = fb.export_state(), pt.export_state(), plain.export_state()
    for key in a:
        if key != "step":
            torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-5)
    weights = [k for k in a if k.endswith(".weight")]
    assert weights and any(not torch.equal(a[k], c[k]) for k in weights)  # the decay acted


def test_weight_decay_shrinks_the_touched_rows_before_their_update(monkeypatch):
    # sgd, lr 0.5, decay 0.1, a bag of row 3 twice: w3 <- 0.9 * w3 - 0.5 * (g + g), once per step
    table = [LocalTable(TableSpec(name="a", rows=5, dim=2), 0)]
    s = torch_shard(table, SparseOptimizerConfig(kind="sgd", lr=0.5, weight_decay=0.1), monkeypatch)
    w0 = s.export_state()["a.weight"].clone()
    batch = SparseFeatures.from_lengths(torch.tensor([3, 3]), torch.tensor([[2]]))
    out = s(batch)
    torch.testing.assert_close(out[0], 2 * w0[3])  # the forward saw the rows before the decay
    out.backward(torch.ones_like(out))
    w1 = s.export_state()["a.weight"]
    torch.testing.assert_close(w1[3], 0.9 * w0[3] - 0.5 * 2 * torch.ones(2))
    assert torch.equal(w1[[0, 1, 2, 4]], w0[[0, 1, 2, 4]])  # rows not read keep their weights


def test_rowwise_adagrad_known_values():
    # One row, dim 2: g = [3, 4]; mean(g^2) = 12.5; acc = 12.5; w -= 0.5 * g / sqrt(12.5)
    w = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    state = {"momentum1": torch.zeros(2)}
    cfg = SparseOptimizerConfig(kind="rowwise_adagrad", lr=0.5, eps=1e-12)
    apply_sparse_update(cfg, w, state, torch.tensor([0]), torch.tensor([[3.0, 4.0]]), step=1)
    s = math.sqrt(12.5)
    torch.testing.assert_close(w[0], torch.tensor([1 - 0.5 * 3 / s, 1 - 0.5 * 4 / s]))
    assert state["momentum1"].tolist() == [12.5, 0.0]
    assert w[1].tolist() == [0.0, 0.0]  # untouched row


def test_torch_adam_equals_torch_optim_adam_when_all_rows_are_touched():
    cfg = SparseOptimizerConfig(kind="adam", lr=0.01)
    w = torch.randn(3, 4)
    ref = w.clone().requires_grad_(True)
    opt = torch.optim.Adam([ref], lr=0.01, eps=cfg.eps)
    state = {"exp_avg": torch.zeros(3, 4), "exp_avg_sq": torch.zeros(3, 4)}
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 6):
        g = torch.randn(3, 4, generator=gen)
        apply_sparse_update(cfg, w, state, torch.arange(3), g, step)
        ref.grad = g.clone()
        opt.step()
    torch.testing.assert_close(w, ref.detach(), atol=1e-6, rtol=1e-5)


def test_adam_on_cpu_uses_torch_kernel_and_learns():
    client = InProcessEmbeddingClient(
        [TableSpec(name="t", rows=10, dim=4)], SparseOptimizerConfig(kind="adam", lr=0.1)
    )
    assert client.kernel == "torch"  # fbgemm's CPU build has no Adam
    ids = SparseFeatures.one_hot(torch.tensor([[1, 2]]))
    before = client.lookup(ids).detach().clone()
    client.lookup(ids).sum().backward()
    after = client.lookup(ids).detach()
    assert torch.all(after < before)  # gradient of sum is +1: rows move down


def test_duplicate_ids_are_summed_exactly(monkeypatch):
    cfg = SparseOptimizerConfig(kind="sgd", lr=1.0)
    tables = [LocalTable(TableSpec(name="t", rows=5, dim=4), 0)]
    for s in [EmbeddingShard(tables, cfg), torch_shard(tables, cfg, monkeypatch)]:
        w0 = s.table_weights()["t"].clone()
        batch = SparseFeatures.from_lengths(torch.tensor([3, 3, 3]), torch.tensor([[2, 1]]))
        s(batch).sum().backward()
        torch.testing.assert_close(s.table_weights()["t"][3], w0[3] - 3.0)
        torch.testing.assert_close(s.table_weights()["t"][:3], w0[:3])


def test_mean_pooling_and_empty_bags():
    s = EmbeddingShard(
        [LocalTable(TableSpec(name="t", rows=5, dim=4, pooling="mean"), 0)], SparseOptimizerConfig()
    )
    w = s.table_weights()["t"]
    batch = SparseFeatures.from_lengths(torch.tensor([1, 2]), torch.tensor([[2, 0]]))
    out = s(batch)
    torch.testing.assert_close(out[0], (w[1] + w[2]) / 2)
    assert torch.all(out[1] == 0)


def test_initialisation_does_not_depend_on_sharding():
    table = TableSpec(name="t", rows=200_000, dim=8)
    full = init_rows(LocalTable(table, 3), seed=7)
    assert full.abs().max() <= math.sqrt(1 / 200_000)
    piece = init_rows(
        LocalTable(table, 3, row_start=65_000, rows=70_000, col_start=2, dim=4), seed=7
    )
    torch.testing.assert_close(piece, full[65_000:135_000, 2:6], rtol=0, atol=0)
    assert not torch.equal(full, init_rows(LocalTable(table, 4), seed=7))


def test_state_round_trip_between_kernels(monkeypatch):
    cfg = SparseOptimizerConfig(kind="rowwise_adagrad")
    a = EmbeddingShard(TABLES, cfg, seed=1)
    gen = torch.Generator().manual_seed(0)
    a(random_batch(gen)).sum().backward()
    b = torch_shard(TABLES, cfg, monkeypatch)
    b.import_state({k: v.clone() for k, v in a.export_state().items()})
    batch = random_batch(gen)
    torch.testing.assert_close(a(batch), b(batch))
    with pytest.raises(KeyError, match="lacks"):
        b.import_state({"a.weight": torch.zeros(50, 8)})

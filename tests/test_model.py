import pytest
import torch

from dense_trainer.config import ModelConfig
from dense_trainer.model import (
    DenseArch,
    DLRMDense,
    InteractionArch,
    InteractionDCNArch,
    LogisticRegression,
    OverArch,
    build_served_model,
)

B, I, F, D = 5, 13, 26, 16


def test_dense_arch_shape_and_relu():
    out = DenseArch(I, [32, D])(torch.randn(B, I))
    assert out.shape == (B, D) and torch.all(out >= 0)


def test_dot_interaction_golden_values():
    arch = InteractionArch(num_sparse_features=2)
    dense = torch.tensor([[1.0, 2.0]])  # B=1, D=2
    sparse = torch.tensor([[[3.0, 0.0], [0.0, 4.0]]])  # F=2
    out = arch(dense, sparse)
    # [dense, <d,s1>, <d,s2>, <s1,s2>] = [1, 2, 3, 8, 0]
    assert out.tolist() == [[1.0, 2.0, 3.0, 8.0, 0.0]]


def test_dot_interaction_shape():
    arch = InteractionArch(F)
    out = arch(torch.randn(B, D), torch.randn(B, F, D))
    assert out.shape == (B, D + (F + 1) * F // 2) == (B, D + arch.num_pairs)


def test_dot_interaction_gradient_matches_autograd_reference():
    arch = InteractionArch(num_sparse_features=4)
    dense = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    sparse = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda d, s: arch(d, s), (dense, sparse))

    def reference(d, s):  # the textbook formulation
        z = torch.cat([d.unsqueeze(1), s], 1)
        rows, cols = torch.triu_indices(5, 5, 1)
        return torch.cat([d, torch.bmm(z, z.transpose(1, 2))[:, rows, cols]], 1)

    torch.testing.assert_close(arch(dense, sparse), reference(dense, sparse))


def test_dcn_shape_and_identity_at_zero_weights():
    arch = InteractionDCNArch(D + F * D, num_layers=2, low_rank=8)
    dense, flat = torch.randn(B, D), torch.randn(B, F * D)
    assert arch(dense, flat).shape == (B, D + F * D)
    for layer in arch.crossnet.u:
        torch.nn.init.zeros_(layer.weight)
    # x0 * (0 + 0) + x_l = x_l: zero cross weights pass the input through.
    torch.testing.assert_close(arch(dense, flat), torch.cat([dense, flat], 1))


def test_over_arch_shape():
    assert OverArch(40, [8]).forward(torch.randn(B, 40)).shape == (B, 1)


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_dlrm_dense_uniform_and_mixed_dims(interaction):
    cfg = ModelConfig(
        interaction=interaction,
        dense_arch_layer_sizes=[32],
        over_arch_layer_sizes=[16],
        first_order=False,
    )
    model = DLRMDense(I, [D] * F, cfg, embedding_dim=D)
    assert model(torch.randn(B, I), torch.randn(B, F * D)).shape == (B,)
    dims = [8, 16, 32] * 8 + [4, 4]
    mixed = DLRMDense(I, dims, cfg, embedding_dim=D)
    assert mixed(torch.randn(B, I), torch.randn(B, sum(dims))).shape == (B,)
    assert (mixed.project is not None) == (interaction == "dot")


def test_logistic_regression():
    lr = LogisticRegression(I, F)
    torch.nn.init.zeros_(lr.linear.weight)
    torch.nn.init.constant_(lr.linear.bias, 0.5)
    emb = torch.randn(B, F)
    torch.testing.assert_close(lr(torch.randn(B, I), emb), emb.sum(1) + 0.5)


def test_mlp_without_autograd_is_nn_linear_and_frozen_mlps_equal_it():
    """The evaluation path of the MLPs (bare addmm) is nn.Sequential bit for bit, also after the
    weights change in place (a fused optimizer step); a frozen (served) MLP equals it to
    rounding."""
    from dense_trainer.model import freeze_for_serving, mlp

    torch.manual_seed(0)
    net = mlp([13, 64, 32, 1], relu_last=False)
    plain = torch.nn.Sequential(*net)
    opt = torch.optim.Adam(net.parameters(), lr=0.5, fused=True)
    for _ in range(3):
        for batch in (1, 7, 300):
            x = torch.randn(batch, 13)
            with torch.no_grad():
                assert torch.equal(net(x), plain(x))
            with torch.inference_mode():
                assert torch.equal(net(x), plain(x))
            assert torch.equal(net(x), plain(x))  # with autograd: nn.Sequential's own forward
        net(torch.randn(4, 13)).sum().backward()
        opt.step()
    served = mlp([13, 64, 32, 1], relu_last=False)
    served.load_state_dict(net.state_dict())
    freeze_for_serving(served.eval())
    with torch.inference_mode():
        for batch in (1, 7, 300):
            x = torch.randn(batch, 13)
            torch.testing.assert_close(served(x), plain(x), rtol=1e-6, atol=1e-6)


def test_wide_part_adds_each_inputs_linear_term():
    """model.wide: logit = deep(x) + w . [dense, embedded] + b, zero at the start (the deep
    model's logits unchanged until it learns); a version published before it serves as before."""
    from api.model import build_dense
    from dense_trainer.config import Config
    from embedding_server.wire import ModelVersion

    torch.manual_seed(0)
    deep = DLRMDense(3, [4, 4], ModelConfig(wide=False, first_order=False), embedding_dim=4)
    wide = DLRMDense(3, [4, 4], ModelConfig(wide=True, first_order=False), embedding_dim=4)
    wide.load_state_dict({**deep.state_dict(), **{k: v for k, v in wide.state_dict().items()
                                                   if k.startswith("wide.")}})  # fmt: skip
    dense, embedded = torch.randn(5, 3), torch.randn(5, 8)
    torch.testing.assert_close(wide(dense, embedded), deep(dense, embedded))
    with torch.no_grad():
        wide.wide.weight.copy_(torch.arange(11.0).unsqueeze(0))
        wide.wide.bias.fill_(0.5)
    extra = torch.cat([dense, embedded], 1) @ torch.arange(11.0) + 0.5
    torch.testing.assert_close(wide(dense, embedded), deep(dense, embedded) + extra)

    cfg = Config(model={"first_order": False})
    old = {
        k: v
        for k, v in cfg.model.model_dump(mode="json").items()
        if k not in ("wide", "first_order")
    }
    spec = cfg.feature_spec()
    net = build_served_model(ModelConfig(wide=False, first_order=False), spec, cfg.embedding.dim)
    meta = ModelVersion(version="v", spec=spec, model=old, embedding_dim=cfg.embedding.dim)
    served = build_dense(meta, net.state_dict())  # no wide.* weights: loads
    assert served.wide is None and not served.first_order


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_first_order_weights_are_each_tables_first_column(interaction):
    """model.first_order: tables are one column wider; logit = the model without it over the
    other columns + the sum of each table's first column (an id's own weight)."""
    from dense_trainer.config import Config

    torch.manual_seed(0)
    base = {"interaction": interaction, "dense_arch_layer_sizes": [8], "over_arch_layer_sizes": [8]}
    plain = DLRMDense(I, [D] * F, ModelConfig(**base, first_order=False), embedding_dim=D)
    first = DLRMDense(I, [D + 1] * F, ModelConfig(**base, first_order=True), embedding_dim=D + 1)
    first.load_state_dict(plain.state_dict())  # the same parameters: the column adds none
    dense, rest, own = torch.randn(B, I), torch.randn(B, F, D), torch.randn(B, F, 1)
    embedded = torch.cat([own, rest], 2).flatten(1)  # [B, F * (1 + D)], each table's own first
    want = plain(dense, rest.flatten(1)) + own.sum((1, 2))
    torch.testing.assert_close(first(dense, embedded), want)
    assert first(dense[:0], embedded[:0]).shape == (0,)  # a trainer's empty batch
    mixed = [D + 1, 9, D + 1, 5] + [D + 1] * (F - 4)
    net = DLRMDense(I, mixed, ModelConfig(**base), embedding_dim=D + 1)
    assert net(dense, torch.randn(B, sum(mixed))).shape == (B,)

    assert Config().model.first_order  # the default; the tables keep their dim
    assert not Config(dist={"towers": "plan.json"}).model.first_order  # towers: whole vectors
    with pytest.raises(ValueError, match="first_order"):
        Config(embedding={"dim": 1})
